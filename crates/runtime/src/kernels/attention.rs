//! Transformer ops: Attention (opsets 23-25), RotaryEmbedding (opset 23) and SwiGLU (opset 28).
//!
//! Attention computes in f32 whatever its float input types: Q·Kᵀ and P·V run as batched
//! matrix products through the crate's gemm (one product per batch and query head, reading
//! the heads of 3-D inputs in place through strided views), and the masked softmax runs row
//! by row with the row maximum subtracted.

use std::borrow::Cow;

use half::{bf16, f16};
use qforge_ir::{DType, Tensor};

use super::elementwise::{from_f32, sigmoid, to_f32};
use super::gemm::{sgemm_into, MatRef};
use super::util::{input, ints, kernel, min_items, opt_input, par_chunks_mut, threads, ELEMENT_WORK, PAR_MIN_WORK};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers Attention, RotaryEmbedding and SwiGLU.
pub fn register(r: &mut Registry) {
    r.add("", "Attention", 23, LATEST, attention);
    r.add("", "RotaryEmbedding", 23, LATEST, rotary_embedding);
    r.add("", "SwiGLU", 28, LATEST, swiglu);
}

/// Elements of a tensor of `dims`, or an error naming `what` when it would exceed
/// [`MAX_KERNEL_BYTES`](super::util::MAX_KERNEL_BYTES) as f32.
pub(super) fn checked_len(dims: &[usize], what: &str) -> RuntimeResult<usize> {
    super::util::check_output_size(what, DType::F32, dims)?;
    Ok(dims.iter().product())
}

/// A positive integer attribute, `None` when absent.
pub(super) fn positive_attr(info: &NodeInfo, name: &str) -> RuntimeResult<Option<usize>> {
    match info.node.attr_int(name) {
        None => Ok(None),
        Some(v) if v > 0 => Ok(Some(v as usize)),
        Some(v) => Err(info.error(format!("'{name}' must be positive, got {v}"))),
    }
}

/// RotaryEmbedding's `rotary_embedding_dim`: `None` for 0 (the default: the whole head),
/// the width when positive; negative values are errors.
pub(super) fn rotary_dim_attr(info: &NodeInfo) -> RuntimeResult<Option<usize>> {
    match info.attr_int("rotary_embedding_dim", 0) {
        0 => Ok(None),
        d if d > 0 => Ok(Some(d as usize)),
        d => Err(info.error(format!("rotary_embedding_dim must be nonnegative, got {d}"))),
    }
}

/// A window-size attribute: `None` for -1 (unbounded), the bound when nonnegative.
fn window_attr(info: &NodeInfo, name: &str) -> RuntimeResult<Option<i64>> {
    match info.attr_int(name, -1) {
        -1 => Ok(None),
        v if v >= 0 => Ok(Some(v)),
        v => Err(info.error(format!("'{name}' must be -1 or nonnegative, got {v}"))),
    }
}

/// Which intermediate the optional `qk_matmul_output` output holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum QkOutput {
    /// The scaled Q·Kᵀ scores (after the softcap, when one is set, as the reference does).
    Scores,
    /// The scores after the softcap.
    Softcapped,
    /// The scores after the softcap with the mask bias added.
    Biased,
    /// The softmax probabilities (zero rows where every key is masked).
    Probabilities,
}

/// The attributes of an Attention node.
struct AttentionAttrs {
    q_num_heads: Option<usize>,
    kv_num_heads: Option<usize>,
    scale: Option<f32>,
    is_causal: bool,
    softcap: f32,
    qk_output: QkOutput,
    left_window: Option<i64>,
    right_window: Option<i64>,
    /// Whether the heads attributes are forbidden for 4-D inputs (opset 25 on).
    strict_heads: bool,
}

/// How one of Q, K, V (or a cache) lays out its heads: 4-D `[batch, heads, seq, head_size]`,
/// or 3-D `[batch, seq, heads * head_size]`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Heads {
    pub(super) batch: usize,
    pub(super) heads: usize,
    pub(super) seq: usize,
    pub(super) head_size: usize,
    pub(super) packed: bool,
}

impl Heads {
    /// The layout of `shape` (rank 3 with `heads` from the attribute, or rank 4), naming
    /// the tensor `what` in errors.
    fn of(shape: &[usize], heads_attr: Option<usize>, attr_name: &str, strict: bool, what: &str) -> RuntimeResult<Heads> {
        match *shape {
            [batch, seq, hidden] => {
                let heads = heads_attr.ok_or_else(|| kernel_error(format!("{what} of shape {shape:?} is 3-D, which needs the '{attr_name}' attribute")))?;
                if hidden % heads != 0 {
                    return Err(kernel_error(format!("{what} hidden size {hidden} is not divisible by {attr_name} {heads}")));
                }
                Ok(Heads { batch, heads, seq, head_size: hidden / heads, packed: true })
            }
            [batch, heads, seq, head_size] => {
                match heads_attr {
                    Some(_) if strict => return Err(kernel_error(format!("'{attr_name}' must not be set for 4-D inputs ({what} has shape {shape:?})"))),
                    Some(h) if h != heads => return Err(kernel_error(format!("{what} of shape {shape:?} has {heads} heads but {attr_name} is {h}"))),
                    _ => {}
                }
                Ok(Heads { batch, heads, seq, head_size, packed: false })
            }
            _ => Err(kernel_error(format!("{what} must be 3-D or 4-D, got shape {shape:?}"))),
        }
    }

    /// The `seq x head_size` matrix of batch `b`, head `h` within `data`.
    fn matrix<'a>(&self, data: &'a [f32], b: usize, h: usize) -> MatRef<'a> {
        if self.packed {
            let row = self.heads * self.head_size;
            MatRef { data: data.get(b * self.seq * row + h * self.head_size..).unwrap_or(&[]), rs: row, cs: 1 }
        } else {
            let size = self.seq * self.head_size;
            MatRef::rows(&data[(b * self.heads + h) * size..(b * self.heads + h + 1) * size], self.head_size)
        }
    }
}

/// `past` (4-D `[batch, heads, past_len, head_size]`, when given) followed along the
/// sequence by the keys or values `x` of layout `layout`: the 4-D present cache.
pub(super) fn concat_cache(past: Option<(&[f32], usize)>, x: &[f32], layout: Heads) -> Vec<f32> {
    let Heads { batch, heads, seq, head_size, .. } = layout;
    let past_len = past.map_or(0, |p| p.1);
    let mut out = Vec::with_capacity(batch * heads * (past_len + seq) * head_size);
    for b in 0..batch {
        for h in 0..heads {
            if let Some((p, _)) = past {
                let block = past_len * head_size;
                out.extend_from_slice(&p[(b * heads + h) * block..(b * heads + h + 1) * block]);
            }
            let m = layout.matrix(x, b, h);
            for s in 0..seq {
                out.extend_from_slice(&m.data[s * m.rs..s * m.rs + head_size]);
            }
        }
    }
    out
}

/// The additive bias of every score: the attention mask (bool as 0 / -inf, float as is,
/// -inf past its last column), the causal and sliding-window frontiers and the padding of
/// `nonpad_kv_seqlen`, the frontiers aligned bottom-right by each batch's offset.
struct Bias<'a> {
    /// Mask values, with the strides of its (batch, head, query) dimensions (0 where
    /// broadcast) and its number of key columns.
    mask: Option<(Cow<'a, [f32]>, [usize; 3], usize)>,
    causal: bool,
    left_window: Option<i64>,
    right_window: Option<i64>,
    /// Keys preceding each batch's query block.
    offsets: Vec<i64>,
    /// Valid keys of each batch, when `nonpad_kv_seqlen` is given.
    valid_keys: Option<Vec<i64>>,
}

impl Bias<'_> {
    /// Fills `row` with the bias of query `i` of batch `b`, head `h`.
    fn fill(&self, b: usize, h: usize, i: usize, row: &mut [f32]) {
        let position = i as i64 + self.offsets[b];
        match &self.mask {
            Some((values, strides, cols)) => {
                let start = b * strides[0] + h * strides[1] + i * strides[2];
                let n = (*cols).min(row.len());
                row[..n].copy_from_slice(&values[start..start + n]);
                row[n..].fill(f32::NEG_INFINITY);
            }
            None => row.fill(0.0),
        }
        for (j, v) in row.iter_mut().enumerate() {
            let j = j as i64;
            let disallowed = (self.causal && j > position)
                || self.left_window.is_some_and(|w| position - j > w)
                || self.right_window.is_some_and(|w| j - position > w)
                || self.valid_keys.as_ref().is_some_and(|k| j >= k[b]);
            if disallowed {
                *v += f32::NEG_INFINITY;
            }
        }
    }
}

/// The mask as additive f32 values with its broadcast strides against
/// `[batch, q_heads, q_seq, keys]`; the mask's last dimension may be shorter than `keys`.
fn mask_bias(mask: &Tensor, batch: usize, q_heads: usize, q_seq: usize, keys: usize) -> RuntimeResult<(Cow<'_, [f32]>, [usize; 3], usize)> {
    let shape = mask.shape();
    if shape.is_empty() || shape.len() > 4 {
        return Err(kernel_error(format!("attn_mask must have rank 1 to 4, got shape {shape:?}")));
    }
    let cols = shape[shape.len() - 1];
    if cols > keys {
        return Err(kernel_error(format!("attn_mask of shape {shape:?} has {cols} key columns, more than the {keys} keys")));
    }
    let target = [batch, q_heads, q_seq];
    let mut strides = [0usize; 3];
    let mut stride = cols;
    for d in (0..shape.len() - 1).rev() {
        let t = 3 - (shape.len() - 1 - d);
        if shape[d] != 1 && shape[d] != target[t] {
            return Err(kernel_error(format!("attn_mask of shape {shape:?} does not broadcast to [{batch}, {q_heads}, {q_seq}, {keys}]")));
        }
        strides[t] = if shape[d] == 1 { 0 } else { stride };
        stride *= shape[d];
    }
    let values = match mask.dtype() {
        DType::Bool => {
            let bools = mask.bools().map_err(|e| kernel_error(e.to_string()))?;
            Cow::Owned(bools.into_iter().map(|b| if b { 0.0 } else { f32::NEG_INFINITY }).collect())
        }
        d if d.is_float() => to_f32(mask)?,
        d => return Err(kernel_error(format!("attn_mask must be bool or float, got {d}"))),
    };
    Ok((values, strides, cols))
}

/// `x` rounded to the precision of `dtype`.
fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::BF16 => bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// `[batch, heads, seq, head]` values laid out as `[batch, seq, heads · head]`.
pub(super) fn heads_to_sequence(y: &[f32], batch: usize, heads: usize, seq: usize, head: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(y.len());
    for b in 0..batch {
        for s in 0..seq {
            for h in 0..heads {
                let at = ((b * heads + h) * seq + s) * head;
                out.extend_from_slice(&y[at..at + head]);
            }
        }
    }
    out
}

/// `batch` products written to consecutive `m x n` blocks of `out`: block `p` is
/// `a(p) · b(p)` (`k` the shared dimension), split across threads by block when there are
/// enough blocks, else within each product.
pub(super) fn batched_products<'a>(out: &mut [f32], m: usize, n: usize, k: usize, a: impl Fn(usize) -> MatRef<'a> + Sync + Send, b: impl Fn(usize) -> MatRef<'a> + Sync + Send) {
    let block = m * n;
    if block == 0 {
        return;
    }
    let batch = out.len() / block;
    let across = threads() > 1 && batch >= threads() && batch * block * k >= 2 * PAR_MIN_WORK;
    let product = |p: usize, dst: &mut [f32], parallel: bool| {
        // SAFETY: `dst` is an exclusively borrowed block of `m * n` values with `n` columns,
        // apart from the inputs `a` and `b` read.
        unsafe { sgemm_into(m, n, k, a(p), b(p), dst.as_mut_ptr(), n, false, parallel) }
    };
    if across {
        par_chunks_mut(out, block, min_items(block * k.max(1)), || (), |_, p, dst| product(p, dst, false));
    } else {
        out.chunks_mut(block).enumerate().for_each(|(p, dst)| product(p, dst, true));
    }
}

/// Softmax of one row of scores in place, after adding `bias`: the row maximum is
/// subtracted first, a NaN score makes the row NaN, and a row whose bias is -inf
/// everywhere (no key attended) becomes zeros. `round` is applied to every intermediate
/// (the identity, or rounding to the input's precision).
pub(super) fn masked_softmax(row: &mut [f32], bias: &[f32], round: impl Fn(f32) -> f32) {
    if !bias.iter().any(|&b| b != f32::NEG_INFINITY) {
        row.fill(0.0);
        return;
    }
    let mut max = f32::NEG_INFINITY;
    for (x, &b) in row.iter_mut().zip(bias) {
        *x = round(*x + b);
        if x.is_nan() || *x > max {
            max = *x;
        }
    }
    let shift = if max == f32::NEG_INFINITY { 0.0 } else { max };
    let mut sum = 0.0;
    for x in row.iter_mut() {
        *x = round(round(*x - shift).exp());
        sum = round(sum + *x);
    }
    let sum = if sum == 0.0 { 1.0 } else { sum };
    row.iter_mut().for_each(|x| *x = round(*x / sum));
}

/// Attention (opsets 23-25): `softmax(softcap(scale · Q·Kᵀ) + bias) · V` per batch and query
/// head. Inputs Q, K, V are 4-D `[batch, heads, seq, head_size]` or 3-D
/// `[batch, seq, heads * head_size]` with `q_num_heads`/`kv_num_heads`; query heads share
/// key/value heads in groups (GQA/MQA) when there are fewer of those. `past_key`/`past_value`
/// (4-D) are prepended to K/V, giving `present_key`/`present_value`; `nonpad_kv_seqlen`
/// (opset 24 on) pads each batch's keys. The bias combines `attn_mask`, `is_causal` and the
/// sliding window (opset 25 on) aligned bottom-right by the cache offset; a query with no
/// attended key gives a zero row. `scale` defaults to 1/√head_size and is applied as the
/// square of its square root rounded to Q's type, as the reference does. `qk_matmul_output`
/// holds the intermediate `qk_matmul_output_mode` selects. All arithmetic is f32; outputs take
/// the types of Q (Y, present_key, qk_matmul_output) and V (present_value).
fn attention(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let qk_output = match info.attr_int("qk_matmul_output_mode", 0) {
        0 => QkOutput::Scores,
        1 => QkOutput::Softcapped,
        2 => QkOutput::Biased,
        3 => QkOutput::Probabilities,
        m => return Err(info.error(format!("qk_matmul_output_mode must be 0, 1, 2 or 3, got {m}"))),
    };
    let softcap = info.attr_float("softcap", 0.0);
    if softcap.is_nan() || softcap < 0.0 {
        return Err(info.error(format!("softcap must be nonnegative, got {softcap}")));
    }
    let (left_window, right_window) = if info.opset >= 25 { (window_attr(info, "left_window_size")?, window_attr(info, "right_window_size")?) } else { (None, None) };
    let attrs = AttentionAttrs {
        q_num_heads: positive_attr(info, "q_num_heads")?,
        kv_num_heads: positive_attr(info, "kv_num_heads")?,
        scale: info.node.attr_float("scale"),
        is_causal: info.attr_int("is_causal", 0) != 0,
        softcap,
        qk_output,
        left_window,
        right_window,
        strict_heads: info.opset >= 25,
    };
    let wants_present = info.node.outputs.get(1).is_some_and(|o| o.is_some()) || info.node.outputs.get(2).is_some_and(|o| o.is_some());
    let wants_qk = info.node.outputs.get(3).is_some_and(|o| o.is_some());
    let opset = info.opset;
    kernel(move |ins| {
        let nonpad = if opset >= 24 { opt_input(ins, 6) } else { None };
        run_attention(&attrs, ins, nonpad, wants_present, wants_qk)
    })
}

/// One Attention run; see [`attention`].
fn run_attention(a: &AttentionAttrs, ins: &[Option<&Tensor>], nonpad: Option<&Tensor>, wants_present: bool, wants_qk: bool) -> RuntimeResult<Vec<Tensor>> {
    let (q, k, v) = (input(ins, 0)?, input(ins, 1)?, input(ins, 2)?);
    let (past_key, past_value) = (opt_input(ins, 4), opt_input(ins, 5));
    if q.rank() != k.rank() || q.rank() != v.rank() {
        return Err(kernel_error(format!("Q, K and V must have one rank, got shapes {:?}, {:?} and {:?}", q.shape(), k.shape(), v.shape())));
    }
    for (t, name) in [(q, "Q"), (k, "K"), (v, "V")] {
        if !t.dtype().is_float() {
            return Err(kernel_error(format!("{name} must be a float tensor, got {}", t.dtype())));
        }
    }
    if q.dtype() != k.dtype() {
        return Err(kernel_error(format!("Q and K must share one type, got {} and {}", q.dtype(), k.dtype())));
    }
    let ql = Heads::of(q.shape(), a.q_num_heads, "q_num_heads", a.strict_heads, "Q")?;
    let kl = Heads::of(k.shape(), a.kv_num_heads, "kv_num_heads", a.strict_heads, "K")?;
    let vl = Heads::of(v.shape(), a.kv_num_heads, "kv_num_heads", a.strict_heads, "V")?;
    if kl.batch != ql.batch || vl.batch != ql.batch {
        return Err(kernel_error(format!("Q, K and V must share the batch size, got shapes {:?}, {:?} and {:?}", q.shape(), k.shape(), v.shape())));
    }
    if kl.heads != vl.heads || kl.seq != vl.seq {
        return Err(kernel_error(format!("K and V must share heads and sequence length, got {} and {} heads, lengths {} and {}", kl.heads, vl.heads, kl.seq, vl.seq)));
    }
    if kl.head_size != ql.head_size {
        return Err(kernel_error(format!("Q and K must share the head size, got {} and {}", ql.head_size, kl.head_size)));
    }
    if ql.heads % kl.heads != 0 {
        return Err(kernel_error(format!("the {} query heads are not a multiple of the {} key/value heads", ql.heads, kl.heads)));
    }
    let (batch, q_heads, q_seq, head_size, v_head_size) = (ql.batch, ql.heads, ql.seq, ql.head_size, vl.head_size);
    let group = q_heads / kl.heads;

    let past = match (past_key, past_value) {
        (None, None) => None,
        (Some(pk), Some(pv)) => {
            let past_len = pk.shape().get(2).copied().unwrap_or(0);
            let want_k = [batch, kl.heads, past_len, head_size];
            let want_v = [batch, kl.heads, past_len, v_head_size];
            if pk.shape() != want_k || pv.shape() != want_v {
                return Err(kernel_error(format!("past_key and past_value must have shapes {want_k:?} and {want_v:?}, got {:?} and {:?}", pk.shape(), pv.shape())));
            }
            if nonpad.is_some() {
                return Err(kernel_error("nonpad_kv_seqlen cannot be combined with past_key and past_value"));
            }
            Some((pk, pv, past_len))
        }
        _ => return Err(kernel_error("past_key and past_value must be given together")),
    };
    let past_len = past.map_or(0, |p| p.2);
    let keys = past_len.checked_add(kl.seq).ok_or_else(|| kernel_error("the key sequence length overflows"))?;
    checked_len(&[batch, kl.heads, keys, head_size.max(v_head_size)], "present key/value")?;
    let scores_len = checked_len(&[batch, q_heads, q_seq, keys], "attention scores")?;
    let y_len = checked_len(&[batch, q_heads, q_seq, v_head_size], "Y")?;

    let (qv, kv, vv) = (to_f32(q)?, to_f32(k)?, to_f32(v)?);
    // The keys and values attended, as the 4-D present cache when one is built.
    let presents = if past.is_some() || wants_present {
        let (pk, pv) = match past {
            Some((pk, pv, _)) => (Some(to_f32(pk)?), Some(to_f32(pv)?)),
            None => (None, None),
        };
        let pk = concat_cache(pk.as_deref().map(|p| (p, past_len)), &kv, kl);
        let pv = concat_cache(pv.as_deref().map(|p| (p, past_len)), &vv, vl);
        Some((pk, pv))
    } else {
        None
    };
    let (k_src, k_layout, v_src, v_layout) = match &presents {
        Some((pk, pv)) => {
            let layout = |head_size| Heads { batch, heads: kl.heads, seq: keys, head_size, packed: false };
            (&pk[..], layout(head_size), &pv[..], layout(v_head_size))
        }
        None => (&kv[..], kl, &vv[..], vl),
    };

    let valid_keys = match nonpad {
        Some(t) => {
            let n = ints(t, "nonpad_kv_seqlen")?;
            if t.shape() != [batch] {
                return Err(kernel_error(format!("nonpad_kv_seqlen must have shape [{batch}], got {:?}", t.shape())));
            }
            Some(n)
        }
        None => None,
    };
    let offsets: Vec<i64> = match &valid_keys {
        Some(n) => n.iter().map(|&n| n - q_seq as i64).collect(),
        None => vec![past_len as i64; batch],
    };
    let bias = Bias {
        mask: opt_input(ins, 3).map(|m| mask_bias(m, batch, q_heads, q_seq, keys)).transpose()?,
        causal: a.is_causal,
        left_window: a.left_window,
        right_window: a.right_window,
        offsets,
        valid_keys,
    };

    let dtype = q.dtype();
    let scale_root = round_to(dtype, a.scale.unwrap_or(1.0 / (head_size as f32).sqrt()).sqrt());
    // bfloat16 inputs follow the reference's rounding to bfloat16 after every step (Q and K
    // each scaled by the rounded root, products accumulated in f32); the other types keep
    // f32 intermediates and apply the scale once to the products.
    let half_precision = dtype == DType::BF16;
    let round = |x: f32| if half_precision { round_to(dtype, x) } else { x };
    let scaled = |x: &[f32]| x.iter().map(|&v| round(v * scale_root)).collect::<Vec<f32>>();
    let (q_scaled, k_scaled) = if half_precision { (Some(scaled(&qv)), Some(scaled(k_src))) } else { (None, None) };
    let (q_src, k_src) = (q_scaled.as_deref().unwrap_or(&qv), k_scaled.as_deref().unwrap_or(k_src));
    let alpha = if half_precision { 1.0 } else { scale_root * scale_root };
    let mut scores = vec![0f32; scores_len];
    batched_products(&mut scores, q_seq, keys, head_size,
        |p| ql.matrix(q_src, p / q_heads, p % q_heads),
        |p| {
            let m = k_layout.matrix(k_src, p / q_heads, p % q_heads / group);
            MatRef { data: m.data, rs: m.cs, cs: m.rs }
        });
    let softcap = a.softcap;
    let row_min = min_items(keys.max(1) * ELEMENT_WORK);
    par_chunks_mut(&mut scores, keys.max(1), row_min, || (), |_, _, row| {
        for x in row.iter_mut() {
            *x = round(*x * alpha);
            if softcap > 0.0 {
                *x = round(softcap * round(round(*x / softcap).tanh()));
            }
        }
    });
    let row_coords = |r: usize| (r / q_seq / q_heads, r / q_seq % q_heads, r % q_seq);
    let mut qk_out = match a.qk_output {
        QkOutput::Scores | QkOutput::Softcapped if wants_qk => Some(scores.clone()),
        QkOutput::Biased if wants_qk => {
            let mut biased = scores.clone();
            par_chunks_mut(&mut biased, keys.max(1), row_min, || vec![0f32; keys], |bias_row, r, row| {
                let (b, h, i) = row_coords(r);
                bias.fill(b, h, i, bias_row);
                row.iter_mut().zip(bias_row.iter()).for_each(|(x, &c)| *x = round(*x + c));
            });
            Some(biased)
        }
        _ => None,
    };
    par_chunks_mut(&mut scores, keys.max(1), row_min, || vec![0f32; keys], |bias_row, r, row| {
        let (b, h, i) = row_coords(r);
        bias.fill(b, h, i, bias_row);
        masked_softmax(row, bias_row, round);
    });
    if a.qk_output == QkOutput::Probabilities && wants_qk {
        qk_out = Some(scores.clone());
    }
    let mut y = vec![0f32; y_len];
    batched_products(&mut y, q_seq, v_head_size, keys,
        |p| MatRef::rows(&scores[p * q_seq * keys..(p + 1) * q_seq * keys], keys),
        |p| v_layout.matrix(v_src, p / q_heads, p % q_heads / group));

    let y = if ql.packed {
        from_f32(q.dtype(), &[batch, q_seq, q_heads * v_head_size], heads_to_sequence(&y, batch, q_heads, q_seq, v_head_size))?
    } else {
        from_f32(q.dtype(), &[batch, q_heads, q_seq, v_head_size], y)?
    };
    let (present_key, present_value) = match presents {
        Some((pk, pv)) => (from_f32(k.dtype(), &[batch, kl.heads, keys, head_size], pk)?, from_f32(v.dtype(), &[batch, kl.heads, keys, v_head_size], pv)?),
        None => (Tensor::scalar(0f32), Tensor::scalar(0f32)),
    };
    let qk = match qk_out {
        Some(s) => from_f32(q.dtype(), &[batch, q_heads, q_seq, keys], s)?,
        None => Tensor::scalar(0f32),
    };
    Ok(vec![y, present_key, present_value, qk])
}

/// RotaryEmbedding (opset 23): rotates the first `rotary_embedding_dim` (default: all) values
/// of each head vector of X (4-D `[batch, heads, seq, head_size]`, or 3-D
/// `[batch, seq, heads * head_size]` with `num_heads`) by the angles whose cosines and sines
/// are `cos_cache`/`sin_cache`: rows `position_ids[batch, seq]` of `[max_position, dim / 2]`
/// caches, or `[batch, seq, dim / 2]` caches without position ids. Pairs are the two halves
/// of the rotated part, or adjacent values when `interleaved`. Computes in f32; the output
/// has X's shape and type.
fn rotary_embedding(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let interleaved = info.attr_int("interleaved", 0) != 0;
    let num_heads = positive_attr(info, "num_heads")?;
    let rotary_dim = rotary_dim_attr(info)?;
    kernel(move |ins| {
        let (x, cos, sin) = (input(ins, 0)?, input(ins, 1)?, input(ins, 2)?);
        let layout = match *x.shape() {
            [batch, seq, hidden] => {
                let heads = num_heads.ok_or_else(|| kernel_error(format!("X of shape {:?} is 3-D, which needs the 'num_heads' attribute", x.shape())))?;
                if hidden % heads != 0 {
                    return Err(kernel_error(format!("X hidden size {hidden} is not divisible by num_heads {heads}")));
                }
                Heads { batch, heads, seq, head_size: hidden / heads, packed: true }
            }
            [batch, heads, seq, head_size] => Heads { batch, heads, seq, head_size, packed: false },
            _ => return Err(kernel_error(format!("X must be 3-D or 4-D, got shape {:?}", x.shape()))),
        };
        let dim = rotary_dim.unwrap_or(layout.head_size);
        if dim > layout.head_size || dim % 2 != 0 {
            return Err(kernel_error(format!("rotary_embedding_dim {dim} must be even and at most the head size {}", layout.head_size)));
        }
        let half = dim / 2;
        if cos.shape() != sin.shape() {
            return Err(kernel_error(format!("cos_cache and sin_cache must share one shape, got {:?} and {:?}", cos.shape(), sin.shape())));
        }
        let tokens = layout.batch * layout.seq;
        // The cache row of each (batch, seq) token.
        let rows: Vec<usize> = match opt_input(ins, 3) {
            Some(p) => {
                let &[max_pos, w] = cos.shape() else {
                    return Err(kernel_error(format!("with position_ids the caches must be 2-D [max_position, {half}], got {:?}", cos.shape())));
                };
                if w != half {
                    return Err(kernel_error(format!("the caches' last dimension {w} is not rotary_embedding_dim / 2 = {half}")));
                }
                if p.shape() != [layout.batch, layout.seq] {
                    return Err(kernel_error(format!("position_ids must have shape [{}, {}], got {:?}", layout.batch, layout.seq, p.shape())));
                }
                ints(p, "position_ids")?.into_iter().map(|id| usize::try_from(id).ok().filter(|&id| id < max_pos)
                    .ok_or_else(|| kernel_error(format!("position id {id} is out of range [0, {max_pos})")))).collect::<RuntimeResult<_>>()?
            }
            None => {
                if cos.shape() != [layout.batch, layout.seq, half] {
                    return Err(kernel_error(format!("without position_ids the caches must have shape [{}, {}, {half}], got {:?}", layout.batch, layout.seq, cos.shape())));
                }
                (0..tokens).collect()
            }
        };
        let (xv, cv, sv) = (to_f32(x)?, to_f32(cos)?, to_f32(sin)?);
        let out = rotate(&xv, layout, dim, interleaved, &rows, &cv, &sv);
        Ok(vec![from_f32(x.dtype(), x.shape(), out)?])
    })
}

/// `x` (laid out as `layout`) with the first `dim` values of every head vector rotated by the
/// angles of cache row `rows[b * seq + s]` (`dim / 2` cosines and sines per row, in `cos` and
/// `sin`): pairs are the two halves of the rotated part, or adjacent values when
/// `interleaved`; the rest of each head vector is copied.
pub(super) fn rotate(x: &[f32], layout: Heads, dim: usize, interleaved: bool, rows: &[usize], cos: &[f32], sin: &[f32]) -> Vec<f32> {
    let half = dim / 2;
    let mut out = x.to_vec();
    let Heads { batch, heads, seq, head_size, packed } = layout;
    for b in 0..batch {
        for h in 0..heads {
            for s in 0..seq {
                let at = if packed { (b * seq + s) * heads * head_size + h * head_size } else { ((b * heads + h) * seq + s) * head_size };
                let row = rows[b * seq + s] * half;
                let (c, sn) = (&cos[row..row + half], &sin[row..row + half]);
                let src = &x[at..at + dim];
                let dst = &mut out[at..at + dim];
                for p in 0..half {
                    let (i1, i2) = if interleaved { (2 * p, 2 * p + 1) } else { (p, p + half) };
                    let (x1, x2) = (src[i1], src[i2]);
                    dst[i1] = c[p] * x1 - sn[p] * x2;
                    dst[i2] = sn[p] * x1 + c[p] * x2;
                }
            }
        }
    }
    out
}

/// SwiGLU (opset 28): `Y = A · sigmoid(alpha · A) · B` elementwise over gate `A` and value
/// `B` of one shape and float type (no broadcasting). Computes in f32; Y has A's shape and
/// type.
fn swiglu(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let alpha = info.attr_float("alpha", 1.0);
    kernel(move |ins| {
        let (a, b) = (input(ins, 0)?, input(ins, 1)?);
        if a.shape() != b.shape() || a.dtype() != b.dtype() {
            return Err(kernel_error(format!("SwiGLU inputs A and B must share one shape and type, got {} {:?} and {} {:?}", a.dtype(), a.shape(), b.dtype(), b.shape())));
        }
        let (av, bv) = (to_f32(a)?, to_f32(b)?);
        let mut y = vec![0f32; av.len()];
        par_chunks_mut(&mut y, 1 << 14, min_items((1 << 14) * ELEMENT_WORK), || (), |_, c, dst| {
            let at = c << 14;
            for ((d, &x), &v) in dst.iter_mut().zip(&av[at..]).zip(&bv[at..]) {
                *d = x * sigmoid(alpha * x) * v;
            }
        });
        Ok(vec![from_f32(a.dtype(), a.shape(), y)?])
    })
}
