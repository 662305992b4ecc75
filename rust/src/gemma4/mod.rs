//! The Gemma 4 text model: checkpoint → loader → model → decode loop.
//!
//! `config` (config.json), `weights` (safetensors, W4A16 unpacking), `norm`, `rope`, `mlp`,
//! `attention` (with the ring masks), `layer`, `model`, `cache` (fixed-shape rings), `engine`
//! (the decode loop). The forward pass follows ../shared/reference/gemma4-architecture.md.

pub mod attention;
pub mod cache;
pub mod config;
pub mod engine;
pub mod layer;
pub mod mlp;
pub mod model;
pub mod norm;
pub mod rope;
pub mod weights;
