//! The engine's one error type. Each variant names what was wrong and where (file, key, shape),
//! so the CLI can print one clear line instead of a panic.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
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
    /// A backend could not do what was asked (no device, out of memory, library error).
    #[error("{0}")]
    Backend(String),
    /// A distributed run cannot go on: launch environment, rendezvous, a lost or diverged rank.
    #[error("distributed run: {0}")]
    Dist(String),
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Format { path: path.into(), msg: msg.into() }
    }
    pub fn data(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Data { path: path.into(), msg: msg.into() }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
