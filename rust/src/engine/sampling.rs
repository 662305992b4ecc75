//! Choosing the next token of every slot on the device: logit bias, penalties, temperature,
//! top-k, top-p, min-p, a seeded draw, and log-probabilities.
//!
//! The processors follow Transformers 5.18 `generation/logits_process.py` exactly, in the order
//! `GenerationMixin._get_logits_processor` applies them: `SequenceBiasLogitsProcessor` (OpenAI's
//! `logit_bias`), `RepetitionPenaltyLogitsProcessor` (over prompt and output tokens), then OpenAI's
//! presence and frequency penalties over output tokens (which Transformers does not have; vLLM's
//! `apply_penalties` puts them beside the repetition penalty), then the warpers
//! `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`. One stable
//! ascending sort serves all three filters: top-k and top-p only mask entries at the low end of the
//! sorted row, so the order stays sorted after each, and min-p's "top probability" is the last entry.
//!
//! The draw is an inverse-CDF draw in sorted order with one uniform number per row. That number is
//! a pure function of the request's seed and the index of the token being drawn (splitmix64,
//! Steele, Lea and Flood, "Fast Splittable Pseudorandom Number Generators", OOPSLA 2014), computed
//! with int64 tensor ops on the device. So a seeded request draws the same tokens whatever else is
//! in the batch, in whatever order requests arrived, and whatever `read_every` or `prefill_chunk`
//! are: there is no shared generator whose state other requests advance.
//!
//! A grammar-constrained row (engine/grammar.rs) first has every token its grammar does not allow
//! set to -inf, before every other stage, so the bias, the penalties, the filters, the draw, the
//! argmax and the log-probabilities all see the constrained distribution. The host writes the
//! allowed sets bit-packed into `mask_host` (`[slots, ceil(vocab / 8)]` bytes, bit `i % 8` of byte
//! `i / 8`: llguidance's own layout) and `upload_masks` copies the rows of one step to the device
//! buffer of the same shape in one copy; the device unpacks them by looking each byte up in a
//! constant float32 `[256, 8]` table whose entry (b, k) is -0.0 where bit k of b is set and -inf where
//! it is not, and adds the result to the logits (`allowed`). Adding -0.0 returns every float as it
//! is (IEEE 754: x + -0 = x, zeros' signs included), so an unconstrained row, whose bytes are all ones,
//! keeps its logits bit for bit; a step with no constrained row skips the stage (`Stages::grammar`).
//! An add, not `where(allowed, logits, -inf)`: the same result, and on the CPU ATen's `where` with a
//! bool mask took 8-9 ms over `[8, 262144]` on one thread against 2.4 ms for the lookup and the add.
//! The buffer is 1/8 byte a token a slot: 32 KiB a slot at Gemma 4's 262,144 tokens.
//!
//! Rows with temperature 0 take the argmax of the processed logits (greedy). Log-probabilities are
//! those of the model's own distribution (`log_softmax` of the raw logits), as vLLM reports them by
//! default.

use crate::engine::request::LIMITS;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// One request's sampling parameters. Neutral values disable a stage: temperature 0 is greedy,
/// top_k 0 keeps every token, top_p 1 and min_p 0 filter nothing, penalties 0 (or 1 for the
/// repetition penalty) change nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f64,
    pub top_k: i64,
    pub top_p: f64,
    pub min_p: f64,
    pub seed: i64,
    pub presence_penalty: f64,
    pub frequency_penalty: f64,
    pub repetition_penalty: f64,
    /// (token id, bias added to its logit).
    pub logit_bias: Vec<(i64, f64)>,
    /// None: no log-probabilities; Some(k): the chosen token's and the k most likely
    /// (0..=`LIMITS.max_top_logprobs`).
    pub logprobs: Option<i64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            logprobs: None,
        }
    }
}

fn finite(name: &str, v: f64) -> Result<()> {
    if v.is_finite() { Ok(()) } else { Err(Error::Input(format!("{name} must be a finite number, got {v}"))) }
}

/// The smallest positive temperature and repetition penalty: the sampler divides float32 logits by
/// them, and a smaller divisor takes a logit (at most the softcap, 30 for Gemma 4) past float32's range:
/// inf, then NaN probabilities, which a grammar's mask cannot survive (5e-324 is even 0 in float32).
pub const MIN_DIVISOR: f64 = 1e-30;

impl SamplingParams {
    /// Check every field; the error names the field.
    pub fn check(&self, vocab: i64) -> Result<()> {
        for (name, v) in [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
            ("repetition_penalty", self.repetition_penalty),
        ] {
            finite(name, v)?;
        }
        if self.temperature < 0.0 || (self.temperature > 0.0 && self.temperature < MIN_DIVISOR) {
            return Err(Error::Input(format!(
                "temperature must be 0 or at least {MIN_DIVISOR:e}, got {}",
                self.temperature
            )));
        }
        if self.top_k < 0 {
            return Err(Error::Input(format!("top_k must be >= 0 (0 keeps every token), got {}", self.top_k)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Input(format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::Input(format!("min_p must be in [0, 1], got {}", self.min_p)));
        }
        if self.repetition_penalty < MIN_DIVISOR {
            return Err(Error::Input(format!(
                "repetition_penalty must be at least {MIN_DIVISOR:e}, got {}",
                self.repetition_penalty
            )));
        }
        let max_bias = LIMITS.max_logit_bias;
        if self.logit_bias.len() > max_bias {
            return Err(Error::Input(format!(
                "logit_bias holds at most {max_bias} entries (max_logit_bias), got {}",
                self.logit_bias.len()
            )));
        }
        for &(id, bias) in &self.logit_bias {
            if id < 0 || id >= vocab {
                return Err(Error::Input(format!("logit_bias: token id {id} is outside the vocabulary [0, {vocab})")));
            }
            finite("logit_bias value", bias)?;
        }
        let max_top = LIMITS.max_top_logprobs;
        if let Some(k) = self.logprobs.filter(|k| !(0..=max_top).contains(k)) {
            return Err(Error::Input(format!("top_logprobs must be in [0, {max_top}] (max_top_logprobs), got {k}")));
        }
        Ok(())
    }

    fn flags(&self) -> Stages {
        Stages {
            bias: !self.logit_bias.is_empty(),
            repetition: self.repetition_penalty != 1.0,
            presence_frequency: self.presence_penalty != 0.0 || self.frequency_penalty != 0.0,
            draw: self.temperature > 0.0,
            // Every request asking for log-probabilities gets the top `max_top_logprobs` computed, each row
            // keeping its own first k (read_point.rs): one step shape for every top_logprobs, so a compiled
            // engine captures one, not one per k (one topk either way, returning 20 columns instead of k).
            logprobs: self.logprobs.map(|_| LIMITS.max_top_logprobs),
            grammar: false,
        }
    }
}

/// Which stages a step runs: the union over the rows it covers, known on the host, so a batch of
/// greedy requests runs argmax alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Stages {
    pub bias: bool,
    pub repetition: bool,
    pub presence_frequency: bool,
    pub draw: bool,
    /// The top count computed: `max_top_logprobs` where a row asks for log-probabilities (`flags`).
    pub logprobs: Option<i64>,
    /// A row is grammar-constrained (its mask applies).
    pub grammar: bool,
}

impl Stages {
    pub fn union(self, o: Stages) -> Stages {
        Stages {
            bias: self.bias || o.bias,
            repetition: self.repetition || o.repetition,
            presence_frequency: self.presence_frequency || o.presence_frequency,
            draw: self.draw || o.draw,
            grammar: self.grammar || o.grammar,
            logprobs: match (self.logprobs, o.logprobs) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            },
        }
    }
}

/// What a verify step's later position sees besides its logits (engine/speculative.rs); the default is a
/// plain step's.
#[derive(Default)]
pub struct Ahead<'a> {
    /// How many tokens past each slot's next this position is.
    pub by: i64,
    /// int64 `[n, by]`: the drafts before the position, which its penalties count as generated.
    pub before: Option<&'a Tensor>,
    /// uint8 `[n, mask_bytes]`: the grammar masks at the position (module docs).
    pub masks: Option<&'a Tensor>,
}

/// What a step chose, on the device.
pub struct Chosen {
    /// int64 `[rows]`.
    pub tokens: Tensor,
    /// The chosen tokens' log-probabilities `[rows]` and the top `k` `([rows, k], [rows, k])`.
    pub logprobs: Option<(Tensor, Tensor, Tensor)>,
}

impl Chosen {
    /// A copy with its own storage (a replayed CUDA graph overwrites its outputs at the next replay).
    pub fn copy(&self) -> Result<Chosen> {
        let logprobs = match &self.logprobs {
            Some((a, b, c)) => Some((a.copy()?, b.copy()?, c.copy()?)),
            None => None,
        };
        Ok(Chosen { tokens: self.tokens.copy()?, logprobs })
    }
}

/// Per-slot sampling state on the device, one row per sequence slot.
pub struct Sampler {
    vocab: i64,
    temperature: Tensor,
    greedy: Tensor,
    kth: Tensor,
    top_p_cut: Tensor,
    min_p: Tensor,
    repetition: Tensor,
    presence: Tensor,
    frequency: Tensor,
    seed: Tensor,
    /// Index of the token each slot draws next.
    step: Tensor,
    bias: Tensor,
    in_prompt: Tensor,
    /// How often each token was generated, float32 `[slots, vocab]`.
    counts: Tensor,
    ones: Tensor,
    /// Constants of every step, made once: -inf (float32 scalar), and bool `[1, vocab]` true but for the
    /// last entry (top-p always keeps the largest of a row sorted ascending).
    ninf: Tensor,
    not_last: Tensor,
    /// Per slot, the stages its request needs (host).
    flags: Vec<Stages>,
    /// The allowed sets of the grammar-constrained slots, bit-packed (module docs): on the host
    /// `[slots * mask_bytes]`, written by the engine; on the device uint8 `[slots, mask_bytes]`, written
    /// only by `upload_masks`. Unconstrained rows hold all ones.
    mask_host: Vec<u8>,
    mask_bits: Tensor,
    /// float32 `[256, 8]`: entry (b, k) is -0.0 when bit k of byte b is set, else -inf (module docs).
    mask_table: Tensor,
}

/// splitmix64's increment (the golden ratio in 64 bits), as i64.
const GOLDEN: i64 = 0x9E37_79B9_7F4A_7C15_u64 as i64;
const MIX1: i64 = 0xBF58_476D_1CE4_E5B9_u64 as i64;
const MIX2: i64 = 0x94D0_49BB_1331_11EB_u64 as i64;

/// Uniform float32 numbers in [0, 1), one per row: the (step + 1)-th output of splitmix64 started
/// at `seed` (both int64 `[rows]`), top 24 bits. `tests/engine/test_sampling.py` checks it against a
/// plain Python splitmix64.
pub fn uniform(seed: &Tensor, step: &Tensor) -> Result<Tensor> {
    let z = step.add_int(1)?.mul_int(GOLDEN)?.add(seed)?;
    let z = z.bitwise_xor(&z.shift_right_logical(30)?)?.mul_int(MIX1)?;
    let z = z.bitwise_xor(&z.shift_right_logical(27)?)?.mul_int(MIX2)?;
    let z = z.bitwise_xor(&z.shift_right_logical(31)?)?;
    z.shift_right_logical(40)?.to_dtype(DType::F32)?.mul_scalar(1.0 / (1u64 << 24) as f64)
}

impl Sampler {
    pub fn new(slots: i64, vocab: i64, like: &Tensor) -> Result<Sampler> {
        let col = |v: f64, dt: DType| Tensor::full(&[slots, 1], v, dt, like);
        let table = |v: f64, dt: DType| Tensor::full(&[slots, vocab], v, dt, like);
        let mask_bytes = (vocab as usize).div_ceil(8);
        let lookup: Vec<f32> = (0..256)
            .flat_map(|b| (0..8).map(move |k| if b >> k & 1 == 1 { -0.0 } else { f32::NEG_INFINITY }))
            .collect();
        Ok(Sampler {
            mask_host: vec![0xff; slots as usize * mask_bytes],
            mask_bits: Tensor::full(&[slots, mask_bytes as i64], 255.0, DType::U8, like)?,
            mask_table: Tensor::from_f32(&lookup, &[256, 8])?.to_like(like, DType::F32)?,
            vocab,
            temperature: col(1.0, DType::F32)?,
            greedy: Tensor::full(&[slots], 1.0, DType::Bool, like)?,
            kth: col(0.0, DType::I64)?,
            top_p_cut: col(0.0, DType::F32)?,
            min_p: col(0.0, DType::F32)?,
            repetition: col(1.0, DType::F32)?,
            presence: col(0.0, DType::F32)?,
            frequency: col(0.0, DType::F32)?,
            seed: Tensor::full(&[slots], 0.0, DType::I64, like)?,
            step: Tensor::full(&[slots], 0.0, DType::I64, like)?,
            bias: table(0.0, DType::F32)?,
            in_prompt: table(0.0, DType::Bool)?,
            counts: table(0.0, DType::F32)?,
            ones: col(1.0, DType::F32)?,
            ninf: Tensor::full(&[], f64::NEG_INFINITY, DType::F32, like)?,
            not_last: Tensor::arange(0, vocab, DType::I64, like)?.lt_scalar((vocab - 1) as f64)?.unsqueeze(0)?,
            flags: vec![Stages::default(); slots as usize],
        })
    }

    /// Give `slot` to a request with `params` whose prompt is `prompt` (int64 `[T]` on the device),
    /// grammar-constrained or not: its first drawn token is token 0 of its stream. `params` must have
    /// passed `check`.
    pub fn assign(&mut self, slot: i64, params: &SamplingParams, prompt: &Tensor, constrained: bool) -> Result<()> {
        let row = |t: &Tensor| t.narrow(0, slot, 1);
        let greedy = params.temperature == 0.0;
        row(&self.temperature)?.fill_(if greedy { 1.0 } else { params.temperature })?;
        row(&self.greedy)?.fill_(if greedy { 1.0 } else { 0.0 })?;
        // top_k keeps values >= the k-th largest: index vocab - k of the ascending sort (0 keeps all).
        let k = if params.top_k == 0 { self.vocab } else { params.top_k.min(self.vocab) };
        row(&self.kth)?.fill_((self.vocab - k) as f64)?;
        // TopPLogitsWarper removes cumulative probabilities <= 1 - top_p, the cut rounded to float32
        // as Transformers' comparison with a Python float rounds it.
        row(&self.top_p_cut)?.fill_(((1.0 - params.top_p) as f32) as f64)?;
        row(&self.min_p)?.fill_(params.min_p)?;
        row(&self.repetition)?.fill_(params.repetition_penalty)?;
        row(&self.presence)?.fill_(params.presence_penalty)?;
        row(&self.frequency)?.fill_(params.frequency_penalty)?;
        row(&self.seed)?.fill_int_(params.seed)?;
        row(&self.step)?.fill_(0.0)?;
        row(&self.counts)?.fill_(0.0)?;
        let bias = row(&self.bias)?;
        bias.fill_(0.0)?;
        if !params.logit_bias.is_empty() {
            let ids: Vec<i64> = params.logit_bias.iter().map(|(id, _)| *id).collect();
            let vals: Vec<f32> = params.logit_bias.iter().map(|(_, b)| *b as f32).collect();
            let ids = Tensor::from_i64(&ids)?.to_like(&bias, DType::I64)?;
            let vals = Tensor::from_f32(&vals, &[ids.numel()?])?.to_like(&bias, DType::F32)?;
            bias.reshape(&[self.vocab])?.index_put_(&[Some(&ids)], &vals)?;
        }
        let in_prompt = row(&self.in_prompt)?;
        in_prompt.fill_(0.0)?;
        if params.repetition_penalty != 1.0 {
            let yes = Tensor::full(&[1], 1.0, DType::Bool, prompt)?;
            in_prompt.reshape(&[self.vocab])?.index_put_(&[Some(prompt)], &yes)?;
        }
        self.flags[slot as usize] = Stages { grammar: constrained, ..params.flags() };
        self.mask_rows_mut(slot, 1).fill(0xff);
        Ok(())
    }

    /// Bytes of one slot's mask: ceil(vocab / 8).
    pub fn mask_bytes(&self) -> usize {
        (self.vocab as usize).div_ceil(8)
    }

    /// The host mask rows of the slots `start..start + n`, for the engine to write allowed sets into.
    pub fn mask_rows_mut(&mut self, start: i64, n: i64) -> &mut [u8] {
        let m = self.mask_bytes();
        &mut self.mask_host[start as usize * m..(start + n) as usize * m]
    }

    /// The host mask rows of the slots `start..start + n`.
    pub fn mask_rows(&self, start: i64, n: i64) -> &[u8] {
        let m = self.mask_bytes();
        &self.mask_host[start as usize * m..(start + n) as usize * m]
    }

    /// Copy the host mask rows of the slots `start..start + n` to the device, in one copy.
    pub fn upload_masks(&self, start: i64, n: i64) -> Result<()> {
        self.mask_bits.narrow(0, start, n)?.write_bytes_(self.mask_rows(start, n))
    }

    /// `raw` `[n, vocab]` with every token its rows' device masks `bits` (uint8 `[n, mask_bytes]`) do not
    /// allow at -inf (module docs).
    fn allowed(&self, raw: &Tensor, bits: &Tensor) -> Result<Tensor> {
        raw.add(&self.mask_values(bits)?)
    }

    /// What `allowed` adds for the device masks `bits` (uint8 `[n, mask_bytes]`): float32 `[n, vocab]`, -0.0 where a
    /// token is allowed and -inf where not (module docs).
    pub fn mask_values(&self, bits: &Tensor) -> Result<Tensor> {
        let (n, m) = (bits.size()?[0], self.mask_bytes() as i64);
        let bytes = bits.to_dtype(DType::I64)?.reshape(&[n * m])?;
        self.mask_table.index_select(0, &bytes)?.reshape(&[n, m * 8])?.narrow(1, 0, self.vocab)
    }

    /// The stages the slots `start..start + len` need.
    pub fn stages(&self, start: i64, len: i64) -> Stages {
        self.flags[start as usize..(start + len) as usize].iter().fold(Stages::default(), |a, b| a.union(*b))
    }

    /// The slot's stages as a free slot: nothing (its rows may still run as padding).
    pub fn release(&mut self, slot: i64) {
        self.flags[slot as usize] = Stages::default();
        self.mask_rows_mut(slot, 1).fill(0xff);
    }

    /// Choose the next token of the slots `start..start + n` from their `logits` `[n, vocab]`.
    pub fn choose(&self, logits: &Tensor, start: i64, n: i64) -> Result<Chosen> {
        self.choose_ahead(logits, start, n, &Ahead::default())
    }

    /// `choose` for the token `ahead.by` draws past each slot's next (a verify step's later positions,
    /// engine/speculative.rs): its draw takes the uniform number of that index, its penalties count the drafts
    /// before it as generated, and its grammar masks are `ahead.masks`.
    pub fn choose_ahead(&self, logits: &Tensor, start: i64, n: i64, ahead: &Ahead) -> Result<Chosen> {
        let stages = self.stages(start, n);
        let rows = |t: &Tensor| t.narrow(0, start, n);
        let raw = logits.as_dtype(DType::F32)?;
        let raw = match (stages.grammar, ahead.masks) {
            (false, _) => raw,
            (true, Some(masks)) => self.allowed(&raw, masks)?,
            (true, None) => self.allowed(&raw, &self.mask_bits.narrow(0, start, n)?)?,
        };
        // The histories only the penalties read (a plain step without them makes no call for them).
        let counts = match (stages.repetition || stages.presence_frequency, ahead.before) {
            (false, _) => None,
            (true, None) => Some(rows(&self.counts)?),
            (true, Some(before)) => {
                let counts = rows(&self.counts)?.copy()?;
                let ones = Tensor::full(&before.size()?, 1.0, DType::F32, &counts)?;
                counts.scatter_add_(1, before, &ones)?;
                Some(counts)
            }
        };
        let x = self.process(&raw, start, n, stages, counts.as_ref())?;
        let greedy = x.argmax(-1, false)?;
        let tokens = if stages.draw {
            let (sorted, order) = self.filtered(&x, start, n)?;
            let cdf = sorted.softmax(-1)?.cumsum(-1)?;
            let total = cdf.narrow(1, self.vocab - 1, 1)?;
            let step = rows(&self.step)?;
            let step = if ahead.by == 0 { step } else { step.add_int(ahead.by)? };
            let u = uniform(&rows(&self.seed)?, &step)?.unsqueeze(1)?;
            let at = cdf.searchsorted_right(&u.mul(&total)?)?.clamp(0.0, (self.vocab - 1) as f64)?;
            let drawn = order.gather(1, &at)?.reshape(&[n])?;
            Tensor::where_(&rows(&self.greedy)?, &greedy, &drawn)?
        } else {
            greedy
        };
        let logprobs = match stages.logprobs {
            None => None,
            Some(k) => {
                let lp = raw.log_softmax(-1)?;
                let chosen = lp.gather(1, &tokens.unsqueeze(1)?)?.reshape(&[n])?;
                let (top_lp, top_ids) = lp.topk(k.min(self.vocab))?;
                Some((chosen, top_ids, top_lp))
            }
        };
        Ok(Chosen { tokens, logprobs })
    }

    /// After a step: count the chosen tokens into the slots' output histories, and move the slots'
    /// draw index on; with `live` (bool `[n]`), only for the live rows (the others were padding).
    /// Histories feed only the penalties and the draw index only draws, so a batch whose requests
    /// use neither skips them (a request's stages are fixed at `assign`, and `assign` resets both).
    pub fn advance(&mut self, tokens: &Tensor, start: i64, n: i64, live: Option<&Tensor>) -> Result<()> {
        let stages = self.stages(start, n);
        if !(stages.draw || stages.repetition || stages.presence_frequency) {
            return Ok(());
        }
        let counts = self.counts.narrow(0, start, n)?;
        let step = self.step.narrow(0, start, n)?;
        match live {
            None => {
                counts.scatter_add_(1, &tokens.unsqueeze(1)?, &self.ones.narrow(0, start, n)?)?;
                step.add_int_(1)
            }
            Some(live) => {
                counts.scatter_add_(1, &tokens.unsqueeze(1)?, &live.to_dtype(DType::F32)?.unsqueeze(1)?)?;
                step.copy_(&step.add(&live.to_dtype(DType::I64)?)?)
            }
        }
    }

    /// After a verify step (engine/speculative.rs) in which the slots `start..start + n` drew the first
    /// `drawn` (int64 `[n]`) of `tokens` (int64 `[n, width]`): count those into their histories and move their
    /// draw index on by that many; with `live`, only for the live rows.
    pub fn advance_verified(
        &mut self,
        tokens: &Tensor,
        drawn: &Tensor,
        start: i64,
        n: i64,
        live: Option<&Tensor>,
    ) -> Result<()> {
        let stages = self.stages(start, n);
        let drawn = match live {
            Some(live) => drawn.mul(&live.to_dtype(DType::I64)?)?,
            None => drawn.shallow_clone()?,
        };
        if stages.repetition || stages.presence_frequency {
            let width = tokens.size()?[1];
            let cols = Tensor::arange(0, width, DType::I64, tokens)?.reshape(&[1, width])?;
            let taken = cols.lt(&drawn.reshape(&[n, 1])?)?.to_dtype(DType::F32)?;
            self.counts.narrow(0, start, n)?.scatter_add_(1, tokens, &taken)?;
        }
        if stages.draw {
            self.step.narrow(0, start, n)?.add_(&drawn)?;
        }
        Ok(())
    }

    /// Logit bias and penalties (the processors before the warpers) over the histories `counts` (float32
    /// `[n, vocab]`; Some when `stages` has penalties), float32 `[n, vocab]`.
    fn process(&self, raw: &Tensor, start: i64, n: i64, stages: Stages, counts: Option<&Tensor>) -> Result<Tensor> {
        let rows = |t: &Tensor| t.narrow(0, start, n);
        let mut x = raw.shallow_clone()?;
        if stages.bias {
            x = x.add(&rows(&self.bias)?)?;
        }
        let history = || counts.ok_or_else(|| Error::Internal("the penalties' histories are missing".into()));
        if stages.repetition {
            let seen = rows(&self.in_prompt)?.logical_or(&history()?.gt_scalar(0.0)?)?;
            let p = rows(&self.repetition)?;
            let penalized = Tensor::where_(&x.lt_scalar(0.0)?, &x.mul(&p)?, &x.div(&p)?)?;
            x = Tensor::where_(&seen, &penalized, &x)?;
        }
        if stages.presence_frequency {
            let counts = history()?;
            let present = counts.gt_scalar(0.0)?.to_dtype(DType::F32)?;
            x = x.sub(&counts.mul(&rows(&self.frequency)?)?)?.sub(&present.mul(&rows(&self.presence)?)?)?;
        }
        Ok(x)
    }

    /// Temperature, top-k, top-p and min-p: the processed logits sorted ascending with the removed
    /// entries at -inf, and the sort order.
    fn filtered(&self, x: &Tensor, start: i64, n: i64) -> Result<(Tensor, Tensor)> {
        let rows = |t: &Tensor| t.narrow(0, start, n);
        let ninf = &self.ninf;
        let (sorted, order) = x.div(&rows(&self.temperature)?)?.sort(false)?;
        // TopKLogitsWarper: remove values < the k-th largest.
        let kth = sorted.gather(1, &rows(&self.kth)?)?;
        let sorted = Tensor::where_(&sorted.lt(&kth)?, ninf, &sorted)?;
        // TopPLogitsWarper: remove cumulative probability <= 1 - top_p, always keeping the largest.
        let cum = sorted.softmax(-1)?.cumsum(-1)?;
        let cut = cum.le(&rows(&self.top_p_cut)?)?.logical_and(&self.not_last)?;
        let sorted = Tensor::where_(&cut, ninf, &sorted)?;
        // MinPLogitsWarper: remove probabilities < min_p * the largest (which it always keeps).
        let probs = sorted.softmax(-1)?;
        let top = probs.narrow(1, self.vocab - 1, 1)?;
        let cut = probs.lt(&top.mul(&rows(&self.min_p)?)?)?;
        Ok((Tensor::where_(&cut, ninf, &sorted)?, order))
    }

    /// The distribution the draw samples from, in vocabulary order, float32 `[n, vocab]` (for tests:
    /// it is compared with Transformers' processors).
    pub fn distribution(&self, logits: &Tensor, start: i64, n: i64) -> Result<Tensor> {
        let stages = self.stages(start, n);
        let counts = self.counts.narrow(0, start, n)?;
        let x = self.process(&logits.to_dtype(DType::F32)?, start, n, stages, Some(&counts))?;
        let (sorted, order) = self.filtered(&x, start, n)?;
        let probs = sorted.softmax(-1)?;
        Tensor::full(&[n, self.vocab], 0.0, DType::F32, &probs)?.scatter(1, &order, &probs)
    }

    /// Count `tokens` (host ids) as already generated by `slot` (for tests of the penalties).
    pub fn record(&mut self, slot: i64, tokens: &Tensor) -> Result<()> {
        let ones = Tensor::full(&[tokens.numel()?], 1.0, DType::F32, tokens)?;
        self.counts.narrow(0, slot, 1)?.reshape(&[self.vocab])?.scatter_add_(0, tokens, &ones)
    }

    /// Set `slot`'s draw index (for tests: the index of the token being drawn).
    pub fn set_step(&mut self, slot: i64, step: i64) -> Result<()> {
        self.step.narrow(0, slot, 1)?.fill_(step as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(p: SamplingParams) -> String {
        p.check(100).unwrap_err().to_string()
    }

    #[test]
    fn out_of_range_parameters_name_the_field() {
        let d = SamplingParams::default();
        assert!(d.check(100).is_ok());
        assert!(err(SamplingParams { temperature: -0.5, ..d.clone() }).starts_with("temperature"));
        assert!(err(SamplingParams { temperature: f64::NAN, ..d.clone() }).starts_with("temperature"));
        assert!(err(SamplingParams { top_p: 0.0, ..d.clone() }).starts_with("top_p"));
        assert!(err(SamplingParams { min_p: 1.5, ..d.clone() }).starts_with("min_p"));
        assert!(err(SamplingParams { top_k: -1, ..d.clone() }).starts_with("top_k"));
        assert!(err(SamplingParams { repetition_penalty: 0.0, ..d.clone() }).starts_with("repetition_penalty"));
        assert!(err(SamplingParams { logprobs: Some(21), ..d.clone() }).starts_with("top_logprobs"));
        assert!(err(SamplingParams { logit_bias: vec![(100, 1.0)], ..d.clone() }).contains("token id 100"));
        let bias = |n: i64| (0..n).map(|id| (id, 1.0)).collect::<Vec<_>>();
        let at = LIMITS.max_logit_bias as i64;
        assert!(SamplingParams { logit_bias: bias(at), ..d.clone() }.check(1000).is_ok());
        let e = SamplingParams { logit_bias: bias(at + 1), ..d }.check(1000).unwrap_err().to_string();
        assert!(e.starts_with("logit_bias") && e.contains("300"), "{e}");
    }

    #[test]
    fn stages_of_a_batch_are_the_union_of_its_requests() {
        let greedy = SamplingParams::default().flags();
        assert_eq!(greedy, Stages::default());
        let sampled = SamplingParams { temperature: 0.7, logprobs: Some(3), ..Default::default() }.flags();
        let biased = SamplingParams { logit_bias: vec![(1, 2.0)], logprobs: Some(5), ..Default::default() }.flags();
        let all = greedy.union(sampled).union(biased);
        assert!(all.draw && all.bias && !all.repetition && !all.presence_frequency);
        assert_eq!((sampled.logprobs, all.logprobs), (Some(LIMITS.max_top_logprobs), Some(LIMITS.max_top_logprobs)));
    }
}
