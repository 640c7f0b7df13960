//! The run folder's advisory lock: one process writes a run folder at a time. `RunLock::acquire`
//! takes an exclusive `flock` on `<dir>/.meddpm.lock` and writes its PID there; a second run
//! into the folder fails at once with the holder's PID. The OS drops the lock when its file is
//! closed or the process dies, so a lock left by a killed process never blocks the next run.

use crate::error::{Error, Result};
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The lock file's name inside a run folder.
pub const LOCK_FILE: &str = ".meddpm.lock";

/// A held run-folder lock; released when dropped (or at exit).
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
    _file: File,
}

impl RunLock {
    /// Lock `dir` (which must exist) for this process.
    pub fn acquire(dir: &Path) -> Result<RunLock> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut pid = String::new();
                let _ = file.read_to_string(&mut pid);
                let who = match pid.trim() {
                    "" => "another process".to_string(),
                    p => format!("another meddpm process (PID {p})"),
                };
                return Err(Error::Data {
                    path: dir.to_path_buf(),
                    msg: format!(
                        "{who} is writing to this run folder (lock {}); wait for it to finish, stop it, or give \
                         another --out",
                        path.display()
                    ),
                });
            }
            Err(TryLockError::Error(e)) => return Err(Error::io(&path, e)),
        }
        let pid = std::process::id().to_string();
        file.set_len(0)
            .and_then(|_| file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(pid.as_bytes()))
            .map_err(|e| Error::io(&path, e))?;
        Ok(RunLock { path, _file: file })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_fails_naming_the_holder_and_a_released_one_is_free() {
        let dir = std::env::temp_dir().join(format!("meddpm-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = RunLock::acquire(&dir).unwrap();
        let e = RunLock::acquire(&dir).unwrap_err().to_string();
        assert!(e.contains(&format!("PID {}", std::process::id())), "{e}");
        drop(first);
        let again = RunLock::acquire(&dir).unwrap();
        assert_eq!(std::fs::read_to_string(again.path()).unwrap(), std::process::id().to_string());
        drop(again);
        std::fs::remove_dir_all(&dir).ok();
    }
}
