//! Prompt log-probabilities (`Request::prompt_logprobs`): the log-probability of each prompt token
//! given the ones before it, and the `k` most likely tokens there, computed on the device while the
//! prompt is read.
//!
//! A prompt forward that reads a slot which asks (or whose followers ask) keeps its final hidden
//! states (`Output::Hidden`). The rows at positions `0..n - 1` of that prompt each predict the next
//! prompt id: `rows` picks them out of the forward's `[rows * T, hidden]` layout (`chunk` for a chunk
//! of one prompt, `padded` for a row of a left-padded group, `schedule::padded_prompts`), and the
//! last row of a chunk before the last is gathered at the next chunk's first id. `compute` takes the
//! picked rows through the final norm, lm_head and softcap (`Model::head`), `log_softmax` in float32,
//! gathers each at its target and takes the top `k`, all on the device; only those `[m]` and `[m, k]`
//! tensors reach the host, once, when the prompt is done (`to_host`). As vLLM reports prompt
//! logprobs (`vllm/v1/worker/gpu_model_runner.py`, `_get_prompt_logprobs_dict`): of the model's own
//! distribution, position 0 has none.

use crate::engine::request::TokenLogprobs;
use crate::error::Result;
use crate::gemma4::model::Model;
use crate::tensor::{DType, Tensor};

/// The hidden-state rows of one prompt forward to score, and the id each is scored at.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Rows {
    pub(super) rows: Vec<i64>,
    pub(super) targets: Vec<i64>,
}

/// The rows of a chunk `done..end` of `prompt` read alone (hidden row `j - done` is position `j`):
/// positions `done..min(end, n - 1)`, each scored at the id after it.
pub(super) fn chunk(prompt: &[i64], done: usize, end: usize) -> Rows {
    let last = end.min(prompt.len().saturating_sub(1));
    Rows {
        rows: (0..last.saturating_sub(done) as i64).collect(),
        targets: prompt[(done + 1).min(last + 1)..last + 1].to_vec(),
    }
}

/// The rows of `prompt`, read whole as row `row` of a left-padded forward of `t` columns (its
/// tokens are the last `prompt.len()` columns).
pub(super) fn padded(prompt: &[i64], row: usize, t: usize) -> Rows {
    let start = (row * t + t - prompt.len()) as i64;
    let m = prompt.len().saturating_sub(1) as i64;
    Rows { rows: (start..start + m).collect(), targets: prompt[1..].to_vec() }
}

/// One forward's scored rows of one slot, on the device: each target's log-probability `[m]`, and
/// the top `k` ids and log-probabilities `[m, k]`.
pub(super) struct Piece {
    chosen: Tensor,
    top_ids: Tensor,
    top_lp: Tensor,
}

/// Score `rows` of a forward's final `hidden` states (`Model::head`, then float32 `log_softmax`) at
/// their targets, with the top `k`, on `hidden`'s device. None when there are no rows.
pub(super) fn compute(model: &Model, hidden: &Tensor, rows: &Rows, k: i64) -> Result<Option<Piece>> {
    if rows.rows.is_empty() {
        return Ok(None);
    }
    let to_device = |v: &[i64]| Tensor::from_i64(v)?.to_like(hidden, DType::I64);
    let picked = hidden.index_select(0, &to_device(&rows.rows)?)?;
    let lp = model.head(&picked)?.to_dtype(DType::F32)?.log_softmax(-1)?;
    let m = rows.rows.len() as i64;
    let chosen = lp.gather(1, &to_device(&rows.targets)?.reshape(&[m, 1])?)?.reshape(&[m])?;
    let (top_lp, top_ids) = lp.topk(k.min(model.cfg.vocab_size))?;
    Ok(Some(Piece { chosen, top_ids, top_lp }))
}

/// The pieces of one prompt, in position order, on the host: one entry per position 1..n.
pub(super) fn to_host(pieces: &[Piece]) -> Result<Vec<TokenLogprobs>> {
    let mut out = Vec::new();
    for p in pieces {
        let (chosen, ids, lps) = (p.chosen.to_vec_f32()?, p.top_ids.to_vec_i64()?, p.top_lp.to_vec_f32()?);
        let k = if chosen.is_empty() { 0 } else { ids.len() / chosen.len() };
        out.extend(chosen.iter().enumerate().map(|(i, lp)| TokenLogprobs {
            logprob: *lp,
            top: (0..k).map(|j| (ids[i * k + j], lps[i * k + j])).collect(),
        }));
    }
    Ok(out)
}

/// `all` with each entry's top list cut to `k`.
pub(super) fn trimmed(all: &[TokenLogprobs], k: i64) -> Vec<TokenLogprobs> {
    all.iter()
        .map(|l| TokenLogprobs { logprob: l.logprob, top: l.top.iter().take(k as usize).copied().collect() })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_position_but_the_last_is_scored_at_the_next_id_across_chunks() {
        let p = [10, 11, 12, 13, 14];
        // Chunks of 2: rows 0..2 scored at 11, 12; then 12, 13 -> 13, 14; the last chunk's row is none.
        assert_eq!(chunk(&p, 0, 2), Rows { rows: vec![0, 1], targets: vec![11, 12] });
        assert_eq!(chunk(&p, 2, 4), Rows { rows: vec![0, 1], targets: vec![13, 14] });
        assert_eq!(chunk(&p, 4, 5), Rows::default());
        assert_eq!(chunk(&p, 0, 5), Rows { rows: vec![0, 1, 2, 3], targets: vec![11, 12, 13, 14] });
        assert_eq!(chunk(&[7], 0, 1), Rows::default());
    }

    #[test]
    fn a_padded_row_is_scored_from_its_first_real_column() {
        // Row 1 of a 4-column forward holding a 3-token prompt: columns 5, 6, 7 of the flat layout.
        assert_eq!(padded(&[20, 21, 22], 1, 4), Rows { rows: vec![5, 6], targets: vec![21, 22] });
        assert_eq!(padded(&[20], 0, 4), Rows::default());
    }
}
