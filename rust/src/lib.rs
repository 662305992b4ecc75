//! gemma_engine: a Gemma 4 text model in Rust over PyTorch's ATen, built by maturin into the
//! Python package `gemma_engine` (native part `gemma_engine._native`).
//!
//! Layers, from the edge in: `aten.cpp` (C++ shim, exceptions caught) → `ffi` (declarations,
//! the `ffi!` macro) → `tensor` (owned handles) → `gemma4` (the model: config, loader, layers, ring
//! cache) → `engine` (the runtime: requests, slots, the decode step, sampling, the batching loop) →
//! `bindings` (the only place that sees Python objects).
//! Design follows the article "Gemma 4 in Rust on TorchTPU: A Native TPU Rig With PyO3 and MCP", which
//! ran Gemma 4 E2B this way on one TPU v5e chip.

mod bindings;
pub(crate) mod engine;
pub(crate) mod error;
pub(crate) mod ffi;
pub(crate) mod gemma4;
pub(crate) mod tensor;
