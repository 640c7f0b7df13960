//! What the CLI tests that drive the built `meddpm` binary share: a scratch folder per test, and
//! the binary as a child process with the fault-injection variables cleared (unless a test sets
//! them), so a developer's environment cannot change what a test sees.
#![allow(dead_code)] // each test file uses its own part

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const BIN: &str = env!("CARGO_BIN_EXE_meddpm");

/// An empty folder `meddpm-<suite>-<name>-<pid>` in the temp dir.
pub fn scratch(suite: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-{suite}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `meddpm ARGS` run in `cwd`, the fault variables cleared, then `env` set.
pub fn meddpm(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(BIN);
    c.current_dir(cwd)
        .args(args)
        .env_remove("MEDDPM_FAULT_NAN_AT_STEP")
        .env_remove("MEDDPM_FAULT_DISK_FULL_AT_STEP")
        .env_remove("MEDDPM_FAULT_SLOW_STEP_MS");
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// [`meddpm`] to its end: (exit code, stdout, stderr).
pub fn run(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let o: Output = meddpm(cwd, args, env).output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}
