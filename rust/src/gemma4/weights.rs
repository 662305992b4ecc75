//! The loader: memory-mapped safetensors (one file or shards with an index), dense bf16/f16/f32
//! tensors and compressed-tensors pack-quantized tensors, all returned dense in the compute
//! dtype on the `like` device, so the model code never asks whether a weight was quantized.
//!
//! Packing (compressed_tensors/compressors/pack_quantized/helpers.py, `pack_to_int32`): value i
//! of a row sits at bits `i*B .. i*B+B` of the row's little-endian int32 words, stored with an
//! offset of `2^(B-1)`. Dequantization (quantization/lifecycle/forward_helpers.py `_dequantize`)
//! is `q.to(scale.dtype) * scale`, with `scale` `[out, in/group_size]`; here both are first cast
//! to the compute dtype, as in `Gemma4ForCausalLM.from_pretrained(path, dtype=...)`, which loads
//! the stored (bfloat16) scales in `dtype` before compressed-tensors decompresses the weights.
//! Tensor names may carry `model.` (Gemma4ForCausalLM) or `model.language_model.`
//! (Gemma4ForConditionalGeneration); each checkpoint's prefix is detected once.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype as StDtype, Metadata, SafeTensors};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::gemma4::config::QuantSpec;
use crate::tensor::{DType, Tensor};

/// One safetensors file, mapped.
struct Shard {
    map: Mmap,
    data_start: usize,
    meta: Metadata,
}

/// One checkpoint directory.
pub struct Checkpoint {
    shards: Vec<Shard>,
    index: HashMap<String, usize>,
    prefix: &'static str,
    quant: Option<QuantSpec>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.display().to_string(), source }
}

fn open_shard(path: PathBuf) -> Result<Shard> {
    let file = File::open(&path).map_err(io(&path))?;
    let map = crate::ffi::map_readonly(&file).map_err(io(&path))?;
    let (n, meta) = SafeTensors::read_metadata(&map)
        .map_err(|e| Error::Format { path: path.display().to_string(), msg: format!("not a safetensors file: {e}") })?;
    Ok(Shard { map, data_start: 8 + n, meta })
}

impl Checkpoint {
    /// Open `dir`: model.safetensors.index.json with its shards, or every *.safetensors file.
    pub fn open(dir: &Path, quant: Option<QuantSpec>) -> Result<Checkpoint> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(io(&index_path))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| Error::Format { path: index_path.display().to_string(), msg: e.to_string() })?;
            let wm = v
                .get("weight_map")
                .and_then(|w| w.as_object())
                .ok_or_else(|| Error::Format { path: index_path.display().to_string(), msg: "no weight_map".into() })?;
            let mut names: Vec<&str> = wm.values().filter_map(|f| f.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            names.into_iter().map(|f| dir.join(f)).collect()
        } else {
            let mut fs: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(io(dir))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            fs.sort();
            fs
        };
        if files.is_empty() {
            return Err(Error::Format { path: dir.display().to_string(), msg: "no *.safetensors files".into() });
        }
        let shards = files.into_iter().map(open_shard).collect::<Result<Vec<_>>>()?;
        let mut index = HashMap::new();
        for (i, s) in shards.iter().enumerate() {
            for name in s.meta.tensors().keys() {
                index.insert(name.clone(), i);
            }
        }
        let prefix = if index.keys().any(|k| k.starts_with("model.language_model.")) {
            "model.language_model."
        } else {
            "model."
        };
        Ok(Checkpoint { shards, index, prefix, quant })
    }

    fn full_name(&self, name: &str) -> String {
        if name == "lm_head" { name.to_string() } else { format!("{}{name}", self.prefix) }
    }

    fn has(&self, full: &str) -> bool {
        self.index.contains_key(full)
    }

    /// Raw view: (dtype, shape, bytes).
    fn raw(&self, full: &str) -> Option<(StDtype, Vec<i64>, &[u8])> {
        let shard = &self.shards[*self.index.get(full)?];
        let info = shard.meta.info(full)?;
        let (a, b) = info.data_offsets;
        let bytes = shard.map.get(shard.data_start + a..shard.data_start + b)?;
        Some((info.dtype, info.shape.iter().map(|&d| d as i64).collect(), bytes))
    }

    /// A dense tensor as a host tensor in its stored dtype, checked against `shape`.
    fn dense(&self, full: &str, shape: &[i64]) -> Result<Tensor> {
        let (dtype, got, bytes) =
            self.raw(full).ok_or_else(|| Error::weight(full, format!("missing (expected shape {shape:?})")))?;
        if got != shape {
            return Err(Error::weight(full, format!("has shape {got:?}, expected {shape:?}")));
        }
        let dt = st_dtype(dtype).ok_or_else(|| Error::weight(full, format!("unsupported dtype {dtype:?}")))?;
        Tensor::from_bytes(bytes, shape, dt)
    }

    /// A `[rows, cols]` matrix named `name` (without `.weight`): dense `.weight`, or
    /// `.weight_packed` + `.weight_scale` + `.weight_shape`, dequantized on `like`'s device.
    fn matrix(&self, name: &str, rows: i64, cols: i64, like: &Tensor, dtype: DType) -> Result<Tensor> {
        let base = self.full_name(name);
        let dense = format!("{base}.weight");
        let packed = format!("{base}.weight_packed");
        if self.has(&dense) || !self.has(&packed) {
            return self.dense(&dense, &[rows, cols])?.to_like(like, dtype);
        }
        let q = self
            .quant
            .as_ref()
            .ok_or_else(|| Error::weight(&packed, "is pack-quantized but config.json has no quantization_config"))?;
        let bits = q.num_bits as i64;
        let words = (cols * bits + 31) / 32;
        let (pdt, pshape, pbytes) = self.raw(&packed).ok_or_else(|| Error::weight(&packed, "missing"))?;
        if pdt != StDtype::I32 || pshape != [rows, words] {
            return Err(Error::weight(&packed, format!("has {pdt:?} {pshape:?}, expected I32 {:?}", [rows, words])));
        }
        let shape_name = format!("{base}.weight_shape");
        let stored = self.dense(&shape_name, &[2])?.to_vec_i64()?;
        if stored != [rows, cols] {
            return Err(Error::weight(&shape_name, format!("says {stored:?}, expected {:?}", [rows, cols])));
        }
        let group = q.group_size.unwrap_or(cols);
        if cols % group != 0 {
            return Err(Error::weight(&packed, format!("{cols} columns do not divide into groups of {group}")));
        }
        let scale_name = format!("{base}.weight_scale");
        let scale_shape = [rows, cols / group];
        let (sdt, sshape, sbytes) = self
            .raw(&scale_name)
            .ok_or_else(|| Error::weight(&scale_name, format!("missing (expected shape {scale_shape:?})")))?;
        if sshape != scale_shape {
            return Err(Error::weight(&scale_name, format!("has shape {sshape:?}, expected {scale_shape:?}")));
        }
        let sdtype = st_dtype(sdt).ok_or_else(|| Error::weight(&scale_name, format!("unsupported dtype {sdt:?}")))?;
        let ints = unpack(pbytes, rows as usize, cols as usize, words as usize, q.num_bits);
        // Dequantize on the device in the compute dtype: a float32 engine multiplies in float32
        // (no bfloat16 rounding of the product), as Transformers' plain float32 load does.
        let qt = Tensor::from_bytes(&ints, &[rows, cols / group, group], DType::I8)?.to_like(like, dtype)?;
        let scale = Tensor::from_bytes(sbytes, &[rows, cols / group, 1], sdtype)?.to_like(like, dtype)?;
        qt.mul(&scale)?.reshape(&[rows, cols])
    }
}

/// Unpack `rows` rows of `words` little-endian u32 words into `cols` signed values each.
fn unpack(bytes: &[u8], rows: usize, cols: usize, words: usize, bits: u32) -> Vec<u8> {
    let offset = 1i32 << (bits - 1);
    let mask = (1u64 << bits) - 1;
    let mut out = vec![0u8; rows * cols];
    for r in 0..rows {
        let row = &bytes[r * words * 4..(r + 1) * words * 4];
        let word = |w: usize| -> u64 {
            if w < words {
                u32::from_le_bytes([row[4 * w], row[4 * w + 1], row[4 * w + 2], row[4 * w + 3]]) as u64
            } else {
                0
            }
        };
        let dst = &mut out[r * cols..(r + 1) * cols];
        for (i, d) in dst.iter_mut().enumerate() {
            let bit = i * bits as usize;
            let (w, o) = (bit / 32, bit % 32);
            // Two words cover any value that straddles a word boundary.
            let v = ((word(w) | (word(w + 1) << 32)) >> o) & mask;
            *d = ((v as i32 - offset) as i8) as u8;
        }
    }
    out
}

fn st_dtype(d: StDtype) -> Option<DType> {
    Some(match d {
        StDtype::BF16 => DType::BF16,
        StDtype::F16 => DType::F16,
        StDtype::F32 => DType::F32,
        StDtype::I64 => DType::I64,
        StDtype::I32 => DType::I32,
        StDtype::I8 => DType::I8,
        StDtype::U8 => DType::U8,
        _ => return None,
    })
}

/// Everything a `load` function needs: the checkpoint(s), the device and the compute dtype.
pub struct Weights {
    main: Checkpoint,
    /// Where `embed_tokens` and `embed_tokens_per_layer` come from when given (the "-emb4" twin).
    emb: Option<Checkpoint>,
    pub like: Tensor,
    pub dtype: DType,
}

impl Weights {
    pub fn new(main: Checkpoint, emb: Option<Checkpoint>, like: Tensor, dtype: DType) -> Weights {
        Weights { main, emb, like, dtype }
    }

    /// A linear layer's `[out, in]` weight (`name` without `.weight`).
    pub fn linear(&self, name: &str, out: i64, inp: i64) -> Result<Tensor> {
        self.main.matrix(name, out, inp, &self.like, self.dtype)
    }

    /// A vocabulary table, from the embeddings directory when it has one.
    pub fn embedding(&self, name: &str, rows: i64, cols: i64) -> Result<Tensor> {
        if let Some(emb) = &self.emb {
            let base = emb.full_name(name);
            if emb.has(&format!("{base}.weight")) || emb.has(&format!("{base}.weight_packed")) {
                return emb.matrix(name, rows, cols, &self.like, self.dtype);
            }
        }
        self.main.matrix(name, rows, cols, &self.like, self.dtype)
    }

    /// A norm weight or other small vector, in `dtype`.
    pub fn vector(&self, name: &str, shape: &[i64], dtype: DType) -> Result<Tensor> {
        self.main.dense(&self.main.full_name(name), shape)?.to_like(&self.like, dtype)
    }
}

/// Quantization spec of an embeddings directory: its own config.json when it has one.
pub fn emb_quant(dir: &Path, fallback: Option<QuantSpec>) -> Result<Option<QuantSpec>> {
    let path = dir.join("config.json");
    if !path.exists() {
        return Ok(fallback);
    }
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| Error::Format { path: path.display().to_string(), msg: e.to_string() })?;
    if v.get("quantization_config").is_none() {
        return Ok(fallback);
    }
    crate::gemma4::config::Config::quant_only(&v).map(|q| q.or(fallback))
}

#[cfg(test)]
mod tests {
    use super::unpack;

    #[test]
    fn unpacks_int4_little_endian_nibbles() {
        // Values -8..7 stored as v+8, element i in bits 4i..4i+4 of the word.
        let vals: Vec<i8> = vec![-8, -5, -2, 1, 4, 7, 0, -1];
        let mut w = 0u32;
        for (i, v) in vals.iter().enumerate() {
            w |= ((*v as i32 + 8) as u32) << (4 * i);
        }
        let got = unpack(&w.to_le_bytes(), 1, 8, 1, 4);
        assert_eq!(got.iter().map(|b| *b as i8).collect::<Vec<_>>(), vals);
    }
}
