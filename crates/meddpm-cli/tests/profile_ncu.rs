//! `meddpm profile` collection paths that need no GPU (issue 4): a command run "under Nsight
//! Compute" through a stand-in `ncu` script that runs the command and exports the committed real
//! H200 exports (`testdata/ncu/`), a missing `ncu`, and `--device cuda` without a device. Each
//! report must be written and must say what could not be collected.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-profile-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A stand-in for `ncu`: `-o REP … CMD…` runs CMD and writes REP.ncu-rep; `-i REP --page raw|details`
/// prints the fixture export of that page.
fn fake_ncu(dir: &Path) -> PathBuf {
    let fx = root().join("testdata/ncu");
    let script = format!(
        r#"#!/bin/sh
if [ "$1" = "-i" ]; then
  case "$*" in
    *"--page raw"*) cat "{raw}" ;;
    *"--page details"*) cat "{details}" ;;
    *) exit 2 ;;
  esac
  exit 0
fi
echo "$*" > "{log}"
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then rep="$2"; shift 2; break; fi
  shift
done
"$@" || exit $?
echo fake > "$rep.ncu-rep"
"#,
        raw = fx.join("h200_conv_raw.csv").display(),
        details = fx.join("h200_conv_details.csv").display(),
        log = dir.join("ncu-args.txt").display()
    );
    let p = dir.join("ncu");
    std::fs::write(&p, script).unwrap();
    Command::new("chmod").arg("+x").arg(&p).status().unwrap();
    p
}

fn meddpm(args: &[&str]) -> std::process::Output {
    let o = Command::new(env!("CARGO_BIN_EXE_meddpm")).args(args).output().expect("run meddpm");
    eprintln!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    o
}

#[test]
fn command_under_ncu_gives_the_same_report() {
    let d = tmp("cmd");
    let ncu = fake_ncu(&d);
    let out = d.join("report");
    let marker = d.join("ran.txt");
    let o = meddpm(&[
        "profile",
        "--ncu",
        ncu.to_str().unwrap(),
        "--counters",
        "--nvtx-include",
        "forward/",
        "--out",
        out.to_str().unwrap(),
        "--",
        "sh",
        "-c",
        &format!("echo ran > {}", marker.display()),
    ]);
    assert!(o.status.success());
    assert!(marker.exists(), "the command did not run");
    let args = std::fs::read_to_string(d.join("ncu-args.txt")).unwrap();
    for want in ["--clock-control none", "--set full", "--nvtx --nvtx-include forward/", "-f -o"] {
        assert!(args.contains(want), "ncu arguments lack {want:?}: {args}");
    }
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    // 6 kernels in the fixture: 2 FMA convs + 1 TF32 conv (conv forward), 3 cuDNN transposes (layout)
    assert!(md.contains("(ncu, 6 kernels)"), "no command pass:\n{md}");
    assert!(md.contains("layout conversion") && md.contains("conv forward"), "categories missing:\n{md}");
    assert!(out.join("ncu_kernels.csv").exists() && out.join("ncu/command_raw.csv").exists());
    let ncu_rows = std::fs::read_to_string(out.join("ncu_kernels.csv")).unwrap();
    assert!(ncu_rows.contains("nchwToNhwcKernel"));
}

#[test]
fn missing_ncu_is_reported_not_fatal() {
    let d = tmp("nocu");
    let out = d.join("report");
    let o = meddpm(&["profile", "--ncu", "/nonexistent/ncu", "--out", out.to_str().unwrap(), "--", "true"]);
    assert!(o.status.success());
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("could not be started"), "no reason given:\n{md}");
}

#[test]
fn cuda_without_a_device_still_writes_the_report() {
    if meddpm_cuda::probe().is_ok() {
        eprintln!("skip: a CUDA device is present (this test covers the no-device path)");
        return;
    }
    let d = tmp("nocuda");
    let out = d.join("report");
    let o = meddpm(&[
        "profile",
        "--device",
        "cuda",
        "--counters",
        "--matrix",
        "--preset",
        "tiny",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("no CUDA backend"), "no reason given:\n{md}");
}
