//! `Model`: the Gemma 4 text forward (Gemma4ForCausalLM), M:1574-1867.
//!
//! x0 = embed_tokens[ids] * sqrt(H) (the scale cast to the weight dtype, M:1455); per-layer
//! inputs ple = (rms(proj(x0) * H^-0.5) + embed_tokens_per_layer[ids] * sqrt(P)) * 2^-0.5 split
//! per layer (M:1755-1788); the decoder layers; the final norm; tied lm_head; final softcap
//! `cap * tanh(logits / cap)` (M:1864-1867).

use crate::error::{Error, Result};
use crate::gemma4::attention::{Attended, Fill, Liveness, Plan};
use crate::gemma4::cache::{KvCache, Rows};
use crate::gemma4::config::{Config, LayerType};
use crate::gemma4::layer::DecoderLayer;
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::rope::Rope;
use crate::gemma4::weights::Weights;
use crate::tensor::{DType, Tensor};

/// Whether a forward computes next-token logits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Output {
    /// The last position's logits of every row.
    Logits,
    /// Nothing (prompt chunks before the last).
    Nothing,
}

/// The per-layer-embedding front end (P > 0).
struct PerLayerEmbeddings {
    embed_tokens_per_layer: Tensor,
    embed_scale: Tensor,
    per_layer_model_projection: Tensor,
    per_layer_projection_norm: RmsNorm,
}

pub struct Model {
    pub cfg: Config,
    embed_tokens: Tensor,
    embed_scale: Tensor,
    per_layer: Option<PerLayerEmbeddings>,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Tensor,
    /// Indexed by `LayerType::index`; None when no layer has that type.
    ropes: [Option<Rope>; 2],
    dtype: DType,
}

/// The head dim shared by every layer of `kind` (RoPE tables are per type).
fn type_head_dim(cfg: &Config, kind: LayerType) -> Result<Option<i64>> {
    let mut dims = cfg.layers.iter().filter(|l| l.kind == kind).map(|l| l.head_dim);
    let Some(first) = dims.next() else { return Ok(None) };
    if dims.any(|d| d != first) {
        return Err(Error::config("per_layer_config", format!("layers of type {kind:?} must share one head_dim")));
    }
    Ok(Some(first))
}

impl Model {
    pub fn load(cfg: Config, w: &Weights, context: i64) -> Result<Model> {
        let (v, h, l, p) = (cfg.vocab_size, cfg.hidden_size, cfg.num_layers as i64, cfg.ple_dim);
        let like = &w.like;
        // The embedding scales are buffers cast to the weight dtype before the multiply (M:1455).
        let scale = |x: f64| Tensor::full(&[], x, w.dtype, like);
        let embed_tokens = w.embedding("embed_tokens", v, h)?;
        let per_layer = if p > 0 {
            Some(PerLayerEmbeddings {
                embed_tokens_per_layer: w.embedding("embed_tokens_per_layer", cfg.vocab_size_per_layer_input, l * p)?,
                embed_scale: scale((p as f64).sqrt())?,
                per_layer_model_projection: w.linear("per_layer_model_projection", l * p, h)?,
                per_layer_projection_norm: RmsNorm::load(w, "per_layer_projection_norm", p, cfg.rms_norm_eps)?,
            })
        } else {
            None
        };
        let layers = (0..cfg.num_layers).map(|i| DecoderLayer::load(w, &cfg, i)).collect::<Result<Vec<_>>>()?;
        let lm_head = if cfg.tie_word_embeddings { embed_tokens.shallow_clone()? } else { w.linear("lm_head", v, h)? };
        let mut ropes = [None, None];
        for kind in [LayerType::Sliding, LayerType::Full] {
            if let Some(d) = type_head_dim(&cfg, kind)? {
                ropes[kind.index()] = Some(Rope::new(&cfg.rope[kind.index()], d, context, like, w.dtype)?);
            }
        }
        Ok(Model {
            embed_scale: scale((h as f64).sqrt())?,
            norm: RmsNorm::load(w, "norm", h, cfg.rms_norm_eps)?,
            embed_tokens,
            per_layer,
            layers,
            lm_head,
            ropes,
            dtype: w.dtype,
            cfg,
        })
    }

    /// Per-layer inputs `[rows, T, L, P]` for token `ids` (`[rows * T]`) with main embeddings `x0`.
    fn per_layer_inputs(&self, pl: &PerLayerEmbeddings, ids: &Tensor, x0: &Tensor, n: i64, t: i64) -> Result<Tensor> {
        let (h, l, p) = (self.cfg.hidden_size, self.cfg.num_layers as i64, self.cfg.ple_dim);
        let tok = pl.embed_tokens_per_layer.index_select(0, ids)?.mul(&pl.embed_scale)?.reshape(&[n, t, l, p])?;
        let ctx = x0.linear(&pl.per_layer_model_projection)?.mul_scalar((h as f64).powf(-0.5))?.reshape(&[n, t, l, p])?;
        let ctx = pl.per_layer_projection_norm.forward(&ctx)?;
        ctx.add(&tok)?.mul_scalar(0.5f64.sqrt())
    }

    /// Run tokens `ids` at positions `pos` (both `[rows, T]` int64 on the device) of the slots
    /// `rows` through the model, writing their keys into `cache`. `row_index` is `[rows, 1]`
    /// int64 `0..rows`; `live` says which rows are real. Returns each row's next-token logits
    /// `[rows, vocab]` (after softcap, compute dtype) for `Output::Logits`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        cache: &mut KvCache,
        rows: Rows,
        ids: &Tensor,
        pos: &Tensor,
        row_index: &Tensor,
        live: &Liveness,
        fill: Fill,
        output: Output,
    ) -> Result<Option<Tensor>> {
        let [n, t] = ids.size()?[..] else { return Err(Error::Internal("token ids must be [rows, T]".into())) };
        let flat = ids.reshape(&[n * t])?;
        let x0 = self.embed_tokens.index_select(0, &flat)?.mul(&self.embed_scale)?;
        let ple = match &self.per_layer {
            Some(pl) => Some(self.per_layer_inputs(pl, &flat, &x0, n, t)?),
            None => None,
        };
        let mut plans: [Option<Plan>; 2] = [None, None];
        for kind in [LayerType::Sliding, LayerType::Full] {
            if let Some(rope) = &self.ropes[kind.index()] {
                let held = cache.positions(kind, rows)?;
                let ring = cache.ring(kind);
                let window = self.cfg.sliding_window;
                plans[kind.index()] = Some(Plan::new(kind, pos, fill, &held, ring, row_index, live, rope, window)?);
            }
        }
        let mut attended: Attended = (0..self.layers.len()).map(|_| None).collect();
        let mut xs = x0.reshape(&[n, t, self.cfg.hidden_size])?;
        for (i, layer) in self.layers.iter().enumerate() {
            let plan = plans[layer.spec.kind.index()]
                .as_ref()
                .ok_or_else(|| Error::Internal("no RoPE table for a layer type".into()))?;
            let ple_i = match &ple {
                Some(p) => Some(p.narrow(2, i as i64, 1)?.reshape(&[n, t, self.cfg.ple_dim])?),
                None => None,
            };
            xs = layer.forward(&xs, ple_i.as_ref(), plan, rows, cache, &mut attended)?;
        }
        // Every layer has read the old positions: record the new ones.
        for kind in [LayerType::Sliding, LayerType::Full] {
            if let Some(plan) = &plans[kind.index()] {
                cache.set_positions(kind, rows, &plan.positions_after)?;
            }
        }
        if output == Output::Nothing {
            return Ok(None);
        }
        let last = self.norm.forward(&xs.narrow(1, t - 1, 1)?)?;
        let mut logits = last.linear(&self.lm_head)?;
        if let Some(cap) = self.cfg.final_logit_softcapping {
            logits = logits.div_scalar(cap)?.tanh()?.mul_scalar(cap)?;
        }
        Ok(Some(logits.reshape(&[n, self.cfg.vocab_size])?))
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
}
