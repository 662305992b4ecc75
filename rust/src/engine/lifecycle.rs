//! A request's life in a slot: admission (the prefix cache's choice of slot, a resumed or copied history,
//! its snapshots), placement of its state on the device, and its end (finished, failed or cancelled),
//! which frees the slot.

use super::{Engine, Fault};
use crate::engine::media::{self, Media};
use crate::engine::prefix::{self, Hit, Mark};
use crate::engine::request::{Event, Finish, Request, Timing};
use crate::engine::slots::{End, Phase, Placed, Slot};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

impl Engine {
    /// Put `r` in a free slot (the lowest, or with prefix caching the one prefix.rs chooses), or say
    /// why it cannot run.
    pub(super) fn admit(&mut self, mut r: Request) -> Result<Option<Event>> {
        let refuse =
            |r: &Request, msg: String| Ok(Some(Event::end_with_error(r.id, Finish::Error, Timing::default(), msg)));
        if let Err(e) = self.check_request(&r) {
            return refuse(&r, e.to_string());
        }
        let free = self.slots.free_list();
        if free.is_empty() {
            return refuse(&r, format!("all {} slots are busy", self.max_batch));
        }
        // The prompt as the prefix cache sees it: media by their content (media.rs).
        let keyed = media::keyed(&r.prompt, &r.media).into_owned();
        let reading_it = |x: &Option<Slot>| {
            x.as_ref().is_some_and(|x| {
                matches!(x.phase, Phase::Prompt { .. })
                    && *media::keyed(&x.request.prompt, &x.request.media) == keyed[..]
            })
        };
        let leader = self.slots.all().iter().position(reading_it);
        let (s, hit) = match &self.prefix {
            None => (free[0], None),
            Some(p) => {
                // A request scored at every prompt position takes no hit (vLLM skips the cache for
                // prompt_logprobs too); a follower copies its leader's rings.
                let wants = leader.is_none() && r.prompt_logprobs.is_none();
                let hit = if wants { p.best(&free, &keyed, &r.cache_salt) } else { None };
                (p.target(&free, hit.as_ref()), hit)
            }
        };
        let grammar = match self.compile(&r) {
            Ok(g) => g,
            Err(e) => return refuse(&r, e.to_string()),
        };
        let prompt = match self.place(s, &r).and_then(|prompt| self.resume(s, hit).map(|_| prompt)) {
            Ok(prompt) => prompt,
            Err(e) => {
                if let Some(p) = self.prefix.as_mut() {
                    p.drop_history(s);
                }
                return Ok(Some(Event::end_with_error(r.id, Finish::Failed, Timing::default(), e.to_string())));
            }
        };
        let cached = hit.map_or(0, |h| h.at);
        self.stats.cache_queries += r.prompt.len();
        self.stats.cache_hits += cached;
        let phase = match leader {
            Some(leader) => Phase::Follow { leader },
            None => Phase::Prompt { done: cached },
        };
        let room = (self.context - r.prompt.len() as i64) as usize;
        let limit = (r.max_new as usize).min(room);
        if self.prefix.is_none() {
            // Nothing to snapshot, and the prompt may be read in a group.
            (r.cache_boundary, r.next_turn) = (None, None);
        }
        // A mark where the hit ends is snapshotted now: no chunk will end there.
        let at_marks: Vec<Mark> = if leader.is_none() {
            prefix::marks(&r).filter(|&(_, c)| c == cached).map(|(m, _)| m).collect()
        } else {
            Vec::new()
        };
        self.slots.admit(s, r, prompt, phase, limit, grammar);
        match at_marks.into_iter().try_for_each(|m| self.snapshot(s, m, cached)) {
            Err(e) => self.end(s, End::Fail, Some(&e)).map(Some),
            Ok(()) => Ok(None),
        }
    }

    /// Give slot `s`'s rings what a request resuming at `hit` needs (prefix.rs): the donor's rings
    /// copied when they are another slot's, then the snapshot restored when the hit is one. Without a
    /// hit the slot's history is simply overwritten.
    pub(super) fn resume(&mut self, s: usize, hit: Option<Hit>) -> Result<()> {
        let Some(p) = self.prefix.as_mut() else { return Ok(()) };
        let Some(h) = hit else {
            p.claim(s, None, 0);
            return Ok(());
        };
        if h.donor != s {
            self.cache.copy_slot(h.donor as i64, s as i64)?;
        }
        if let Some(m) = h.restore {
            self.cache.restore(s as i64, m.row())?;
        }
        p.claim(s, Some(h.donor), h.at);
        Ok(())
    }

    /// Copy slot `s`'s sliding rings, which have just written `0..at`, into its snapshot `mark`.
    pub(super) fn snapshot(&mut self, s: usize, mark: Mark, at: usize) -> Result<()> {
        let Some(p) = self.prefix.as_mut() else { return Ok(()) };
        self.cache.snapshot(s as i64, mark.row())?;
        p.mark(s, mark, at);
        Ok(())
    }

    /// Upload `r`'s prompt (`upload`) and give slot `s` its sampling state; the slot is still free, so
    /// an error here leaves nothing to undo (the next `assign` rewrites the whole row).
    pub(super) fn place(&mut self, s: usize, r: &Request) -> Result<Placed> {
        self.injected_for(Fault::Admit, r.id)?;
        let prompt = self.upload(&r.prompt, &r.media)?;
        self.sampler.assign(s as i64, &r.params, &prompt.ids, r.grammar.is_some())?;
        Ok(prompt)
    }

    /// Prompt `ids` and the soft tokens of its `media` on the device, which a slot (or `logits`) reads
    /// the prompt from; `check_input` has passed.
    pub(super) fn upload(&self, ids: &[i64], media: &[Media]) -> Result<Placed> {
        let cfg = &self.model.cfg;
        let media = media::on_device(media, ids, &cfg.bidirectional_ids, &self.like, self.model.dtype())?;
        Ok(Placed { ids: Tensor::from_i64(ids)?.to_like(&self.like, DType::I64)?, media })
    }

    /// Free slot `s` and its sampling state; its rings stay for later requests (prefix.rs). Returns
    /// what it held.
    pub(super) fn free(&mut self, s: usize) -> Result<Slot> {
        let slot = self.slots.free(s)?;
        self.sampler.release(s as i64);
        if let Some(p) = self.prefix.as_mut() {
            let (tokens, written) = slot.history();
            p.retire(s, tokens, written, slot.request.cache_salt.clone());
        }
        Ok(slot)
    }

    /// End the request in busy slot `s` by `end` (cancelled, or failed by `error`) and free its slot.
    /// A failed request's rings are not trusted again.
    pub(super) fn end(&mut self, s: usize, end: End, error: Option<&Error>) -> Result<Event> {
        let failed = matches!(end, End::Fail);
        let slot = self.free(s)?;
        if let Some(p) = self.prefix.as_mut().filter(|_| failed) {
            p.drop_history(s);
        }
        Ok(Event {
            finish: slot.finish(end, &self.model.cfg.eos_ids),
            error: error.map(|e| e.to_string()),
            timing: slot.timing(),
            ..slot.event()
        })
    }

    /// End the requests in the slots `which` as failed by `e`, and free their slots.
    pub(super) fn fail(&mut self, which: impl IntoIterator<Item = usize>, e: &Error) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        for s in which {
            if self.slots.get(s).is_some() {
                events.push(self.end(s, End::Fail, Some(e))?);
            }
        }
        Ok(events)
    }

    /// End the requests whose ids `which` picks as "cancelled" and free their slots.
    pub(super) fn cancel(&mut self, which: impl Fn(u64) -> bool) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        for s in 0..self.slots.len() {
            if self.slots.get(s).is_some_and(|slot| which(slot.request.id)) {
                events.push(self.end(s, End::Cancel, None)?);
            }
        }
        Ok(events)
    }
}
