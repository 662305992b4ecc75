//! The grammar masks of a verify step's positions (engine/speculative.rs), for a batch with grammar-constrained
//! rows.
//!
//! Position 0 of a row takes the mask `Engine::constrain` wrote for its next token; position `j + 1` the mask after
//! its drafts `0..=j`. Each constrained row gets a look-ahead of its grammar (`Constraint::lookahead`) that takes
//! its drafts in order; a row's drafts end at the first its grammar refuses (`offered`). Prompt-lookup drafts are
//! taken all at once from the host (`take_all`); an assistant's one at a time while it drafts (`take`, with
//! `mask` giving the assistant the mask of its next draft), so its drafts follow the grammar as the target's
//! tokens do. An unconstrained row, and a position past a row's drafts, allow every token.

use crate::engine::grammar::Lookahead;
use crate::engine::sampling::Sampler;
use crate::engine::slots::Slots;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

pub(super) struct Columns {
    /// Mask bytes a position, positions a row.
    m: usize,
    w: usize,
    /// `[b, w, m]`: each row's masks by position.
    host: Vec<u8>,
    /// Per row: the look-ahead of a constrained row.
    ahead: Vec<Option<Lookahead>>,
    /// Drafts per row, cut where a grammar refuses one.
    pub(super) offered: Vec<usize>,
}

impl Columns {
    /// For the rows `rows` (slots `0..b`) of a verify step of `k` drafts, `offered` drafts a row.
    pub(super) fn new(
        sampler: &Sampler,
        slots: &Slots,
        rows: &[Option<usize>],
        k: i64,
        offered: Vec<usize>,
    ) -> Columns {
        let (m, w) = (sampler.mask_bytes(), (k + 1) as usize);
        let mut host = vec![0xff_u8; rows.len() * w * m];
        for (row, out) in host.chunks_mut(w * m).enumerate() {
            out[..m].copy_from_slice(sampler.mask_rows(row as i64, 1));
        }
        let ahead =
            rows.iter().map(|s| s.and_then(|s| slots.get(s)?.grammar.as_ref()).map(|g| g.lookahead())).collect();
        Columns { m, w, host, ahead, offered }
    }

    /// Each row's draft `j` (`ids`, one a row): a constrained row still taking drafts takes it, and its position
    /// `j + 1` gets the mask after it; a row whose grammar refuses it is offered `j` drafts.
    pub(super) fn take(&mut self, j: usize, ids: &[i64]) {
        let (m, w) = (self.m, self.w);
        for (row, ahead) in self.ahead.iter_mut().enumerate() {
            let Some(ahead) = ahead.as_mut().filter(|_| j < self.offered[row]) else { continue };
            let out = &mut self.host[(row * w + j + 1) * m..][..m];
            if !ahead.take(ids[row], out) {
                self.offered[row] = j;
            }
        }
    }

    /// `take` for every draft of `drafts` (`[b, k]` on the host).
    pub(super) fn take_all(&mut self, drafts: &[i64]) {
        let (b, k) = (self.ahead.len(), self.w - 1);
        for j in 0..k {
            let ids: Vec<i64> = (0..b).map(|row| drafts[row * k + j]).collect();
            self.take(j, &ids);
        }
    }

    /// The masks of position `j`, uint8 `[b, mask_bytes]` on `like`'s device.
    pub(super) fn mask(&self, j: usize, like: &Tensor) -> Result<Tensor> {
        let (m, w) = (self.m, self.w);
        let bytes: Vec<u8> = self.host.chunks(w * m).flat_map(|row| row[j * m..(j + 1) * m].iter().copied()).collect();
        Tensor::from_bytes(&bytes, &[self.ahead.len() as i64, m as i64], DType::U8)?.to_like(like, DType::U8)
    }

    /// Every position's masks, uint8 `[b, k + 1, mask_bytes]` on `like`'s device.
    pub(super) fn masks(&self, like: &Tensor) -> Result<Tensor> {
        let shape = [self.ahead.len() as i64, self.w as i64, self.m as i64];
        Tensor::from_bytes(&self.host, &shape, DType::U8)?.to_like(like, DType::U8)
    }
}
