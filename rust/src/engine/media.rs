//! Media in a prompt: soft tokens (gemma4/media.rs `Encoder`) that take the place of a run of
//! placeholder ids, and what the runtime does with them.
//!
//! - **The forward.** Gemma4Model (Transformers 5.18 `modeling_gemma4.py`, M:2310-2390) embeds the
//!   prompt with the placeholders turned into the pad id, then scatters the soft tokens over the
//!   placeholders' rows (`masked_scatter`); the per-layer inputs take the pad id's table row and the
//!   projection of the merged embeddings. `injection` makes the model's `Injection`, the rows and soft
//!   tokens of one forward (`gemma4::model::Model::forward` does the rest). The E-series text model stays causal with media
//!   (their `use_bidirectional_attention` is unset), so a prompt with media is read in chunks and
//!   groups like any other.
//! - **The prefix cache** compares token ids, and every image's placeholders are the same id. So the
//!   cache and the follower check see the prompt with each placeholder replaced by an id derived from
//!   the media's content key and its offset (`keyed`): negative, so never a vocabulary id. The same
//!   image at the same place resumes; a different one stops the hit at its first soft token (vLLM
//!   hashes the media into its block keys the same way, `vllm/v1/core/kv_cache_utils.py`).

use std::borrow::Cow;
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::{Error, Result};
use crate::gemma4::model::Injection;
use crate::tensor::{DType, Tensor};

/// One image's or clip's soft tokens at prompt positions `start..start + rows`, never changed once
/// made: a request's items hold the soft tokens as given, and admission makes the device copies a
/// slot reads (`on_device`). Cloning shares the soft tokens (a request is cloned out of its Python
/// object, which any thread may hold).
#[derive(Clone)]
pub struct Media {
    pub start: usize,
    /// `[rows, hidden]`, shared. A `Tensor` is `Send` but not `Sync` (tensor.rs), and a request is a
    /// frozen Python object any thread may read, so the handle sits behind a lock; nothing is written
    /// through it, so a poisoned lock still holds the same tensor.
    embeds: Arc<Mutex<Tensor>>,
    /// The soft tokens' first dim, read once.
    rows: usize,
    /// The content's key (a hash of its bytes): equal keys, equal soft tokens.
    pub key: u64,
    /// Sliding layers read these soft tokens both ways (set by `on_device`).
    both_ways: bool,
}

impl std::fmt::Debug for Media {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Media").field("start", &self.start).field("rows", &self.rows).field("key", &self.key).finish()
    }
}

impl Media {
    /// `embeds` `[rows, hidden]` (`check` names any other shape).
    pub fn new(start: usize, embeds: Tensor, key: u64) -> Result<Media> {
        let rows = embeds.size()?.first().map_or(0, |&r| r.max(0) as usize);
        Ok(Media { start, embeds: Arc::new(Mutex::new(embeds)), rows, key, both_ways: false })
    }

    /// A handle on the soft tokens.
    pub fn embeds(&self) -> Result<Tensor> {
        self.embeds.lock().unwrap_or_else(PoisonError::into_inner).shallow_clone()
    }

    /// A new item: this one with its soft tokens on `like`'s device in `dtype`, read both ways or not.
    pub fn on(&self, like: &Tensor, dtype: DType, both_ways: bool) -> Result<Media> {
        let embeds = Arc::new(Mutex::new(self.embeds()?.to_like(like, dtype)?));
        Ok(Media { start: self.start, embeds, rows: self.rows, key: self.key, both_ways })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// The device copies of a request's `media` (made once, at admission, and kept with its slot): each
/// item `on` `like`'s device in `dtype`, read both ways when its placeholder is one of `bidirectional`
/// (the config's `bidirectional_ids`: images of a checkpoint whose sliding layers read an image both
/// ways). `check` has passed.
pub fn on_device(
    media: &[Media],
    prompt: &[i64],
    bidirectional: &[i64],
    like: &Tensor,
    dtype: DType,
) -> Result<Vec<Media>> {
    media.iter().map(|m| m.on(like, dtype, bidirectional.contains(&prompt[m.start]))).collect()
}

/// Where a prompt chunk from `done` that would end at `end` must end so that no item read both ways is
/// cut: at such an item's start when the chunk reaches into it from before, else at its end (a chunk
/// that starts inside or at it reads it whole, past the chunk budget if it must).
pub fn chunk_end(media: &[Media], done: usize, end: usize) -> Result<usize> {
    for m in media.iter().filter(|m| m.both_ways) {
        let stop = m.start + m.rows();
        if m.start < end && end < stop {
            return Ok(if m.start > done { m.start } else { stop });
        }
    }
    Ok(end)
}

/// The checks on a request's media against its prompt: sorted, apart, inside the prompt, each
/// `[rows, hidden]` over `rows` copies of one of `placeholders` (the checkpoint's media ids), and no
/// placeholder outside them. Errors name the item.
pub fn check(media: &[Media], prompt: &[i64], hidden: i64, placeholders: &[i64]) -> Result<()> {
    if !media.is_empty() && placeholders.is_empty() {
        return Err(Error::Input("media: this checkpoint has no vision or audio tower; it takes text only".into()));
    }
    let mut covered = vec![false; prompt.len()];
    let mut end = 0;
    for (i, m) in media.iter().enumerate() {
        let size = m.embeds()?.size()?;
        if size.len() != 2 || size[1] != hidden || size[0] < 1 {
            return Err(Error::Input(format!("media[{i}]: soft tokens must be [rows >= 1, {hidden}], got {size:?}")));
        }
        let rows = size[0] as usize;
        if m.start < end {
            return Err(Error::Input(format!(
                "media[{i}] starts at {} inside the item before it (sorted, apart)",
                m.start
            )));
        }
        if m.start + rows > prompt.len() {
            return Err(Error::Input(format!(
                "media[{i}]: {rows} soft tokens at {} run past the prompt's {} tokens",
                m.start,
                prompt.len()
            )));
        }
        let run = &prompt[m.start..m.start + rows];
        if !placeholders.contains(&run[0]) || run.iter().any(|&id| id != run[0]) {
            return Err(Error::Input(format!(
                "media[{i}]: prompt positions {}..{} must all hold one media placeholder id {placeholders:?}",
                m.start,
                m.start + rows
            )));
        }
        covered[m.start..m.start + rows].iter_mut().for_each(|c| *c = true);
        end = m.start + rows;
    }
    if let Some(p) = prompt.iter().zip(&covered).position(|(id, c)| !c && placeholders.contains(id)) {
        return Err(Error::Input(format!(
            "the prompt holds media placeholder id {} at position {p} with no media there",
            prompt[p]
        )));
    }
    Ok(())
}

/// The id the prefix cache sees at offset `j` of media keyed `key` (module docs): negative.
fn keyed_id(key: u64, j: usize) -> i64 {
    let mixed = (key ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    -1 - (mixed >> 2) as i64
}

/// `prompt` as the prefix cache and the follower check see it (module docs).
pub fn keyed<'a>(prompt: &'a [i64], media: &[Media]) -> Cow<'a, [i64]> {
    if media.is_empty() {
        return Cow::Borrowed(prompt);
    }
    let mut ids = prompt.to_vec();
    for m in media {
        for (j, id) in ids.iter_mut().skip(m.start).take(m.rows()).enumerate() {
            *id = keyed_id(m.key, j);
        }
    }
    Cow::Owned(ids)
}

/// The prompt positions of item `m` inside `from..to`, as a range (empty when it lies outside).
fn overlap(m: &Media, from: usize, to: usize) -> std::ops::Range<usize> {
    m.start.max(from)..(m.start + m.rows()).min(to)
}

/// The soft tokens of prompt positions `from..to` of one row, placed at flat row `offset + (p - from)`:
/// (flat rows, their soft-token pieces).
fn pieces(media: &[Media], from: usize, to: usize, offset: i64) -> Result<(Vec<i64>, Vec<Tensor>)> {
    let (mut index, mut parts) = (Vec::new(), Vec::new());
    for m in media {
        let span = overlap(m, from, to);
        if span.is_empty() {
            continue;
        }
        parts.push(m.embeds()?.narrow(0, (span.start - m.start) as i64, span.len() as i64)?);
        index.extend(span.map(|p| offset + (p - from) as i64));
    }
    Ok((index, parts))
}

/// The block of each flat row of a forward of `total` rows (`Injection::blocks`), or None when no item
/// there is read both ways.
fn blocks(rows: &[(&[Media], usize, usize, i64)], total: usize) -> Result<Option<Vec<i64>>> {
    let mut out: Option<Vec<i64>> = None;
    for &(media, from, to, offset) in rows {
        for m in media.iter().filter(|m| m.both_ways) {
            let ids = out.get_or_insert_with(|| vec![-1; total]);
            for p in overlap(m, from, to) {
                ids[(offset + (p - from) as i64) as usize] = m.start as i64;
            }
        }
    }
    Ok(out)
}

/// One forward's injection from `(media, from, to, offset)` per row (the soft tokens of prompt positions
/// `from..to` of that row's media at flat rows `offset..`), the forward `[rows, t]`; None when no row has
/// media there. The media are device copies (`on_device`), already on `like`'s device in the model's dtype.
pub fn injection(rows: &[(&[Media], usize, usize, i64)], shape: [i64; 2], like: &Tensor) -> Result<Option<Injection>> {
    let (mut index, mut parts) = (Vec::new(), Vec::new());
    for &(media, from, to, offset) in rows {
        let (i, p) = pieces(media, from, to, offset)?;
        index.extend(i);
        parts.extend(p);
    }
    if index.is_empty() {
        return Ok(None);
    }
    let embeds = Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)?;
    let blocks = match blocks(rows, (shape[0] * shape[1]) as usize)? {
        Some(b) => Some(Tensor::from_i64(&b)?.to_like(like, DType::I64)?.reshape(&shape)?),
        None => None,
    };
    Ok(Some(Injection { index: Tensor::from_i64(&index)?.to_like(like, DType::I64)?, embeds, blocks }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(start: usize, rows: i64, key: u64) -> Media {
        Media::new(
            start,
            Tensor::full(&[rows, 4], key as f64, DType::F32, &Tensor::from_i64(&[0]).unwrap()).unwrap(),
            key,
        )
        .unwrap()
    }

    #[test]
    fn keyed_prompts_match_for_the_same_media_and_part_for_different_media() {
        let prompt = [2, 7, 9, 9, 9, 5];
        let a = keyed(&prompt, &[item(2, 3, 11)]);
        let b = keyed(&prompt, &[item(2, 3, 11)]);
        let c = keyed(&prompt, &[item(2, 3, 12)]);
        assert_eq!(a, b);
        assert_eq!(&a[..2], &prompt[..2]);
        assert!(a[2..5].iter().all(|&id| id < 0));
        assert_ne!(a[2], c[2]);
        assert_eq!(a[5], 5);
    }

    #[test]
    fn check_refuses_overlaps_misplaced_runs_and_stray_placeholders() {
        let prompt = [2, 9, 9, 3, 9, 9, 4];
        assert!(check(&[item(1, 2, 1), item(4, 2, 2)], &prompt, 4, &[9]).is_ok());
        let e = |m: &[Media]| check(m, &prompt, 4, &[9]).unwrap_err().to_string();
        assert!(e(&[item(1, 2, 1)]).contains("position 4 with no media"));
        assert!(e(&[item(1, 3, 1), item(4, 2, 2)]).contains("media[0]"));
        assert!(e(&[item(1, 2, 1), item(1, 2, 2)]).contains("inside the item before"));
        assert!(e(&[item(1, 2, 1), item(4, 4, 2)]).contains("run past"));
        assert!(check(&[item(1, 2, 1)], &prompt, 4, &[]).unwrap_err().to_string().contains("text only"));
    }

    #[test]
    fn chunks_never_cut_an_item_read_both_ways() {
        let mut media = [item(10, 5, 1), item(20, 3, 2)];
        assert_eq!(chunk_end(&media, 0, 12).unwrap(), 12);
        media[0].both_ways = true;
        assert_eq!(chunk_end(&media, 0, 12).unwrap(), 10);
        assert_eq!(chunk_end(&media, 10, 12).unwrap(), 15);
        assert_eq!(chunk_end(&media, 11, 14).unwrap(), 15);
        assert_eq!(chunk_end(&media, 15, 21).unwrap(), 21);
        let b = blocks(&[(&media[..], 8, 16, 0)], 8).unwrap().unwrap();
        assert_eq!(b, vec![-1, -1, 10, 10, 10, 10, 10, -1]);
    }

    #[test]
    fn device_copies_are_new_items_marked_by_placeholder() {
        let given = [item(1, 2, 1), item(4, 2, 2)];
        let like = Tensor::from_i64(&[0]).unwrap();
        let placed = on_device(&given, &[2, 9, 9, 3, 8, 8, 4], &[8], &like, DType::BF16).unwrap();
        assert_eq!(placed.iter().map(|m| m.both_ways).collect::<Vec<_>>(), vec![false, true]);
        assert_eq!((placed[1].start, placed[1].rows(), placed[1].key), (4, 2, 2));
        assert_eq!(placed[0].embeds().unwrap().to_vec_f32().unwrap(), vec![1.0; 8]);
    }

    #[test]
    fn a_chunk_takes_the_soft_tokens_it_overlaps_at_its_own_rows() {
        let media = [item(2, 3, 1), item(6, 2, 2)];
        let (index, parts) = pieces(&media, 3, 7, 10).unwrap();
        assert_eq!(index, vec![10, 11, 13]);
        assert_eq!(parts.iter().map(|p| p.size().unwrap()[0]).collect::<Vec<_>>(), vec![2, 1]);
    }
}
