//! The fault hook for tests: `Engine::inject_fault_for_tests` makes the engine fail one request at one place,
//! the one way a test can produce a device error on demand. Serving never sets it; what the hook then costs is
//! a test of one field at each admission (`injected_for`) and each decode step and prompt read (`injected`,
//! inlined, with the rest out of line).

use super::Engine;
use crate::error::{Error, Result};

/// Where `Engine::inject_fault_for_tests` makes the engine fail one request: its admission (after
/// its checks passed), the prompt forward that reads it, or a decode step that runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Admit,
    Prompt,
    Decode,
}

impl Engine {
    /// Make the engine fail request `id` at `at` (once): the one way a test can produce a device
    /// error on demand, to show that it fails that request alone.
    pub fn inject_fault_for_tests(&mut self, at: Fault, id: u64) {
        self.fault = Some((at, id));
    }

    /// An error when a fault is injected at `at` for a request in one of the slots `which` (the fault is
    /// then used up). What a step pays without one: this inlined test of one field, None unless a test
    /// injected a fault; the search of the slots is out of line.
    #[inline(always)]
    pub(super) fn injected(&mut self, at: Fault, which: &[usize]) -> Result<()> {
        match self.fault {
            None => Ok(()),
            Some(_) => self.injected_here(at, which),
        }
    }

    #[cold]
    #[inline(never)]
    fn injected_here(&mut self, at: Fault, which: &[usize]) -> Result<()> {
        let Some((_, id)) = self.fault else { return Ok(()) };
        if which.iter().any(|s| self.slots.get(*s).is_some_and(|slot| slot.request.id == id)) {
            return self.injected_for(at, id);
        }
        Ok(())
    }

    /// An error when a fault is injected at `at` for request `id` (the fault is then used up).
    pub(super) fn injected_for(&mut self, at: Fault, id: u64) -> Result<()> {
        if self.fault == Some((at, id)) {
            return Err(self.take_fault());
        }
        Ok(())
    }

    /// The injected fault as the error it stands for, used up.
    fn take_fault(&mut self) -> Error {
        match self.fault.take() {
            Some((at, id)) => Error::Internal(format!("a fault injected for tests ({at:?}, request {id})")),
            None => Error::Internal("no fault was injected".into()),
        }
    }
}
