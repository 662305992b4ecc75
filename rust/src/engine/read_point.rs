//! The read point: every `read_every` turns (every turn while a grammar-constrained slot decodes)
//! the tokens drawn on the device come to the host in one copy, each constrained request's grammar
//! takes its new tokens (`Slot::feed`), each request is cut at its end (`Slot::finish`), the new
//! tokens and their log-probabilities become events, and finished slots are freed. A slot that hit a stop token
//! between read points ran on as padding; its extra tokens are dropped here, so the result does not
//! depend on `read_every`. A verify step (engine/speculative.rs) brings back several tokens a row, taken
//! one by one as a plain step's are.

use std::time::Instant;

use crate::engine::Engine;
use crate::engine::request::{Event, Finish, TokenLogprobs};
use crate::engine::sampling::Chosen;
use crate::engine::slots::End;
use crate::error::Result;
use crate::tensor::Tensor;

/// Tokens drawn by one forward, waiting for the next read point.
pub(super) struct Drawn {
    /// One token a row, or with `verified` `1 + width` values a row: how many tokens the row drew, then
    /// the target's `width` choices (engine/speculative.rs), of which the first that many are its tokens.
    pub(super) chosen: Chosen,
    /// The slot behind each row (None: padding).
    pub(super) rows: Vec<Option<usize>>,
    pub(super) verified: Option<Verified>,
}

/// What a verify step (engine/speculative.rs) drew besides its tokens.
pub(super) struct Verified {
    /// The target's choices per row: the drafts offered and one more.
    pub(super) width: usize,
    /// Drafts offered per row.
    pub(super) offered: Vec<usize>,
}

impl Drawn {
    /// Values per row in the tokens that come back.
    fn stride(&self) -> usize {
        self.verified.as_ref().map_or(1, |v| v.width + 1)
    }

    /// Where the log-probabilities of row `row`'s `i`-th token are: a verify step has one a column (its
    /// `Chosen` comes from `speculative::column_logprobs`).
    fn logprob_row(&self, row: usize, i: usize) -> usize {
        self.verified.as_ref().map_or(row, |v| row * v.width + i)
    }

    /// Row `row`'s tokens among `values` (this forward's part of what came back).
    fn tokens<'a>(&self, values: &'a [i64], row: usize) -> &'a [i64] {
        let at = row * self.stride();
        match &self.verified {
            None => &values[at..at + 1],
            Some(_) => &values[at + 1..][..values[at] as usize],
        }
    }
}

impl Engine {
    /// Bring the drawn tokens to the host, cut each request at its end, free finished slots.
    pub(super) fn read_point(&mut self) -> Result<Vec<Event>> {
        self.stepped = false;
        if self.drawn.is_empty() {
            return Ok(Vec::new());
        }
        let batch: Vec<Drawn> = std::mem::take(&mut self.drawn);
        let refs: Vec<&Tensor> = batch.iter().map(|d| &d.chosen.tokens).collect();
        let tokens = if refs.len() == 1 { refs[0].to_vec_i64()? } else { Tensor::cat(&refs, 0)?.to_vec_i64()? };
        let now = Instant::now();
        let mut events: Vec<Option<Event>> = (0..self.slots.len()).map(|_| None).collect();
        let eos = &self.model.cfg.eos_ids;
        let mut at = 0;
        for d in &batch {
            let lp = match &d.chosen.logprobs {
                Some((chosen, ids, lps)) => {
                    let k = ids.size()?[1] as usize;
                    Some((chosen.to_vec_f32()?, ids.to_vec_i64()?, lps.to_vec_f32()?, k))
                }
                None => None,
            };
            let values = &tokens[at..at + d.rows.len() * d.stride()];
            for (row, s) in d.rows.iter().enumerate() {
                let Some(s) = *s else { continue };
                if self.slots.get(s).is_none() {
                    continue;
                }
                let drawn = d.tokens(values, row);
                if let Some(v) = &d.verified {
                    self.stats.count_verified(v.offered[row], drawn.len() - 1);
                    self.slots.get_mut(s)?.backoff.after(v.offered[row], drawn.len() - 1);
                    self.slots.count_drawn(s, drawn.len())?;
                }
                let slot = self.slots.get_mut(s)?;
                for (i, &token) in drawn.iter().enumerate() {
                    if slot.finished.is_some() {
                        break;
                    }
                    let ev = events[s].get_or_insert_with(|| slot.event());
                    if let Some(lp) = slot.prompt_lp.take() {
                        ev.prompt_logprobs = Some(lp);
                    }
                    slot.feed(token, eos);
                    let end = slot.finish(End::Token(token), eos);
                    if slot.stops_at(token, eos) || end == Some(Finish::Failed) {
                        ev.error = slot.grammar_error();
                        if slot.stops_at(token, eos) {
                            // The device stopped the slot here (slots.rs): its rings end at the reply.
                            slot.stopped = Some(slot.emitted);
                        }
                        slot.finished = end;
                        break;
                    }
                    ev.tokens.push(token);
                    slot.output.push(token);
                    if let (Some(want), Some((chosen, ids, lps, k))) = (slot.request.params.logprobs, &lp) {
                        let at = d.logprob_row(row, i);
                        let top = (0..(want as usize).min(*k)).map(|j| (ids[at * k + j], lps[at * k + j])).collect();
                        ev.logprobs.push(TokenLogprobs { logprob: chosen[at], top });
                    }
                    slot.first_token.get_or_insert(now);
                    slot.emitted += 1;
                    slot.finished = end;
                }
            }
            at += values.len();
        }
        let mut out = Vec::new();
        for (s, ev) in events.into_iter().enumerate() {
            let Some(mut ev) = ev else { continue };
            if let Some(finish) = self.slots.get(s).and_then(|slot| slot.finished) {
                let slot = self.free(s)?;
                ev.finish = Some(finish);
                ev.timing = slot.timing();
            }
            out.push(ev);
        }
        Ok(out)
    }
}
