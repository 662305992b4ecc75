//! `Model`: the Gemma 4 text forward (Gemma4ForCausalLM), M:1574-1867.
//!
//! x0 = embed_tokens[ids] * sqrt(H) (the scale cast to the weight dtype, M:1455); per-layer
//! inputs ple = (rms(proj(x0) * H^-0.5) + embed_tokens_per_layer[ids] * sqrt(P)) * 2^-0.5 split
//! per layer (M:1755-1788); the decoder layers; the final norm; tied lm_head; final softcap
//! `cap * tanh(logits / cap)` (M:1864-1867). Hidden states are 2-d, `[rows * T, hidden]`.
//!
//! The per-layer table is stored times sqrt(P) (the product the reference makes at run time, made
//! once) and viewed `[V, L, P]`. In float32 (`Weights::folds`) more constants are folded:
//! the table and the norm's weight carry the 2^-0.5; `rms(c * y)` with eps `e` is `rms(y)` with eps
//! `e / c^2`, so the H^-0.5 goes into the eps; the embedding table is stored times sqrt(H) (the same
//! products the reference makes per token), and as lm_head is linear, the final norm's weight
//! carries the softcap's 1 / cap and, when lm_head is that (tied) table, 1 / sqrt(H).

use crate::error::{Error, Result};
use crate::ffi::aten_calls;
use crate::gemma4::attention::{Attended, Fill, Liveness, Plan, Positions};
use crate::gemma4::cache::{KvCache, Rows};
use crate::gemma4::config::{Config, LayerType};
use crate::gemma4::layer::{DecoderLayer, LayerIo};
use crate::gemma4::linear::Linear;
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::parallel::Split;
use crate::gemma4::rope::Rope;
use crate::gemma4::scratch::Scratch;
use crate::gemma4::weights::Weights;
use crate::tensor::{DType, Tensor};

/// Whether a forward computes next-token logits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Output {
    /// The last position's logits of every row.
    Logits,
    /// Nothing (prompt chunks before the last).
    Nothing,
    /// The final hidden states of every position, `[rows * T, hidden]` (before the final norm), for
    /// `last_rows` and `head` (prompt log-probabilities need every position's logits).
    Hidden,
}

/// The rows of one forward's flat `[rows * T]` ids that hold soft tokens of media, and those soft tokens
/// (engine/media.rs `injection` makes it).
pub struct Injection {
    /// int64 `[m]` on the device.
    pub index: Tensor,
    /// `[m, hidden]` in the compute dtype on the device.
    pub embeds: Tensor,
    /// int64 `[rows, T]`: for each token of the forward the block it reads both ways (its item's start),
    /// or -1; None when no item of the forward is read both ways.
    pub blocks: Option<Tensor>,
}

/// The per-layer-embedding front end (P > 0).
struct PerLayerEmbeddings {
    /// `embed_tokens_per_layer * sqrt(P)` (and `* 2^-0.5` when folded), `[V, L, P]` (module docs).
    embed_tokens_per_layer: Tensor,
    per_layer_model_projection: Linear,
    /// When folded: weight times 2^-0.5, eps times H (module docs).
    per_layer_projection_norm: RmsNorm,
}

pub struct Model {
    pub cfg: Config,
    embed_tokens: Tensor,
    embed_scale: Tensor,
    /// `Config::pad_mapped_ids` on the device, when there are any.
    pad_mapped: Option<Tensor>,
    per_layer: Option<PerLayerEmbeddings>,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// What undoes the constants `norm` carries when folded (1.0 otherwise): `final_hidden`.
    hidden_unscale: f64,
    /// Vocabulary-parallel (parallel.rs): this rank's rows of the vocabulary.
    lm_head: Linear,
    /// Indexed by `LayerType::index`; None when no layer has that type.
    ropes: [Option<Rope>; 2],
    /// This process's shard of the model and where the shards' outputs meet.
    split: Split,
    dtype: DType,
    /// float32 (`Weights::folds`): the tables and the norms carry the constants the module docs list.
    folded: bool,
    /// Where one-token forwards write their projections (scratch.rs); made on first use, so a forward
    /// takes `&mut self`.
    scratch: Scratch,
    /// ATen calls each layer made in the last forward (`Engine::layer_calls`), written by `forward`.
    layer_calls: Vec<u64>,
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
    /// The model, this rank's part of it (`split`), from `w`.
    pub fn load(cfg: Config, w: &Weights, split: Split, context: i64) -> Result<Model> {
        let (v, h, l, p) = (cfg.vocab_size, cfg.hidden_size, cfg.num_layers as i64, cfg.ple_dim);
        let like = &w.like;
        // The embedding scales are buffers cast to the weight dtype before the multiply (M:1455).
        let scale = |x: f64| Tensor::full(&[], x, w.dtype, like);
        let embed_scale = scale((h as f64).sqrt())?;
        let embed_tokens = match w.embedding("embed_tokens", v, h)? {
            table if w.folds() => table.mul(&embed_scale)?,
            table => table,
        };
        let per_layer = if p > 0 {
            let vp = cfg.vocab_size_per_layer_input;
            let table = w.embedding("embed_tokens_per_layer", vp, l * p)?;
            let eps = cfg.rms_norm_eps;
            let table = table.mul(&scale((p as f64).sqrt())?)?;
            let norm = RmsNorm::load(w, "per_layer_projection_norm", p, eps)?;
            let half = 0.5f64.sqrt();
            Some(PerLayerEmbeddings {
                embed_tokens_per_layer: if w.folds() { table.mul_scalar(half)? } else { table }.reshape(&[vp, l, p])?,
                per_layer_model_projection: w.linear("per_layer_model_projection", l * p, h)?,
                per_layer_projection_norm: if w.folds() { norm.rescaled(half, eps * h as f64)? } else { norm },
            })
        } else {
            None
        };
        let layers = (0..cfg.num_layers).map(|i| DecoderLayer::load(w, &split, &cfg, i)).collect::<Result<Vec<_>>>()?;
        // This rank's vocabulary rows; tied, they are rows of the embedding table.
        let lm_head = if cfg.tie_word_embeddings {
            let (start, len) = split.tp.part(v);
            w.table_linear(&embed_tokens.narrow(0, start, len)?)?
        } else {
            w.linear_slice("lm_head", v, h, split.tp.rows(v))?
        };
        let mut ropes = [None, None];
        for kind in [LayerType::Sliding, LayerType::Full] {
            if let Some(d) = type_head_dim(&cfg, kind)? {
                ropes[kind.index()] = Some(Rope::new(&cfg.rope[kind.index()], d, context, like, w.dtype)?);
            }
        }
        // `cap * tanh(lm_head(norm(x)) / cap)`: the 1 / cap (and the tied table's 1 / sqrt(H)) go into the
        // norm's weight (module docs).
        let unscale = if cfg.tie_word_embeddings { 1.0 / embed_scale.item_f64()? } else { 1.0 };
        let factor = if w.folds() { unscale / cfg.final_logit_softcapping.unwrap_or(1.0) } else { 1.0 };
        let norm = RmsNorm::load(w, "norm", h, cfg.rms_norm_eps)?;
        Ok(Model {
            norm: if factor != 1.0 { norm.rescaled(factor, cfg.rms_norm_eps)? } else { norm },
            hidden_unscale: 1.0 / factor,
            embed_scale,
            pad_mapped: match cfg.pad_mapped_ids.as_slice() {
                [] => None,
                ids => Some(Tensor::from_i64(ids)?.to_like(like, DType::I64)?),
            },
            folded: w.folds(),
            embed_tokens,
            per_layer,
            layers,
            lm_head,
            ropes,
            dtype: w.dtype,
            layer_calls: vec![0; cfg.num_layers],
            scratch: Scratch::new(like, w.dtype)?,
            split,
            cfg,
        })
    }

    /// Per-layer inputs, one `[rows * T, P]` per layer, for token `ids` (`[rows * T]`) with main
    /// embeddings `x0`.
    fn per_layer_inputs(&self, pl: &PerLayerEmbeddings, ids: &Tensor, x0: &Tensor) -> Result<Vec<Tensor>> {
        let (l, p) = (self.cfg.num_layers as i64, self.cfg.ple_dim);
        let nt = x0.size()?[0];
        let tok = pl.embed_tokens_per_layer.index_select(0, ids)?;
        let ctx = pl.per_layer_model_projection.forward(x0)?;
        if self.folded {
            return pl.per_layer_projection_norm.forward(&ctx.reshape(&[nt, l, p])?)?.add(&tok)?.unbind(1);
        }
        let h = self.cfg.hidden_size as f64;
        let ctx = pl.per_layer_projection_norm.forward(&ctx.mul_scalar(h.powf(-0.5))?.reshape(&[nt, l, p])?)?;
        ctx.add(&tok)?.mul_scalar(0.5f64.sqrt())?.unbind(1)
    }

    /// The embeddings of flat `ids` and, with per-layer inputs, those. In a multimodal checkpoint the
    /// media placeholder ids read the pad id wherever they stand (`Config::pad_mapped_ids`), and with
    /// `inject` the media rows then take the soft tokens (M:2310-2390): the per-layer table's pad row, the
    /// soft tokens in place of the embedding, and the per-layer projection of the merged embeddings.
    fn embed(&self, ids: &Tensor, inject: Option<&Injection>) -> Result<(Tensor, Option<Vec<Tensor>>)> {
        let padded;
        let ids = match &self.pad_mapped {
            Some(placeholders) => {
                padded = ids.masked_fill(&ids.isin(placeholders)?, self.cfg.pad_token_id as f64)?;
                &padded
            }
            None => ids,
        };
        let x0 = self.token_embeddings(ids)?;
        let x0 = match inject {
            Some(inj) => x0.index_copy(0, &inj.index, &inj.embeds)?,
            None => x0,
        };
        let ple = match &self.per_layer {
            Some(pl) => Some(self.per_layer_inputs(pl, ids, &x0)?),
            None => None,
        };
        Ok((x0, ple))
    }

    /// `embed_tokens[ids] * sqrt(H)` for flat `ids`: the scaled embeddings (M:1455) an assistant drafter
    /// reads its input token through (gemma4/assistant.rs).
    pub fn token_embeddings(&self, ids: &Tensor) -> Result<Tensor> {
        let x0 = self.embed_tokens.index_select(0, ids)?;
        if self.folded { Ok(x0) } else { x0.mul(&self.embed_scale) }
    }

    /// The final norm of hidden states `xs` (`[m, hidden]`, as `Output::Hidden` gives them) at the
    /// reference's scale: Transformers' `hidden_states[-1]`, what an assistant drafter reads (folded, the
    /// norm's weight carries the head's constants: `load`).
    pub fn final_hidden(&self, xs: &Tensor) -> Result<Tensor> {
        let normed = self.norm.forward(xs)?;
        if self.hidden_unscale == 1.0 { Ok(normed) } else { normed.mul_scalar(self.hidden_unscale) }
    }

    /// Per layer type (`LayerType::index`), the last layer that computes its own keys: the one whose keys
    /// Transformers hands on as `shared_kv_states` (M:1183-1187, `store_full_length_kv`).
    pub fn kv_donors(&self) -> [Option<usize>; 2] {
        let last = |kind| self.cfg.layers.iter().rposition(|l| l.kind == kind && l.kv_source.is_none());
        [last(LayerType::Sliding), last(LayerType::Full)]
    }

    /// Run tokens `ids` at positions `pos` (`[rows, T]` int64 on the device, and `ids` flat,
    /// `[rows * T]`) of the slots `rows` through the model, writing their keys into `cache`; `live`
    /// says which rows are real; `inject` puts soft tokens of media at some of the flat rows
    /// (`embed`). Returns each row's next-token logits `[rows, vocab]` (after softcap, compute dtype)
    /// for `Output::Logits`, or the hidden states for `Output::Hidden`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        cache: &mut KvCache,
        rows: Rows,
        ids: &Tensor,
        pos: &Positions,
        live: &Liveness,
        fill: Fill,
        output: Output,
        inject: Option<&Injection>,
    ) -> Result<Option<Tensor>> {
        let n = rows.len;
        let t = ids.size()?[0] / n;
        cache.prepare(rows)?;
        let (x0, ple) = self.embed(ids, inject)?;
        let blocks = inject.and_then(|i| i.blocks.as_ref());
        let mut plans = [None, None];
        for kind in [LayerType::Sliding, LayerType::Full] {
            if let Some(rope) = &self.ropes[kind.index()] {
                let window = self.cfg.sliding_window;
                plans[kind.index()] = Some(Plan::new(kind, pos, fill, cache, live, rope, window, blocks)?);
            }
        }
        let mut scratch = (t == 1).then_some(&mut self.scratch);
        let mut attended: Attended = (0..self.layers.len()).map(|_| None).collect();
        let mut xs = x0;
        for (i, layer) in self.layers.iter().enumerate() {
            let plan = plans[layer.spec.kind.index()]
                .as_ref()
                .ok_or_else(|| Error::Internal("no RoPE table for a layer type".into()))?;
            let io = LayerIo { plan, cache: &mut *cache, attended: &mut attended, scratch: scratch.as_deref_mut() };
            let before = aten_calls();
            xs = layer.forward(&xs, ple.as_ref().map(|p| &p[i]), rows, io)?;
            self.layer_calls[i] = aten_calls() - before;
        }
        match output {
            Output::Nothing => Ok(None),
            Output::Hidden => Ok(Some(xs)),
            Output::Logits => Ok(Some(self.head(&self.last_rows(&xs, n, t)?)?)),
        }
    }

    /// Each row's last position of hidden states `xs` (`[rows * t, hidden]`): `[rows, hidden]`.
    pub fn last_rows(&self, xs: &Tensor, rows: i64, t: i64) -> Result<Tensor> {
        if t == 1 {
            return xs.shallow_clone();
        }
        let h = self.cfg.hidden_size;
        xs.reshape(&[rows, t, h])?.narrow(1, t - 1, 1)?.reshape(&[rows, h])
    }

    /// Next-token logits `[m, vocab]` (after softcap, compute dtype) of final hidden states `[m, hidden]`:
    /// the final norm, lm_head and the softcap (M:1864-1867).
    pub fn head(&self, xs: &Tensor) -> Result<Tensor> {
        let logits = self.split.gather(self.lm_head.forward(&self.norm.forward(xs)?)?)?;
        match self.cfg.final_logit_softcapping {
            // Folded: the final norm's weight carries the 1 / cap (see `load`).
            Some(cap) if self.folded => logits.tanh()?.mul_scalar(cap),
            Some(cap) => logits.div_scalar(cap)?.tanh()?.mul_scalar(cap),
            None => Ok(logits),
        }
    }

    /// This process's shard of the model.
    pub fn split(&self) -> &Split {
        &self.split
    }

    /// ATen calls each layer made in the last forward.
    pub fn layer_calls(&self) -> &[u64] {
        &self.layer_calls
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
}
