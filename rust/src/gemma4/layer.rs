//! `DecoderLayer` (M:1355-1441): attention and MLP blocks with pre- and post-norms, the
//! per-layer-embedding (PLE) gate, `layer_scalar` on the whole residual stream, and in MoE models
//! the experts beside the MLP (moe.rs), each branch under its own post-norm before they are summed.
//! Attention, the MLP and the experts are split over the tensor-parallel shards (parallel.rs): the
//! layer runs each shard's part and reduces the partial outputs, once after attention and once after
//! the MLP and the experts.
//!
//! In float32 (`Weights::folds`) the layer's last step, `(x + norm(h)) * s` with `s = layer_scalar`,
//! is one call, `add(norm'(h), x, alpha=s)`, where `norm'` is the last norm with its weight times `s`
//! (read once at load): the same sum, rounded in another order.

use crate::error::Result;
use crate::gemma4::attention::{Attended, Attention, Plan};
use crate::gemma4::cache::{KvCache, Rows};
use crate::gemma4::config::{Config, LayerSpec};
use crate::gemma4::linear::Linear;
use crate::gemma4::mlp::Mlp;
use crate::gemma4::moe::{Experts, Routing};
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::parallel::Split;
use crate::gemma4::scratch::Scratch;
use crate::gemma4::weights::Weights;
use crate::tensor::Tensor;

/// The experts branch of an MoE layer and the norms that frame the two branches (M:1377-1382).
struct MoeBranch {
    routing: Routing,
    /// Per shard.
    experts: Vec<Experts>,
    /// After the dense MLP (`post_feedforward_layernorm_1`).
    post_mlp_norm: RmsNorm,
    /// After the experts (`post_feedforward_layernorm_2`).
    post_moe_norm: RmsNorm,
}

/// The PLE trio of a layer.
struct PerLayerInput {
    per_layer_input_gate: Linear,
    per_layer_projection: Linear,
    post_per_layer_input_norm: RmsNorm,
}

pub struct DecoderLayer {
    pub spec: LayerSpec,
    index: usize,
    input_layernorm: RmsNorm,
    /// Per tensor-parallel shard, as `mlp`.
    self_attn: Vec<Attention>,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    mlp: Vec<Mlp>,
    post_feedforward_layernorm: RmsNorm,
    moe: Option<MoeBranch>,
    per_layer: Option<PerLayerInput>,
    layer_scalar: Scalar,
}

/// What one tensor-parallel shard of a forward works with: its plan, KV rings, the keys its layers
/// attended to, its one-token buffers, and its device.
pub struct ShardIo<'a> {
    pub plan: &'a Plan,
    pub cache: &'a mut KvCache,
    pub attended: &'a mut Attended,
    pub scratch: Option<&'a mut Scratch>,
    pub like: &'a Tensor,
    /// On the first shard's device: nothing is copied to or from it.
    pub local: bool,
}

impl ShardIo<'_> {
    /// `x` on this shard's device.
    fn input(&self, x: &Tensor) -> Result<Tensor> {
        if self.local {
            x.shallow_clone()
        } else {
            x.to_like(self.like, x.kind()?.unwrap_or(crate::tensor::DType::F32))
        }
    }
}

/// How the layer applies `layer_scalar`.
enum Scalar {
    /// The last norm's weight carries it, and the last add scales the residual by it (module docs).
    Folded(f64),
    /// `(x + norm(h)) * s`, as the reference does.
    Multiply(Tensor),
}

impl Scalar {
    /// `(x + h) * s`, where `h` is the last norm's output.
    fn finish(&self, x: &Tensor, h: &Tensor) -> Result<Tensor> {
        match self {
            Scalar::Folded(s) => h.add_alpha(x, *s),
            Scalar::Multiply(s) => x.add(h)?.mul(s),
        }
    }
}

impl DecoderLayer {
    /// `shards` each shard's weights; the first also loads the parts kept whole.
    pub fn load(shards: &[Weights], split: &Split, cfg: &Config, i: usize) -> Result<DecoderLayer> {
        let w = shards.first().ok_or_else(|| crate::error::Error::Internal("a layer of no shards".into()))?;
        let spec = cfg.layers[i].clone();
        let p = format!("layers.{i}");
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let norm = |n: &str| RmsNorm::load(w, &format!("{p}.{n}"), h, eps);
        // A stored buffer (M:1509-1510), in the compute dtype as the reference multiplies.
        let scalar = w.vector(&format!("{p}.layer_scalar"), &[1], w.dtype)?;
        let folded = if w.folds() { Some(scalar.item_f64()?) } else { None };
        // The layer's last norm carries the folded scalar (module docs).
        let last = |n: RmsNorm| match folded {
            Some(s) => n.rescaled(s, eps),
            None => Ok(n),
        };
        let per_layer = if cfg.ple_dim > 0 {
            Some(PerLayerInput {
                per_layer_input_gate: w.linear(&format!("{p}.per_layer_input_gate"), cfg.ple_dim, h)?,
                per_layer_projection: w.linear(&format!("{p}.per_layer_projection"), h, cfg.ple_dim)?,
                post_per_layer_input_norm: last(norm("post_per_layer_input_norm")?)?,
            })
        } else {
            None
        };
        let post_feedforward_layernorm = norm("post_feedforward_layernorm")?;
        let group = split.shards();
        let moe = match &cfg.moe {
            Some(spec) => Some(MoeBranch {
                routing: Routing::load(w, &p, h, eps, spec)?,
                experts: group
                    .iter()
                    .zip(shards)
                    .map(|(tp, sw)| Experts::load(sw, &p, h, spec, *tp))
                    .collect::<Result<_>>()?,
                post_mlp_norm: norm("post_feedforward_layernorm_1")?,
                post_moe_norm: norm("post_feedforward_layernorm_2")?,
            }),
            None => None,
        };
        Ok(DecoderLayer {
            input_layernorm: norm("input_layernorm")?,
            self_attn: group
                .iter()
                .zip(shards)
                .map(|(tp, sw)| Attention::load(sw, cfg, &spec, &format!("{p}.self_attn"), *tp))
                .collect::<Result<_>>()?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
            mlp: group
                .iter()
                .zip(shards)
                .map(|(tp, sw)| Mlp::load(sw, &format!("{p}.mlp"), h, spec.intermediate_size, *tp))
                .collect::<Result<_>>()?,
            post_feedforward_layernorm: match per_layer {
                Some(_) => post_feedforward_layernorm,
                None => last(post_feedforward_layernorm)?,
            },
            moe,
            per_layer,
            layer_scalar: match folded {
                Some(s) => Scalar::Folded(s),
                None => Scalar::Multiply(scalar),
            },
            spec,
            index: i,
        })
    }

    /// `xs` `[rows * T, hidden]`; `ple` this layer's per-layer input `[rows * T, P]`; `io` one entry
    /// per shard (the first on `xs`'s device).
    pub fn forward(
        &self,
        xs: &Tensor,
        ple: Option<&Tensor>,
        rows: Rows,
        io: &mut [ShardIo],
        split: &Split,
    ) -> Result<Tensor> {
        let residual = xs;
        let normed = self.input_layernorm.forward(xs)?;
        let local = io.iter().all(|s| s.local);
        let attended = self
            .self_attn
            .iter()
            .zip(io.iter_mut())
            .map(|(a, s)| {
                let x = s.input(&normed)?;
                a.forward(&x, s.plan, self.index, rows, s.cache, s.attended, s.scratch.as_deref_mut())
            })
            .collect::<Result<Vec<_>>>()?;
        let h = split.sum(attended, xs, local)?;
        let xs = residual.add(&self.post_attention_layernorm.forward(&h)?)?;

        let ff = self.pre_feedforward_layernorm.forward(&xs)?;
        let h = match &self.moe {
            None => {
                let parts = self
                    .mlp
                    .iter()
                    .zip(io.iter_mut())
                    .map(|(m, s)| m.forward(&s.input(&ff)?, s.scratch.as_deref_mut()));
                split.sum(parts.collect::<Result<Vec<_>>>()?, &xs, local)?
            }
            Some(b) => {
                // The router and the experts read the residual stream, not the MLP's input (M:1414-1426).
                let routed = b.routing.forward(&xs)?;
                let mut parts = Vec::with_capacity(io.len());
                for ((m, e), s) in self.mlp.iter().zip(&b.experts).zip(io.iter_mut()) {
                    let mlp = m.forward(&s.input(&ff)?, s.scratch.as_deref_mut())?;
                    let experts =
                        e.forward(&s.input(&routed.x)?, &s.input(&routed.weights)?, &s.input(&routed.ids)?)?;
                    parts.push([mlp, experts]);
                }
                let [mlp, experts] = match (parts.len(), split) {
                    (1, Split::InProcess { .. }) => {
                        parts.pop().ok_or_else(|| crate::error::Error::Internal("no shard".into()))?
                    }
                    // One reduction over both branches, side by side.
                    _ => {
                        let h = xs.size()?[1];
                        let joined = parts.iter().map(|[m, e]| Tensor::cat(&[m, e], -1)).collect::<Result<Vec<_>>>()?;
                        split.sum(joined, &xs, local)?.split_array(&[h, h], -1)?
                    }
                };
                b.post_mlp_norm.forward(&mlp)?.add(&b.post_moe_norm.forward(&experts)?)?
            }
        };
        let h = self.post_feedforward_layernorm.forward(&h)?;
        match (&self.per_layer, ple) {
            (Some(pl), Some(ple)) => {
                let xs = xs.add(&h)?;
                let g = pl.per_layer_input_gate.forward(&xs)?.gelu_tanh()?.mul(ple)?;
                self.layer_scalar
                    .finish(&xs, &pl.post_per_layer_input_norm.forward(&pl.per_layer_projection.forward(&g)?)?)
            }
            (None, _) => self.layer_scalar.finish(&xs, &h),
            (Some(_), None) => {
                Err(crate::error::Error::Internal(format!("layer {} got no per-layer input", self.index)))
            }
        }
    }
}
