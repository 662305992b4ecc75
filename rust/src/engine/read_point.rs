//! The read point: every `read_every` turns (every turn while a grammar-constrained slot decodes)
//! the tokens drawn on the device come to the host in one copy, each constrained request's grammar
//! takes its new tokens (`Slot::feed`), each request is cut at its end (`Slot::finish`), the new
//! tokens and their log-probabilities become events, and finished slots are freed. A slot that hit a stop token
//! between read points ran on as padding; its extra tokens are dropped here, so the result does not
//! depend on `read_every`.

use std::time::Instant;

use crate::engine::Engine;
use crate::engine::request::{Event, Finish, TokenLogprobs};
use crate::engine::sampling::Chosen;
use crate::engine::slots::End;
use crate::error::Result;
use crate::tensor::Tensor;

/// Tokens drawn by one forward, waiting for the next read point.
pub(super) struct Drawn {
    pub(super) chosen: Chosen,
    /// The slot behind each row (None: padding).
    pub(super) rows: Vec<Option<usize>>,
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
            for (row, s) in d.rows.iter().enumerate() {
                let token = tokens[at + row];
                let Some(s) = *s else { continue };
                let Ok(slot) = self.slots.get_mut(s) else { continue };
                if slot.finished.is_some() {
                    continue;
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
                    continue;
                }
                ev.tokens.push(token);
                slot.output.push(token);
                if let (Some(want), Some((chosen, ids, lps, k))) = (slot.request.params.logprobs, &lp) {
                    let base = row * k;
                    let top = (0..(want as usize).min(*k)).map(|j| (ids[base + j], lps[base + j])).collect();
                    ev.logprobs.push(TokenLogprobs { logprob: chosen[row], top });
                }
                slot.first_token.get_or_insert(now);
                slot.emitted += 1;
                slot.finished = end;
            }
            at += d.rows.len();
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
