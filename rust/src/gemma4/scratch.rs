//! Buffers that a one-token forward (every decode step) writes its ops' outputs into, made once per
//! shape together with the views its readers take. Such a forward then makes no call to reshape or
//! split a fresh output (a call costs a device a fixed amount, see `ffi::aten_calls`), and its
//! intermediate tensors keep their addresses from step to step, as a captured CUDA graph needs.
//!
//! Layers of the same shape share a buffer: each layer's readers of it run before the next layer
//! writes it (one stream, in order), and nothing that outlives a layer (the cache, the keys a
//! KV-shared layer reads) points into one.

use std::collections::HashMap;

use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// A buffer and the views of it that its readers take.
pub struct Buffer {
    pub whole: Tensor,
    pub views: Vec<Tensor>,
}

pub struct Scratch {
    like: Tensor,
    dtype: DType,
    /// By role and the dimensions that fix the buffer's shape and its views.
    buffers: HashMap<(&'static str, Vec<i64>), Buffer>,
}

impl Scratch {
    /// Buffers in `dtype` on `like`'s device.
    pub fn new(like: &Tensor, dtype: DType) -> Result<Scratch> {
        Ok(Scratch { like: like.shallow_clone()?, dtype, buffers: HashMap::new() })
    }

    /// The buffer for `role` with dimensions `dims`: on first use, `shape` zeros and `views(whole)`.
    pub fn get(
        &mut self,
        role: &'static str,
        dims: &[i64],
        shape: &[i64],
        views: impl FnOnce(&Tensor) -> Result<Vec<Tensor>>,
    ) -> Result<Buffer> {
        let key = (role, dims.to_vec());
        if let Some(b) = self.buffers.get(&key) {
            return b.handles();
        }
        let whole = Tensor::full(shape, 0.0, self.dtype, &self.like)?;
        let buffer = Buffer { views: views(&whole)?, whole };
        let handles = buffer.handles();
        self.buffers.insert(key, buffer);
        handles
    }
}

impl Buffer {
    /// New handles to the same tensors (no ATen call).
    fn handles(&self) -> Result<Buffer> {
        Ok(Buffer {
            whole: self.whole.shallow_clone()?,
            views: self.views.iter().map(Tensor::shallow_clone).collect::<Result<_>>()?,
        })
    }
}
