//! `Engine::decode`: one request through the batching loop alone, its tokens handed to a callback.
//! The loop decides how the request ends (`Slot::finish`); this adapter only reports it, and a
//! falsy callback return cancels the request at the next read point.

use crate::engine::Engine;
use crate::engine::request::{Event, Finish, Io, Request, StepStats, Timing};
use crate::error::{Error, Result};

/// `Engine::decode`'s side of the loop: one request, its tokens handed to `on_tokens`.
struct One<F: FnMut(&[i64]) -> bool> {
    request: Option<Request>,
    id: u64,
    on_tokens: F,
    tokens: Vec<i64>,
    finish: Option<Finish>,
    error: Option<String>,
    cancel: bool,
    timing: Timing,
}

impl<F: FnMut(&[i64]) -> bool> Io for One<F> {
    fn poll(&mut self, _free: usize, _idle: bool) -> Result<Option<(Vec<Request>, Vec<u64>)>> {
        if self.finish.is_some() {
            return Ok(None);
        }
        let cancels = if self.cancel { vec![self.id] } else { Vec::new() };
        Ok(Some((self.request.take().into_iter().collect(), cancels)))
    }

    fn emit(&mut self, events: Vec<Event>, _stats: &StepStats) -> Result<()> {
        for e in events {
            self.tokens.extend_from_slice(&e.tokens);
            if !e.tokens.is_empty() && !self.cancel && !(self.on_tokens)(&e.tokens) {
                self.cancel = true;
            }
            if let Some(f) = e.finish {
                // A request the caller cancelled in this very batch reports "cancelled", as it would
                // have at the next read point.
                self.finish = Some(if self.cancel { Finish::Cancelled } else { f });
                self.error = e.error;
                self.timing = e.timing;
            }
        }
        Ok(())
    }
}

/// The result of `Engine::decode`.
pub struct Decoded {
    pub tokens: Vec<i64>,
    pub finish: Finish,
    pub timing: Timing,
}

impl Engine {
    /// One request through the loop alone; `on_tokens` gets each non-empty batch and returns false
    /// to cancel.
    pub fn decode(
        &mut self,
        request: Request,
        read_every: i64,
        on_tokens: impl FnMut(&[i64]) -> bool,
    ) -> Result<Decoded> {
        self.check_request(&request)?;
        let mut one = One {
            id: request.id,
            request: Some(request),
            on_tokens,
            tokens: Vec::new(),
            finish: None,
            error: None,
            cancel: false,
            timing: Timing::default(),
        };
        self.run(&mut one, read_every)?;
        match (one.finish, one.error) {
            (Some(Finish::Error), Some(e)) => Err(Error::Input(e)),
            (Some(Finish::Failed), e) => Err(Error::Internal(e.unwrap_or_default())),
            (Some(finish), _) => Ok(Decoded { tokens: one.tokens, finish, timing: one.timing }),
            (None, _) => Err(Error::Internal("the loop ended without finishing the request".into())),
        }
    }
}
