//! The loader: memory-mapped safetensors (one file or shards with an index), dense bf16/f16/f32
//! tensors and compressed-tensors pack-quantized tensors. Linear weights come back as a `Linear`:
//! dense in the compute dtype, or (int4, `Int4Path::Packed`) kept packed for ATen's int4 matmul;
//! everything else comes back dense in the compute dtype on the `like` device.
//!
//! Packing (compressed_tensors/compressors/pack_quantized/helpers.py, `pack_to_int32`): value i
//! of a row sits at bits `i*B .. i*B+B` of the row's little-endian int32 words, stored with an
//! offset of `2^(B-1)`. Dequantization (quantization/lifecycle/forward_helpers.py `_dequantize`)
//! is `q.to(scale.dtype) * scale`, with `scale` `[out, in/group_size]`; here both are first cast
//! to the compute dtype, as in `Gemma4ForCausalLM.from_pretrained(path, dtype=...)`, which loads
//! the stored (bfloat16) scales in `dtype` before compressed-tensors decompresses the weights.
//! Tensor names may carry `model.` (Gemma4ForCausalLM) or `model.language_model.`
//! (Gemma4ForConditionalGeneration); each checkpoint's prefix is detected once.

use std::cell::Cell;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype as StDtype, Metadata, SafeTensors};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::gemma4::config::{Config, QuantSpec, read_json};
use crate::gemma4::linear::Linear;
use crate::tensor::{DType, Tensor};

/// One safetensors file, mapped.
struct Shard {
    map: Mmap,
    data_start: usize,
    meta: Metadata,
}

/// Modules named from the checkpoint's root rather than under the text model's prefix: the LM head, and an
/// assistant drafter's projections and masked embedder (Transformers 5.18
/// `models/gemma4_assistant/modeling_gemma4_assistant.py`, `Gemma4AssistantForCausalLM`).
const ROOT_MODULES: [&str; 4] = ["lm_head", "pre_projection", "post_projection", "masked_embedding"];

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

    /// Add what this checkpoint's text-model tensors take once loaded in `dtype` to `into` (`WeightsEstimate`):
    /// dense tensors in `dtype`; int4 ones at half a byte a value plus their scales when kept packed, else in
    /// `dtype`. `skip` leaves out tensors whose name contains it (tables another directory replaces).
    fn estimate(&self, dtype: DType, int4_packed: bool, skip: Option<&str>, into: &mut WeightsEstimate) {
        let bits = self.quant.as_ref().map_or(4, |q| q.num_bits as i64);
        for name in self.index.keys() {
            let text_model = name.starts_with(self.prefix) || name.starts_with("lm_head.");
            if !text_model || skip.is_some_and(|s| name.contains(s)) || name.ends_with(".weight_shape") {
                continue;
            }
            let Some((_, shape, _)) = self.raw(name) else { continue };
            let numel: i64 = shape.iter().product();
            let bytes = if name.ends_with(".weight_packed") {
                let values = numel * 32 / bits;
                if int4_packed { values / 2 } else { values * dtype.size() }
            } else if name.ends_with(".weight_scale") {
                if int4_packed { numel * 4 } else { 0 } // bfloat16 scales and zeros (`pack_int4`)
            } else {
                numel * dtype.size()
            };
            let split =
                [".self_attn.", ".mlp.", ".experts."].iter().any(|p| name.contains(p)) || name.starts_with("lm_head.");
            if split { into.split += bytes } else { into.whole += bytes }
        }
    }

    fn full_name(&self, name: &str) -> String {
        let root = ROOT_MODULES
            .iter()
            .any(|r| name.strip_prefix(r).is_some_and(|rest| rest.is_empty() || rest.starts_with('.')));
        if root { name.to_string() } else { format!("{}{name}", self.prefix) }
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

    /// A `[rows, cols]` matrix named `name` (without `.weight`) as stored: dense `.weight`, or
    /// `.weight_packed` + `.weight_scale` + `.weight_shape` unpacked on the host.
    fn part(&self, name: &str, rows: i64, cols: i64) -> Result<Part> {
        let base = self.full_name(name);
        let dense = format!("{base}.weight");
        let packed = format!("{base}.weight_packed");
        if self.has(&dense) || !self.has(&packed) {
            return Ok(Part::Dense(self.dense(&dense, &[rows, cols])?));
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
        Ok(Part::Quant {
            values: unpack(pbytes, rows as usize, cols as usize, words as usize, q.num_bits),
            scales: Tensor::from_bytes(sbytes, &scale_shape, sdtype)?,
            bits: q.num_bits,
            rows,
            cols,
            group,
        })
    }

    /// `part` dense in `dtype` on `like`'s device.
    fn matrix(&self, name: &str, rows: i64, cols: i64, like: &Tensor, dtype: DType) -> Result<Tensor> {
        self.part(name, rows, cols)?.dense(like, dtype)
    }
}

/// What a checkpoint's weights will take on the device, in bytes, before any is loaded: `split` the parts
/// tensor parallelism divides (attention, MLP, experts, an untied lm_head), `whole` the rest, which the
/// first device keeps whole (embeddings, per-layer inputs, norms, routers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightsEstimate {
    pub whole: i64,
    pub split: i64,
}

/// Which part of a checkpoint's `[out, in]` matrix a tensor-parallel shard loads (gemma4/parallel.rs):
/// all of it, the output rows `start..start + len` (column-parallel) or the input columns
/// (row-parallel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slice {
    All,
    Rows(i64, i64),
    Cols(i64, i64),
}

/// A matrix as the checkpoint stores it, on the host.
enum Part {
    Dense(Tensor),
    /// Signed values (`unpack`) and their per-group scales `[rows, cols / group]` in the stored dtype.
    Quant {
        values: Vec<u8>,
        scales: Tensor,
        bits: u32,
        rows: i64,
        cols: i64,
        group: i64,
    },
}

impl Part {
    /// The part a tensor-parallel shard holds (`Slice`), copied out of the whole so the rest is freed.
    fn slice(self, slice: Slice) -> Result<Part> {
        match (self, slice) {
            (part, Slice::All) => Ok(part),
            (Part::Dense(t), Slice::Rows(start, len)) => Ok(Part::Dense(t.narrow(0, start, len)?.copy()?)),
            (Part::Dense(t), Slice::Cols(start, len)) => Ok(Part::Dense(t.narrow(1, start, len)?.copy()?)),
            (Part::Quant { values, scales, bits, cols, group, .. }, Slice::Rows(start, len)) => Ok(Part::Quant {
                values: values[(start * cols) as usize..((start + len) * cols) as usize].to_vec(),
                scales: scales.narrow(0, start, len)?.copy()?,
                bits,
                rows: len,
                cols,
                group,
            }),
            (part @ Part::Quant { group, .. }, Slice::Cols(start, len)) if start % group != 0 || len % group != 0 => {
                // The shard's columns cut a scale group (a 26B-A4B MLP's 2112 inputs over 8 shards, in groups of
                // 128): the part is dequantized on the host first, in float32, where `q * scale` is exact, so
                // the compute dtype rounds it once, as it does a dequantized part.
                let host = Tensor::from_f32(&[0.0], &[1])?;
                Part::Dense(part.dense(&host, DType::F32)?).slice(slice)
            }
            (Part::Quant { values, scales, bits, rows, cols, group }, Slice::Cols(start, len)) => {
                let values = (0..rows as usize)
                    .flat_map(|r| {
                        &values[r * cols as usize + start as usize..r * cols as usize + (start + len) as usize]
                    })
                    .copied()
                    .collect();
                let scales = scales.narrow(1, start / group, len / group)?.copy()?;
                Ok(Part::Quant { values, scales, bits, rows, cols: len, group })
            }
        }
    }

    /// Dense in `dtype` on `like`'s device. Quantized values are dequantized there in the compute
    /// dtype: a float32 engine multiplies in float32 (no bfloat16 rounding of the product), as
    /// Transformers' plain float32 load does.
    fn dense(self, like: &Tensor, dtype: DType) -> Result<Tensor> {
        match self {
            Part::Dense(t) => t.to_like(like, dtype),
            Part::Quant { values, scales, rows, cols, group, .. } => {
                let qt = Tensor::from_bytes(&values, &[rows, cols / group, group], DType::I8)?.to_like(like, dtype)?;
                let scale = scales.reshape(&[rows, cols / group, 1])?.to_like(like, dtype)?;
                qt.mul(&scale)?.reshape(&[rows, cols])
            }
        }
    }
}

/// The group sizes ATen's int4 matmul kernels take (`_weight_int4pack_mm`, `_weight_int4pack_mm_for_cpu`).
const INT4_GROUPS: [i64; 4] = [32, 64, 128, 256];

/// Several int4 parts stacked by rows, packed for ATen's int4 matmul on `like`'s device, or None
/// when they do not fit its layout (another bit width or group size, a width it cannot tile).
fn pack_int4(parts: &[Part], like: &Tensor) -> Result<Option<Linear>> {
    let mut values: Vec<u8> = Vec::new();
    let mut scales: Vec<&Tensor> = Vec::new();
    let (mut rows, mut shape) = (0, None);
    for p in parts {
        let Part::Quant { values: v, scales: s, bits: 4, rows: r, cols, group } = p else { return Ok(None) };
        if shape.is_some_and(|x| x != (*cols, *group)) || !INT4_GROUPS.contains(group) {
            return Ok(None);
        }
        shape = Some((*cols, *group));
        values.extend_from_slice(v);
        scales.push(s);
        rows += r;
    }
    let Some((cols, group)) = shape else { return Ok(None) };
    // The kernels tile `in` by 16 * inner_k_tiles and `out` by 16 (the CPU packer's rule; CUDA's is 8).
    let Some(tiles) = [8, 4, 2].into_iter().find(|k| cols % (16 * k) == 0) else { return Ok(None) };
    if rows % 16 != 0 {
        return Ok(None);
    }
    // The kernels store v + 8 in 0..15 and dequantize (u - 8) * scale + zero; the checkpoint's
    // symmetric groups have zero 0.
    let stored: Vec<u8> = values.iter().flat_map(|v| ((*v as i8 as i32) + 8).to_ne_bytes()).collect();
    let packed = Tensor::from_bytes(&stored, &[rows, cols], DType::I32)?.int4_pack(tiles, like)?;
    let s = Tensor::cat(&scales, 0)?.to_dtype(DType::BF16)?.transpose(0, 1)?.unsqueeze(2)?; // [in/group, out, 1]
    let z = Tensor::full(&[cols / group, rows, 1], 0.0, DType::BF16, &s)?;
    let scales_zeros = Tensor::cat(&[&s, &z], 2)?.to_like(like, DType::BF16)?;
    Ok(Some(Linear::Int4 { packed, scales_zeros, group }))
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

/// How W4A16 (int4) linear weights reach the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int4Path {
    /// Kept packed and multiplied by ATen's int4 kernels (bfloat16 activations).
    Packed,
    /// Dequantized to the compute dtype at load (any device, any dtype).
    Dequantized,
}

/// The kernels a caller asks for (`gemma_engine.Engine(packed_int4=, onednn=)`): Some(true) requires
/// one, Some(false) refuses it, None lets the loader choose where it can run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Kernels {
    /// Keep int4 weights packed (`Int4Path::Packed`): Some(true) requires it; None keeps them packed
    /// where ATen has int4 kernels (CPU, CUDA) and the compute dtype is bfloat16, which they take, and
    /// dequantizes elsewhere; Some(false) dequantizes at load, as Transformers does (the kernels round
    /// differently from the dequantized product, enough to change tokens of a small random model).
    pub packed_int4: Option<bool>,
    /// Multiply dense weights with oneDNN (linear.rs): Some(true) requires it (CPU, float32 or
    /// bfloat16, a torch with oneDNN, and for bfloat16 a CPU its oneDNN computes bfloat16 on); None
    /// uses it where it can; Some(false) uses ATen's matmul.
    pub onednn: Option<bool>,
}

impl Kernels {
    /// Whether dense weights go through oneDNN in `dtype` on `device` (ATen's device string).
    pub fn onednn(&self, dtype: DType, device: &str) -> Result<bool> {
        match (self.onednn, onednn_why_not(dtype, device)) {
            (Some(false), _) | (None, Some(_)) => Ok(false),
            (_, None) => Ok(true),
            (Some(true), Some(why)) => Err(Error::Input(why)),
        }
    }

    /// Why dense weights are not multiplied by oneDNN: None where they are; Some(false) asked for;
    /// else why oneDNN cannot run them (a line `weights()` reports).
    pub fn onednn_note(&self, dtype: DType, device: &str) -> Option<String> {
        match self.onednn {
            Some(false) => Some("ATen's matmul, as asked (onednn=False)".into()),
            _ => onednn_why_not(dtype, device),
        }
    }

    /// How int4 weights reach `device` (ATen's device string) in `dtype`.
    pub fn int4_path(&self, dtype: DType, device: &str) -> Result<Int4Path> {
        let kernels = device.starts_with("cpu") || device.starts_with("cuda");
        match self.packed_int4 {
            Some(false) => Ok(Int4Path::Dequantized),
            None if dtype == DType::BF16 && kernels => Ok(Int4Path::Packed),
            None => Ok(Int4Path::Dequantized),
            Some(true) if dtype != DType::BF16 => Err(Error::Input(format!(
                "packed int4 weights compute in bfloat16 (ATen's int4 kernels take bfloat16 activations); dtype is {}",
                dtype.name()
            ))),
            Some(true) if !kernels => Err(Error::Input(format!(
                "packed int4 weights need ATen's int4 kernels (CPU or CUDA); the device is {device}"
            ))),
            Some(true) => Ok(Int4Path::Packed),
        }
    }
}

/// Why oneDNN cannot multiply dense weights in `dtype` on `device`, or None where it can.
fn onednn_why_not(dtype: DType, device: &str) -> Option<String> {
    if !device.starts_with("cpu") {
        Some(format!("oneDNN linears run on the CPU; the device is {device}"))
    } else if dtype != DType::F32 && dtype != DType::BF16 {
        Some(format!("oneDNN linears compute in float32 or bfloat16; dtype is {}", dtype.name()))
    } else if !Tensor::has_onednn() {
        Some("this torch was built without oneDNN (torch.backends.mkldnn.is_available() is False)".into())
    } else if dtype == DType::BF16 && !Tensor::has_onednn_bf16() {
        Some(
            "this CPU has no bfloat16 support in oneDNN (torch.ops.mkldnn._is_mkldnn_bf16_supported() is \
              False): bfloat16 linears run on ATen's matmul"
                .into(),
        )
    } else {
        None
    }
}

/// What the loader put on the device.
#[derive(Clone, Copy, Debug, Default)]
pub struct Loaded {
    /// Bytes of every weight on the device (packed int4 weights at their packed size).
    pub bytes: i64,
    /// Quantized linears kept packed, and dequantized.
    pub packed: usize,
    pub dequantized: usize,
    /// Dense linears go through oneDNN.
    pub onednn: bool,
}

/// Everything a `load` function needs: the checkpoint(s), the device and the compute dtype.
pub struct Weights {
    main: Checkpoint,
    /// Where `embed_tokens` and `embed_tokens_per_layer` come from when given (the "-emb4" twin).
    emb: Option<Checkpoint>,
    pub like: Tensor,
    pub dtype: DType,
    int4: Int4Path,
    /// Dense linears in oneDNN's packed layout (linear.rs).
    onednn: bool,
    loaded: Cell<Loaded>,
}

impl Weights {
    /// Open `model_dir` (and the int4 tables of `emb_dir`) for loading onto `like`'s device in
    /// `dtype`, with the kernels `kernels` asks for where they can run.
    pub fn open(
        model_dir: &Path,
        emb_dir: Option<&Path>,
        quant: Option<QuantSpec>,
        like: Tensor,
        dtype: DType,
        kernels: Kernels,
    ) -> Result<Weights> {
        let main = Checkpoint::open(model_dir, quant.clone())?;
        let emb = match emb_dir {
            Some(d) => Some(Checkpoint::open(d, emb_quant(d, quant)?)?),
            None => None,
        };
        let device = like.device()?;
        let (int4, onednn) = (kernels.int4_path(dtype, &device)?, kernels.onednn(dtype, &device)?);
        Ok(Weights::new(main, emb, like, dtype, int4, onednn))
    }

    /// Open `model_dir` for the media towers (gemma4/media.rs): names relative to `model.` (the
    /// Gemma4ForConditionalGeneration layout: `vision_tower.*`, `embed_vision.*`, ...), dense ATen
    /// linears in `dtype`, int4 weights dequantized at load.
    pub fn open_media(model_dir: &Path, quant: Option<QuantSpec>, like: Tensor, dtype: DType) -> Result<Weights> {
        let mut main = Checkpoint::open(model_dir, quant)?;
        main.prefix = "model.";
        Ok(Weights::new(main, None, like, dtype, Int4Path::Dequantized, false))
    }

    fn new(
        main: Checkpoint,
        emb: Option<Checkpoint>,
        like: Tensor,
        dtype: DType,
        int4: Int4Path,
        onednn: bool,
    ) -> Weights {
        let loaded = Cell::new(Loaded { onednn, ..Loaded::default() });
        Weights { main, emb, like, dtype, int4, onednn, loaded }
    }

    /// Whether the model may fold a constant into a neighbouring op (a norm's weight, an eps, a
    /// table) where the reference multiplies separately: the same value rounded in another order.
    /// Only in float32, where that moves the last bit; in 16-bit dtypes every op keeps the
    /// reference's rounding.
    pub fn folds(&self) -> bool {
        self.dtype == DType::F32
    }

    pub fn loaded(&self) -> Loaded {
        self.loaded.get()
    }

    /// What loading the model will put on the devices (`WeightsEstimate`), read from the files' headers.
    pub fn estimate(&self) -> WeightsEstimate {
        let mut e = WeightsEstimate::default();
        let packed = self.int4 == Int4Path::Packed;
        let tables = "embed_tokens";
        self.main.estimate(self.dtype, packed, self.emb.as_ref().map(|_| tables), &mut e);
        if let Some(emb) = &self.emb {
            emb.estimate(self.dtype, packed, None, &mut e);
        }
        e
    }

    /// Count `tensors`' bytes as loaded, and what `also` adds.
    fn count(&self, tensors: &[&Tensor], also: impl FnOnce(&mut Loaded)) -> Result<()> {
        let mut l = self.loaded.get();
        for t in tensors {
            l.bytes += t.nbytes()?;
        }
        also(&mut l);
        self.loaded.set(l);
        Ok(())
    }

    /// A linear layer's `[out, in]` weight (`name` without `.weight`).
    pub fn linear(&self, name: &str, out: i64, inp: i64) -> Result<Linear> {
        self.fused(&[(name, out)], inp)
    }

    /// Several linears over the same input as one, their outputs side by side in the order given
    /// (`(name, out)` pairs): one matrix product where the model has several.
    pub fn fused(&self, parts: &[(&str, i64)], inp: i64) -> Result<Linear> {
        let whole: Vec<_> = parts.iter().map(|&(n, out)| (n, out, Slice::All)).collect();
        self.fused_slices(&whole, inp)
    }

    /// A shard's part of a linear (`Slice`), `out` and `inp` the checkpoint's whole sizes.
    pub fn linear_slice(&self, name: &str, out: i64, inp: i64, slice: Slice) -> Result<Linear> {
        self.fused_slices(&[(name, out, slice)], inp)
    }

    /// `fused` over a shard's parts: `(name, whole out, slice)`, `inp` the whole input width.
    pub fn fused_slices(&self, parts: &[(&str, i64, Slice)], inp: i64) -> Result<Linear> {
        let parts = parts
            .iter()
            .map(|&(n, out, slice)| self.main.part(n, out, inp)?.slice(slice))
            .collect::<Result<Vec<_>>>()?;
        let quantized = parts.iter().any(|p| matches!(p, Part::Quant { .. }));
        let packed = if quantized && self.int4 == Int4Path::Packed { pack_int4(&parts, &self.like)? } else { None };
        let linear = match packed {
            Some(linear) => linear,
            None => {
                let dense = parts.into_iter().map(|p| p.dense(&self.like, self.dtype)).collect::<Result<Vec<_>>>()?;
                self.dense_linear(match &dense[..] {
                    [one] => one.shallow_clone()?,
                    many => Tensor::cat(&many.iter().collect::<Vec<_>>(), 0)?,
                })?
            }
        };
        let packed = matches!(linear, Linear::Int4 { .. });
        self.count(&linear.tensors(), |l| match (packed, quantized) {
            (true, _) => l.packed += 1,
            (false, true) => l.dequantized += 1,
            (false, false) => {}
        })?;
        Ok(linear)
    }

    /// The linear of a dense `[out, in]` weight on the device: packed for oneDNN when the engine
    /// uses it (linear.rs). Not counted as loaded (`fused` counts what it makes).
    fn dense_linear(&self, w: Tensor) -> Result<Linear> {
        Ok(if self.onednn { Linear::OneDnn(w.onednn_pack()?) } else { Linear::Dense(w) })
    }

    /// A linear over a table already loaded (the tied lm_head over `embed_tokens`): the table itself,
    /// or its oneDNN copy, which is counted as loaded.
    pub fn table_linear(&self, table: &Tensor) -> Result<Linear> {
        let linear = self.dense_linear(table.shallow_clone()?)?;
        if self.onednn {
            self.count(&linear.tensors(), |_| {})?;
        }
        Ok(linear)
    }

    /// A vocabulary table, from the embeddings directory when it has one.
    pub fn embedding(&self, name: &str, rows: i64, cols: i64) -> Result<Tensor> {
        let in_emb = |emb: &Checkpoint| {
            let base = emb.full_name(name);
            emb.has(&format!("{base}.weight")) || emb.has(&format!("{base}.weight_packed"))
        };
        let from = self.emb.as_ref().filter(|emb| in_emb(emb)).unwrap_or(&self.main);
        let t = from.matrix(name, rows, cols, &self.like, self.dtype)?;
        self.count(&[&t], |_| {})?;
        Ok(t)
    }

    /// A norm weight or other small vector, in `dtype`.
    pub fn vector(&self, name: &str, shape: &[i64], dtype: DType) -> Result<Tensor> {
        self.dense_part(name, shape, dtype, |t| t.shallow_clone())
    }

    /// A dense tensor of `shape` (the experts' 3D weights), `pick` applied on the host before it moves
    /// to the device in `dtype` (a tensor-parallel shard's part of it, copied out of the whole).
    pub fn dense_part(
        &self,
        name: &str,
        shape: &[i64],
        dtype: DType,
        pick: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let t = pick(&self.main.dense(&self.main.full_name(name), shape)?)?.to_like(&self.like, dtype)?;
        self.count(&[&t], |_| {})?;
        Ok(t)
    }
}

/// Quantization spec of an embeddings directory: its own config.json when it has one.
pub fn emb_quant(dir: &Path, fallback: Option<QuantSpec>) -> Result<Option<QuantSpec>> {
    let path = dir.join("config.json");
    if !path.exists() {
        return Ok(fallback);
    }
    Config::quant_only(&read_json(&path)?).map(|q| q.or(fallback))
}

#[cfg(test)]
mod tests {
    use super::{Int4Path, Kernels, unpack};
    use crate::tensor::DType;

    #[test]
    fn int4_stays_packed_by_default_where_the_kernels_run_in_bfloat16() {
        let auto = Kernels::default();
        assert_eq!(auto.int4_path(DType::BF16, "cpu").unwrap(), Int4Path::Packed);
        assert_eq!(auto.int4_path(DType::BF16, "cuda:0").unwrap(), Int4Path::Packed);
        assert_eq!(auto.int4_path(DType::F32, "cpu").unwrap(), Int4Path::Dequantized);
        assert_eq!(auto.int4_path(DType::BF16, "tpu:0").unwrap(), Int4Path::Dequantized);
        let off = Kernels { packed_int4: Some(false), ..Kernels::default() };
        assert_eq!(off.int4_path(DType::BF16, "cpu").unwrap(), Int4Path::Dequantized);
        let on = Kernels { packed_int4: Some(true), ..Kernels::default() };
        assert!(on.int4_path(DType::F32, "cpu").is_err() && on.int4_path(DType::BF16, "tpu:0").is_err());
    }

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
