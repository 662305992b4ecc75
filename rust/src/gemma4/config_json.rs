//! config.json as serde reads it: structs that mirror Transformers' keys, each default written once beside
//! its key, and `parse`, whose errors name the key path (`vision_config.rope_parameters.rope_theta`).
//!
//! The text keys mirror Transformers 5.18 `models/gemma4/configuration_gemma4.py` (C:, line legend in
//! gemma4/mod.rs): Gemma4TextConfig (C:152-183) and Gemma4Config's media ids (C:346-352). The sizes the model
//! is built from, `rms_norm_eps`, `sliding_window` and `rope_parameters` have no default here, though
//! Transformers has them: the engine builds no model from a size the file leaves out, and refuses a config.json
//! without one, naming the key. Where a key has a default, it is Transformers', except the three whose field
//! says why (`eos_token_id`, `hidden_size_per_layer_input`, `vocab_size_per_layer_input`).
//! A key whose value is null reads as absent (Transformers writes an unset optional as null); a value of the
//! wrong type is an error, never a default. config.rs turns these into the `Config` the model uses; the
//! towers' configs are in media.rs, the assistant's in assistant.rs.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::gemma4::config::LayerType;

/// `value` read as a `T`; an error names the key path under `value` and what is wrong there.
pub fn parse<T: DeserializeOwned>(value: &Value) -> Result<T> {
    let value = without_nulls(value);
    serde_path_to_error::deserialize(&value).map_err(|e| {
        let path = e.path().to_string();
        describe(if path == "." { "" } else { &path }, &e.into_inner().to_string())
    })
}

/// `e` with its config key under `prefix` (`text_config`, `vision_config`).
pub fn within(prefix: &str) -> impl Fn(Error) -> Error + '_ {
    move |e| match e {
        Error::Config { key, msg } if key == "(top level)" => Error::config(prefix, msg),
        Error::Config { key, msg } => Error::config(format!("{prefix}.{key}"), msg),
        e => e,
    }
}

/// Objects' null values dropped, at every depth (a list keeps its nulls, and they are errors).
fn without_nulls(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            Value::Object(m.iter().filter(|(_, x)| !x.is_null()).map(|(k, x)| (k.clone(), without_nulls(x))).collect())
        }
        Value::Array(a) => Value::Array(a.iter().map(without_nulls).collect()),
        v => v.clone(),
    }
}

/// serde's message at `path` in the engine's words: "hidden_size: missing", "num_attention_heads: must be
/// an integer, got string \"four\"". It reads the wording of serde 1.0's `de::Error` messages (serde
/// `src/de/mod.rs`: `missing_field`, `invalid_type`, `invalid_value`); this module's tests pin it.
fn describe(path: &str, msg: &str) -> Error {
    let join = |key: &str| if path.is_empty() { key.to_string() } else { format!("{path}.{key}") };
    if let Some(field) = msg.strip_prefix("missing field `").and_then(|m| m.strip_suffix('`')) {
        return Error::config(join(field), "missing");
    }
    let key = if path.is_empty() { "(top level)" } else { path };
    for prefix in ["invalid type: ", "invalid value: "] {
        if let Some((got, expected)) = msg.strip_prefix(prefix).and_then(|m| m.rsplit_once(", expected ")) {
            let what = match expected {
                "i64" | "u32" | "u64" => "an integer",
                "usize" => "an integer >= 0",
                "f64" => "a number",
                "a boolean" => "true or false",
                e if e.starts_with("struct ") || e == "a map" => "an object",
                e => e,
            };
            return Error::config(key, format!("must be {what}, got {got}"));
        }
    }
    Error::config(key, msg)
}

/// Token ids written as one integer or a list of them (`eos_token_id`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(try_from = "Value")]
pub struct TokenIds(pub Vec<i64>);

impl TryFrom<Value> for TokenIds {
    type Error = String;

    fn try_from(v: Value) -> std::result::Result<Self, String> {
        let bad = || format!("must be an integer or a list of integers, got {v}");
        match &v {
            Value::Number(n) => n.as_i64().map(|x| TokenIds(vec![x])).ok_or_else(bad),
            Value::Array(a) => a.iter().map(Value::as_i64).collect::<Option<_>>().map(TokenIds).ok_or_else(bad),
            _ => Err(bad()),
        }
    }
}

/// The one activation Gemma 4's text model and vision tower use, their `hidden_activation` default (C:159,
/// C:279).
pub const GELU_TANH: &str = "gelu_pytorch_tanh";

pub fn gelu_tanh() -> String {
    GELU_TANH.into()
}

/// `use_bidirectional_attention` (C:174).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Bidirectional {
    Vision,
    All,
}

/// The top level of a config.json: a Gemma4Config (`text_config` and the towers' configs, read where they are
/// used), or a Gemma4TextConfig itself.
#[derive(Debug, Deserialize)]
pub struct RawRoot {
    pub text_config: Option<Value>,
    pub vision_config: Option<Value>,
    pub audio_config: Option<Value>,
    pub quantization_config: Option<RawQuant>,
    pub eos_token_id: Option<TokenIds>,
}

/// A `Gemma4Config`'s media token ids: the placeholders and the markers around an image (boi, eoi) and a clip
/// (boa, eoa).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct MediaIds {
    #[serde(rename = "image_token_id")]
    pub image: i64,
    #[serde(rename = "video_token_id")]
    pub video: i64,
    #[serde(rename = "audio_token_id")]
    pub audio: i64,
    #[serde(rename = "boi_token_id")]
    pub boi: i64,
    #[serde(rename = "eoi_token_id")]
    pub eoi: i64,
    #[serde(rename = "boa_token_id")]
    pub boa: i64,
    #[serde(rename = "eoa_token_index")]
    pub eoa: i64,
}

impl Default for MediaIds {
    /// Gemma4Config's defaults (C:346-352).
    fn default() -> Self {
        MediaIds {
            image: 258_880,
            video: 258_884,
            audio: 258_881,
            boi: 255_999,
            eoi: 258_882,
            boa: 256_000,
            eoa: 258_883,
        }
    }
}

/// Gemma4TextConfig's keys that the engine reads (C:152-183, 210-211).
#[derive(Clone, Debug, Deserialize)]
pub struct RawText {
    pub model_type: Option<String>,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    #[serde(default = "gelu_tanh")]
    pub hidden_activation: String,
    pub rms_norm_eps: f64,
    /// C:164.
    #[serde(default)]
    pub pad_token_id: i64,
    /// C:165 defaults to 1; the engine takes the eos ids config.json and generation_config.json name.
    pub eos_token_id: Option<TokenIds>,
    /// C:167.
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    pub rope_parameters: RawRopes,
    pub sliding_window: i64,
    /// None: C:190-195's 5:1 pattern.
    pub layer_types: Option<Vec<LayerType>>,
    pub final_logit_softcapping: Option<f64>,
    pub use_bidirectional_attention: Option<Bidirectional>,
    /// None: as many as the token vocabulary (`vocab_size`), the smallest table every token id can index
    /// (Transformers' default is 262144, C:175, the released checkpoints' vocabulary).
    pub vocab_size_per_layer_input: Option<i64>,
    /// Absent, 0: no per-layer inputs. Gemma4TextConfig defaults it to 256 (C:176) and writes it to every
    /// config.json it saves; Gemma4UnifiedTextConfig (`models/gemma4_unified/configuration_gemma4_unified.py`),
    /// whose model has none, has no such key.
    #[serde(default)]
    pub hidden_size_per_layer_input: i64,
    /// C:177.
    #[serde(default)]
    pub attention_k_eq_v: bool,
    /// C:178.
    #[serde(default)]
    pub num_kv_shared_layers: i64,
    /// C:179.
    #[serde(default)]
    pub enable_moe_block: bool,
    /// C:180.
    #[serde(default)]
    pub use_double_wide_mlp: bool,
    pub num_experts: Option<i64>,
    pub top_k_experts: Option<i64>,
    pub moe_intermediate_size: Option<i64>,
    /// C:210: `kwargs.pop("global_head_dim", 512)`.
    #[serde(default = "global_head_dim")]
    pub global_head_dim: i64,
    /// C:211; read with `attention_k_eq_v` only.
    pub num_global_key_value_heads: Option<i64>,
    /// By layer index as Transformers writes it (zero-padded: "04").
    pub per_layer_config: Option<BTreeMap<String, RawLayer>>,
}

fn yes() -> bool {
    true
}

fn global_head_dim() -> i64 {
    512
}

/// A `per_layer_config` entry: the head geometry it overrides.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct RawLayer {
    pub head_dim: Option<i64>,
    pub num_key_value_heads: Option<i64>,
}

/// `rope_parameters`, by layer type.
#[derive(Clone, Debug, Deserialize)]
pub struct RawRopes {
    pub sliding_attention: RawRope,
    pub full_attention: RawRope,
}

/// One layer type's rotary embedding (Transformers' `modeling_rope_utils.py`, default and proportional).
#[derive(Clone, Debug, Deserialize)]
pub struct RawRope {
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_type: RopeType,
    /// Proportional RoPE's share of each head's pairs; absent, all of them.
    pub partial_rotary_factor: Option<f64>,
    #[serde(default = "one")]
    pub factor: f64,
}

fn one() -> f64 {
    1.0
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeType {
    #[default]
    Default,
    Proportional,
}

/// compressed-tensors' `quantization_config` (compressed-tensors `QuantizationConfig`).
#[derive(Clone, Debug, Deserialize)]
pub struct RawQuant {
    pub format: Option<String>,
    pub config_groups: BTreeMap<String, RawGroup>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct RawGroup {
    pub weights: RawQuantArgs,
}

/// A group's weights (compressed-tensors `QuantizationArgs`).
#[derive(Clone, Debug, Deserialize)]
pub struct RawQuantArgs {
    pub num_bits: i64,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// `QuantizationArgs.symmetric` defaults to true.
    #[serde(default = "yes")]
    pub symmetric: bool,
    /// Absent: one scale per `group_size` inputs.
    pub strategy: Option<String>,
    pub group_size: Option<i64>,
}

/// The top level's `quantization_config` alone (an embeddings directory's config.json).
#[derive(Debug, Deserialize)]
pub struct RawQuantOnly {
    pub quantization_config: Option<RawQuant>,
}

/// generation_config.json's eos ids.
#[derive(Debug, Deserialize)]
pub struct RawGeneration {
    pub eos_token_id: Option<TokenIds>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn text() -> Value {
        json!({
            "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "sliding_window": 8,
            "rope_parameters": {"sliding_attention": {"rope_theta": 10000.0}, "full_attention": {"rope_theta": 1e6}},
        })
    }

    fn error(v: &Value) -> String {
        parse::<RawText>(v).unwrap_err().to_string()
    }

    #[test]
    fn a_wrong_type_is_an_error_naming_its_path() {
        let mut v = text();
        v["rope_parameters"]["full_attention"]["rope_theta"] = json!("big");
        assert_eq!(
            error(&v),
            "config.json: rope_parameters.full_attention.rope_theta: must be a number, got string \"big\""
        );
        let mut v = text();
        v["num_attention_heads"] = json!(4.5);
        assert!(error(&v).starts_with("config.json: num_attention_heads: must be an integer"), "{}", error(&v));
        let mut v = text();
        v["tie_word_embeddings"] = json!("no");
        assert!(error(&v).contains("tie_word_embeddings: must be true or false"));
        let mut v = text();
        v["layer_types"] = json!(["sliding_attention", "local"]);
        assert!(error(&v).contains("layer_types[1]: unknown variant `local`"), "{}", error(&v));
        let mut v = text();
        v["per_layer_config"] = json!({"1": {"head_dim": "x"}});
        assert!(error(&v).contains("per_layer_config.1.head_dim: must be an integer"));
        let mut v = text();
        v["eos_token_id"] = json!([1, "2"]);
        assert!(error(&v).contains("eos_token_id: must be an integer or a list of integers"));
        assert!(parse::<RawText>(&json!("x")).unwrap_err().to_string().contains("(top level): must be an object"));
    }

    #[test]
    fn a_missing_key_and_null_read_as_absent() {
        let mut v = text();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert_eq!(error(&v), "config.json: hidden_size: missing");
        let mut v = text();
        v["rope_parameters"]["sliding_attention"] = json!({"rope_type": "default"});
        assert_eq!(error(&v), "config.json: rope_parameters.sliding_attention.rope_theta: missing");
        let mut v = text();
        v["final_logit_softcapping"] = Value::Null;
        v["global_head_dim"] = Value::Null;
        let t = parse::<RawText>(&v).unwrap();
        assert_eq!((t.final_logit_softcapping, t.global_head_dim), (None, 512));
    }

    #[test]
    fn absent_keys_take_transformers_defaults() {
        // Transformers 5.18 configuration_gemma4.py, Gemma4TextConfig and Gemma4Config.
        let t = parse::<RawText>(&text()).unwrap();
        assert_eq!(t.hidden_activation, "gelu_pytorch_tanh");
        assert_eq!((t.pad_token_id, t.tie_word_embeddings, t.global_head_dim), (0, true, 512));
        assert_eq!((t.attention_k_eq_v, t.enable_moe_block, t.use_double_wide_mlp), (false, false, false));
        assert_eq!((t.num_kv_shared_layers, t.final_logit_softcapping, t.use_bidirectional_attention), (0, None, None));
        assert_eq!((t.num_experts, t.top_k_experts, t.moe_intermediate_size), (None, None, None));
        let rope = &t.rope_parameters.sliding_attention;
        assert_eq!((rope.rope_type, rope.factor, rope.partial_rotary_factor), (RopeType::Default, 1.0, None));
        let ids = parse::<MediaIds>(&json!({})).unwrap();
        assert_eq!(
            [ids.image, ids.video, ids.audio, ids.boi, ids.eoi, ids.boa, ids.eoa],
            [258_880, 258_884, 258_881, 255_999, 258_882, 256_000, 258_883]
        );
        assert_eq!(parse::<MediaIds>(&json!({"image_token_id": 7})).unwrap().image, 7);
    }

    #[test]
    fn within_puts_a_key_under_its_section() {
        let e = within("text_config")(Error::config("hidden_size", "missing"));
        assert_eq!(e.to_string(), "config.json: text_config.hidden_size: missing");
    }
}
