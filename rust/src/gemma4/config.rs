//! `Config`: the parts of a Gemma 4 text config.json the engine needs, validated at load.
//!
//! config.json is read by serde (config_json.rs: the keys, Transformers' defaults, errors naming the key
//! path); `Config` is derived from what it read by pure functions here, which check what serde cannot (ranges,
//! supported variants, sizes that must agree) and name the key. Every size comes from the file. Derived
//! per-layer facts (head dim, KV source, MLP width) follow transformers 5.18 `models/gemma4/configuration_gemma4.py`
//! `Gemma4TextConfig.__post_init__` (C:) and `Gemma4TextAttention.__init__` / `Gemma4TextMLP` (M:) of that
//! release (line legend in gemma4/mod.rs); the quantization spec follows compressed-tensors' `quantization_config`.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::gemma4::config_json::{
    Bidirectional, GELU_TANH, MediaIds, RawGeneration, RawLayer, RawQuant, RawQuantOnly, RawRoot, RawRope, RawText,
    RopeType, parse, within,
};

/// `layer_types`' entries (C:172).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum LayerType {
    #[serde(rename = "sliding_attention")]
    Sliding,
    #[serde(rename = "full_attention")]
    Full,
}

impl LayerType {
    pub fn index(self) -> usize {
        match self {
            LayerType::Sliding => 0,
            LayerType::Full => 1,
        }
    }
}

/// What one decoder layer looks like.
#[derive(Clone, Debug)]
pub struct LayerSpec {
    pub kind: LayerType,
    pub head_dim: i64,
    pub num_kv_heads: i64,
    /// For a KV-shared layer, the last non-shared layer of the same type whose K/V it reads.
    pub kv_source: Option<usize>,
    pub intermediate_size: i64,
    /// K=V attention (`attention_k_eq_v`, the 31B's full layers): the values are the key projection's
    /// output, before k_norm and RoPE (modeling_gemma4.py, Gemma4TextAttention: `v_proj` is None and
    /// `value_states = key_states`), so the layer has no v_proj.
    pub values_from_keys: bool,
}

/// Rotary embedding of one layer type.
#[derive(Clone, Debug)]
pub struct RopeSpec {
    pub theta: f64,
    /// "default" rotates every pair; "proportional" the first `partial_rotary_factor * d / 2`.
    pub partial_rotary_factor: Option<f64>,
    pub factor: f64,
}

/// A mixture-of-experts block (`enable_moe_block`, the 26B-A4B): beside each layer's dense MLP, a router
/// picks `top_k` of `num_experts` experts of width `intermediate_size` for every token (C:179-183,
/// M:1279-1352).
#[derive(Clone, Debug)]
pub struct MoeSpec {
    pub num_experts: i64,
    pub top_k: i64,
    pub intermediate_size: i64,
}

/// compressed-tensors pack-quantized weights (W4A16): symmetric int, group or channel scales.
#[derive(Clone, Debug)]
pub struct QuantSpec {
    pub num_bits: u32,
    /// None: one scale per output row (channel strategy).
    pub group_size: Option<i64>,
}

#[derive(Clone, Debug)]
pub struct Config {
    pub vocab_size: i64,
    pub vocab_size_per_layer_input: i64,
    pub hidden_size: i64,
    /// `hidden_size_per_layer_input`; 0 turns per-layer embeddings off.
    pub ple_dim: i64,
    pub num_layers: usize,
    pub num_heads: i64,
    pub layers: Vec<LayerSpec>,
    pub sliding_window: i64,
    pub rope: [RopeSpec; 2],
    pub final_logit_softcapping: Option<f64>,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub eos_ids: Vec<i64>,
    /// The pad id, which media positions read before their soft tokens replace them (M:2313-2321).
    pub pad_token_id: i64,
    /// The placeholder ids of the media the checkpoint's towers take (`image_token_id` with a
    /// `vision_config`, `audio_token_id` with an `audio_config`; Gemma4Config's defaults); empty for text
    /// only.
    pub media_token_ids: Vec<i64>,
    /// The ids a multimodal checkpoint's text model reads as the pad id wherever they stand, generated
    /// tokens too (image, video and audio placeholders: Gemma4Model's `get_placeholder_mask`, M:2213-2259,
    /// 2313-2316); empty for a text-model config.
    pub pad_mapped_ids: Vec<i64>,
    /// The placeholder ids whose runs sliding layers read both ways (`use_bidirectional_attention:
    /// "vision"`, the 31B and 26B-A4B: an image's or a video frame's soft tokens see each other, M:2080-2158);
    /// empty otherwise, as for the E-series.
    pub bidirectional_ids: Vec<i64>,
    pub quant: Option<QuantSpec>,
    pub moe: Option<MoeSpec>,
}

/// What the top level of a config.json adds to its text config: media ids, towers, quantization, eos ids.
#[derive(Clone, Debug, Default)]
pub struct TopLevel {
    pub ids: MediaIds,
    pub quant: Option<QuantSpec>,
    /// The top level's `eos_token_id`, read when the text config has none.
    pub eos_ids: Option<Vec<i64>>,
    /// Whether it has a `vision_config` and an `audio_config`.
    pub towers: [bool; 2],
    /// Whether the text config is a `text_config` (a multimodal Gemma4Config).
    pub multimodal: bool,
}

/// `v` when it is at least 1; else an error naming `key`.
pub(crate) fn positive(key: &str, v: i64) -> Result<i64> {
    if v < 1 {
        return Err(Error::config(key, format!("must be >= 1, got {v}")));
    }
    Ok(v)
}

fn rope_spec(r: &RawRope, kind: &str) -> Result<RopeSpec> {
    let partial_rotary_factor = match (r.rope_type, r.partial_rotary_factor) {
        (RopeType::Default, _) => None,
        (RopeType::Proportional, None) => Some(1.0),
        (RopeType::Proportional, Some(f)) if (0.0..=1.0).contains(&f) => Some(f),
        (RopeType::Proportional, Some(_)) => {
            let key = format!("rope_parameters.{kind}.partial_rotary_factor");
            return Err(Error::config(key, "must be a number in [0, 1]"));
        }
    };
    Ok(RopeSpec { theta: r.rope_theta, partial_rotary_factor, factor: r.factor })
}

/// The weight format a config.json's `quantization_config` names, if it has one.
fn quant_of(q: Option<&RawQuant>) -> Result<Option<QuantSpec>> {
    q.map_or(Ok(None), quant_spec)
}

/// compressed-tensors quantization_config: every config group must be symmetric pack-quantized
/// int weights with one group size (E2B W4A16 has one group).
fn quant_spec(q: &RawQuant) -> Result<Option<QuantSpec>> {
    let key = "quantization_config";
    if let Some(fmt) = &q.format
        && fmt != "pack-quantized"
    {
        return Err(Error::config(format!("{key}.format"), format!("{fmt:?} is not supported (pack-quantized)")));
    }
    let mut spec: Option<(u32, Option<i64>)> = None;
    for (name, g) in &q.config_groups {
        let gk = format!("{key}.config_groups.{name}.weights");
        let w = &g.weights;
        let bits = w.num_bits;
        if !(1..=8).contains(&bits) {
            return Err(Error::config(format!("{gk}.num_bits"), format!("must be in 1..=8, got {bits}")));
        }
        if w.kind.as_deref().is_some_and(|t| t != "int") {
            return Err(Error::config(format!("{gk}.type"), "only int weights are supported"));
        }
        if !w.symmetric {
            return Err(Error::config(format!("{gk}.symmetric"), "asymmetric (zero-point) weights are not supported"));
        }
        let group = match w.strategy.as_deref().unwrap_or("group") {
            "group" => {
                let size_key = format!("{gk}.group_size");
                Some(positive(&size_key, w.group_size.ok_or_else(|| Error::config(&size_key, "missing"))?)?)
            }
            "channel" => None,
            s => {
                return Err(Error::config(
                    format!("{gk}.strategy"),
                    format!("{s:?} is not supported (group, channel)"),
                ));
            }
        };
        match spec {
            None => spec = Some((bits as u32, group)),
            Some(s) if s == (bits as u32, group) => {}
            Some(_) => return Err(Error::config(&gk, "config groups with different weight formats are not supported")),
        }
    }
    Ok(spec.map(|(num_bits, group_size)| QuantSpec { num_bits, group_size }))
}

impl Config {
    /// Only the quantization_config of a config.json (for an embeddings directory).
    pub fn quant_only(root: &Value) -> Result<Option<QuantSpec>> {
        quant_of(parse::<RawQuantOnly>(root)?.quantization_config.as_ref())
    }

    /// Read `dir/config.json` (and the eos ids of `generation_config.json` when present).
    pub fn load(dir: &Path) -> Result<Config> {
        let mut cfg = Config::from_json(&read_json(&dir.join("config.json"))?)?;
        let gen_path = dir.join("generation_config.json");
        // An unreadable generation_config.json is skipped; one whose eos ids are wrong is an error naming it.
        if let Ok(generation) = read_json(&gen_path) {
            let generation: RawGeneration = parse(&generation).map_err(|e| match e {
                Error::Config { key, msg } => {
                    Error::Format { path: gen_path.display().to_string(), msg: format!("{key}: {msg}") }
                }
                e => e,
            })?;
            for id in generation.eos_token_id.unwrap_or_default().0 {
                if !cfg.eos_ids.contains(&id) {
                    cfg.eos_ids.push(id);
                }
            }
        }
        Ok(cfg)
    }

    /// Parse a config.json value: a Gemma4TextConfig, or a multimodal config with `text_config` (whose keys
    /// errors name under `text_config.`).
    pub fn from_json(root: &Value) -> Result<Config> {
        let raw: RawRoot = parse(root)?;
        let top = TopLevel {
            ids: parse(root)?,
            quant: quant_of(raw.quantization_config.as_ref())?,
            eos_ids: raw.eos_token_id.map(|t| t.0),
            towers: [raw.vision_config.is_some(), raw.audio_config.is_some()],
            multimodal: raw.text_config.is_some(),
        };
        match &raw.text_config {
            Some(text) => parse(text).and_then(|t| Config::derive(t, &top)).map_err(within("text_config")),
            None => Config::derive(parse(root)?, &top),
        }
    }

    /// The model's config from a text config and its top level, checked; an error names the key.
    pub fn derive(t: RawText, top: &TopLevel) -> Result<Config> {
        check_supported(&t)?;
        let vocab_size = positive("vocab_size", t.vocab_size)?;
        let hidden_size = positive("hidden_size", t.hidden_size)?;
        let num_layers = positive("num_hidden_layers", t.num_hidden_layers)? as usize;
        let (ple_dim, vocab_size_per_layer_input) = per_layer_inputs(&t, vocab_size)?;
        let num_kv_shared = t.num_kv_shared_layers;
        if num_kv_shared < 0 || num_kv_shared as usize >= num_layers {
            return Err(Error::config(
                "num_kv_shared_layers",
                format!("must be in 0..{num_layers} (num_hidden_layers), got {num_kv_shared}"),
            ));
        }
        let kinds = layer_types(t.layer_types.as_deref(), num_layers)?;
        let layers = layer_specs(&t, &kinds, num_layers - num_kv_shared as usize)?;
        let image_and_video = vec![top.ids.image, top.ids.video];
        Ok(Config {
            vocab_size,
            vocab_size_per_layer_input,
            hidden_size,
            ple_dim,
            num_layers,
            num_heads: t.num_attention_heads,
            layers,
            sliding_window: positive("sliding_window", t.sliding_window)?,
            rope: [
                rope_spec(&t.rope_parameters.sliding_attention, "sliding_attention")?,
                rope_spec(&t.rope_parameters.full_attention, "full_attention")?,
            ],
            final_logit_softcapping: t.final_logit_softcapping.filter(|c| *c > 0.0),
            rms_norm_eps: t.rms_norm_eps,
            tie_word_embeddings: t.tie_word_embeddings,
            eos_ids: t.eos_token_id.clone().map(|e| e.0).or_else(|| top.eos_ids.clone()).unwrap_or_default(),
            pad_token_id: t.pad_token_id,
            media_token_ids: [(top.towers[0], top.ids.image), (top.towers[1], top.ids.audio)]
                .into_iter()
                .filter_map(|(tower, id)| tower.then_some(id))
                .collect(),
            pad_mapped_ids: if top.multimodal { vec![top.ids.image, top.ids.video, top.ids.audio] } else { vec![] },
            bidirectional_ids: if t.use_bidirectional_attention == Some(Bidirectional::Vision) {
                image_and_video
            } else {
                vec![]
            },
            quant: top.quant.clone(),
            moe: moe_spec(&t)?,
        })
    }
}

/// `(hidden_size_per_layer_input, vocab_size_per_layer_input)`, both 0 without per-layer inputs.
fn per_layer_inputs(t: &RawText, vocab_size: i64) -> Result<(i64, i64)> {
    let ple_dim = t.hidden_size_per_layer_input;
    if ple_dim < 0 {
        return Err(Error::config("hidden_size_per_layer_input", format!("must be >= 0, got {ple_dim}")));
    }
    if ple_dim == 0 {
        return Ok((0, 0));
    }
    let vocab = match t.vocab_size_per_layer_input {
        None => vocab_size,
        Some(v) => positive("vocab_size_per_layer_input", v)?,
    };
    // Every token id indexes the per-layer table too: a smaller table would let a valid id (or a
    // generated one) index past its end, a device-side assert on CUDA.
    if vocab < vocab_size {
        return Err(Error::config(
            "vocab_size_per_layer_input",
            format!("must be >= vocab_size ({vocab_size}), got {vocab}"),
        ));
    }
    Ok((ple_dim, vocab))
}

/// Every layer's spec; layers from `first_shared` on read the K/V of an earlier one.
fn layer_specs(t: &RawText, kinds: &[LayerType], first_shared: usize) -> Result<Vec<LayerSpec>> {
    let num_layers = kinds.len();
    let intermediate_size = positive("intermediate_size", t.intermediate_size)?;
    let per_layer = per_layer_config(t.per_layer_config.as_ref(), num_layers)?;
    // C:210-218: with attention_k_eq_v, full layers take num_global_key_value_heads (when no
    // per_layer_config says otherwise); without it that key is not read.
    let global_num_kv_heads = match t.num_global_key_value_heads {
        Some(n) if t.attention_k_eq_v => Some(positive("num_global_key_value_heads", n)?),
        _ => None,
    };
    let defaults = HeadDefaults {
        head_dim: positive("head_dim", t.head_dim)?,
        num_kv_heads: positive("num_key_value_heads", t.num_key_value_heads)?,
        global_head_dim: positive("global_head_dim", t.global_head_dim)?,
        global_num_kv_heads,
        num_heads: positive("num_attention_heads", t.num_attention_heads)?,
    };
    let mut layers = Vec::with_capacity(num_layers);
    for (i, &kind) in kinds.iter().enumerate() {
        let (d, nkv) = head_geometry(per_layer.as_ref().map(|p| p.get(&i)), i, kind, &defaults)?;
        // M:1064-1069: the double-wide MLP needs `layer_idx >= first_shared > 0`.
        let wide = t.use_double_wide_mlp && i >= first_shared && first_shared > 0;
        layers.push(LayerSpec {
            kind,
            head_dim: d,
            num_kv_heads: nkv,
            kv_source: kv_donor(kinds, first_shared, i)?,
            intermediate_size: if wide { 2 * intermediate_size } else { intermediate_size },
            values_from_keys: t.attention_k_eq_v && kind == LayerType::Full,
        });
    }
    for l in &layers {
        if let Some(s) = l.kv_source {
            let src = &layers[s];
            if (src.head_dim, src.num_kv_heads) != (l.head_dim, l.num_kv_heads) {
                return Err(Error::config(
                    "per_layer_config",
                    "a KV-shared layer must have its source layer's head geometry",
                ));
            }
        }
    }
    Ok(layers)
}

/// `path` read as JSON (a config.json).
pub fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.display().to_string(), source })?;
    serde_json::from_str(&text).map_err(|e| Error::Format { path: path.display().to_string(), msg: e.to_string() })
}

/// The model types whose text model the engine computes: Gemma 4 (`gemma4`, `gemma4_text`) and the 12B
/// "unified" one, whose text decoder is Gemma 4's without per-layer inputs or experts (Transformers 5.18
/// `models/gemma4_unified/modular_gemma4_unified.py`, Gemma4UnifiedTextDecoderLayer).
const MODEL_TYPES: [&str; 4] = ["gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text"];

/// The MoE block's sizes, when `enable_moe_block` is on; each key it then needs must be there.
fn moe_spec(t: &RawText) -> Result<Option<MoeSpec>> {
    if !t.enable_moe_block {
        return Ok(None);
    }
    let need = |key: &str, v: Option<i64>| positive(key, v.ok_or_else(|| Error::config(key, "missing"))?);
    let num_experts = need("num_experts", t.num_experts)?;
    let top_k = need("top_k_experts", t.top_k_experts)?;
    if top_k > num_experts {
        return Err(Error::config("top_k_experts", format!("must be <= num_experts ({num_experts}), got {top_k}")));
    }
    let intermediate_size = need("moe_intermediate_size", t.moe_intermediate_size)?;
    Ok(Some(MoeSpec { num_experts, top_k, intermediate_size }))
}

/// Refuse the Gemma 4 variants the engine does not implement, naming the key.
fn check_supported(t: &RawText) -> Result<()> {
    if let Some(m) = &t.model_type
        && !MODEL_TYPES.contains(&m.as_str())
    {
        return Err(Error::config(
            "model_type",
            format!("{m:?} is not a Gemma 4 text model ({})", MODEL_TYPES.join(", ")),
        ));
    }
    if t.use_bidirectional_attention == Some(Bidirectional::All) {
        return Err(Error::config("use_bidirectional_attention", "\"all\" is not supported"));
    }
    if t.hidden_activation != GELU_TANH {
        let act = &t.hidden_activation;
        return Err(Error::config("hidden_activation", format!("{act:?} is not supported ({GELU_TANH})")));
    }
    Ok(())
}

/// `per_layer_config` by layer index. Transformers writes the keys zero-padded to one width ("04" of
/// 35 layers).
fn per_layer_config(
    given: Option<&BTreeMap<String, RawLayer>>,
    num_layers: usize,
) -> Result<Option<HashMap<usize, RawLayer>>> {
    let Some(given) = given else { return Ok(None) };
    let mut map = HashMap::new();
    for (k, entry) in given {
        let key = format!("per_layer_config.{k}");
        let i: usize = k.parse().map_err(|_| Error::config(&key, "the key must be a layer index"))?;
        if i >= num_layers {
            return Err(Error::config(&key, format!("layer {i} does not exist ({num_layers} layers)")));
        }
        map.insert(i, *entry);
    }
    Ok(Some(map))
}

/// The config-wide head sizes a layer starts from.
struct HeadDefaults {
    head_dim: i64,
    num_kv_heads: i64,
    global_head_dim: i64,
    /// `num_global_key_value_heads` of a K=V config: the full layers' KV heads.
    global_num_kv_heads: Option<i64>,
    num_heads: i64,
}

/// Layer `i`'s (head_dim, num_kv_heads). With a `per_layer_config` (what save_pretrained writes) its
/// entry overrides head_dim and num_key_value_heads (`entry` is Some(None) when the layer has none);
/// without one (`entry` None), full layers take global_head_dim, and a K=V config's
/// num_global_key_value_heads (C:210-223).
fn head_geometry(entry: Option<Option<&RawLayer>>, i: usize, kind: LayerType, h: &HeadDefaults) -> Result<(i64, i64)> {
    let (mut d, mut nkv) = (h.head_dim, h.num_kv_heads);
    match entry {
        Some(Some(o)) => {
            let k = format!("per_layer_config.{i}");
            d = o.head_dim.map_or(Ok(d), |v| positive(&format!("{k}.head_dim"), v))?;
            nkv = o.num_key_value_heads.map_or(Ok(nkv), |v| positive(&format!("{k}.num_key_value_heads"), v))?;
        }
        Some(None) => {}
        None if kind == LayerType::Full => {
            d = h.global_head_dim;
            nkv = h.global_num_kv_heads.unwrap_or(nkv);
        }
        None => {}
    }
    if d % 2 != 0 {
        return Err(Error::config(format!("head_dim (layer {i})"), format!("must be even, got {d}")));
    }
    if h.num_heads % nkv != 0 {
        return Err(Error::config(
            "num_key_value_heads",
            format!("must divide num_attention_heads ({}), got {nkv} on layer {i}", h.num_heads),
        ));
    }
    Ok((d, nkv))
}

/// The layer whose K/V layer `i` reads, when `i` is KV-shared (`i >= first_shared`): the last
/// non-shared layer of its type (M:1181-1187).
fn kv_donor(kinds: &[LayerType], first_shared: usize, i: usize) -> Result<Option<usize>> {
    if i < first_shared {
        return Ok(None);
    }
    (0..first_shared).rev().find(|&j| kinds[j] == kinds[i]).map(Some).ok_or_else(|| {
        Error::config("num_kv_shared_layers", format!("shared layer {i} has no earlier non-shared layer of its type"))
    })
}

fn layer_types(given: Option<&[LayerType]>, num_layers: usize) -> Result<Vec<LayerType>> {
    let mut kinds: Vec<LayerType> = match given {
        // C:190-195: a 5:1 sliding:full pattern by default.
        None => (0..num_layers).map(|i| if (i + 1) % 6 == 0 { LayerType::Full } else { LayerType::Sliding }).collect(),
        Some(a) if a.len() != num_layers => {
            return Err(Error::config(
                "layer_types",
                format!("has {} entries, num_hidden_layers is {num_layers}", a.len()),
            ));
        }
        Some(a) => a.to_vec(),
    };
    // C:197-201: the last layer is forced to full attention.
    if let Some(last) = kinds.last_mut() {
        *last = LayerType::Full;
    }
    Ok(kinds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use LayerType::{Full, Sliding};
    use serde_json::json;

    /// A small text config with `extra`'s keys set over it.
    fn raw(extra: Value) -> RawText {
        let mut v = json!({
            "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "sliding_window": 8,
            "rope_parameters": {"sliding_attention": {"rope_theta": 10000.0}, "full_attention": {"rope_theta": 1e6}},
        });
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        parse(&v).unwrap()
    }

    #[test]
    fn layer_types_default_to_five_sliding_one_full_and_the_last_is_full() {
        let kinds = layer_types(None, 8).unwrap();
        assert_eq!(kinds, vec![Sliding, Sliding, Sliding, Sliding, Sliding, Full, Sliding, Full]);
        assert_eq!(layer_types(Some(&[Sliding, Full, Sliding]), 3).unwrap(), vec![Sliding, Full, Full]);
        let err = layer_types(Some(&[Sliding]), 2).unwrap_err();
        assert!(err.to_string().contains("layer_types: has 1 entries"));
    }

    #[test]
    fn a_shared_layer_reads_the_last_non_shared_layer_of_its_type() {
        let kinds = [Sliding, Sliding, Full, Sliding, Full, Sliding, Full];
        assert_eq!(kv_donor(&kinds, 5, 4).unwrap(), None);
        assert_eq!(kv_donor(&kinds, 5, 5).unwrap(), Some(3));
        assert_eq!(kv_donor(&kinds, 5, 6).unwrap(), Some(4));
        let err = kv_donor(&[Full, Sliding], 1, 1).unwrap_err();
        assert!(err.to_string().contains("num_kv_shared_layers"));
    }

    #[test]
    fn head_geometry_follows_per_layer_config_or_global_head_dim() {
        let h = HeadDefaults {
            head_dim: 32,
            num_kv_heads: 2,
            global_head_dim: 64,
            global_num_kv_heads: None,
            num_heads: 4,
        };
        assert_eq!(head_geometry(None, 0, Sliding, &h).unwrap(), (32, 2));
        assert_eq!(head_geometry(None, 1, Full, &h).unwrap(), (64, 2));
        let k_eq_v = HeadDefaults { global_num_kv_heads: Some(1), ..h };
        assert_eq!(head_geometry(None, 1, Full, &k_eq_v).unwrap(), (64, 1));
        assert_eq!(head_geometry(None, 0, Sliding, &k_eq_v).unwrap(), (32, 2));
        let h = HeadDefaults { global_num_kv_heads: None, ..k_eq_v };
        let entry = RawLayer { head_dim: Some(128), num_key_value_heads: Some(1) };
        assert_eq!(head_geometry(Some(Some(&entry)), 1, Full, &h).unwrap(), (128, 1));
        assert_eq!(head_geometry(Some(None), 1, Full, &h).unwrap(), (32, 2));
        let odd = RawLayer { head_dim: Some(33), ..RawLayer::default() };
        assert!(head_geometry(Some(Some(&odd)), 2, Sliding, &h).unwrap_err().to_string().contains("layer 2"));
        let bad = RawLayer { num_key_value_heads: Some(3), ..RawLayer::default() };
        assert!(
            head_geometry(Some(Some(&bad)), 0, Sliding, &h).unwrap_err().to_string().contains("num_key_value_heads")
        );
    }

    #[test]
    fn unsupported_variants_name_their_key() {
        for (v, key) in [
            (json!({"model_type": "llama"}), "model_type"),
            (json!({"hidden_activation": "relu"}), "hidden_activation"),
            (json!({"use_bidirectional_attention": "all"}), "use_bidirectional_attention"),
        ] {
            assert!(check_supported(&raw(v)).unwrap_err().to_string().contains(key), "{key}");
        }
        assert!(check_supported(&raw(json!({"model_type": "gemma4_text"}))).is_ok());
        assert!(check_supported(&raw(json!({"model_type": "gemma4_unified_text"}))).is_ok());
    }

    #[test]
    fn a_moe_block_needs_its_sizes() {
        assert!(moe_spec(&raw(json!({}))).unwrap().is_none());
        let full = json!({"enable_moe_block": true, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 64});
        let spec = moe_spec(&raw(full.clone())).unwrap().unwrap();
        assert_eq!((spec.num_experts, spec.top_k, spec.intermediate_size), (8, 2, 64));
        for key in ["num_experts", "top_k_experts", "moe_intermediate_size"] {
            let mut m = full.clone();
            m.as_object_mut().unwrap().remove(key);
            assert_eq!(moe_spec(&raw(m)).unwrap_err().to_string(), format!("config.json: {key}: missing"));
        }
        let mut m = full;
        m["top_k_experts"] = json!(9);
        assert!(moe_spec(&raw(m)).unwrap_err().to_string().contains("top_k_experts"));
    }

    #[test]
    fn per_layer_config_keys_are_layer_indices_even_zero_padded() {
        let t = raw(json!({"per_layer_config": {"04": {"head_dim": 64}}}));
        let p = per_layer_config(t.per_layer_config.as_ref(), 5).unwrap().unwrap();
        assert_eq!(p[&4].head_dim, Some(64));
        let past = raw(json!({"per_layer_config": {"9": {}}}));
        let err = per_layer_config(past.per_layer_config.as_ref(), 5).unwrap_err();
        assert!(err.to_string().contains("per_layer_config.9"));
    }

    #[test]
    fn a_text_config_key_is_named_under_text_config() {
        let mut text = json!({"vocab_size": 512});
        text["hidden_size"] = json!("wide");
        let err = Config::from_json(&json!({"text_config": text})).unwrap_err().to_string();
        assert!(err.starts_with("config.json: text_config.hidden_size: must be an integer"), "{err}");
        let quant = json!({"quantization_config": {"config_groups": {"g": {"weights": {"num_bits": "4"}}}}});
        let err = Config::quant_only(&quant).unwrap_err().to_string();
        assert!(err.contains("quantization_config.config_groups.g.weights.num_bits: must be an integer"), "{err}");
    }

    #[test]
    fn a_derived_config_keeps_the_defaults_of_absent_keys() {
        let top = TopLevel { multimodal: true, towers: [true, false], ..TopLevel::default() };
        let cfg = Config::derive(raw(json!({"use_bidirectional_attention": "vision"})), &top).unwrap();
        assert_eq!((cfg.ple_dim, cfg.vocab_size_per_layer_input, cfg.pad_token_id), (0, 0, 0));
        assert!(cfg.tie_word_embeddings && cfg.final_logit_softcapping.is_none() && cfg.eos_ids.is_empty());
        assert_eq!(cfg.layers.iter().map(|l| l.head_dim).collect::<Vec<_>>(), [16, 16, 16, 512]);
        assert_eq!(cfg.media_token_ids, [258_880]);
        assert_eq!(cfg.pad_mapped_ids, [258_880, 258_884, 258_881]);
        assert_eq!(cfg.bidirectional_ids, [258_880, 258_884]);
        assert_eq!(cfg.rope[0].partial_rotary_factor, None);
    }
}
