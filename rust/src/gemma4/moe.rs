//! The mixture-of-experts block of `enable_moe_block` models (the 26B-A4B): a router that picks
//! `top_k` experts a token (M:1318-1352, Gemma4TextRouter) and the experts as two 3D weights
//! (M:1279-1316, Gemma4TextExperts: `gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`).
//!
//! The experts run as Transformers' default `grouped_mm` implementation computes them
//! (`transformers/integrations/moe.py`, `grouped_mm_experts_forward`, 5.18): the token-expert pairs
//! sorted by expert, one grouped matrix product for every expert's gate and up projections and one for
//! the down projections, the weighted rows put back in token order and summed over the `top_k` picks in
//! float32. A step's ATen calls are the same whatever the number of experts, and no expert is visited
//! from the host.

use crate::error::Result;
use crate::gemma4::config::MoeSpec;
use crate::gemma4::linear::Linear;
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::parallel::Tp;
use crate::gemma4::weights::Weights;
use crate::tensor::{DType, Tensor};

/// Gemma4TextRouter: `softmax(proj(norm(x) * scale * H^-0.5))` in float32, the `top_k` largest
/// renormalised to sum to 1, times `per_expert_scale` of the chosen experts.
struct Router {
    /// The norm without weight, with `scale * H^-0.5` as its weight: the reference multiplies the
    /// normed rows by both afterwards; here the norm's one rounding covers the product.
    norm: RmsNorm,
    proj: Linear,
    /// `[E]` float32 (the reference multiplies float32 weights by it).
    per_expert_scale: Tensor,
    top_k: i64,
}

impl Router {
    fn load(w: &Weights, p: &str, hidden: i64, eps: f64, spec: &MoeSpec) -> Result<Router> {
        let scale = w.vector(&format!("{p}.scale"), &[hidden], DType::F32)?;
        let weight = scale.mul_scalar((hidden as f64).powf(-0.5))?.to_dtype(w.dtype)?;
        Ok(Router {
            norm: RmsNorm::new(weight, eps),
            proj: w.linear(&format!("{p}.proj"), spec.num_experts, hidden)?,
            per_expert_scale: w.vector(&format!("{p}.per_expert_scale"), &[spec.num_experts], DType::F32)?,
            top_k: spec.top_k,
        })
    }

    /// `x` `[T, H]` → (weights `[T, K]` float32, expert ids `[T, K]` int64).
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let scores = self.proj.forward(&self.norm.forward(x)?)?;
        let probs = scores.to_dtype(DType::F32)?.softmax(-1)?;
        let (top, ids) = probs.topk(self.top_k)?;
        let top = top.div(&top.sum_dim(-1)?.unsqueeze(-1)?)?;
        let k = self.top_k;
        let scale = self.per_expert_scale.index_select(0, &ids.reshape(&[-1])?)?.reshape(&[-1, k])?;
        Ok((top.mul(&scale)?, ids))
    }
}

/// Gemma4TextExperts, batched over experts; a tensor-parallel shard holds every expert's share of the
/// intermediate features (parallel.rs), its output a partial sum.
pub struct Experts {
    /// `[E, H, 2I]`: `gate_up_proj` transposed (a view), the layout the grouped product reads.
    gate_up: Tensor,
    /// `[E, I, H]`: `down_proj` transposed (a view).
    down: Tensor,
    num_experts: i64,
    intermediate: i64,
}

impl Experts {
    pub fn load(w: &Weights, layer: &str, hidden: i64, spec: &MoeSpec, tp: Tp) -> Result<Experts> {
        let (e, i) = (spec.num_experts, spec.intermediate_size);
        let (first, len) = tp.part(i);
        // `gate_up_proj` stacks every gate row, then every up row: a shard takes its rows of each.
        let gate_up = w.dense_part(&format!("{layer}.experts.gate_up_proj"), &[e, 2 * i, hidden], w.dtype, |t| {
            if tp.size == 1 {
                return t.shallow_clone();
            }
            Tensor::cat(&[&t.narrow(1, first, len)?, &t.narrow(1, i + first, len)?], 1)
        })?;
        let down = w.dense_part(&format!("{layer}.experts.down_proj"), &[e, hidden, i], w.dtype, |t| {
            if tp.size == 1 { t.shallow_clone() } else { t.narrow(2, first, len)?.copy() }
        })?;
        Ok(Experts {
            gate_up: gate_up.transpose(1, 2)?,
            down: down.transpose(1, 2)?,
            num_experts: e,
            intermediate: len,
        })
    }

    /// `x` `[T, H]`, `weights` `[T, K]` float32, `ids` `[T, K]` → `[T, H]` in `x`'s dtype.
    pub fn forward(&self, x: &Tensor, weights: &Tensor, ids: &Tensor) -> Result<Tensor> {
        let size = x.size()?;
        let (t, h) = (size[0], size[1]);
        let k = ids.size()?[1];
        let (e, i) = (self.num_experts, self.intermediate);
        // Token-expert pairs (S = T * K) sorted by expert; `perm[s]` is the pair's flat index.
        let (sorted, perm) = ids.reshape(&[-1])?.sort(false)?;
        let rows = x.index_select(0, &perm.floor_div_int(k)?)?;
        let counts = sorted.to_dtype(DType::F32)?.histc(e, 0.0, (e - 1) as f64)?;
        let offsets = counts.cumsum(0)?.to_dtype(DType::I32)?;
        let [gate, up] = rows.grouped_mm(&self.gate_up, &offsets)?.split_array(&[i, i], -1)?;
        let out = gate.gelu_tanh()?.mul(&up)?.grouped_mm(&self.down, &offsets)?;
        let out = out.mul(&weights.reshape(&[-1])?.index_select(0, &perm)?.unsqueeze(-1)?)?;
        // Back in pair order, then each token's K rows summed in float32 (the reference's order).
        let unsorted = Tensor::full(&[t * k, h], 0.0, DType::F32, x)?;
        unsorted.index_put_(&[Some(&perm)], &out)?;
        unsorted.reshape(&[t, k, h])?.sum_dim(1)?.to_dtype(x.kind()?.unwrap_or(DType::F32))
    }
}

/// The router and the experts' norm: both read the layer's residual stream, the router as it is, the
/// experts after their own norm (M:1414-1426). The experts are the layer's (this rank's share of each).
pub struct Routing {
    router: Router,
    pre_norm: RmsNorm,
}

/// What `Routing::forward` hands the experts.
pub struct Routed {
    /// `pre_feedforward_layernorm_2(residual)`, `[T, H]`.
    pub x: Tensor,
    /// `[T, K]` float32.
    pub weights: Tensor,
    /// `[T, K]` int64.
    pub ids: Tensor,
}

impl Routing {
    pub fn load(w: &Weights, layer: &str, hidden: i64, eps: f64, spec: &MoeSpec) -> Result<Routing> {
        Ok(Routing {
            router: Router::load(w, &format!("{layer}.router"), hidden, eps, spec)?,
            pre_norm: RmsNorm::load(w, &format!("{layer}.pre_feedforward_layernorm_2"), hidden, eps)?,
        })
    }

    /// `residual` `[T, H]`, the stream after attention.
    pub fn forward(&self, residual: &Tensor) -> Result<Routed> {
        let (weights, ids) = self.router.forward(residual)?;
        Ok(Routed { x: self.pre_norm.forward(residual)?, weights, ids })
    }
}
