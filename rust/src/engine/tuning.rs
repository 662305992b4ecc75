//! Steps run on made-up requests between runs: where speculative decoding stops paying, measured on the engine's own
//! device (`Engine::speculation_costs`), and a compiling engine's verify steps captured before serving
//! (`Engine::compile_verify`).
//!
//! A verify step (speculative.rs) reads `k + 1` positions a row where a plain step reads one. Where a step is
//! bound by reading the weights (an accelerator at small batches) that costs little more than a plain step; where
//! it is bound by arithmetic (a CPU, or a large batch) it costs about `k + 1` of them. A verify step gives a row
//! `1 + a` tokens for `a` kept drafts, so speculating pays at a batch when the tokens a verify step gives exceed
//! the ratio of its time to a plain step's. Both steps compute every row of their decode bucket, padding included,
//! so the ratio is the bucket's, whatever number of its rows decode. The server measures it for every decode bucket
//! at warmup and sets `Speculative::max_bucket` from it (gemma_server/speculation.py).
//!
//! The measurement runs `b` requests of one made-up prompt (greedy, the eos ids barred by a logit bias so that none
//! ends early) through the engine's own steps (compiled steps where the engine compiles, CUDA-graphed plain steps
//! where it has them): `turns` plain steps read at the end, then `turns` verify steps with `k` drafts a row, each
//! read at once (a batch that speculates ends every turn in a read point). A compiling engine first runs `WARM`
//! rounds of each kind untimed, so that what is timed is replays, not the captures and compiles. The drafts are made
//! up too: what a verify step costs does not depend on how many it keeps.
//!
//! Serving's verify steps' checks are keyed by their sampling stages (compiled.rs; their forwards are not), which
//! the measurement's logit bias changes, so a compiling engine captures them apart: `compile_verify` runs the
//! caller's prompts with the caller's sampling through `WARM` verify steps with every row live and, from two rows
//! up, `WARM` more with the first row cancelled (the key of a bucket with padding), with an assistant each also
//! without drafts (the step that only records its states), so none compiles while a request waits.
//!
//! Both forget every slot's rings before (so the requests take the lowest slots) and after (so nothing of them
//! reaches the prefix cache), and cancel their requests.

use std::time::Instant;

use crate::engine::Engine;
use crate::engine::request::{Request, StepStats};
use crate::engine::sampling::SamplingParams;
use crate::engine::slots::Phase;
use crate::engine::speculative::Drafts;
use crate::error::{Error, Result};

/// Untimed rounds of each kind of step before the timed ones on a compiling engine, and verify steps of each key
/// `compile_verify` runs: a key is captured at its second step.
const WARM: usize = 2;

/// Tokens of the measurement's made-up prompt.
const PROMPT: usize = 8;

/// What one batch's steps cost (`Engine::speculation_costs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// The decode bucket the steps ran in.
    pub bucket: i64,
    /// Seconds of a plain decode step and of a verify step, each with its share of read points.
    pub plain_s: f64,
    pub verify_s: f64,
    /// Drafts a row the verify steps carried.
    pub drafts: i64,
}

impl Engine {
    /// The cost of plain and verify steps with `batch` requests decoding, `turns` steps of each (module docs).
    /// Between runs only, on an engine with speculative decoding; `turns` at most `speculation_turns()`.
    pub fn speculation_costs(&mut self, batch: usize, turns: usize) -> Result<Costs> {
        let k = self.verify_columns()?;
        if !(1..=self.slots.len()).contains(&batch) || turns < 1 {
            return Err(Error::Input(format!(
                "batch must be in 1..={} and turns >= 1, got {batch} and {turns}",
                self.slots.len()
            )));
        }
        if turns > self.speculation_turns() {
            return Err(Error::Input(format!("a context of {} holds too few tokens for {turns} turns", self.context)));
        }
        let vocab = self.model.cfg.vocab_size;
        let prompt: Vec<i64> = (0..PROMPT as i64).map(|i| (3 + i % 4).min(vocab - 1)).collect();
        // A made-up prompt may well be followed by an eos token: the requests must decode all their turns.
        let eos = &self.model.cfg.eos_ids;
        let never_stop =
            SamplingParams { logit_bias: eos.iter().map(|&id| (id, -1e9)).collect(), ..Default::default() };
        let warm = self.warm_rounds();
        let max_new = ((turns + warm) as i64) * (k + 2) + 2;
        let prompts = vec![prompt; batch];
        self.with_made_up(&prompts, never_stop, max_new, "speculation costs", |e| e.time_steps(turns, warm, k))
    }

    /// The most turns `speculation_costs` can time in this context (0: not one): its requests hold the made-up
    /// prompt and `k + 2` tokens a turn, a compiling engine's warming rounds included.
    pub fn speculation_turns(&self) -> usize {
        let Ok(k) = self.verify_columns() else { return 0 };
        let turns = (self.context - PROMPT as i64 - 2).max(0) as usize / (k + 2) as usize;
        turns.saturating_sub(self.warm_rounds())
    }

    /// Capture the verify steps of the decode bucket that `prompts` fill, as serving keys them with `params`'s
    /// sampling stages (module docs). Between runs only, on a compiling engine with speculative decoding. Returns
    /// whether every step ran with the rows it was meant to (false when a request ended early, on an eos: then try
    /// other prompts).
    pub fn compile_verify(&mut self, prompts: &[Vec<i64>], params: SamplingParams) -> Result<bool> {
        let k = self.verify_columns()?;
        if !self.compiles() {
            return Err(Error::Input("this engine does not compile its steps".into()));
        }
        if !(1..=self.slots.len()).contains(&prompts.len()) {
            return Err(Error::Input(format!("1..={} prompts are needed, got {}", self.slots.len(), prompts.len())));
        }
        let max_new = 2 * WARM as i64 * (k + 2) + 2;
        if let Some(p) = prompts.iter().find(|p| p.is_empty() || p.len() as i64 + max_new > self.context) {
            return Err(Error::Input(format!(
                "each prompt needs 1..={} tokens in a context of {}, got {}",
                self.context - max_new,
                self.context,
                p.len()
            )));
        }
        self.with_made_up(prompts, params, max_new, "compile verify", |e| e.verify_each_key(k))
    }

    /// Drafts a row of speculative decoding's verify steps; an error when it is off.
    fn verify_columns(&self) -> Result<i64> {
        let spec = self.speculative.as_ref().ok_or_else(|| Error::Input("speculative decoding is off".into()))?;
        Ok(self.draft_columns(spec).max(0))
    }

    /// Untimed rounds `speculation_costs` runs first: `WARM` on a compiling engine, else none.
    fn warm_rounds(&self) -> usize {
        if self.compiles() { WARM } else { 0 }
    }

    /// Run `f` with one speculating request a prompt admitted (`params`, `max_new` tokens each) in the lowest
    /// slots, every slot's rings forgotten before and after and the requests cancelled (module docs).
    fn with_made_up<T>(
        &mut self,
        prompts: &[Vec<i64>],
        params: SamplingParams,
        max_new: i64,
        what: &str,
        f: impl FnOnce(&mut Engine) -> Result<T>,
    ) -> Result<T> {
        // Forgotten first too: a request that finds no hit takes the lowest free slots, so the prompts fill a bucket.
        self.reset_prefix_cache();
        self.slots.reset()?;
        self.drawn.clear();
        self.stepped = false;
        let mut admitted = Ok(());
        for (i, prompt) in prompts.iter().enumerate() {
            let request = Request {
                id: u64::MAX - i as u64,
                prompt: prompt.clone(),
                max_new,
                stop_ids: Vec::new(),
                params: params.clone(),
                grammar: None,
                prompt_logprobs: None,
                cache_salt: Some(format!("gemma-engine {what}")),
                cache_boundary: None,
                next_turn: None,
                media: Vec::new(),
                speculate: true,
            };
            admitted = match self.admit(request) {
                Ok(None) => Ok(()),
                Ok(Some(refused)) => Err(Error::Internal(format!("a {what} request was refused: {:?}", refused.error))),
                Err(e) => Err(e),
            };
            if admitted.is_err() {
                break;
            }
        }
        // The ones admitted are cancelled whatever happened.
        let done = admitted.and_then(|()| self.until_decoding()).and_then(|()| f(self));
        let ended = self.cancel(|_| true);
        self.reset_prefix_cache();
        self.stats = StepStats::default();
        ended?;
        done
    }

    /// Turns until every admitted request decodes.
    fn until_decoding(&mut self) -> Result<()> {
        let reading = |e: &Engine| e.slots.all().iter().flatten().any(|s| !matches!(s.phase, Phase::Decode));
        while reading(self) {
            self.turn()?;
            self.read_point()?;
        }
        Ok(())
    }

    /// `speculation_costs` once its requests decode: `warm` untimed steps of each kind, then `turns` timed.
    fn time_steps(&mut self, turns: usize, warm: usize, k: i64) -> Result<Costs> {
        let (bucket, rows) = self.decoding().ok_or_else(|| Error::Internal("no measuring request decodes".into()))?;
        let plain = |e: &mut Engine| -> Result<()> {
            e.decode_step(bucket, &rows)?;
            e.slots.count_step(&rows.iter().flatten().copied().collect::<Vec<_>>())
        };
        // Each warming round runs both keys of a run of plain steps: the first after a read point, and the padded
        // ones after it (engine/mod.rs `decode_step`).
        for _ in 0..warm {
            plain(self)?;
            plain(self)?;
            self.read_point()?;
        }
        let started = Instant::now();
        for _ in 0..turns {
            plain(self)?;
        }
        self.read_point()?;
        let plain_s = started.elapsed().as_secs_f64() / turns as f64;
        for _ in 0..warm {
            self.made_up_verify(k)?;
        }
        let started = Instant::now();
        for _ in 0..turns {
            self.made_up_verify(k)?;
        }
        let verify_s = started.elapsed().as_secs_f64() / turns as f64;
        Ok(Costs { bucket, plain_s, verify_s, drafts: k })
    }

    /// `compile_verify` once its requests decode: `WARM` verify steps with every row live, then, from two rows up,
    /// `WARM` with the first row's request cancelled, in the same bucket; with an assistant each also without
    /// drafts (the step that only records its states, speculative.rs). Whether each ran with those rows.
    fn verify_each_key(&mut self, k: i64) -> Result<bool> {
        let (bucket, _) = self.decoding().ok_or_else(|| Error::Internal("no compile request decodes".into()))?;
        let widths: &[i64] = if self.drafter.is_some() && k > 0 { &[k, 0] } else { &[k] };
        let mut as_meant = true;
        for padded in [false, true] {
            if padded {
                if bucket == 1 {
                    break;
                }
                let first = self.slots.get(0).map(|s| s.request.id);
                self.cancel(|id| Some(id) == first)?;
            }
            for &width in widths {
                for _ in 0..WARM {
                    let Some((b, rows)) = self.decoding() else { return Ok(false) };
                    as_meant &= b == bucket && rows.iter().any(Option::is_none) == padded;
                    self.made_up_verify(width)?;
                }
            }
        }
        Ok(as_meant)
    }

    /// One verify step of the decoding rows with `k` made-up drafts each, read at once.
    fn made_up_verify(&mut self, k: i64) -> Result<()> {
        let (b, rows) = self.decoding().ok_or_else(|| Error::Internal("the made-up requests ended".into()))?;
        let offered: Vec<usize> = rows.iter().map(|r| if r.is_some() { k as usize } else { 0 }).collect();
        self.verify_step(b, &rows, Drafts::pack(k, &[], offered))?;
        self.read_point().map(drop)
    }

    /// The decode bucket of the decoding slots and its rows, when some slot decodes.
    fn decoding(&self) -> Option<(i64, Vec<Option<usize>>)> {
        let b = self.slots.bucket(self.slots.top_live()?);
        Some((b, self.slots.rows(b)))
    }

    /// Set `Speculative::max_bucket`: no step of a decode bucket above `n` speculates (0: none does).
    pub fn set_speculative_max_bucket(&mut self, n: i64) -> Result<()> {
        let spec = self.speculative.as_mut().ok_or_else(|| Error::Input("speculative decoding is off".into()))?;
        if n < 0 {
            return Err(Error::Input(format!("speculative_max_bucket must be >= 0, got {n}")));
        }
        spec.max_bucket = Some(n);
        Ok(())
    }
}
