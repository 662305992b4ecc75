//! `Config`: the parts of a Gemma 4 text config.json the engine needs, validated at load.
//!
//! Mirrors transformers 5.18 `models/gemma4/configuration_gemma4.py` (Gemma4TextConfig) and the
//! compressed-tensors `quantization_config`. Every size comes from the file; a bad or missing key
//! is an `Error::Config` naming it. Derived per-layer facts (head dim, KV source, MLP width)
//! follow `Gemma4TextConfig.__init__` (C:) and `Gemma4TextAttention.__init__` / `Gemma4TextMLP` (M:) of
//! that release (line legend in gemma4/mod.rs).

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerType {
    Sliding,
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

pub(crate) fn get<'a>(m: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    m.get(key).filter(|v| !v.is_null())
}

fn int(m: &Map<String, Value>, key: &str) -> Result<i64> {
    let v = get(m, key).ok_or_else(|| Error::config(key, "missing"))?;
    v.as_i64().ok_or_else(|| Error::config(key, format!("must be an integer, got {v}")))
}

fn positive(m: &Map<String, Value>, key: &str) -> Result<i64> {
    let v = int(m, key)?;
    if v < 1 {
        return Err(Error::config(key, format!("must be >= 1, got {v}")));
    }
    Ok(v)
}

fn float(m: &Map<String, Value>, key: &str) -> Result<f64> {
    let v = get(m, key).ok_or_else(|| Error::config(key, "missing"))?;
    v.as_f64().ok_or_else(|| Error::config(key, format!("must be a number, got {v}")))
}

fn boolean(m: &Map<String, Value>, key: &str, default: bool) -> Result<bool> {
    match get(m, key) {
        None => Ok(default),
        Some(v) => v.as_bool().ok_or_else(|| Error::config(key, format!("must be true or false, got {v}"))),
    }
}

fn int_list(v: &Value, key: &str) -> Result<Vec<i64>> {
    match v {
        Value::Null => Ok(vec![]),
        Value::Number(n) => n.as_i64().map(|x| vec![x]).ok_or_else(|| Error::config(key, "must be integers")),
        Value::Array(a) => a.iter().map(|x| x.as_i64().ok_or_else(|| Error::config(key, "must be integers"))).collect(),
        _ => Err(Error::config(key, format!("must be an integer or a list of integers, got {v}"))),
    }
}

fn rope_spec(m: &Map<String, Value>, kind: &str) -> Result<RopeSpec> {
    let key = format!("rope_parameters.{kind}");
    let r = get(m, "rope_parameters")
        .and_then(|v| v.get(kind))
        .and_then(|v| v.as_object())
        .ok_or_else(|| Error::config(&key, "missing"))?;
    let theta =
        float(r, "rope_theta").map_err(|_| Error::config(format!("{key}.rope_theta"), "missing or not a number"))?;
    let factor = match get(r, "factor") {
        None => 1.0,
        Some(v) => v.as_f64().ok_or_else(|| Error::config(format!("{key}.factor"), "must be a number"))?,
    };
    let rope_type = get(r, "rope_type").and_then(|v| v.as_str()).unwrap_or("default");
    let partial_rotary_factor = match rope_type {
        "default" => None,
        "proportional" => Some(match get(r, "partial_rotary_factor") {
            None => 1.0,
            Some(v) => v
                .as_f64()
                .filter(|f| (0.0..=1.0).contains(f))
                .ok_or_else(|| Error::config(format!("{key}.partial_rotary_factor"), "must be a number in [0, 1]"))?,
        }),
        other => {
            return Err(Error::config(
                format!("{key}.rope_type"),
                format!("{other:?} is not supported (default or proportional)"),
            ));
        }
    };
    Ok(RopeSpec { theta, partial_rotary_factor, factor })
}

/// compressed-tensors quantization_config: every config group must be symmetric pack-quantized
/// int weights with one group size (E2B W4A16 has one group).
fn quant_spec(root: &Map<String, Value>) -> Result<Option<QuantSpec>> {
    let Some(q) = get(root, "quantization_config") else { return Ok(None) };
    let key = "quantization_config";
    let q = q.as_object().ok_or_else(|| Error::config(key, "must be an object"))?;
    if let Some(fmt) = get(q, "format").and_then(|v| v.as_str())
        && fmt != "pack-quantized"
    {
        return Err(Error::config(format!("{key}.format"), format!("{fmt:?} is not supported (pack-quantized)")));
    }
    let groups = get(q, "config_groups")
        .and_then(|v| v.as_object())
        .ok_or_else(|| Error::config(format!("{key}.config_groups"), "missing"))?;
    let mut spec: Option<(u32, Option<i64>)> = None;
    for (name, g) in groups {
        let gk = format!("{key}.config_groups.{name}.weights");
        let w = g.get("weights").and_then(|v| v.as_object()).ok_or_else(|| Error::config(&gk, "missing"))?;
        let bits = int(w, "num_bits").map_err(|_| Error::config(format!("{gk}.num_bits"), "missing"))?;
        if !(1..=8).contains(&bits) {
            return Err(Error::config(format!("{gk}.num_bits"), format!("must be in 1..=8, got {bits}")));
        }
        if get(w, "type").and_then(|v| v.as_str()).is_some_and(|t| t != "int") {
            return Err(Error::config(format!("{gk}.type"), "only int weights are supported"));
        }
        if !boolean(w, "symmetric", true)? {
            return Err(Error::config(format!("{gk}.symmetric"), "asymmetric (zero-point) weights are not supported"));
        }
        let strategy = get(w, "strategy").and_then(|v| v.as_str()).unwrap_or("group");
        let group = match strategy {
            "group" => Some(positive(w, "group_size").map_err(|e| match e {
                Error::Config { msg, .. } => Error::config(format!("{gk}.group_size"), msg),
                e => e,
            })?),
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
        let root = root.as_object().ok_or_else(|| Error::config("(top level)", "must be a JSON object"))?;
        quant_spec(root)
    }

    /// Read `dir/config.json` (and the eos ids of `generation_config.json` when present).
    pub fn load(dir: &Path) -> Result<Config> {
        let mut cfg = Config::from_json(&read_json(&dir.join("config.json"))?)?;
        let gen_path = dir.join("generation_config.json");
        if let Ok(gen_text) = std::fs::read_to_string(&gen_path)
            && let Ok(generation) = serde_json::from_str::<Value>(&gen_text)
            && let Some(v) = generation.get("eos_token_id")
        {
            for id in int_list(v, "generation_config.json: eos_token_id")? {
                if !cfg.eos_ids.contains(&id) {
                    cfg.eos_ids.push(id);
                }
            }
        }
        Ok(cfg)
    }

    /// Parse a config.json value: a Gemma4TextConfig, or a multimodal config with `text_config`.
    pub fn from_json(root: &Value) -> Result<Config> {
        let root = root.as_object().ok_or_else(|| Error::config("(top level)", "must be a JSON object"))?;
        let m = match get(root, "text_config") {
            Some(t) => t.as_object().ok_or_else(|| Error::config("text_config", "must be an object"))?,
            None => root,
        };
        check_supported(m)?;
        let ids = MediaIds::from_root(root)?;

        let vocab_size = positive(m, "vocab_size")?;
        let hidden_size = positive(m, "hidden_size")?;
        let intermediate_size = positive(m, "intermediate_size")?;
        let num_layers = positive(m, "num_hidden_layers")? as usize;
        let num_heads = positive(m, "num_attention_heads")?;
        let num_kv_heads = positive(m, "num_key_value_heads")?;
        let head_dim = positive(m, "head_dim")?;
        let sliding_window = positive(m, "sliding_window")?;
        let rms_norm_eps = float(m, "rms_norm_eps")?;
        let ple_dim = match get(m, "hidden_size_per_layer_input") {
            None => 0,
            Some(_) => {
                let p = int(m, "hidden_size_per_layer_input")?;
                if p < 0 {
                    return Err(Error::config("hidden_size_per_layer_input", format!("must be >= 0, got {p}")));
                }
                p
            }
        };
        let vocab_size_per_layer_input = if ple_dim > 0 {
            get(m, "vocab_size_per_layer_input")
                .map_or(Ok(vocab_size), |_| positive(m, "vocab_size_per_layer_input"))?
        } else {
            0
        };
        // Every token id indexes the per-layer table too: a smaller table would let a valid id (or a
        // generated one) index past its end, a device-side assert on CUDA.
        if ple_dim > 0 && vocab_size_per_layer_input < vocab_size {
            return Err(Error::config(
                "vocab_size_per_layer_input",
                format!("must be >= vocab_size ({vocab_size}), got {vocab_size_per_layer_input}"),
            ));
        }
        let num_kv_shared = match get(m, "num_kv_shared_layers") {
            None => 0,
            Some(_) => int(m, "num_kv_shared_layers")?,
        };
        if num_kv_shared < 0 || num_kv_shared as usize >= num_layers {
            return Err(Error::config(
                "num_kv_shared_layers",
                format!("must be in 0..{num_layers} (num_hidden_layers), got {num_kv_shared}"),
            ));
        }
        let double_wide = boolean(m, "use_double_wide_mlp", false)?;
        let final_logit_softcapping = match get(m, "final_logit_softcapping") {
            None => None,
            Some(_) => Some(float(m, "final_logit_softcapping")?).filter(|c| *c > 0.0),
        };
        let tie_word_embeddings = boolean(m, "tie_word_embeddings", true)?;

        let kinds = layer_types(m, num_layers)?;
        let per_layer = per_layer_config(m, num_layers)?;
        let global_head_dim = match get(m, "global_head_dim") {
            None => 512, // configuration_gemma4.py: kwargs.pop("global_head_dim", 512)
            Some(_) => positive(m, "global_head_dim")?,
        };

        // C:210-218: with attention_k_eq_v, full layers take num_global_key_value_heads (when no
        // per_layer_config says otherwise); without it that key is not read.
        let k_eq_v = boolean(m, "attention_k_eq_v", false)?;
        let global_num_kv_heads = match get(m, "num_global_key_value_heads") {
            Some(_) if k_eq_v => Some(positive(m, "num_global_key_value_heads")?),
            _ => None,
        };

        let first_shared = num_layers - num_kv_shared as usize;
        let defaults = HeadDefaults { head_dim, num_kv_heads, global_head_dim, global_num_kv_heads, num_heads };
        let mut layers = Vec::with_capacity(num_layers);
        for (i, &kind) in kinds.iter().enumerate() {
            let (d, nkv) = head_geometry(per_layer.as_ref().map(|p| p.get(&i).copied()), i, kind, &defaults)?;
            // M:1064-1069: the double-wide MLP needs `layer_idx >= first_shared > 0`.
            let wide = double_wide && i >= first_shared && first_shared > 0;
            layers.push(LayerSpec {
                kind,
                head_dim: d,
                num_kv_heads: nkv,
                kv_source: kv_donor(&kinds, first_shared, i)?,
                intermediate_size: if wide { 2 * intermediate_size } else { intermediate_size },
                values_from_keys: k_eq_v && kind == LayerType::Full,
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

        let eos_ids = int_list(
            get(m, "eos_token_id").or_else(|| get(root, "eos_token_id")).unwrap_or(&Value::Null),
            "eos_token_id",
        )?;
        Ok(Config {
            vocab_size,
            vocab_size_per_layer_input,
            hidden_size,
            ple_dim,
            num_layers,
            num_heads,
            layers,
            sliding_window,
            rope: [rope_spec(m, "sliding_attention")?, rope_spec(m, "full_attention")?],
            final_logit_softcapping,
            rms_norm_eps,
            tie_word_embeddings,
            eos_ids,
            pad_token_id: get(m, "pad_token_id").map_or(Ok(0), |_| int(m, "pad_token_id"))?,
            media_token_ids: [(get(root, "vision_config"), ids.image), (get(root, "audio_config"), ids.audio)]
                .into_iter()
                .filter_map(|(tower, id)| tower.map(|_| id))
                .collect(),
            pad_mapped_ids: if get(root, "text_config").is_some() {
                vec![ids.image, ids.video, ids.audio]
            } else {
                vec![]
            },
            bidirectional_ids: if get(m, "use_bidirectional_attention").and_then(|v| v.as_str()) == Some("vision") {
                vec![ids.image, ids.video]
            } else {
                vec![]
            },
            quant: quant_spec(root)?,
            moe: moe_spec(m)?,
        })
    }
}

/// A `Gemma4Config`'s media token ids (configuration_gemma4.py, its defaults where config.json gives none):
/// the placeholders and the markers around an image (boi, eoi) and a clip (boa, eoa).
#[derive(Clone, Copy, Debug)]
pub struct MediaIds {
    pub image: i64,
    pub video: i64,
    pub audio: i64,
    pub boi: i64,
    pub eoi: i64,
    pub boa: i64,
    pub eoa: i64,
}

impl MediaIds {
    /// From a config.json's top level.
    pub fn from_root(root: &Map<String, Value>) -> Result<MediaIds> {
        let id = |key: &str, default: i64| get(root, key).map_or(Ok(default), |_| int(root, key));
        Ok(MediaIds {
            image: id("image_token_id", 258_880)?,
            video: id("video_token_id", 258_884)?,
            audio: id("audio_token_id", 258_881)?,
            boi: id("boi_token_id", 255_999)?,
            eoi: id("eoi_token_id", 258_882)?,
            boa: id("boa_token_id", 256_000)?,
            eoa: id("eoa_token_index", 258_883)?,
        })
    }
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
fn moe_spec(m: &Map<String, Value>) -> Result<Option<MoeSpec>> {
    if !boolean(m, "enable_moe_block", false)? {
        return Ok(None);
    }
    let num_experts = positive(m, "num_experts")?;
    let top_k = positive(m, "top_k_experts")?;
    if top_k > num_experts {
        return Err(Error::config("top_k_experts", format!("must be <= num_experts ({num_experts}), got {top_k}")));
    }
    Ok(Some(MoeSpec { num_experts, top_k, intermediate_size: positive(m, "moe_intermediate_size")? }))
}

/// Refuse the Gemma 4 variants the engine does not implement, naming the key.
fn check_supported(m: &Map<String, Value>) -> Result<()> {
    if let Some(t) = get(m, "model_type").and_then(|v| v.as_str())
        && !MODEL_TYPES.contains(&t)
    {
        return Err(Error::config(
            "model_type",
            format!("{t:?} is not a Gemma 4 text model ({})", MODEL_TYPES.join(", ")),
        ));
    }
    if get(m, "use_bidirectional_attention").and_then(|v| v.as_str()) == Some("all") {
        return Err(Error::config("use_bidirectional_attention", "\"all\" is not supported"));
    }
    if let Some(act) = get(m, "hidden_activation").and_then(|v| v.as_str())
        && act != "gelu_pytorch_tanh"
    {
        return Err(Error::config("hidden_activation", format!("{act:?} is not supported (gelu_pytorch_tanh)")));
    }
    Ok(())
}

/// `per_layer_config` by layer index. Transformers writes the keys zero-padded to one width ("04" of
/// 35 layers).
fn per_layer_config(m: &Map<String, Value>, num_layers: usize) -> Result<Option<HashMap<usize, &Map<String, Value>>>> {
    let Some(v) = get(m, "per_layer_config") else { return Ok(None) };
    let o = v.as_object().ok_or_else(|| Error::config("per_layer_config", "must be an object keyed by layer index"))?;
    let mut map = HashMap::new();
    for (k, entry) in o {
        let key = format!("per_layer_config.{k}");
        let i: usize = k.parse().map_err(|_| Error::config(&key, "the key must be a layer index"))?;
        if i >= num_layers {
            return Err(Error::config(&key, format!("layer {i} does not exist ({num_layers} layers)")));
        }
        map.insert(i, entry.as_object().ok_or_else(|| Error::config(&key, "must be an object"))?);
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
fn head_geometry(
    entry: Option<Option<&Map<String, Value>>>,
    i: usize,
    kind: LayerType,
    h: &HeadDefaults,
) -> Result<(i64, i64)> {
    let (mut d, mut nkv) = (h.head_dim, h.num_kv_heads);
    match entry {
        Some(Some(o)) => {
            let k = format!("per_layer_config.{i}");
            if get(o, "head_dim").is_some() {
                d = positive(o, "head_dim")
                    .map_err(|_| Error::config(format!("{k}.head_dim"), "must be an integer >= 1"))?;
            }
            if get(o, "num_key_value_heads").is_some() {
                nkv = positive(o, "num_key_value_heads")
                    .map_err(|_| Error::config(format!("{k}.num_key_value_heads"), "must be an integer >= 1"))?;
            }
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

fn layer_types(m: &Map<String, Value>, num_layers: usize) -> Result<Vec<LayerType>> {
    let mut kinds: Vec<LayerType> = match get(m, "layer_types") {
        // C:190-195: a 5:1 sliding:full pattern by default.
        None => (0..num_layers).map(|i| if (i + 1) % 6 == 0 { LayerType::Full } else { LayerType::Sliding }).collect(),
        Some(v) => {
            let a = v.as_array().ok_or_else(|| Error::config("layer_types", "must be a list"))?;
            if a.len() != num_layers {
                return Err(Error::config(
                    "layer_types",
                    format!("has {} entries, num_hidden_layers is {num_layers}", a.len()),
                ));
            }
            a.iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("sliding_attention") => Ok(LayerType::Sliding),
                    Some("full_attention") => Ok(LayerType::Full),
                    _ => Err(Error::config(
                        format!("layer_types[{i}]"),
                        format!("{t} is not sliding_attention or full_attention"),
                    )),
                })
                .collect::<Result<_>>()?
        }
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

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn layer_types_default_to_five_sliding_one_full_and_the_last_is_full() {
        let kinds = layer_types(&obj(json!({})), 8).unwrap();
        assert_eq!(kinds, vec![Sliding, Sliding, Sliding, Sliding, Sliding, Full, Sliding, Full]);
        let given = obj(json!({"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}));
        assert_eq!(layer_types(&given, 3).unwrap(), vec![Sliding, Full, Full]);
        let err = layer_types(&obj(json!({"layer_types": ["sliding_attention"]})), 2).unwrap_err();
        assert!(err.to_string().contains("layer_types"));
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
        let entry = obj(json!({"head_dim": 128, "num_key_value_heads": 1}));
        assert_eq!(head_geometry(Some(Some(&entry)), 1, Full, &h).unwrap(), (128, 1));
        assert_eq!(head_geometry(Some(None), 1, Full, &h).unwrap(), (32, 2));
        let odd = obj(json!({"head_dim": 33}));
        assert!(head_geometry(Some(Some(&odd)), 2, Sliding, &h).unwrap_err().to_string().contains("layer 2"));
        let bad = obj(json!({"num_key_value_heads": 3}));
        assert!(
            head_geometry(Some(Some(&bad)), 0, Sliding, &h).unwrap_err().to_string().contains("num_key_value_heads")
        );
    }

    #[test]
    fn unsupported_variants_name_their_key() {
        for (v, key) in [
            (json!({"model_type": "llama"}), "model_type"),
            (json!({"hidden_activation": "relu"}), "hidden_activation"),
        ] {
            assert!(check_supported(&obj(v)).unwrap_err().to_string().contains(key), "{key}");
        }
        assert!(check_supported(&obj(json!({"model_type": "gemma4_text"}))).is_ok());
        assert!(check_supported(&obj(json!({"model_type": "gemma4_unified_text"}))).is_ok());
    }

    #[test]
    fn a_moe_block_needs_its_sizes() {
        assert!(moe_spec(&obj(json!({}))).unwrap().is_none());
        let full = json!({"enable_moe_block": true, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 64});
        let spec = moe_spec(&obj(full.clone())).unwrap().unwrap();
        assert_eq!((spec.num_experts, spec.top_k, spec.intermediate_size), (8, 2, 64));
        for key in ["num_experts", "top_k_experts", "moe_intermediate_size"] {
            let mut m = obj(full.clone());
            m.remove(key);
            assert!(moe_spec(&m).unwrap_err().to_string().contains(key), "{key}");
        }
        let mut m = obj(full);
        m.insert("top_k_experts".into(), json!(9));
        assert!(moe_spec(&m).unwrap_err().to_string().contains("top_k_experts"));
    }

    #[test]
    fn per_layer_config_keys_are_layer_indices_even_zero_padded() {
        let m = obj(json!({"per_layer_config": {"04": {"head_dim": 64}}}));
        let p = per_layer_config(&m, 5).unwrap().unwrap();
        assert!(p.contains_key(&4));
        let past = obj(json!({"per_layer_config": {"9": {}}}));
        assert!(per_layer_config(&past, 5).unwrap_err().to_string().contains("per_layer_config.9"));
    }
}
