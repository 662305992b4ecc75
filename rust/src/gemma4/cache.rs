//! The fixed-shape ring KV cache.
//!
//! Full-attention layers own a ring of `context` slots, sliding layers a ring of
//! `min(sliding_window, context)` slots, KV-shared layers none (they read their source layer's
//! keys, M:1181-1187). Which position each slot holds is tracked per layer type in a device
//! tensor (-1 = empty), and the attention masks are computed from it, so a decode step runs the
//! same shapes at every position (what lets a device fuse or capture the step). Design from the
//! seed rig's ring (Colab article, Step 4).

use crate::error::Result;
use crate::gemma4::config::{Config, LayerType};
use crate::tensor::{DType, Tensor};

/// One layer's keys and values, `[kv_heads, slots, head_dim]`, after k_norm/RoPE and v_norm.
pub struct Ring {
    pub k: Tensor,
    pub v: Tensor,
}

pub struct Cache {
    pub rings: Vec<Option<Ring>>,
    /// Slot positions per layer type (`LayerType::index`), int64 `[slots]`.
    pub kpos: [Tensor; 2],
    pub slots: [i64; 2],
}

impl Cache {
    pub fn new(cfg: &Config, context: i64, like: &Tensor, dtype: DType) -> Result<Cache> {
        let slots = [cfg.sliding_window.min(context), context];
        let rings = cfg
            .layers
            .iter()
            .map(|l| {
                if l.kv_source.is_some() {
                    return Ok(None);
                }
                let shape = [l.num_kv_heads, slots[l.kind.index()], l.head_dim];
                Ok(Some(Ring {
                    k: Tensor::full(&shape, 0.0, dtype, like)?,
                    v: Tensor::full(&shape, 0.0, dtype, like)?,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        let kpos =
            [Tensor::full(&[slots[0]], -1.0, DType::I64, like)?, Tensor::full(&[slots[1]], -1.0, DType::I64, like)?];
        Ok(Cache { rings, kpos, slots })
    }

    /// Forget every position (the K/V values stay but are masked out).
    pub fn reset(&self) -> Result<()> {
        self.kpos[0].fill_(-1.0)?;
        self.kpos[1].fill_(-1.0)
    }

    pub fn count(&self, kind: LayerType, cfg: &Config) -> i64 {
        cfg.layers.iter().zip(&self.rings).filter(|(l, r)| l.kind == kind && r.is_some()).count() as i64
    }
}
