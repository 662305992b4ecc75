//! gemma_engine: a Gemma 4 text model in Rust over PyTorch's ATen, built by maturin into the
//! Python package `gemma_engine` (native part `gemma_engine._native`).
//!
//! Layers, from the edge in: `aten.cpp` (C++ shim, exceptions caught) → `ffi` (declarations,
//! the `ffi!` macro) → `tensor` (owned handles) → `gemma4` (config, loader, model, ring cache,
//! decode loop) → `bindings` (the only place that sees Python objects).
//! Design follows the seed rig "Gemma 4 in Rust on TorchTPU: A Native TPU Rig With PyO3 and MCP".

pub mod bindings;
pub mod error;
pub(crate) mod ffi;
pub mod gemma4;
pub mod tensor;

pub use error::{Error, Result};
