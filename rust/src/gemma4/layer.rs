//! `DecoderLayer` (M:1355-1441): attention and MLP blocks with pre- and post-norms, the
//! per-layer-embedding (PLE) gate, and `layer_scalar` on the whole residual stream.

use crate::error::Result;
use crate::gemma4::attention::{Attended, Attention, Plan};
use crate::gemma4::cache::{KvCache, Rows};
use crate::gemma4::config::{Config, LayerSpec};
use crate::gemma4::mlp::Mlp;
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::weights::Weights;
use crate::tensor::Tensor;

/// The PLE trio of a layer.
struct PerLayerInput {
    per_layer_input_gate: Tensor,
    per_layer_projection: Tensor,
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
    per_layer: Option<PerLayerInput>,
    layer_scalar: Tensor,
}

impl DecoderLayer {
    pub fn load(w: &Weights, cfg: &Config, i: usize) -> Result<DecoderLayer> {
        let spec = cfg.layers[i].clone();
        let p = format!("layers.{i}");
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let norm = |n: &str| RmsNorm::load(w, &format!("{p}.{n}"), h, eps);
        let per_layer = if cfg.ple_dim > 0 {
            Some(PerLayerInput {
                per_layer_input_gate: w.linear(&format!("{p}.per_layer_input_gate"), cfg.ple_dim, h)?,
                per_layer_projection: w.linear(&format!("{p}.per_layer_projection"), h, cfg.ple_dim)?,
                post_per_layer_input_norm: norm("post_per_layer_input_norm")?,
            })
        } else {
            None
        };
        Ok(DecoderLayer {
            input_layernorm: norm("input_layernorm")?,
            self_attn: Attention::load(w, cfg, &spec, &format!("{p}.self_attn"))?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
            mlp: Mlp::load(w, &format!("{p}.mlp"), h, spec.intermediate_size)?,
            post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
            per_layer,
            // A stored buffer (M:1509-1510), in the compute dtype as the reference multiplies.
            layer_scalar: w.vector(&format!("{p}.layer_scalar"), &[1], w.dtype)?,
            spec,
            index: i,
        })
    }

    /// `xs` `[rows, T, hidden]`; `ple` this layer's per-layer input `[rows, T, P]`.
    pub fn forward(
        &self,
        xs: &Tensor,
        ple: Option<&Tensor>,
        plan: &Plan,
        rows: Rows,
        cache: &mut KvCache,
        attended: &mut Attended,
    ) -> Result<Tensor> {
        let residual = xs;
        let h = self.self_attn.forward(&self.input_layernorm.forward(xs)?, plan, self.index, rows, cache, attended)?;
        let xs = residual.add(&self.post_attention_layernorm.forward(&h)?)?;

        let residual = &xs;
        let h = self.mlp.forward(&self.pre_feedforward_layernorm.forward(&xs)?)?;
        let mut xs = residual.add(&self.post_feedforward_layernorm.forward(&h)?)?;

        if let (Some(pl), Some(ple)) = (&self.per_layer, ple) {
            let g = xs.linear(&pl.per_layer_input_gate)?.gelu_tanh()?.mul(ple)?;
            let h = pl.post_per_layer_input_norm.forward(&g.linear(&pl.per_layer_projection)?)?;
            xs = xs.add(&h)?;
        }
        xs.mul(&self.layer_scalar)
    }
}
