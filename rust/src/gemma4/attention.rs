//! `Attention` (M:1162-1275) and the per-forward `Keys` plan that masks the ring.
//!
//! q = rope(q_norm(q_proj(x))), k = rope(k_norm(k_proj(x))), v = v_norm(v_proj(x)) (no scale);
//! scores use scaling 1.0 (the q/k norms replace 1/sqrt(d)), softmax in float32 inside SDPA,
//! GQA maps query head h to KV head h / (heads / kv_heads). KV-shared layers have no k/v
//! projections: they read the keys the last non-shared layer of their type attended to.
//!
//! Masks (masking_utils.py:82, :101): full layers see key j iff j <= i; sliding layers iff
//! i - W < j <= i, computed from the ring's slot positions. `Source` says which keys a forward
//! reads: a later chunk of T > 1 prompt tokens on a sliding layer attends over the ring as it
//! was plus the chunk itself (so a chunk longer than the window still sees exactly the right
//! keys) and then leaves its last min(T, slots) keys in the ring.

use crate::error::Result;
use crate::gemma4::cache::{Cache, Ring};
use crate::gemma4::config::{Config, LayerSpec, LayerType};
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::rope::{Rope, RopeAt};
use crate::gemma4::weights::Weights;
use crate::tensor::Tensor;

/// Which keys a forward attends to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Source {
    /// Write the new keys into the ring first, then attend over the whole ring (decode steps,
    /// and later prompt chunks on full layers, whose ring never wraps).
    Ring,
    /// Attend over `cat(ring, chunk)`, then leave the chunk's tail in the ring (later prompt
    /// chunks on sliding layers, where writing first could overwrite keys an earlier query of
    /// the same chunk still needs).
    RingAndChunk,
    /// The first chunk from an empty cache: attend over the chunk alone (the ring is empty),
    /// which is the same computation as an uncached reference forward; then fill the ring.
    Chunk,
}

/// How one layer type reads and writes its rings during one forward.
pub struct Keys {
    pub rope: RopeAt,
    /// bool `[1, 1, T, keys]`: true where the query may see the key.
    pub mask: Tensor,
    pub source: Source,
    /// Ring slots to write, int64 `[n]`, and how many trailing chunk rows go there.
    pub slots: Tensor,
    pub tail: i64,
    /// Slot positions to record in the cache after the forward (when written after attending).
    pub deferred: Option<Tensor>,
}

impl Keys {
    /// Plan a forward of `t` tokens at positions `pos` (`[t]` int64 on the device); `fresh` when
    /// the cache holds nothing yet.
    pub fn plan(
        kind: LayerType,
        pos: &Tensor,
        t: i64,
        fresh: bool,
        cache: &Cache,
        rope: &Rope,
        window: i64,
    ) -> Result<Keys> {
        let s = cache.slots[kind.index()];
        let kpos_ring = &cache.kpos[kind.index()];
        let qpos = pos.unsqueeze(1)?;
        let source = if fresh {
            Source::Chunk
        } else if kind == LayerType::Sliding && t > 1 {
            Source::RingAndChunk
        } else {
            Source::Ring
        };
        let (kpos, slots, tail, deferred) = if source == Source::Ring {
            let slots = pos.remainder(s)?;
            kpos_ring.index_copy_(0, &slots, pos)?;
            (kpos_ring.shallow_clone()?, slots, t, None)
        } else {
            let tail = t.min(s);
            let tail_pos = pos.narrow(0, t - tail, tail)?;
            let slots = tail_pos.remainder(s)?;
            let kpos = if source == Source::Chunk { pos.shallow_clone()? } else { Tensor::cat(&[kpos_ring, pos], 0)? };
            (kpos, slots, tail, Some(tail_pos))
        };
        let kpos = kpos.unsqueeze(0)?;
        let mut keep = kpos.ge_scalar(0.0)?.logical_and(&kpos.le(&qpos)?)?;
        if kind == LayerType::Sliding {
            keep = keep.logical_and(&kpos.gt(&qpos.add_scalar(-(window as f64))?)?)?;
        }
        let mask = keep.unsqueeze(0)?.unsqueeze(0)?;
        Ok(Keys { rope: rope.at(pos)?, mask, source, slots, tail, deferred })
    }

    /// Record the positions written after attending, once every layer has read the old ring.
    pub fn commit(&self, kpos_ring: &Tensor) -> Result<()> {
        match &self.deferred {
            Some(p) => kpos_ring.index_copy_(0, &self.slots, p),
            None => Ok(()),
        }
    }
}

struct KvProj {
    k_proj: Tensor,
    v_proj: Tensor,
    k_norm: RmsNorm,
    v_norm: RmsNorm,
}

pub struct Attention {
    q_proj: Tensor,
    q_norm: RmsNorm,
    /// None on KV-shared layers.
    kv: Option<KvProj>,
    o_proj: Tensor,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    pub fn load(w: &Weights, cfg: &Config, spec: &LayerSpec, prefix: &str) -> Result<Attention> {
        let (h, d, nh, nkv) = (cfg.hidden_size, spec.head_dim, cfg.num_heads, spec.num_kv_heads);
        let eps = cfg.rms_norm_eps;
        // Shared layers' k/v tensors, which some checkpoints ship, are never read (M:1606-1612).
        let kv = match spec.kv_source {
            Some(_) => None,
            None => Some(KvProj {
                k_proj: w.linear(&format!("{prefix}.k_proj"), nkv * d, h)?,
                v_proj: w.linear(&format!("{prefix}.v_proj"), nkv * d, h)?,
                k_norm: RmsNorm::load(w, &format!("{prefix}.k_norm"), d, eps)?,
                v_norm: RmsNorm::no_scale(eps, w.dtype),
            }),
        };
        Ok(Attention {
            q_proj: w.linear(&format!("{prefix}.q_proj"), nh * d, h)?,
            q_norm: RmsNorm::load(w, &format!("{prefix}.q_norm"), d, eps)?,
            kv,
            o_proj: w.linear(&format!("{prefix}.o_proj"), h, nh * d)?,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
        })
    }

    /// `x` `[T, hidden]` → `[T, hidden]`. `shared` carries the keys/values this layer type last
    /// attended to: written by own-KV layers, read by KV-shared ones.
    pub fn forward(
        &self,
        x: &Tensor,
        keys: &Keys,
        ring: Option<&Ring>,
        shared: &mut Option<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let t = x.size()?[0];
        let q = x.linear(&self.q_proj)?.reshape(&[t, self.num_heads, self.head_dim])?;
        let q = keys.rope.apply(&self.q_norm.forward(&q)?)?;

        if let (Some(kv), Some(ring)) = (&self.kv, ring) {
            let shape = [t, self.num_kv_heads, self.head_dim];
            let k = keys.rope.apply(&kv.k_norm.forward(&x.linear(&kv.k_proj)?.reshape(&shape)?)?)?.transpose(0, 1)?;
            let v = kv.v_norm.forward(&x.linear(&kv.v_proj)?.reshape(&shape)?)?.transpose(0, 1)?;
            let (k_all, v_all) = match keys.source {
                Source::Ring => {
                    ring.k.index_copy_(1, &keys.slots, &k)?;
                    ring.v.index_copy_(1, &keys.slots, &v)?;
                    (ring.k.shallow_clone()?, ring.v.shallow_clone()?)
                }
                Source::RingAndChunk | Source::Chunk => {
                    // cat copies, so the ring can take the chunk's tail right after.
                    let both = match keys.source {
                        Source::Chunk => (k.shallow_clone()?, v.shallow_clone()?),
                        _ => (Tensor::cat(&[&ring.k, &k], 1)?, Tensor::cat(&[&ring.v, &v], 1)?),
                    };
                    let (k_tail, v_tail) =
                        (k.narrow(1, t - keys.tail, keys.tail)?, v.narrow(1, t - keys.tail, keys.tail)?);
                    ring.k.index_copy_(1, &keys.slots, &k_tail)?;
                    ring.v.index_copy_(1, &keys.slots, &v_tail)?;
                    both
                }
            };
            *shared = Some((k_all, v_all));
        }
        let (k_all, v_all) = shared.as_ref().ok_or_else(|| crate::error::Error::Torch {
            op: "attention",
            msg: "KV-shared layer ran before its source layer".into(),
        })?;

        let q = q.transpose(0, 1)?.unsqueeze(0)?;
        let out = Tensor::sdpa(&q, &k_all.unsqueeze(0)?, &v_all.unsqueeze(0)?, &keys.mask, 1.0)?;
        // [1, heads, T, d] -> [T, heads * d]
        let out = out
            .reshape(&[self.num_heads, t, self.head_dim])?
            .transpose(0, 1)?
            .reshape(&[t, self.num_heads * self.head_dim])?;
        out.linear(&self.o_proj)
    }
}
