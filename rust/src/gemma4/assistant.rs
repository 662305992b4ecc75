//! `Assistant`: Gemma 4's MTP assistant drafter (Transformers 5.18
//! `models/gemma4_assistant/modeling_gemma4_assistant.py`, `Gemma4AssistantForCausalLM`, and the same model as
//! `models/gemma4_unified_assistant/` for the 12B), which proposes draft tokens from the target's own state.
//!
//! A few Gemma 4 decoder layers whose every layer is KV-shared: they compute queries only and attend to the
//! keys and values of the target's last layer of their type that computes its own (`Model::kv_donors`,
//! Transformers' `shared_kv_states`), so the drafter reads no prompt of its own. One draft at position `p`
//! (the position of the row's next input token `t`):
//! `x = pre_projection(cat(embed_target(t), h))`, where `embed_target` is the target's scaled embedding and
//! `h` the target's final hidden state (after the final norm) at `p - 1`, the one that chose `t`; the layers
//! at position `p` (RoPE of the assistant's own config); `y = norm(x)`; the draft is `argmax(lm_head(y))`
//! (no softcap: `logits = self.lm_head(last_hidden_state)`), or with ordered embeddings the argmax over the
//! tokens of the `centroid_intermediate_top_k` best centroids (`Gemma4AssistantMaskedEmbedder`, whose other
//! logits are the minimum less one); then `h = post_projection(y)` and `t` the draft for the next draft,
//! still at position `p` (`SinglePositionMultiTokenCandidateGenerator` in `generation/candidate_generator.py`
//! keeps `position_ids` fixed within a round).
//!
//! Which keys a draft sees: every key of the target's rings at positions `<= p - 1` (the target has not
//! written `p`). The reference's bidirectional sliding mask (`create_attention_masks`) admits the last
//! `sliding_window + 1` keys handed to it; a sliding ring holds the last `sliding_window`, and those are what
//! the drafter reads. Drafts only propose: whichever tokens they are, the verify step keeps the target's.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::gemma4::attention::{Attended, Plan, Positions};
use crate::gemma4::cache::{KvCache, Rows, held_before_rows};
use crate::gemma4::config::{Config, LayerType, TopLevel, positive, read_json};
use crate::gemma4::config_json::{RawText, parse, within};
use crate::gemma4::layer::{DecoderLayer, LayerIo};
use crate::gemma4::linear::Linear;
use crate::gemma4::model::Model;
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::parallel::Split;
use crate::gemma4::rope::Rope;
use crate::gemma4::weights::{Kernels, Weights};
use crate::tensor::{DType, Tensor};

const MODEL_TYPES: [&str; 2] = ["gemma4_assistant", "gemma4_unified_assistant"];

/// What `Assistant::draft` adds to draft `j`'s logits, given draft `j - 1` (None for the first): None adds nothing.
pub type DraftMask<'a> = dyn FnMut(i64, Option<&Tensor>) -> Result<Option<Tensor>> + 'a;

/// An assistant's config.json: its text model, and what ties it to a target.
pub struct AssistantConfig {
    /// The text model, every layer reading its type's donor (`kv_source` = `LayerType::index`).
    pub text: Config,
    pub backbone_hidden_size: i64,
    /// `(num_centroids, centroid_intermediate_top_k)` with `use_ordered_embeddings`.
    pub ordered: Option<(i64, i64)>,
}

impl AssistantConfig {
    /// Parse an assistant's config.json (`Gemma4AssistantConfig`): its `text_config` as a Gemma 4 text model
    /// whose layers are all KV-shared, under `validate_architecture`'s rules (no per-layer inputs, experts or
    /// double-wide MLP).
    pub fn from_json(root: &Value) -> Result<AssistantConfig> {
        let raw: RawAssistant = parse(root)?;
        match raw.model_type.as_deref() {
            Some(t) if MODEL_TYPES.contains(&t) => {}
            other => {
                return Err(Error::config(
                    "model_type",
                    format!("{other:?} is not a Gemma 4 assistant ({})", MODEL_TYPES.join(", ")),
                ));
            }
        }
        let text = raw.text_config.as_ref().filter(|t| t.is_object());
        let text = text.ok_or_else(|| Error::config("text_config", "an assistant needs a text_config object"))?;
        let mut text: RawText = parse(text).map_err(within("text_config"))?;
        for (key, ok, want) in [
            ("hidden_size_per_layer_input", text.hidden_size_per_layer_input == 0, "0"),
            ("vocab_size_per_layer_input", text.vocab_size_per_layer_input.is_none_or(|v| v == 0), "0"),
            ("enable_moe_block", !text.enable_moe_block, "false"),
            ("use_double_wide_mlp", !text.use_double_wide_mlp, "false"),
        ] {
            if !ok {
                return Err(Error::config(format!("text_config.{key}"), format!("must be {want} in an assistant")));
            }
        }
        // Every layer reads the target's keys; derived as a model of its own, none is shared.
        text.num_kv_shared_layers = 0;
        let mut cfg = Config::derive(text, &TopLevel::default()).map_err(within("text_config"))?;
        for l in &mut cfg.layers {
            l.kv_source = Some(l.kind.index());
        }
        let ordered = if raw.use_ordered_embeddings {
            Some((
                positive("num_centroids", raw.num_centroids)?,
                positive("centroid_intermediate_top_k", raw.centroid_intermediate_top_k)?,
            ))
        } else {
            None
        };
        if let Some((c, k)) = ordered
            && (cfg.vocab_size % c != 0 || k > c)
        {
            return Err(Error::config(
                "num_centroids",
                format!(
                    "must divide vocab_size ({}) and be >= centroid_intermediate_top_k ({k}), got {c}",
                    cfg.vocab_size
                ),
            ));
        }
        Ok(AssistantConfig {
            backbone_hidden_size: positive("backbone_hidden_size", raw.backbone_hidden_size)?,
            ordered,
            text: cfg,
        })
    }
}

/// `Gemma4AssistantConfig`'s own keys, Transformers' defaults where absent (Transformers 5.18
/// `models/gemma4_assistant/configuration_gemma4_assistant.py`, lines 70-73).
#[derive(Deserialize)]
struct RawAssistant {
    model_type: Option<String>,
    text_config: Option<Value>,
    #[serde(default = "backbone_hidden_size")]
    backbone_hidden_size: i64,
    #[serde(default)]
    use_ordered_embeddings: bool,
    #[serde(default = "num_centroids")]
    num_centroids: i64,
    #[serde(default = "centroid_intermediate_top_k")]
    centroid_intermediate_top_k: i64,
}

fn backbone_hidden_size() -> i64 {
    1536
}

fn num_centroids() -> i64 {
    2048
}

fn centroid_intermediate_top_k() -> i64 {
    32
}

/// `Gemma4AssistantMaskedEmbedder`: the tokens sorted by centroid, `[num_centroids, vocab / num_centroids]`.
struct Ordered {
    centroids: Linear,
    canonical: Tensor,
    top_k: i64,
}

pub struct Assistant {
    cfg: Config,
    pre_projection: Linear,
    post_projection: Linear,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// The LM head's rows (the tied embedding table), `[vocab, hidden]`, and the head over them.
    table: Tensor,
    lm_head: Linear,
    ordered: Option<Ordered>,
    /// Indexed by `LayerType::index`; None when no layer has that type.
    ropes: [Option<Rope>; 2],
    /// The target layers whose rings each type reads.
    donors: [usize; 2],
    /// Bytes of its weights on the device.
    pub bytes: i64,
}

impl Assistant {
    /// Load the assistant in `dir` for `target`, onto `like`'s device in `dtype`; an error names what does not
    /// fit the target (hidden size, vocabulary, a layer type the target has no ring of, head geometry).
    pub fn load(
        dir: &Path,
        target: &Model,
        like: &Tensor,
        dtype: DType,
        kernels: Kernels,
        context: i64,
    ) -> Result<Assistant> {
        let ac = AssistantConfig::from_json(&read_json(&dir.join("config.json"))?)?;
        let (cfg, tc) = (ac.text, &target.cfg);
        if ac.backbone_hidden_size != tc.hidden_size {
            return Err(Error::config(
                "backbone_hidden_size",
                format!(
                    "the assistant was trained for hidden size {}, the target's is {}",
                    ac.backbone_hidden_size, tc.hidden_size
                ),
            ));
        }
        if cfg.vocab_size != tc.vocab_size {
            return Err(Error::config(
                "text_config.vocab_size",
                format!("the assistant's vocabulary has {} tokens, the target's {}", cfg.vocab_size, tc.vocab_size),
            ));
        }
        let found = target.kv_donors();
        let mut donors = [0, 0];
        for (i, l) in cfg.layers.iter().enumerate() {
            let kind = l.kind.index();
            let d = found[kind].ok_or_else(|| {
                Error::config(
                    "text_config.layer_types",
                    format!("layer {i} is {:?}, a type the target has no ring of", l.kind),
                )
            })?;
            let t = &tc.layers[d];
            if (t.head_dim, t.num_kv_heads) != (l.head_dim, l.num_kv_heads) {
                return Err(Error::config(
                    "text_config.head_dim",
                    format!(
                        "layer {i} has {} KV heads of {}, the target's keys it reads {} of {}",
                        l.num_kv_heads, l.head_dim, t.num_kv_heads, t.head_dim
                    ),
                ));
            }
            donors[kind] = d;
        }
        let w = Weights::open(dir, None, None, like.shallow_clone()?, dtype, kernels)?;
        let (v, h, hb) = (cfg.vocab_size, cfg.hidden_size, tc.hidden_size);
        let split = Split::whole();
        let layers =
            (0..cfg.num_layers).map(|i| DecoderLayer::load(&w, &split, &cfg, i)).collect::<Result<Vec<_>>>()?;
        let table =
            if cfg.tie_word_embeddings { w.embedding("embed_tokens", v, h)? } else { w.embedding("lm_head", v, h)? };
        let ordered = match ac.ordered {
            Some((c, top_k)) => Some(Ordered {
                centroids: w.linear("masked_embedding.centroids", c, h)?,
                canonical: w.vector("masked_embedding.token_ordering", &[v], DType::I64)?.reshape(&[c, v / c])?,
                top_k,
            }),
            None => None,
        };
        let mut ropes = [None, None];
        for kind in [LayerType::Sliding, LayerType::Full] {
            if let Some(l) = cfg.layers.iter().find(|l| l.kind == kind) {
                ropes[kind.index()] = Some(Rope::new(&cfg.rope[kind.index()], l.head_dim, context, like, dtype)?);
            }
        }
        let (pre_projection, post_projection) =
            (w.linear("pre_projection", h, 2 * hb)?, w.linear("post_projection", hb, h)?);
        let (norm, lm_head) = (RmsNorm::load(&w, "norm", h, cfg.rms_norm_eps)?, w.table_linear(&table)?);
        Ok(Assistant {
            bytes: w.loaded().bytes,
            pre_projection,
            post_projection,
            norm,
            lm_head,
            table,
            ordered,
            layers,
            ropes,
            donors,
            cfg,
        })
    }

    /// `k` drafts, int64 `[rows, k]`, for the slots `rows` of the target's `cache` whose next input tokens are
    /// `tokens` at positions `positions` (int64 `[rows]`), the target's final hidden states before them
    /// `hidden` (`[rows, target hidden]`, `Model::final_hidden`) (module docs). Draft `j` is chosen with
    /// `mask(j, draft j - 1)` (None for the first) added to its logits when that is Some (float `[rows, vocab]`: a
    /// caller's grammar masks, engine/columns.rs).
    #[allow(clippy::too_many_arguments)]
    pub fn draft(
        &self,
        target: &Model,
        cache: &mut KvCache,
        rows: Rows,
        tokens: &Tensor,
        hidden: &Tensor,
        positions: &Tensor,
        k: i64,
        mask: &mut DraftMask<'_>,
    ) -> Result<Tensor> {
        let b = rows.len;
        cache.prepare(rows)?;
        let pos = Positions::new(&positions.reshape(&[b, 1])?)?;
        let last = positions.reshape(&[b, 1, 1, 1])?.add_int(-1)?;
        let mut plans = [None, None];
        let mut attended: Attended = vec![None, None];
        for kind in [LayerType::Sliding, LayerType::Full] {
            let Some(rope) = &self.ropes[kind.index()] else { continue };
            let donor = self.donors[kind.index()];
            let (key, value) =
                cache.kv(donor, rows)?.ok_or_else(|| Error::Internal(format!("target layer {donor} has no ring")))?;
            attended[kind.index()] = Some((key.shallow_clone()?, value.shallow_clone()?));
            let held = match kind {
                LayerType::Full => cache.ring_order(kind).shallow_clone()?,
                LayerType::Sliding => held_before_rows(positions, cache.ring(kind))?.reshape(&[b, 1, 1, -1])?,
            };
            plans[kind.index()] = Some(Plan::reading(rope.at(&pos)?, held.le(&last)?)?);
        }
        let (mut token, mut h) = (tokens.shallow_clone()?, hidden.shallow_clone()?);
        let mut drafts = Vec::with_capacity(k as usize);
        for j in 0..k {
            let allowed = mask(j, (j > 0).then_some(&token))?;
            let mut x = self.pre_projection.forward(&Tensor::cat(&[&target.token_embeddings(&token)?, &h], 1)?)?;
            for layer in &self.layers {
                let plan = plans[layer.spec.kind.index()]
                    .as_ref()
                    .ok_or_else(|| Error::Internal("no plan for an assistant layer's type".into()))?;
                let io = LayerIo { plan, cache: &mut *cache, attended: &mut attended, scratch: None };
                x = layer.forward(&x, None, rows, io)?;
            }
            let y = self.norm.forward(&x)?;
            token = self.choose(&y, allowed.as_ref())?;
            h = self.post_projection.forward(&y)?;
            drafts.push(token.reshape(&[b, 1])?);
        }
        Tensor::cat(&drafts.iter().collect::<Vec<_>>(), 1)
    }

    /// The most likely token under the head of final states `y` (`[rows, hidden]`), with `mask` (float
    /// `[rows, vocab]`, 0 or -inf) added to its logits: int64 `[rows]`.
    fn choose(&self, y: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let Some(o) = &self.ordered else {
            let logits = self.lm_head.forward(y)?;
            return mask.map_or(Ok(logits.shallow_clone()?), |m| logits.add(m))?.argmax(1, false);
        };
        let b = y.size()?[0];
        // The tokens of the best centroids, `[rows, top_k * per_centroid]`, and their logits.
        let (_, best) = o.centroids.forward(y)?.topk(o.top_k)?;
        let tokens = o.canonical.index_select(0, &best.reshape(&[-1])?)?.reshape(&[b, -1])?;
        let rows = self.table.index_select(0, &tokens.reshape(&[-1])?)?.reshape(&[b, -1, self.cfg.hidden_size])?;
        let logits = rows.matmul(&y.unsqueeze(2)?)?.reshape(&[b, -1])?;
        let logits = match mask {
            Some(m) => logits.add(&m.gather(1, &tokens)?)?,
            None => logits,
        };
        tokens.gather(1, &logits.argmax(1, true)?)?.reshape(&[b])
    }
}
