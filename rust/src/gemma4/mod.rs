//! The Gemma 4 text model alone: checkpoint → loader → model. Which requests run and when is the
//! runtime's (`crate::engine`), as candle's `candle-transformers/src/models/gemma3.rs` is the model only.
//!
//! `config` (the model's config, derived from config.json as `config_json` reads it), `weights` (safetensors, W4A16
//! unpacking, the choice of kernels), `norm`, `rope`, `mlp`, `moe` (the 26B-A4B's router and experts), `attention`
//! (with the ring masks), `layer`, `model`, `assistant` (the MTP drafter, which reads the target's rings), `cache`
//! (per-slot fixed-shape rings), `scratch` (a decode step's op outputs, made once), `parallel` (tensor parallelism:
//! the shards' slices, their reductions and KV caches).
//!
//! The forward pass follows Transformers 5.18 `src/transformers/models/gemma4/modeling_gemma4.py`
//! (`Gemma4ForCausalLM`) and its config `configuration_gemma4.py`. Comments cite line ranges of
//! those two files of that release as `M:<lines>` (modeling) and `C:<lines>` (configuration).

pub mod assistant;
pub mod attention;
pub mod audio;
pub mod cache;
pub mod config;
pub mod config_json;
pub mod layer;
pub mod linear;
pub mod media;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod norm;
pub mod parallel;
pub mod rope;
pub mod scratch;
pub mod vision;
pub mod weights;
