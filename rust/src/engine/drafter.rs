//! The engine's side of an MTP assistant drafter (gemma4/assistant.rs, `speculative_method="mtp"`): what the
//! drafter reads that the target's rings do not hold, the target's final hidden state at each slot's last
//! position, and whose it is.
//!
//! A verify step (engine/speculative.rs) computes every position's hidden state anyway; it keeps each row's
//! state at the position that chose the row's next token (the last kept draft's) in `hidden`. A plain decode
//! step keeps none, so a slot's state is current only while every step since its last verify step was a
//! verify step of the same request (`holds`). A slot without one is offered no drafts in its next verify
//! step, which then records its state: the first decode step after a prompt, or after plain steps (a batch
//! above `speculative_max_batch`), checks only the target's own token. When no slot of the step has drafts, the
//! step reads one position a row (a verify step of no drafts), as a plain step does.

use std::path::Path;

use crate::engine::settings::Settings;
use crate::engine::speculative::Method;
use crate::engine::step::StepViews;
use crate::error::{Error, Result};
use crate::gemma4::assistant::{Assistant, DraftMask};
use crate::gemma4::cache::{KvCache, Rows};
use crate::gemma4::model::Model;
use crate::gemma4::weights::Kernels;
use crate::tensor::{DType, Tensor};

pub(super) struct Drafter {
    assistant: Assistant,
    /// The target's final hidden state at each slot's last position (`Model::final_hidden`),
    /// `[max_batch, hidden]`.
    hidden: Tensor,
    /// Per slot: the request whose state `hidden` holds, None when it holds none that is current.
    holds: Vec<Option<u64>>,
}

impl Drafter {
    /// The drafter `settings` ask for (`speculative_method="mtp"`), for `target` on `like`'s device.
    pub(super) fn of(settings: &Settings, target: &Model, like: &Tensor) -> Result<Option<Drafter>> {
        let Some(Method::Mtp(dir)) = settings.speculative.as_ref().map(|s| &s.method) else { return Ok(None) };
        if settings.tensor_parallel_size > 1 {
            return Err(Error::Input("an MTP drafter (speculative_model) needs tensor_parallel_size 1".into()));
        }
        let sizes = (settings.context, settings.max_batch);
        Drafter::load(dir, target, like, settings.dtype, settings.kernels(), sizes).map(Some)
    }

    /// The assistant in `dir` for `target`, and an empty state for `max_batch` slots.
    fn load(
        dir: &Path,
        target: &Model,
        like: &Tensor,
        dtype: DType,
        kernels: Kernels,
        (context, max_batch): (i64, i64),
    ) -> Result<Drafter> {
        let assistant = Assistant::load(dir, target, like, dtype, kernels, context)?;
        let hidden = Tensor::full(&[max_batch, target.cfg.hidden_size], 0.0, dtype, like)?;
        Ok(Drafter { assistant, hidden, holds: vec![None; max_batch as usize] })
    }

    /// Bytes of the assistant's weights and of the states it reads.
    pub(super) fn bytes(&self) -> Result<i64> {
        Ok(self.assistant.bytes + self.hidden.nbytes()?)
    }

    /// Whether slot `slot` holds request `request`'s current state.
    pub(super) fn ready(&self, slot: usize, request: u64) -> bool {
        self.holds.get(slot).copied().flatten() == Some(request)
    }

    /// A plain step of `rows` moved their slots past the states held.
    pub(super) fn forget(&mut self, rows: &[Option<usize>]) {
        for s in rows.iter().flatten() {
            self.holds[*s] = None;
        }
    }

    /// `k` drafts, int64 `[b, k]`, for the slots `0..b` at their next tokens and positions (`v`), each chosen
    /// under `mask` (`Assistant::draft`).
    pub(super) fn draft(
        &self,
        target: &Model,
        cache: &mut KvCache,
        v: &StepViews,
        k: i64,
        mask: &mut DraftMask<'_>,
    ) -> Result<Tensor> {
        let b = v.b;
        let hidden = self.hidden.narrow(0, 0, b)?;
        self.assistant.draft(target, cache, Rows::first(b), &v.next, &hidden, &v.positions, k, mask)
    }

    /// After a verify step of `k` drafts a row over slots `0..b`: keep each row's hidden state at its last
    /// kept draft (`kept`, int64 `[b]`) of the step's `hidden` (`[b * (k + 1), hidden]`, before the final
    /// norm), and note whose it is (`requests`, per row, None for padding rows).
    pub(super) fn keep(
        &mut self,
        target: &Model,
        hidden: &Tensor,
        kept: &Tensor,
        k: i64,
        requests: &[Option<(usize, u64)>],
    ) -> Result<()> {
        let b = requests.len() as i64;
        let at = Tensor::arange(0, b, DType::I64, kept)?.mul_int(k + 1)?.add(kept)?;
        self.hidden.narrow(0, 0, b)?.copy_(&target.final_hidden(&hidden.index_select(0, &at)?)?)?;
        for (slot, request) in requests.iter().flatten() {
            self.holds[*slot] = Some(*request);
        }
        Ok(())
    }
}
