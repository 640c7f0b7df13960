//! The engine's one error type. Each variant names what was wrong and where (file, key, shape),
//! so the CLI can print one clear line instead of a panic.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written. The OS reason is part of this message and is
    /// deliberately *not* exposed as `source()`: error reporters that print the whole chain
    /// (anyhow's `{:#}`) would otherwise print it twice ("…: No such file or directory (os
    /// error 2): No such file or directory (os error 2)"). The field is therefore not named
    /// `source`, which thiserror would treat as the source.
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    /// A configuration value is invalid (what, and what was expected).
    #[error("invalid config: {0}")]
    Config(String),
    /// A file exists but its content is not what was expected.
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },
    /// A checkpoint does not match the model: missing, unexpected or wrong-shaped keys.
    #[error("checkpoint {path} does not match the model: {msg}")]
    Checkpoint { path: PathBuf, msg: String },
    /// Input data (a volume, a mask) is unusable.
    #[error("{path}: {msg}")]
    Data { path: PathBuf, msg: String },
    /// A file could not be written; `kept` says what was left intact instead (e.g. the previous
    /// checkpoint). The OS reason is in the message once (see `Io`).
    #[error("{path} not written: {err}; {kept}")]
    NotWritten { path: PathBuf, err: std::io::Error, kept: String },
    /// A value that must be finite is NaN or ±Inf (what, where, at which step).
    #[error("not finite: {0}")]
    NonFinite(String),
    /// A backend could not do what was asked (no device, out of memory, library error).
    #[error("{0}")]
    Backend(String),
    /// A distributed run cannot go on: launch environment, rendezvous, a lost or diverged rank.
    #[error("distributed run: {0}")]
    Dist(String),
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, err: std::io::Error) -> Self {
        Error::Io { path: path.into(), err }
    }
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Format { path: path.into(), msg: msg.into() }
    }
    pub fn data(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Data { path: path.into(), msg: msg.into() }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// The file and the OS reason appear once each, also through a chain-printing reporter.
    #[test]
    fn io_error_names_the_file_and_the_reason_once() {
        let e = Error::io("/no/such/file.nii.gz", std::io::Error::from(std::io::ErrorKind::NotFound));
        let reason = std::io::Error::from(std::io::ErrorKind::NotFound).to_string();
        // What `anyhow`'s `{:#}` prints: the message, then ": " and each source in turn.
        let mut chain = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            chain.push_str(&format!(": {s}"));
            src = s.source();
        }
        assert_eq!(chain.matches("/no/such/file.nii.gz").count(), 1, "{chain}");
        assert_eq!(chain.matches(&reason).count(), 1, "{chain}");
    }
}
