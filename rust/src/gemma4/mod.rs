//! The Gemma 4 text model: checkpoint → loader → model → batched decode loop.
//!
//! `config` (config.json), `weights` (safetensors, W4A16 unpacking), `norm`, `rope`, `mlp`,
//! `attention` (with the ring masks), `layer`, `model`, `cache` (per-slot fixed-shape rings),
//! `sampling` (next-token choice on the device), `scratch` (a decode step's op outputs, made once),
//! `engine` (the continuous-batching loop).
//!
//! The forward pass follows Transformers 5.18 `src/transformers/models/gemma4/modeling_gemma4.py`
//! (`Gemma4ForCausalLM`) and its config `configuration_gemma4.py`. Comments cite line ranges of
//! those two files of that release as `M:<lines>` (modeling) and `C:<lines>` (configuration).

pub mod attention;
pub mod cache;
pub mod config;
pub mod engine;
pub mod layer;
pub mod linear;
pub mod mlp;
pub mod model;
pub mod norm;
pub mod rope;
pub mod sampling;
pub mod scratch;
pub mod weights;
