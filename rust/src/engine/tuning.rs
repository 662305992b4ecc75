//! Where speculative decoding stops paying, measured on the engine's own device (`Engine::speculation_costs`).
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
//! up too: what a verify step costs does not depend on how many it keeps. Every slot's rings are forgotten before
//! (so the requests take the lowest slots) and after (so nothing of them reaches the prefix cache).

use std::time::Instant;

use crate::engine::Engine;
use crate::engine::request::{Request, StepStats};
use crate::engine::sampling::SamplingParams;
use crate::engine::slots::Phase;
use crate::engine::speculative::Drafts;
use crate::error::{Error, Result};

/// Untimed rounds of each kind of step before the timed ones on a compiling engine: a key is captured at its second
/// step.
const WARM: usize = 2;

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
    /// Between runs only, on an engine with speculative decoding.
    pub fn speculation_costs(&mut self, batch: usize, turns: usize) -> Result<Costs> {
        let spec = self.speculative.as_ref().ok_or_else(|| Error::Input("speculative decoding is off".into()))?;
        let k = self.draft_columns(spec).max(0);
        if !(1..=self.slots.len()).contains(&batch) || turns < 1 {
            return Err(Error::Input(format!(
                "batch must be in 1..={} and turns >= 1, got {batch} and {turns}",
                self.slots.len()
            )));
        }
        let vocab = self.model.cfg.vocab_size;
        let prompt: Vec<i64> = (0..8).map(|i| (3 + i % 4).min(vocab - 1)).collect();
        let warm = if self.compiled.as_ref().is_some_and(|c| c.active) { WARM } else { 0 };
        let max_new = ((turns + warm) as i64) * (k + 2) + 2;
        if max_new > self.context - prompt.len() as i64 {
            return Err(Error::Input(format!("a context of {} holds too few tokens for {turns} turns", self.context)));
        }
        // A made-up prompt may well be followed by an eos token: the requests must decode all their turns.
        let eos = &self.model.cfg.eos_ids;
        let never_stop =
            SamplingParams { logit_bias: eos.iter().map(|&id| (id, -1e9)).collect(), ..Default::default() };
        // Forgotten first too: a request that finds no hit takes the lowest free slots, so `batch` fills a bucket.
        self.reset_prefix_cache();
        self.slots.reset()?;
        self.drawn.clear();
        self.stepped = false;
        for i in 0..batch {
            let request = Request {
                id: u64::MAX - i as u64,
                prompt: prompt.clone(),
                max_new,
                stop_ids: Vec::new(),
                params: never_stop.clone(),
                grammar: None,
                prompt_logprobs: None,
                cache_salt: Some("gemma-engine speculation costs".into()),
                cache_boundary: None,
                next_turn: None,
                media: Vec::new(),
                speculate: true,
            };
            if let Some(refused) = self.admit(request)? {
                return Err(Error::Internal(format!("a measuring request was refused: {:?}", refused.error)));
            }
        }
        let measured = self.time_steps(turns, warm, k);
        let ended = self.cancel(|_| true);
        self.reset_prefix_cache();
        self.stats = StepStats::default();
        ended?;
        measured
    }

    /// `speculation_costs` once its requests are admitted: `warm` untimed steps of each kind, then `turns` timed.
    fn time_steps(&mut self, turns: usize, warm: usize, k: i64) -> Result<Costs> {
        let reading = |e: &Engine| e.slots.all().iter().flatten().any(|s| !matches!(s.phase, Phase::Decode));
        while reading(self) {
            self.turn()?;
            self.read_point()?;
        }
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
        let verify = |e: &mut Engine| -> Result<()> {
            let (b, rows) = e.decoding().ok_or_else(|| Error::Internal("the measuring requests ended".into()))?;
            let offered: Vec<usize> = rows.iter().map(|r| if r.is_some() { k as usize } else { 0 }).collect();
            e.verify_step(b, &rows, Drafts::pack(k, &[], offered))?;
            e.read_point().map(drop)
        };
        for _ in 0..warm {
            verify(self)?;
        }
        let started = Instant::now();
        for _ in 0..turns {
            verify(self)?;
        }
        let verify_s = started.elapsed().as_secs_f64() / turns as f64;
        Ok(Costs { bucket, plain_s, verify_s, drafts: k })
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
