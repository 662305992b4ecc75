//! `Slots`: the engine's sequence slots, on the host (which request each holds, how far it got) and
//! on the device (each slot's next token, next position, whether it decodes, and which tokens stop
//! it). Every flag has one writer: a slot starts decoding (`start`), stops at its length limit
//! (`count_step`), and is freed (`free`) only here, each method writing the host and the device side
//! together; and on the device alone a slot stops when it draws a stop token (`advance`), so it
//! writes nothing past its reply while it waits for the next read point (the host sees the stop
//! there). Its rings then end exactly at the reply, which the next chat turn extends
//! (engine/prefix.rs).
//!
//! As vLLM's scheduler keeps its requests as fields (`vllm/v1/core/sched/scheduler.py`,
//! `self.waiting`, `self.running`) rather than locals threaded through calls.

use std::time::Instant;

use crate::engine::grammar::Constraint;
use crate::engine::media;
use crate::engine::prompt_logprobs::Piece;
use crate::engine::request::{Event, Finish, Request, Timing, TokenLogprobs};
use crate::engine::schedule::followers;
use crate::engine::speculative::Backoff;
use crate::engine::step::{StepViews, buckets};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Where a slot's request is.
pub(super) enum Phase {
    /// Reading the prompt; `done` tokens read so far.
    Prompt {
        done: usize,
    },
    /// Waiting for slot `leader`, which reads the same prompt (engine module docs).
    Follow {
        leader: usize,
    },
    Decode,
}

/// A request's prompt on the device, made once at admission (`Engine::upload`): its ids and its
/// media's soft tokens (engine/media.rs `on_device`). The request keeps its media as given.
pub(super) struct Placed {
    pub(super) ids: Tensor,
    pub(super) media: Vec<media::Media>,
}

/// One busy slot.
pub(super) struct Slot {
    pub(super) request: Request,
    /// The prompt on the device.
    pub(super) prompt: Placed,
    /// The most tokens this request may generate (max_new, and the context's room).
    pub(super) limit: usize,
    pub(super) phase: Phase,
    /// Tokens drawn on the device (including those not read yet).
    drawn: usize,
    /// Tokens handed to the caller.
    pub(super) emitted: usize,
    /// Decoding on the device: the host side of `Slots::live`, written with it.
    live: bool,
    /// Decided by `Slot::finish` at a read point; the slot is freed there.
    pub(super) finished: Option<Finish>,
    admitted: Instant,
    pub(super) first_token: Option<Instant>,
    /// Admission order, for first-come-first-served prompt reading.
    pub(super) seq: u64,
    /// The request's grammar state (Some for a constrained request), fed each token at read points.
    pub(super) grammar: Option<Constraint>,
    /// Prompt log-probabilities scored so far, on the device (engine/prompt_logprobs.rs).
    pub(super) prompt_pieces: Vec<Piece>,
    /// The prompt log-probabilities on the host, for the request's first event.
    pub(super) prompt_lp: Option<Vec<TokenLogprobs>>,
    /// The tokens handed to the caller.
    pub(super) output: Vec<i64>,
    /// Tokens handed to the caller when a stop token came back (the device stopped the slot there).
    pub(super) stopped: Option<usize>,
    /// Prompt tokens taken from the prefix cache (engine/prefix.rs): the prompt position it was
    /// admitted at.
    pub(super) cached: usize,
    /// When the slot is next offered drafts (engine/speculative.rs).
    pub(super) backoff: Backoff,
}

/// What ends a request now, if anything (`Slot::finish`).
pub(super) enum End {
    /// A token came back to the host at a read point.
    Token(i64),
    /// The caller cancelled it, or the loop ended.
    Cancel,
    /// A forward, an upload or a read point failed it.
    Fail,
}

impl Slot {
    /// Whether the request ends with `end`, and why: the one place a running request's `Finish` is
    /// decided. A stop token (`stops_at`) ends it "stop" and is not returned; a token its grammar
    /// refused (`feed`) ends it "failed" and is not returned; a token after which its grammar can take
    /// nothing more ends it "stop", and the token that reaches `limit` (max_new, or the context full)
    /// "length", both returned.
    pub(super) fn finish(&self, end: End, eos_ids: &[i64]) -> Option<Finish> {
        match end {
            End::Cancel => Some(Finish::Cancelled),
            End::Fail => Some(Finish::Failed),
            End::Token(t) if self.stops_at(t, eos_ids) => Some(Finish::Stop),
            End::Token(_) if self.grammar_error().is_some() => Some(Finish::Failed),
            End::Token(_) if self.grammar.as_ref().is_some_and(|g| g.stopped()) => Some(Finish::Stop),
            End::Token(_) if self.emitted + 1 >= self.limit => Some(Finish::Length),
            End::Token(_) => None,
        }
    }

    /// A stop token: one of the model's eos ids or the request's stop ids (never returned).
    pub(super) fn stops_at(&self, t: i64, eos_ids: &[i64]) -> bool {
        eos_ids.contains(&t) || self.request.stop_ids.contains(&t)
    }

    /// Hand token `t`, just back on the host, to the request's grammar (a stop token ends the request
    /// and is not fed). A refusal is kept in the grammar state (`grammar_error`) for `finish`.
    pub(super) fn feed(&mut self, t: i64, eos_ids: &[i64]) {
        if self.stops_at(t, eos_ids) {
            return;
        }
        if let Some(g) = self.grammar.as_mut() {
            let _refused = g.consume(t);
        }
    }

    /// Why the request's grammar failed, if it did.
    pub(super) fn grammar_error(&self) -> Option<String> {
        self.grammar.as_ref().and_then(|g| g.error())
    }

    /// An event of this request, with no tokens yet.
    pub(super) fn event(&self) -> Event {
        Event { cached_tokens: self.cached, ..Event::new(self.request.id) }
    }

    /// What the slot's rings hold (engine/prefix.rs `History`): the tokens at positions
    /// `0..tokens.len()`, and the positions written in all. While it reads its prompt: the prompt's
    /// first `done`. Once it decodes, every decode step while it was live wrote the token it drew
    /// before: all but the last drawn, or up to the stop token, which the device stopped it at. The
    /// tokens drawn since the last read point are not known here, so then `written` is more than the
    /// tokens known.
    pub(super) fn history(&self) -> (Vec<i64>, usize) {
        let prompt = media::keyed(&self.request.prompt, &self.request.media);
        match self.phase {
            Phase::Prompt { done } => (prompt[..done].to_vec(), done),
            Phase::Follow { .. } => (Vec::new(), 0),
            Phase::Decode => {
                let fed = self.stopped.unwrap_or(self.drawn.saturating_sub(1));
                let known = fed.min(self.output.len());
                (prompt.iter().chain(&self.output[..known]).copied().collect(), prompt.len() + fed)
            }
        }
    }

    /// Tokens drawn on the device, including those not read yet.
    pub(super) fn drawn(&self) -> usize {
        self.drawn
    }

    /// Seconds from admission to the first token, and from then to now.
    pub(super) fn timing(&self) -> Timing {
        let now = Instant::now();
        match self.first_token {
            Some(first) => {
                Timing { prompt_s: (first - self.admitted).as_secs_f64(), decode_s: (now - first).as_secs_f64() }
            }
            None => Timing { prompt_s: (now - self.admitted).as_secs_f64(), decode_s: 0.0 },
        }
    }
}

pub(super) struct Slots {
    host: Vec<Option<Slot>>,
    /// Each slot's last drawn token, int64 `[max_batch]`: the next decode step's input.
    next: Tensor,
    /// Each slot's next position, int64 `[max_batch]`.
    positions: Tensor,
    /// Which slots decode, bool `[max_batch]`.
    live: Tensor,
    /// Per slot, false at its stop tokens (the model's eos ids and the request's stop ids), bool
    /// `[max_batch, vocab]`: a decode step clears `live` for a row that drew one.
    keep: Tensor,
    /// Views of `next`, `positions` and `live` for each bucket (`buckets`), made once.
    views: Vec<StepViews>,
    /// The last admission's number.
    seq: u64,
}

impl Slots {
    /// `max_batch` free slots for a vocabulary of `vocab` tokens on `like`'s device.
    pub(super) fn new(max_batch: i64, vocab: i64, like: &Tensor) -> Result<Slots> {
        let next = Tensor::full(&[max_batch], 0.0, DType::I64, like)?;
        let positions = Tensor::full(&[max_batch], 0.0, DType::I64, like)?;
        let live = Tensor::full(&[max_batch], 0.0, DType::Bool, like)?;
        let keep = Tensor::full(&[max_batch, vocab], 1.0, DType::Bool, like)?;
        let views = buckets(max_batch)
            .iter()
            .map(|b| StepViews::new(*b, &next, &positions, &live, &keep))
            .collect::<Result<Vec<_>>>()?;
        let host = (0..max_batch).map(|_| None).collect();
        Ok(Slots { host, next, positions, live, keep, views, seq: 0 })
    }

    /// Every slot free, on the device too: a run that ended on an error (a callback's exception)
    /// leaves its slots marked live, and a decode step would run such a row as live (writing its
    /// cache and moving its draw index) while a new request reads its prompt there.
    pub(super) fn reset(&mut self) -> Result<()> {
        self.live.fill_(0.0)?;
        self.host.iter_mut().for_each(|s| *s = None);
        self.seq = 0;
        Ok(())
    }

    pub(super) fn len(&self) -> usize {
        self.host.len()
    }

    pub(super) fn free_count(&self) -> usize {
        self.host.iter().filter(|s| s.is_none()).count()
    }

    /// The free slots, lowest first.
    pub(super) fn free_list(&self) -> Vec<usize> {
        (0..self.host.len()).filter(|s| self.host[*s].is_none()).collect()
    }

    pub(super) fn get(&self, s: usize) -> Option<&Slot> {
        self.host.get(s).and_then(|x| x.as_ref())
    }

    /// Busy slot `s`; an error when it is free.
    pub(super) fn busy_slot(&self, s: usize) -> Result<&Slot> {
        self.get(s).ok_or_else(|| Error::Internal(format!("slot {s} is free")))
    }

    pub(super) fn get_mut(&mut self, s: usize) -> Result<&mut Slot> {
        busy_mut(&mut self.host, s)
    }

    /// The host slots, free ones as None, for the pure functions of schedule.rs.
    pub(super) fn all(&self) -> &[Option<Slot>] {
        &self.host
    }

    /// The busy slots.
    pub(super) fn busy(&self) -> Vec<usize> {
        (0..self.host.len()).filter(|s| self.host[*s].is_some()).collect()
    }

    /// Put `request` (its prompt uploaded to `prompt`, its grammar compiled into `grammar`) in the free
    /// slot `s`, in `phase` (a prompt read from a prefix-cache hit starts with its hit read).
    pub(super) fn admit(
        &mut self,
        s: usize,
        request: Request,
        prompt: Placed,
        phase: Phase,
        limit: usize,
        grammar: Option<Constraint>,
    ) {
        self.seq += 1;
        let cached = if let Phase::Prompt { done } = phase { done } else { 0 };
        self.host[s] = Some(Slot {
            output: Vec::new(),
            stopped: None,
            cached,
            grammar,
            prompt_pieces: Vec::new(),
            prompt_lp: None,
            limit,
            request,
            prompt,
            phase,
            drawn: 0,
            emitted: 0,
            live: false,
            finished: None,
            admitted: Instant::now(),
            first_token: None,
            seq: self.seq,
            backoff: Backoff::default(),
        });
    }

    /// Slot `s` drew its first token `token` (int64 `[1]` on the device) after its prompt: it decodes
    /// from the next step, unless that token already reached its limit or is one of its stop tokens
    /// (`eos_ids` or the request's).
    pub(super) fn start(&mut self, s: usize, token: &Tensor, eos_ids: &[i64]) -> Result<()> {
        let si = s as i64;
        let slot = busy_mut(&mut self.host, s)?;
        self.next.narrow(0, si, 1)?.copy_(token)?;
        self.positions.narrow(0, si, 1)?.fill_(slot.request.prompt.len() as f64)?;
        slot.phase = Phase::Decode;
        slot.drawn = 1;
        let keep = self.keep.narrow(0, si, 1)?;
        keep.fill_(1.0)?;
        let stops: Vec<i64> = eos_ids.iter().chain(&slot.request.stop_ids).copied().collect();
        if !stops.is_empty() {
            let ids = Tensor::from_i64(&stops)?.to_like(&keep, DType::I64)?;
            let no = Tensor::full(&[1], 0.0, DType::Bool, &keep)?;
            keep.reshape(&[keep.numel()?])?.index_put_(&[Some(&ids)], &no)?;
        }
        if slot.limit > 1 {
            slot.live = true;
            let live = self.live.narrow(0, si, 1)?;
            live.copy_(&keep.gather(1, &token.reshape(&[1, 1])?)?.reshape(&[1])?)?;
        }
        Ok(())
    }

    /// The decoding slots `rows` each drew one more token: a slot that reached its limit stops
    /// decoding at once (its tokens are read at the next read point).
    pub(super) fn count_step(&mut self, rows: &[usize]) -> Result<()> {
        for &s in rows {
            self.count_drawn(s, 1)?;
        }
        Ok(())
    }

    /// Slot `s` drew `n` more tokens (one a plain step, up to the drafts and one a verify step, whose
    /// count the host learns at the read point): at its limit it stops decoding.
    pub(super) fn count_drawn(&mut self, s: usize, n: usize) -> Result<()> {
        let slot = busy_mut(&mut self.host, s)?;
        slot.drawn += n;
        if slot.drawn >= slot.limit && slot.live {
            slot.live = false;
            self.live.narrow(0, s as i64, 1)?.fill_(0.0)?;
        }
        Ok(())
    }

    /// Free slot `s` and return what it held. A leader that goes before its prompt is read hands
    /// the reading to its oldest follower.
    pub(super) fn free(&mut self, s: usize) -> Result<Slot> {
        let slot = self.host[s].take().ok_or_else(|| Error::Internal(format!("slot {s} is already free")))?;
        if let Some((&heir, rest)) = followers(&self.host, s).split_first() {
            let phases = rest.iter().map(|i| (*i, Phase::Follow { leader: heir }));
            for (i, phase) in phases.chain([(heir, Phase::Prompt { done: 0 })]) {
                if let Some(x) = self.host[i].as_mut() {
                    x.phase = phase;
                }
            }
        }
        if slot.live {
            self.live.narrow(0, s as i64, 1)?.fill_(0.0)?;
        }
        Ok(slot)
    }

    /// Some grammar-constrained slot decodes: its next mask needs its last token on the host, so the
    /// loop reads tokens back after every turn (engine module docs).
    pub(super) fn constrained_decoding(&self) -> bool {
        self.host.iter().flatten().any(|s| s.grammar.is_some() && matches!(s.phase, Phase::Decode))
    }

    /// The grammar states of the busy, constrained slots among `which`.
    pub(super) fn constraints_mut(&mut self, which: &[usize]) -> Vec<(usize, &mut Constraint)> {
        self.host
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| which.contains(i))
            .filter_map(|(i, s)| s.as_mut().and_then(|s| s.grammar.as_mut()).map(|g| (i, g)))
            .collect()
    }

    /// The highest decoding slot, if any.
    pub(super) fn top_live(&self) -> Option<usize> {
        self.host.iter().rposition(|s| s.as_ref().is_some_and(|s| s.live))
    }

    /// The bucket of a decode step whose highest decoding slot is `top`: the smallest above it.
    pub(super) fn bucket(&self, top: usize) -> i64 {
        self.views.iter().map(|v| v.b).find(|b| *b > top as i64).unwrap_or(self.host.len() as i64)
    }

    /// For each of the slots `0..b`, Some(slot) when it decodes (None: a padding row).
    pub(super) fn rows(&self, b: i64) -> Vec<Option<usize>> {
        (0..b as usize).map(|i| self.host[i].as_ref().filter(|s| s.live).map(|_| i)).collect()
    }

    /// A decode step's inputs for the bucket `b`.
    pub(super) fn views(&self, b: i64) -> Result<&StepViews> {
        self.views.iter().find(|v| v.b == b).ok_or_else(|| Error::Internal(format!("{b} is not a decode bucket")))
    }

    /// After a decode step of slots `0..b` chose `next`: it is the next step's input, the decoding
    /// rows move one position on, or with `kept` (a verify step's drafts kept per row, int64 `[b]`,
    /// engine/speculative.rs) `kept + 1` (padding rows keep theirs), and a row whose `next` is one of
    /// its stop tokens stops decoding (module docs).
    pub(super) fn advance(&mut self, b: i64, next: &Tensor, kept: Option<&Tensor>, padded: bool) -> Result<()> {
        let v = self.views(b)?;
        v.next.copy_(next)?;
        match (kept, padded) {
            (None, true) => v.positions.add_(&v.live)?,
            (None, false) => v.positions.add_int_(1)?,
            (Some(kept), _) => {
                let moved = kept.add_int(1)?;
                let moved = if padded { moved.mul(&v.live.to_dtype(DType::I64)?)? } else { moved };
                v.positions.add_(&moved)?
            }
        }
        let go_on = v.keep.gather(1, &next.reshape(&[b, 1])?)?;
        v.live2.copy_(&v.live2.logical_and(&go_on)?)
    }
}

fn busy_mut(host: &mut [Option<Slot>], s: usize) -> Result<&mut Slot> {
    host.get_mut(s).and_then(|x| x.as_mut()).ok_or_else(|| Error::Internal(format!("slot {s} is free")))
}
