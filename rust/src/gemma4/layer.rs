//! `DecoderLayer` (M:1355-1441): attention and MLP blocks with pre- and post-norms, the
//! per-layer-embedding (PLE) gate, `layer_scalar` on the whole residual stream, and in MoE models
//! the experts beside the MLP (moe.rs), each branch under its own post-norm before they are summed.
//! Under tensor parallelism (parallel.rs) attention and the MLP hold this rank's part and return the
//! sum over the ranks; in an MoE layer the MLP and the experts return partial sums that the layer adds
//! up in one collective, side by side.
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
    experts: Experts,
    /// Sums the MLP's and the experts' partial outputs over the ranks, in one collective.
    split: Split,
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
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    mlp: Mlp,
    post_feedforward_layernorm: RmsNorm,
    moe: Option<MoeBranch>,
    per_layer: Option<PerLayerInput>,
    layer_scalar: Scalar,
}

/// What a forward's layers work with besides the hidden states: the attention plan of the layer's type,
/// the KV rings, the keys the layers attended to, and the one-token buffers.
pub struct LayerIo<'a> {
    pub plan: &'a Plan,
    pub cache: &'a mut KvCache,
    pub attended: &'a mut Attended,
    pub scratch: Option<&'a mut Scratch>,
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
    /// Layer `i`, this rank's part of it (`split`).
    pub fn load(w: &Weights, split: &Split, cfg: &Config, i: usize) -> Result<DecoderLayer> {
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
        let moe = match &cfg.moe {
            Some(spec) => Some(MoeBranch {
                routing: Routing::load(w, &p, h, eps, spec)?,
                experts: Experts::load(w, &p, h, spec, split.tp)?,
                split: split.clone(),
                post_mlp_norm: norm("post_feedforward_layernorm_1")?,
                post_moe_norm: norm("post_feedforward_layernorm_2")?,
            }),
            None => None,
        };
        Ok(DecoderLayer {
            input_layernorm: norm("input_layernorm")?,
            self_attn: Attention::load(w, cfg, &spec, &format!("{p}.self_attn"), split)?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
            mlp: Mlp::load(w, &format!("{p}.mlp"), h, spec.intermediate_size, split, cfg.moe.is_none())?,
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

    /// `xs` `[rows * T, hidden]`; `ple` this layer's per-layer input `[rows * T, P]`.
    pub fn forward(&self, xs: &Tensor, ple: Option<&Tensor>, rows: Rows, io: LayerIo) -> Result<Tensor> {
        let residual = xs;
        let normed = self.input_layernorm.forward(xs)?;
        let mut scratch = io.scratch;
        let h = self.self_attn.forward(
            &normed,
            io.plan,
            self.index,
            rows,
            io.cache,
            io.attended,
            scratch.as_deref_mut(),
        )?;
        let xs = residual.add(&self.post_attention_layernorm.forward(&h)?)?;

        let ff = self.pre_feedforward_layernorm.forward(&xs)?;
        let h = match &self.moe {
            None => self.mlp.forward(&ff, scratch)?,
            Some(b) => {
                // The router and the experts read the residual stream, not the MLP's input (M:1414-1426).
                let routed = b.routing.forward(&xs)?;
                let mlp = self.mlp.forward(&ff, scratch)?;
                let experts = b.experts.forward(&routed.x, &routed.weights, &routed.ids)?;
                let [mlp, experts] = b.split.sum_pair(mlp, experts)?;
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
