//! The engine's one error type. Model and loader code return `Result<_, Error>` and use `?`;
//! `bindings/mod.rs` holds the single `From<Error> for PyErr` that picks the Python exception class.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// An ATen call failed; `msg` is ATen's message.
    #[error("{op}: {msg}")]
    Torch { op: &'static str, msg: String },

    /// config.json is missing a key, has a bad value, or asks for an unsupported feature.
    #[error("config.json: {key}: {msg}")]
    Config { key: String, msg: String },

    /// A checkpoint tensor is missing or has the wrong shape or dtype.
    #[error("tensor {name}: {msg}")]
    Weight { name: String, msg: String },

    /// A request the caller can fix (empty prompt, id outside the vocabulary, ...): ValueError.
    #[error("{0}")]
    Input(String),

    /// A broken invariant of the engine itself, never the caller's fault: RuntimeError.
    #[error("internal error: {0}")]
    Internal(String),

    /// A Python callback raised; the binding re-raises the Python exception itself.
    #[error("a callback raised: {0}")]
    Callback(String),

    /// A file could not be read.
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },

    /// A file exists but is not what it should be (bad safetensors header, bad JSON).
    #[error("{path}: {msg}")]
    Format { path: String, msg: String },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn config(key: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Config { key: key.into(), msg: msg.into() }
    }
    pub fn weight(name: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Weight { name: name.into(), msg: msg.into() }
    }
}
