//! Grammar-constrained sampling: `Grammars`, the token environment of one tokenizer, and
//! `Constraint`, one request's grammar state, over llguidance 1.9.1 and toktrie 1.9.1.
//!
//! A tokenizer.json becomes one byte string per token id (llguidance `tokenizer_json.rs`,
//! `token_bytes_from_tokenizer_json`: byte-level BPE decoded through GPT-2's byte map, SentencePiece
//! byte fallback through its `<0xNN>` tokens and its space character; special tokens start with
//! toktrie's `SPECIAL_TOKEN_MARKER` so a Lark grammar names them as `<|"|>` or `<[52]>`). Ids from the
//! tokenizer's size up to the model's `vocab_size` get no bytes, which no grammar can match: they are
//! never allowed. The byte strings make a `TokTrie` with the checkpoint's eos ids, wrapped as
//! toktrie's `ApproximateTokEnv` (greedy tokenization, marked non-canonical, so llguidance never
//! forces tokens by re-tokenizing text: every token is the model's choice under the mask). One
//! `ParserFactory` compiles every grammar, with `ParserLimits` tightened (`compile_limits`) so that a
//! grammar built to be expensive (deep nesting, a huge enum, a pathological regex) is refused at
//! compile time by llguidance's fuel counters instead of stalling the engine thread.
//!
//! A `Constraint` wraps an llguidance `Matcher` (llguidance `matcher.rs`, "meant to be used in
//! server-side scenarios"): `mask_into` writes the allowed set bit-packed (bit `i % 8` of byte
//! `i / 8`, toktrie `SimpleVob::write_to`), `consume` advances it by the sampled token. llguidance
//! allows the eos ids exactly when the grammar is accepting (`TokenParser::compute_mask`), and a
//! matcher is stopped once nothing more can follow.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::engine::request::LIMITS;
use crate::error::{Error, Result};

/// llguidance's compile and step limits for requests' grammars: its defaults (llguidance `api.rs`
/// `ParserLimits::default`, with the speeds it documents) cut so that one grammar costs at most a
/// few milliseconds to compile and to mask a step. A grammar past them is refused by `check`.
fn compile_limits() -> ParserLimits {
    ParserLimits {
        // Default 2000; the branching factor a schema of real tools needs is far below it.
        max_items_in_row: 500,
        // Default 1,000,000 (about 20 ms at llguidance's 50k/ms); 200,000 is about 4 ms.
        initial_lexer_fuel: 200_000,
        // Default 200,000 (about 14 ms at 14k/ms) per mask; 100,000 is about 7 ms.
        step_lexer_fuel: 100_000,
        // Default 50,000 (about 2.5 ms at 20k/ms).
        step_max_items: 20_000,
        // Default 250,000 (1-2 kB each); 50,000 bounds one grammar's lexer at ~100 MB.
        max_lexer_states: 50_000,
        // Default 500,000 symbols ("a few megabytes of JSON"); our grammars are at most 64 KiB.
        max_grammar_size: 100_000,
        precompute_large_lexemes: true,
        // The message names the failure without the grammar text and the parser state.
        verbose_errors: false,
    }
}

/// What a panic inside llguidance or toktrie said (they assert on malformed input).
fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Run `f`, turning a panic into `Error::Input(what: message)`.
fn guarded<T>(what: &str, f: impl FnOnce() -> anyhow::Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::Input(format!("{what}: {e}"))),
        Err(p) => Err(Error::Input(format!("{what}: {}", panic_text(p)))),
    }
}

/// The tokenizer with each `Metaspace` decoder (what `tokenizers` writes for a SentencePiece model
/// built with its Metaspace pre-tokenizer, alone or in a `Sequence`) spelled as the `Replace(replacement,
/// " ")` that llguidance recognizes, in a `Sequence` that has `ByteFallback` when the model has byte
/// fallback (Gemma's and Llama's tokenizer.json spell their decoders that way). Other decoders are
/// left as they are.
fn spell_out_metaspace(mut tokenizer: Value) -> Value {
    let decoder = tokenizer["decoder"].clone();
    let parts = match decoder["type"].as_str() {
        Some("Metaspace") => vec![decoder],
        Some("Sequence") => decoder["decoders"].as_array().cloned().unwrap_or_default(),
        _ => return tokenizer,
    };
    if !parts.iter().any(|d| d["type"] == "Metaspace") {
        return tokenizer;
    }
    let mut parts: Vec<Value> = parts
        .into_iter()
        .map(|d| match d["type"].as_str() {
            Some("Metaspace") => {
                let space = d["replacement"].as_str().unwrap_or("\u{2581}").to_string();
                json!({"type": "Replace", "pattern": {"String": space}, "content": " "})
            }
            _ => d,
        })
        .collect();
    if tokenizer["model"]["byte_fallback"] == json!(true) && !parts.iter().any(|d| d["type"] == "ByteFallback") {
        parts.push(json!({"type": "ByteFallback"}));
    }
    tokenizer["decoder"] = json!({"type": "Sequence", "decoders": parts});
    tokenizer
}

/// The token environment of one tokenizer and the factory that compiles grammars over it.
pub struct Grammars {
    factory: Arc<ParserFactory>,
    vocab_size: usize,
    eos_ids: Vec<i64>,
}

impl Grammars {
    /// Build from the tokenizer.json at `path`, the checkpoint's `eos_ids` and the model's
    /// `vocab_size` (module docs).
    pub fn load(path: &Path, eos_ids: &[i64], vocab_size: i64) -> Result<Grammars> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::Io { path: path.display().to_string(), source: e })?;
        let format = |msg: String| Error::Format { path: path.display().to_string(), msg };
        let tokenizer: Value = serde_json::from_str(&text).map_err(|e| format(e.to_string()))?;
        let mut words =
            guarded("tokenizer.json", || llguidance::token_bytes_from_tokenizer_json(&spell_out_metaspace(tokenizer)))
                .map_err(|e| format(e.to_string()))?;
        if vocab_size < 1 || words.len() as i64 > vocab_size {
            return Err(Error::Input(format!(
                "the tokenizer has {} tokens, more than the model's vocab_size {vocab_size}",
                words.len()
            )));
        }
        if eos_ids.is_empty() {
            return Err(Error::Input("eos_ids is empty: a grammar needs at least one eos id".into()));
        }
        if let Some(id) = eos_ids.iter().find(|id| !(0..vocab_size).contains(*id)) {
            return Err(Error::Input(format!("eos id {id} is outside the vocabulary [0, {vocab_size})")));
        }
        words.resize(vocab_size as usize, Vec::new());
        let eos: Vec<u32> = eos_ids.iter().map(|id| *id as u32).collect();
        let factory = guarded("tokenizer.json", || {
            let trie = TokTrie::from(&TokRxInfo::new(vocab_size as u32, eos[0]), &words).with_eos_tokens(&eos);
            let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
            let mut factory = ParserFactory::new_simple(&env)?;
            factory.quiet();
            *factory.limits_mut() = compile_limits();
            Ok(factory)
        })
        .map_err(|e| format(e.to_string()))?;
        Ok(Grammars { factory: Arc::new(factory), vocab_size: vocab_size as usize, eos_ids: eos_ids.to_vec() })
    }

    /// The model vocabulary the masks cover.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Compile `grammar` (llguidance Lark) into a fresh constraint; `Error::Input` names why not.
    pub fn compile(&self, grammar: &str) -> Result<Constraint> {
        let max = LIMITS.max_grammar_bytes;
        if grammar.len() > max {
            return Err(Error::Input(format!(
                "grammar: {} bytes, more than the {max} of max_grammar_bytes",
                grammar.len()
            )));
        }
        let parser =
            guarded("grammar", || self.factory.create_parser(TopLevelGrammar::from_lark(grammar.to_string())))?;
        Ok(Constraint { matcher: Matcher::new(Ok(parser)), vocab_size: self.vocab_size, failed: None })
    }

    /// `grammar` after consuming `ids`: Ok(constraint) or the error of the first id it refused.
    fn after(&self, grammar: &str, ids: &[i64]) -> Result<Constraint> {
        let mut c = self.compile(grammar)?;
        for &id in ids {
            c.consume(id)?;
        }
        Ok(c)
    }

    /// Whether `grammar` consumes every id of `ids` and is then accepting.
    pub fn accepts(&self, grammar: &str, ids: &[i64]) -> Result<bool> {
        match self.after(grammar, ids) {
            Ok(mut c) => c.accepting(),
            Err(Error::Input(e)) if e.starts_with("grammar refused") => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The ids `grammar` allows after `ids`: the eos ids alone once it has stopped (nothing more can
    /// follow; the engine ends such a request "stop" without drawing again).
    pub fn allowed(&self, grammar: &str, ids: &[i64]) -> Result<Vec<i64>> {
        let mut c = self.after(grammar, ids)?;
        if c.stopped() {
            return Ok(self.eos_ids.clone());
        }
        let mut bits = vec![0u8; c.mask_bytes()];
        c.mask_into(&mut bits)?;
        Ok((0..self.vocab_size).filter(|i| bits[i / 8] >> (i % 8) & 1 == 1).map(|i| i as i64).collect())
    }
}

/// One request's grammar state (module docs).
pub struct Constraint {
    matcher: Matcher,
    vocab_size: usize,
    /// The first failure of `mask_into` or `consume`, kept for `error`.
    failed: Option<String>,
}

impl Constraint {
    /// Bytes of one bit-packed mask: ceil(vocab / 8).
    pub fn mask_bytes(&self) -> usize {
        self.vocab_size.div_ceil(8)
    }

    /// Write the ids allowed next into `out` (`mask_bytes` bytes, bit `i % 8` of byte `i / 8`).
    pub fn mask_into(&mut self, out: &mut [u8]) -> Result<()> {
        match self.matcher.compute_mask() {
            Ok(mask) => {
                mask.write_to(out);
                Ok(())
            }
            Err(e) => Err(self.fail(format!("grammar: {e}"))),
        }
    }

    /// Advance by the sampled token `id`.
    pub fn consume(&mut self, id: i64) -> Result<()> {
        let done = u32::try_from(id).map_err(|e| anyhow::anyhow!(e)).and_then(|t| self.matcher.consume_token(t));
        done.map_err(|e| self.fail(format!("grammar refused token {id}: {e}")))
    }

    /// A look-ahead from here, for a verify step's drafts (engine/columns.rs).
    pub fn lookahead(&self) -> Lookahead {
        Lookahead { matcher: self.matcher.clone(), open: true }
    }

    fn fail(&mut self, msg: String) -> Error {
        self.failed.get_or_insert_with(|| msg.clone());
        Error::Input(msg)
    }

    /// Nothing more can follow (the grammar ended, or the matcher failed).
    pub fn stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The grammar could end here.
    pub fn accepting(&mut self) -> Result<bool> {
        self.matcher.is_accepting().map_err(|e| Error::Input(format!("grammar: {e}")))
    }

    /// Why the constraint failed, if it did.
    pub fn error(&self) -> Option<String> {
        self.failed.clone().or_else(|| self.matcher.get_error())
    }
}

/// Drafts taken ahead of a request's grammar state, on a clone of its matcher: the constraint itself never moves,
/// so a rejected draft never advances it. It closes at the first draft the grammar refuses, after a draft that
/// ends the grammar (nothing is chosen past a request's end), and where the look-ahead fails: that failure is not
/// the request's, whose own tokens may never lead there.
pub struct Lookahead {
    matcher: Matcher,
    open: bool,
}

impl Lookahead {
    /// Take draft `id`; true when it was taken. Then, unless the grammar ended with it, the mask after it is in
    /// `out` (`mask_bytes` bytes) and the look-ahead stays open.
    pub fn take(&mut self, id: i64, out: &mut [u8]) -> bool {
        if !std::mem::replace(&mut self.open, false) || self.matcher.is_stopped() {
            return false;
        }
        let Ok(token) = u32::try_from(id) else { return false };
        if !matches!(self.matcher.try_consume_tokens(&[token]), Ok(1)) {
            return false;
        }
        if self.matcher.is_stopped() {
            return true;
        }
        match self.matcher.compute_mask() {
            Ok(mask) => {
                mask.write_to(out);
                self.open = true;
                true
            }
            Err(_) => false,
        }
    }
}
