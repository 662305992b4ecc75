//! Reading prompts: one chunk of a long prompt, or a group of short ones in one left-padded forward; after a
//! prompt's last chunk, its followers' copies, its first token and the start of its decoding.

use super::Engine;
use crate::engine::media;
use crate::engine::prefix::{self, Mark};
use crate::engine::prompt_logprobs;
use crate::engine::read_point::Drawn;
use crate::engine::request::{Event, Finish};
use crate::engine::schedule::{followers, padded_prompts};
use crate::engine::slots::Phase;
use crate::error::{Error, Result};
use crate::gemma4::attention::{Fill, Liveness, Positions};
use crate::gemma4::cache::Rows;
use crate::gemma4::model::Output;
use crate::tensor::{DType, Tensor};

impl Engine {
    /// Read one chunk of slot `s`'s prompt; after the last chunk, draw its first token and start
    /// it decoding. Returns the prompt tokens read.
    pub(super) fn read_prompt(&mut self, s: usize) -> Result<usize> {
        let k = self.prompt_k(s);
        let slot = self.slots.busy_slot(s)?;
        let Phase::Prompt { done } = slot.phase else { return Err(Error::Internal("slot is not reading".into())) };
        let prompt = slot.prompt.ids.shallow_clone()?;
        let ids = slot.request.prompt.clone();
        let marks: Vec<(Mark, usize)> = prefix::marks(&slot.request).collect();
        let next_mark = marks.iter().map(|&(_, c)| c).filter(|&c| c > done).min();
        let (end, inject) = self.next_chunk(ids.len(), done, next_mark, &slot.prompt.media)?;
        let (logits, read, piece) = self.prompt_chunk(s as i64, &prompt, &ids, done, end, k, inject.as_ref())?;
        let slot = self.slots.get_mut(s)?;
        slot.phase = Phase::Prompt { done: done + read };
        slot.prompt_pieces.extend(piece);
        for (mark, _) in marks.into_iter().filter(|&(_, c)| c == done + read) {
            self.snapshot(s, mark, done + read)?;
        }
        if let Some(logits) = logits {
            self.prompt_done(s, &logits)?;
        }
        Ok(read)
    }

    /// Read the whole prompts of the slots `group` (`schedule::prompt_group`) in one forward over the
    /// slots from the lowest to the highest, left-padded (`schedule::padded_prompts`, module docs),
    /// and start each decoding. Returns the prompt tokens read.
    pub(super) fn read_prompts(&mut self, group: &[usize]) -> Result<usize> {
        let (Some(&lo), Some(&hi)) = (group.iter().min(), group.iter().max()) else {
            return Err(Error::Internal("an empty prompt group".into()));
        };
        let prompts: Vec<Option<&[i64]>> = (lo..=hi)
            .map(|i| self.slots.get(i).filter(|_| group.contains(&i)).map(|s| s.request.prompt.as_slice()))
            .collect();
        let read = prompts.iter().flatten().map(|p| p.len()).sum();
        let t = prompts.iter().flatten().map(|p| p.len()).max().unwrap_or(0) as i64;
        let padded = padded_prompts(&prompts, t as usize, self.context - 1);
        let rows = Rows { start: lo as i64, len: (hi - lo + 1) as i64 };
        let device = |v: &[i64], dtype: DType| Tensor::from_i64(v)?.to_like(&self.like, dtype);
        let ids = device(&padded.ids, DType::I64)?;
        let pos = Positions::new(&device(&padded.positions, DType::I64)?.reshape(&[rows.len, t])?)?;
        let live = Liveness::Padding(device(&padded.live, DType::Bool)?.reshape(&[rows.len, 1, t])?);
        let wants: Vec<(usize, i64)> = group.iter().filter_map(|&s| self.prompt_k(s).map(|k| (s, k))).collect();
        let output = if wants.is_empty() { Output::Logits } else { Output::Hidden };
        // Each row's soft tokens at its prompt's columns, right-aligned as the ids are.
        let placed: Vec<(&[_], usize, usize, i64)> = group
            .iter()
            .filter_map(|&s| self.slots.get(s).map(|x| (s, x)))
            .map(|(s, x)| {
                let n = x.request.prompt.len();
                (x.prompt.media.as_slice(), 0, n, (s - lo) as i64 * t + (t - n as i64))
            })
            .collect();
        let inject = media::injection(&placed, [rows.len, t], &self.like)?;
        let out = self
            .model
            .forward(&mut self.cache, rows, &ids, &pos, &live, Fill::Empty, output, inject.as_ref())?
            .ok_or_else(|| Error::Internal("a prompt forward returned no logits".into()))?;
        let logits = if wants.is_empty() {
            out.shallow_clone()?
        } else {
            self.model.head(&self.model.last_rows(&out, rows.len, t)?)?
        };
        for (s, k) in wants {
            let prompt = self.slots.get(s).map(|slot| slot.request.prompt.as_slice()).unwrap_or_default();
            let scored = prompt_logprobs::padded(prompt, s - lo, t as usize);
            let piece = prompt_logprobs::compute(&self.model, &out, &scored, k)?;
            self.slots.get_mut(s)?.prompt_pieces.extend(piece);
        }
        for &s in group {
            let slot = self.slots.get_mut(s)?;
            slot.phase = Phase::Prompt { done: slot.request.prompt.len() };
            let row = logits.narrow(0, (s - lo) as i64, 1)?;
            self.prompt_done(s, &row)?;
        }
        Ok(read)
    }

    /// Slot `s` has read its whole prompt, and `logits` `[1, vocab]` follow it: hand its prompt
    /// log-probabilities to it and its followers, and start them decoding (the followers first: a
    /// leader with max_new 0 ends here, and a leader freed first would hand its followers the reading).
    pub(super) fn prompt_done(&mut self, s: usize, logits: &Tensor) -> Result<()> {
        let n = self.slots.get(s).map_or(0, |slot| slot.request.prompt.len()) as i64;
        let pieces = std::mem::take(&mut self.slots.get_mut(s)?.prompt_pieces);
        let scored = prompt_logprobs::to_host(&pieces)?;
        if self.slots.get(s).is_some_and(|slot| slot.request.next_turn.is_none()) {
            self.snapshot(s, Mark::Turn, n as usize)?;
        }
        let fs = followers(self.slots.all(), s);
        for &f in &fs {
            self.cache.copy_slot(s as i64, f as i64)?;
            if let Some(p) = self.prefix.as_mut() {
                p.copy_marks(s, f);
            }
            self.slots.get_mut(f)?.phase = Phase::Prompt { done: n as usize };
        }
        for x in fs.into_iter().chain([s]) {
            let slot = self.slots.get_mut(x)?;
            if let Some(k) = slot.request.prompt_logprobs {
                slot.prompt_lp = Some(prompt_logprobs::trimmed(&scored, k));
            }
            if slot.limit == 0 {
                let slot = self.free(x)?;
                let end = Event { finish: Some(Finish::Length), timing: slot.timing(), ..slot.event() };
                self.ended.push(Event { prompt_logprobs: slot.prompt_lp, ..end });
            } else {
                self.start_decoding(x, logits)?;
            }
        }
        Ok(())
    }

    /// Slot `s` has its prompt's keys in its rings and `logits` `[1, vocab]` after it: draw its first
    /// token and start it decoding.
    pub(super) fn start_decoding(&mut self, s: usize, logits: &Tensor) -> Result<()> {
        if self.slots.get(s).is_none() {
            return Err(Error::Internal(format!("slot {s} is free")));
        }
        let si = s as i64;
        if self.slots.get(s).is_some_and(|slot| slot.grammar.is_some()) {
            self.constrain(&[s])?;
            if self.slots.get(s).is_none() {
                return Ok(());
            }
            self.sampler.upload_masks(si, 1)?;
        }
        let chosen = self.sampler.choose(logits, si, 1)?;
        self.sampler.advance(&chosen.tokens, si, 1, None)?;
        self.slots.start(s, &chosen.tokens, &self.model.cfg.eos_ids)?;
        self.drawn.push(Drawn { chosen, rows: vec![Some(s)], verified: None });
        Ok(())
    }
}
