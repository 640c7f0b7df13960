//! The report inputs of `meddpm profile` that need no GPU backend, each added to the report's
//! [`Input`] or named in its "Not collected" list (a missing tool or a bad file never takes the
//! report down): a program run under Nsight Compute ([`ncu_run`], the process with its time
//! limit and exports; [`command_pass`]), PyTorch profiler tables ([`torch_tables`]), presets
//! counted on the null backend for the roofline predictions ([`predictions`]), Nsight Compute
//! exports ([`ncu_exports`]) and the optimisation matrix read from exports
//! ([`matrix_exports`]). The CLI (`crates/meddpm-cli/src/profile.rs`) parses the arguments and
//! runs the model steps; the CUDA ones are `meddpm_cuda::profile_steps`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use super::gpus;
use super::kernels::short_name;
use super::matrix::{ConfigInput, MatrixSpec};
use super::ncu::{self, NcuData};
use super::profile::{profile_unet, Options};
use super::report::{Input, Pass};
use super::timed::{NullBackend, Timed};
use crate::model::UNetConfig;
use crate::{Error, Result};

/// Run `ncu ARGS… -f -o DIR/NAME TARGET…` (stopped after `timeout_s`), export the raw and details
/// pages next to the report and parse them. Every failure (ncu missing, counters not permitted,
/// no kernel profiled, past the limit) is an error string for the report.
pub fn ncu_run(
    ncu: &str,
    args: &[String],
    target: &[String],
    dir: &Path,
    name: &str,
    timeout_s: u64,
) -> std::result::Result<NcuData, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let rep = dir.join(name);
    let rep_file = dir.join(format!("{name}.ncu-rep"));
    let log_path = dir.join(format!("{name}.log"));
    let _ = std::fs::remove_file(&rep_file);
    let log_file =
        std::fs::File::create(&log_path).map_err(|e| format!("cannot create {}: {e}", log_path.display()))?;
    let log_err = log_file.try_clone().map_err(|e| format!("{}: {e}", log_path.display()))?;
    let mut cmd = Command::new(ncu);
    cmd.args(args).arg("-f").arg("-o").arg(&rep).args(target).stdout(log_file).stderr(log_err);
    eprintln!("profile: {ncu} {} -f -o {} {}", args.join(" "), rep.display(), target.join(" "));
    let t0 = Instant::now();
    let mut child = cmd.spawn().map_err(|e| {
        format!("Nsight Compute `{ncu}` could not be started ({e}): install Nsight Compute or pass --ncu PATH")
    })?;
    // ncu and its target write to the log file; poll so that a run past the limit is stopped
    // and reported instead of taking the whole report down with it
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if t0.elapsed().as_secs() >= timeout_s => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "ncu ran past the {timeout_s} s limit (--ncu-timeout) and was stopped; its output is in {}",
                    log_path.display()
                ));
            }
            Ok(None) => std::thread::sleep(std::time::Duration::from_millis(200)),
            Err(e) => return Err(format!("waiting for ncu: {e}")),
        }
    };
    eprintln!("profile: ncu run {name} took {:.1} s", t0.elapsed().as_secs_f64());
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    if log.contains("ERR_NVGPUCTRPERM") {
        return Err("performance counters are not permitted for this user (ncu: ERR_NVGPUCTRPERM; needs root or \
                    NVreg_RestrictProfilingToAdminUsers=0)"
            .into());
    }
    if !rep_file.exists() {
        return Err(format!(
            "ncu wrote no report (exit {}; no kernel matched the filters?): {}",
            status.code().map_or("signal".into(), |c| c.to_string()),
            ncu::log_tail(&log, 4)
        ));
    }
    if !status.success() {
        eprintln!("warning: ncu exited with {status} (report written; see {name}.log)");
    }
    let export = |page: &str, file: &str| -> std::result::Result<PathBuf, String> {
        let o = Command::new(ncu)
            .arg("-i")
            .arg(&rep_file)
            .args(["--page", page, "--csv", "--print-units", "base"])
            .output()
            .map_err(|e| format!("ncu -i {} --page {page}: {e}", rep_file.display()))?;
        if !o.status.success() {
            return Err(format!(
                "ncu -i {} --page {page} failed: {}",
                rep_file.display(),
                ncu::log_tail(&String::from_utf8_lossy(&o.stderr), 3)
            ));
        }
        let p = dir.join(file);
        std::fs::write(&p, &o.stdout).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
        Ok(p)
    };
    let raw = export("raw", &format!("{name}_raw.csv"))?;
    let details = export("details", &format!("{name}_details.csv"))?;
    NcuData::load(Some(&raw), Some(&details)).map_err(|e| e.to_string())
}

/// What [`command_pass`] runs: `command` under `ncu` with `args` (`ncu::command_args`), the
/// report in `dir`, `counters` when `--set full` was asked for.
pub struct CommandRun<'a> {
    pub ncu: &'a str,
    pub args: Vec<String>,
    pub command: &'a [String],
    pub dir: PathBuf,
    pub counters: bool,
    pub timeout_s: u64,
}

/// Another program under Nsight Compute: its kernels as one summed pass, the device ncu names,
/// its counters; or why not.
pub fn command_pass(input: &mut Input, c: &CommandRun) {
    let what = c.command.join(" ");
    input.config = format!("`{what}` under Nsight Compute ({})", c.args.join(" "));
    match ncu_run(c.ncu, &c.args, c.command, &c.dir, "command", c.timeout_s) {
        Ok(n) => {
            let records = ncu::kernel_records(&n.kernels);
            input.device = n.device_name().unwrap_or_else(|| "the GPU ncu ran on".into());
            input.device_gpu = gpus::find(&input.device);
            input
                .passes
                .push(Pass::summed(format!("{} (ncu, {} kernels)", short_name(&what, 60), records.len()), records));
            input.not_collected.push(
                "command pass: times are Nsight Compute kernel durations under replay, kernels serialised (the pass \
                 time is their sum, not a wall time)"
                    .into(),
            );
            if !c.counters {
                input.not_collected.push(
                    "hardware counters of the command: only durations, cycles, instructions and IPC were collected \
                     (add --counters for `--set full`)"
                        .into(),
                );
            }
            input.ncu = Some(n);
        }
        Err(e) => {
            eprintln!("warning: {e}");
            input.not_collected.push(format!("command `{what}` under Nsight Compute: not collected because {e}"));
        }
    }
}

/// PyTorch profiler kernel tables, one summed pass each (`PyTorch <file stem>`).
pub fn torch_tables(input: &mut Input, tables: &[PathBuf]) {
    for t in tables {
        match std::fs::read_to_string(t).map_err(|e| Error::io(t, e)).and_then(|s| super::torch::parse_table(&s, t)) {
            Ok(records) => {
                let name = t.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
                input.passes.push(Pass::summed(format!("PyTorch {name}"), records));
            }
            Err(e) => {
                eprintln!("warning: {e}");
                input.not_collected.push(format!("PyTorch table {}: {e}", t.display()));
            }
        }
    }
}

/// Counted-only passes (the null backend) of each named model, for the roofline predictions.
pub fn predictions(input: &mut Input, models: &[(&str, UNetConfig)], opts: &Options) -> Result<()> {
    for (name, cfg) in models {
        let nb = Timed::new(NullBackend::default());
        let o =
            Options { warmup: 0, repeats: 1, measured: false, label: format!(" ({name}, counted)"), ..opts.clone() };
        let passes = profile_unet(&nb, cfg, &o).map_err(|e| Error::Backend(format!("counting preset {name}: {e}")))?;
        input.passes.extend(passes);
    }
    Ok(())
}

/// Nsight Compute exports (raw and/or details page) as the report's counters; a bad file is
/// reported, not fatal.
pub fn ncu_exports(input: &mut Input, raw: Option<&Path>, details: Option<&Path>) {
    match NcuData::load(raw, details) {
        Ok(n) => input.ncu = Some(n),
        Err(e) => {
            eprintln!("warning: {e}");
            input.not_collected.push(format!("hardware counters: {e}"));
        }
    }
}

/// The optimisation matrix's configurations given as exports (`--matrix NAME=raw.csv[:IDs]`;
/// other specs are skipped), and a note when fewer than two could be read.
pub fn matrix_exports(input: &mut Input, specs: &[MatrixSpec]) {
    for m in specs {
        let MatrixSpec::Ncu { name, path, ids } = m else { continue };
        match NcuData::load(Some(path), None) {
            Ok(n) => {
                let ks = ncu::select_ids(n.kernels, ids.as_deref());
                if ks.is_empty() {
                    input
                        .not_collected
                        .push(format!("matrix configuration {name}: no kernel with IDs {ids:?} in {}", path.display()));
                } else {
                    input.matrix.push(ConfigInput::from_ncu(name, &ks));
                }
            }
            Err(e) => {
                eprintln!("warning: {e}");
                input.not_collected.push(format!("matrix configuration {name}: {e}"));
            }
        }
    }
    if !specs.is_empty() && input.matrix.len() < 2 {
        input.not_collected.push("optimization matrix: fewer than two configurations could be read".into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        crate::testing::scratch_dir(&format!("collect-{name}"))
    }

    #[test]
    fn a_missing_tool_or_file_is_a_note_not_an_error() {
        let d = tmp("missing");
        let mut input = Input::default();
        let cmd = ["true".to_string()];
        let run = CommandRun {
            ncu: "/nonexistent/ncu",
            args: vec![],
            command: &cmd,
            dir: d.join("ncu"),
            counters: false,
            timeout_s: 5,
        };
        command_pass(&mut input, &run);
        torch_tables(&mut input, &[d.join("absent.txt")]);
        ncu_exports(&mut input, Some(&d.join("absent_raw.csv")), None);
        matrix_exports(&mut input, &[MatrixSpec::Ncu { name: "a".into(), path: d.join("a.csv"), ids: None }]);
        assert!(input.passes.is_empty() && input.ncu.is_none() && input.matrix.is_empty());
        let nc = input.not_collected.join("\n");
        for want in
            ["could not be started", "PyTorch table", "hardware counters:", "matrix configuration a:", "fewer than two"]
        {
            assert!(nc.contains(want), "{want:?} not in {nc}");
        }
    }

    #[test]
    #[cfg(unix)]
    fn ncu_past_its_limit_is_stopped_and_a_run_without_report_says_so() {
        use std::os::unix::fs::PermissionsExt;
        let d = tmp("limit");
        let fake = d.join("ncu");
        std::fs::write(&fake, "#!/bin/sh\nsleep 30\n").unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let t0 = Instant::now();
        let e = ncu_run(fake.to_str().unwrap(), &[], &["true".into()], &d.join("out"), "x", 1).unwrap_err();
        assert!(e.contains("past the 1 s limit") && t0.elapsed().as_secs() < 10, "{e}");
        std::fs::write(&fake, "#!/bin/sh\necho no kernels profiled\nexit 3\n").unwrap();
        let e = ncu_run(fake.to_str().unwrap(), &[], &["true".into()], &d.join("out"), "y", 10).unwrap_err();
        assert!(e.contains("wrote no report (exit 3") && e.contains("no kernels profiled"), "{e}");
    }

    #[test]
    fn predictions_count_a_model_without_running_it() {
        let mut input = Input::default();
        let opts = Options { seed: 0, warmup: 0, repeats: 1, ..Options::default() };
        predictions(&mut input, &[("tiny", UNetConfig::tiny())], &opts).unwrap();
        assert!(!input.passes.is_empty());
        assert!(input.passes.iter().all(|p| p.name.ends_with("(tiny, counted)") && !p.measured), "{:?}", {
            input.passes.iter().map(|p| p.name.clone()).collect::<Vec<_>>()
        });
    }
}
