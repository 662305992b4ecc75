//! The engine's memory check: before the weights are loaded, what they will take on the first device against
//! what it has free; after, the KV cache against what is left. A model that cannot fit is a ValueError naming
//! the sizes and what to change, not an allocator's failure halfway through a load.

use crate::error::{Error, Result};
use crate::gemma4::cache::CacheSize;
use crate::gemma4::weights::WeightsEstimate;

fn mib(b: i64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// Refuse weights that cannot fit in `free` bytes of the device, where a rank of `shards` tensor-parallel
/// ranks puts the whole parts and its share of the split ones.
pub fn check_weights(w: &WeightsEstimate, shards: i64, free: Option<i64>) -> Result<()> {
    let Some(free) = free else { return Ok(()) };
    let split = w.split / shards;
    let need = w.whole + split;
    if need <= free {
        return Ok(());
    }
    Err(Error::Input(format!(
        "the weights need about {:.1} MiB on this device ({:.1} MiB of attention, MLP, experts and lm_head{}, \
         {:.1} MiB kept whole: the embeddings, per-layer inputs, norms and routers), but it has {:.1} MiB free; \
         split the model over more devices (tensor_parallel_size), load a W4A16 checkpoint, or use a device \
         with more memory",
        mib(need),
        mib(split),
        if shards == 1 { String::new() } else { format!(", its share over {shards} devices") },
        mib(w.whole),
        mib(free)
    )))
}

/// Refuse a KV cache that does not fit in what the device has free after the weights.
pub fn check_cache(size: &CacheSize, context: i64, free: Option<i64>) -> Result<()> {
    let Some(free) = free else { return Ok(()) };
    if size.total() <= free {
        return Ok(());
    }
    Err(Error::Input(format!(
        "max_batch {} x context {context} needs a KV cache of {:.1} MiB ({:.2} MiB per slot, of which {:.2} MiB \
         are the prefix cache's snapshots of the sliding rings), but the device has {:.1} MiB free after the \
         weights; lower max_batch or context, turn prefix caching off, or split the model over more devices \
         (tensor_parallel_size)",
        size.max_batch,
        mib(size.total()),
        mib(size.bytes_per_slot),
        mib(size.snapshot_bytes_per_slot),
        mib(free)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_over_the_free_memory_are_refused_naming_both() {
        let w = WeightsEstimate { whole: 100 << 20, split: 400 << 20 };
        assert!(check_weights(&w, 1, None).is_ok());
        assert!(check_weights(&w, 1, Some(500 << 20)).is_ok());
        let err = check_weights(&w, 1, Some(499 << 20)).unwrap_err().to_string();
        assert!(err.contains("500.0 MiB") && err.contains("499.0 MiB free") && err.contains("tensor_parallel_size"));
        // A rank of 4 holds the whole parts and a quarter of the rest.
        assert!(check_weights(&w, 4, Some(200 << 20)).is_ok());
        assert!(check_weights(&w, 4, Some(199 << 20)).is_err());
    }
}
