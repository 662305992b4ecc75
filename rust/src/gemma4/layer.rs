//! `DecoderLayer` (M:1355-1441): attention and MLP blocks with pre- and post-norms, the
//! per-layer-embedding (PLE) gate, `layer_scalar` on the whole residual stream, and in MoE models
//! the experts beside the MLP (moe.rs), each branch under its own post-norm before they are summed.
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
use crate::gemma4::moe::Moe;
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::scratch::Scratch;
use crate::gemma4::weights::Weights;
use crate::tensor::Tensor;

/// The experts branch of an MoE layer and the norms that frame the two branches (M:1377-1382).
struct MoeBranch {
    moe: Moe,
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
    pub fn load(w: &Weights, cfg: &Config, i: usize) -> Result<DecoderLayer> {
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
                moe: Moe::load(w, &p, h, eps, spec)?,
                post_mlp_norm: norm("post_feedforward_layernorm_1")?,
                post_moe_norm: norm("post_feedforward_layernorm_2")?,
            }),
            None => None,
        };
        Ok(DecoderLayer {
            input_layernorm: norm("input_layernorm")?,
            self_attn: Attention::load(w, cfg, &spec, &format!("{p}.self_attn"))?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
            mlp: Mlp::load(w, &format!("{p}.mlp"), h, spec.intermediate_size)?,
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

    /// `xs` `[rows * T, hidden]`; `ple` this layer's per-layer input `[rows * T, P]`; `scratch` for
    /// one-token forwards (scratch.rs).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        xs: &Tensor,
        ple: Option<&Tensor>,
        plan: &Plan,
        rows: Rows,
        cache: &mut KvCache,
        attended: &mut Attended,
        mut scratch: Option<&mut Scratch>,
    ) -> Result<Tensor> {
        let residual = xs;
        let normed = self.input_layernorm.forward(xs)?;
        let h = self.self_attn.forward(&normed, plan, self.index, rows, cache, attended, scratch.as_deref_mut())?;
        let xs = residual.add(&self.post_attention_layernorm.forward(&h)?)?;

        let h = self.mlp.forward(&self.pre_feedforward_layernorm.forward(&xs)?, scratch)?;
        let h = match &self.moe {
            // The router and the experts read the residual stream, not the MLP's input (M:1414-1426).
            Some(b) => b.post_mlp_norm.forward(&h)?.add(&b.post_moe_norm.forward(&b.moe.forward(&xs)?)?)?,
            None => h,
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
