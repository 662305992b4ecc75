//! What a caller hands the engine and gets back: `Request`, `Event` (new tokens, `Finish`, `Timing`),
//! `StepStats`, the caller's side of the loop (`Io`), and the limits every request is checked against
//! (`LIMITS`, exported to Python as `gemma_engine.LIMITS`).
//!
//! The limits bound one request's work: `top_logprobs` is the OpenAI API's own bound (0..=20,
//! `CreateChatCompletionRequest.top_logprobs` in openai/openai-openapi `openapi.yaml`); the logit bias
//! (one row write a token at admission) and the stop ids (one comparison a token at each read point)
//! are bounded so that no single request can make those the cost of a step. The server's protocol
//! reads these numbers for its JSON schema.

use crate::engine::media::Media;
use crate::engine::sampling::SamplingParams;
use crate::error::{Error, Result};

/// The bounds on a request's lists, declared once (`Request::check`, `SamplingParams::check`).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// `SamplingParams::logprobs`: the most likely tokens reported per token.
    pub max_top_logprobs: i64,
    /// `SamplingParams::logit_bias`: entries.
    pub max_logit_bias: usize,
    /// `Request::stop_ids`: ids.
    pub max_stop_token_ids: usize,
    /// `Request::grammar`: bytes of its text (grammar.rs adds llguidance's compile limits).
    pub max_grammar_bytes: usize,
}

pub const LIMITS: Limits =
    Limits { max_top_logprobs: 20, max_logit_bias: 300, max_stop_token_ids: 64, max_grammar_bytes: 64 * 1024 };

impl Limits {
    /// (name, value) of every limit, as `gemma_engine.LIMITS` lists them.
    pub fn entries(&self) -> [(&'static str, i64); 4] {
        [
            ("max_top_logprobs", self.max_top_logprobs),
            ("max_logit_bias", self.max_logit_bias as i64),
            ("max_stop_token_ids", self.max_stop_token_ids as i64),
            ("max_grammar_bytes", self.max_grammar_bytes as i64),
        ]
    }
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    Cancelled,
    /// The request was refused at admission by its own values (`Event::error` says why).
    Error,
    /// The engine failed while admitting or running the request (`Event::error` has the error).
    Failed,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Cancelled => "cancelled",
            Finish::Error => "error",
            Finish::Failed => "failed",
        }
    }
}

/// One request for the loop.
#[derive(Clone, Debug)]
pub struct Request {
    pub id: u64,
    pub prompt: Vec<i64>,
    pub max_new: i64,
    /// Stop tokens besides the model's eos ids (a stop token is not returned).
    pub stop_ids: Vec<i64>,
    pub params: SamplingParams,
    /// An llguidance Lark grammar every generated token must follow (engine/grammar.rs).
    pub grammar: Option<String>,
    /// Some(k): the log-probability of each prompt token and the k most likely there
    /// (`Event::prompt_logprobs`).
    pub prompt_logprobs: Option<i64>,
    /// Requests with different salts never share cached keys (vLLM's `cache_salt`), so tenants of
    /// one server cannot probe each other's prompts by timing. None is a salt of its own.
    pub cache_salt: Option<String>,
    /// A prompt position (`1..len`) where the engine keeps a copy of the sliding rings for later
    /// requests that share the prompt up to there (engine/prefix.rs): the end of the system turn and
    /// tool declarations that every user of an agent shares.
    pub cache_boundary: Option<usize>,
    /// A prompt position (`1..len`) where the conversation's next turn will depart from this prompt,
    /// where the engine also keeps a copy of the sliding rings (engine/prefix.rs). The caller knows it
    /// from the chat template: Gemma 4's ends a prompt with an empty thought channel that the next
    /// turn's rendering of the reply does not have, so the next turn shares all but the prompt's last
    /// few tokens.
    pub next_turn: Option<usize>,
    /// Soft tokens of images and audio in the prompt, sorted by position (engine/media.rs).
    pub media: Vec<Media>,
    /// Whether the engine's speculative decoding may draft for it (engine/speculative.rs); false opts out.
    pub speculate: bool,
}

impl Request {
    /// The checks that need no model: max_new (0 only with prompt_logprobs), the stop ids' count,
    /// prompt_logprobs, the sampling parameters against a vocabulary of `vocab` ids. The error names
    /// the field.
    pub fn check(&self, vocab: i64) -> Result<()> {
        let least = if self.prompt_logprobs.is_some() { 0 } else { 1 };
        if self.max_new < least {
            let why = if least == 0 { "" } else { " (0 only with prompt_logprobs)" };
            return Err(Error::Input(format!("max_new must be >= {least}{why}, got {}", self.max_new)));
        }
        let max_top = LIMITS.max_top_logprobs;
        if let Some(k) = self.prompt_logprobs.filter(|k| !(0..=max_top).contains(k)) {
            return Err(Error::Input(format!("prompt_logprobs must be in [0, {max_top}] (max_top_logprobs), got {k}")));
        }
        for (field, mark) in [("cache_boundary", self.cache_boundary), ("next_turn", self.next_turn)] {
            if let Some(b) = mark.filter(|b| *b == 0 || *b >= self.prompt.len()) {
                return Err(Error::Input(format!(
                    "{field} must be a prompt position in [1, {}] (the prompt has {} tokens), got {b}",
                    self.prompt.len().saturating_sub(1),
                    self.prompt.len()
                )));
            }
        }
        let max = LIMITS.max_stop_token_ids;
        if self.stop_ids.len() > max {
            return Err(Error::Input(format!(
                "stop_ids holds at most {max} ids (max_stop_token_ids), got {}",
                self.stop_ids.len()
            )));
        }
        self.params.check(vocab)
    }
}

/// The log-probabilities of one generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The most likely tokens, most likely first, as many as the request asked for.
    pub top: Vec<(i64, f32)>,
}

/// Seconds a finished request spent: admission to its first token at a read point, then to the end.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timing {
    pub prompt_s: f64,
    pub decode_s: f64,
}

/// New tokens of one request, and its end once it ended.
#[derive(Clone, Debug)]
pub struct Event {
    pub id: u64,
    pub tokens: Vec<i64>,
    /// One entry per token when the request asked for log-probabilities.
    pub logprobs: Vec<TokenLogprobs>,
    /// On the request's first event when it asked for prompt_logprobs: one entry for each prompt
    /// position 1..n (the token there given the ones before).
    pub prompt_logprobs: Option<Vec<TokenLogprobs>>,
    pub finish: Option<Finish>,
    pub error: Option<String>,
    pub timing: Timing,
    /// Prompt tokens the request took from the prefix cache (engine/prefix.rs), on every event.
    pub cached_tokens: usize,
}

impl Event {
    /// No tokens yet, not ended.
    pub(crate) fn new(id: u64) -> Event {
        Event {
            id,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            prompt_logprobs: None,
            finish: None,
            error: None,
            timing: Timing::default(),
            cached_tokens: 0,
        }
    }

    pub(crate) fn end(id: u64, finish: Finish, timing: Timing) -> Event {
        Event { finish: Some(finish), timing, ..Event::new(id) }
    }

    /// Ended with `Finish::Error` or `Finish::Failed`, and why.
    pub(crate) fn end_with_error(id: u64, finish: Finish, timing: Timing, error: String) -> Event {
        Event { error: Some(error), ..Event::end(id, finish, timing) }
    }
}

/// What ran since the last read point.
#[derive(Clone, Debug, Default)]
pub struct StepStats {
    /// Decoding rows of each decode step.
    pub batch_sizes: Vec<usize>,
    /// Prompt tokens read.
    pub prompt_tokens: usize,
    /// Prompts each prompt forward read (more than one: several whole prompts in one forward).
    pub prompt_reads: Vec<usize>,
    /// Wall seconds of those turns (the read point's host sync included).
    pub seconds: f64,
    /// Wall seconds of those spent computing grammar masks on the host (engine/grammar.rs).
    pub mask_seconds: f64,
    /// Prompt tokens of the requests admitted, and how many of them came from the prefix cache
    /// (vLLM's `prefix_cache_queries` and `prefix_cache_hits`, in tokens).
    pub cache_queries: usize,
    pub cache_hits: usize,
    /// Speculative decoding (engine/speculative.rs), vLLM's `spec_decode_*` counters: rows of verify
    /// steps that had drafts, the drafts offered and kept, and how many were kept at each position
    /// (index 0: a row's first draft).
    pub spec_drafts: usize,
    pub spec_draft_tokens: usize,
    pub spec_accepted_tokens: usize,
    pub spec_accepted_per_position: Vec<usize>,
}

impl StepStats {
    /// A verify step's row that was offered `offered` drafts kept `kept` of them.
    pub(crate) fn count_verified(&mut self, offered: usize, kept: usize) {
        if offered == 0 {
            return;
        }
        self.spec_drafts += 1;
        self.spec_draft_tokens += offered;
        self.spec_accepted_tokens += kept;
        if self.spec_accepted_per_position.len() < kept {
            self.spec_accepted_per_position.resize(kept, 0);
        }
        self.spec_accepted_per_position[..kept].iter_mut().for_each(|n| *n += 1);
    }
}

/// The caller's side of `Engine::run`.
pub trait Io {
    /// Called at each read point: new requests (at most `free`) and the ids of requests to cancel,
    /// or None to end the loop (every request still running ends "cancelled"). `idle` says that no
    /// request is running, so the call may wait for work.
    fn poll(&mut self, free: usize, idle: bool) -> Result<Option<(Vec<Request>, Vec<u64>)>>;
    /// New tokens and ends, in the order the engine produced them.
    fn emit(&mut self, events: Vec<Event>, stats: &StepStats) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_limit_holds_at_the_limit_and_fails_above_it_naming_the_field() {
        let r = |stop: usize| Request {
            id: 0,
            prompt: vec![1],
            max_new: 1,
            stop_ids: vec![1; stop],
            params: SamplingParams::default(),
            grammar: None,
            prompt_logprobs: None,
            cache_salt: None,
            cache_boundary: None,
            next_turn: None,
            media: Vec::new(),
            speculate: true,
        };
        assert!(r(LIMITS.max_stop_token_ids).check(100).is_ok());
        let e = r(LIMITS.max_stop_token_ids + 1).check(100).unwrap_err().to_string();
        assert!(e.starts_with("stop_ids") && e.contains("64"), "{e}");
    }
}
