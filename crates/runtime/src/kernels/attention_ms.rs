//! ONNX Runtime's `com.microsoft` attention operators, with the contracts of its CPU kernels:
//! `Attention` (the Q/K/V projection inside), `MultiHeadAttention` (Q, K and V given) and
//! `RotaryEmbedding`.
//!
//! Both attentions compute `softmax(scale · Q·Kᵀ + mask + attention_bias) · V` per batch and
//! head in f32, Q·Kᵀ and P·V as batched products through the crate's gemm. Their masks are
//! ONNX Runtime's: finite additive values (`mask_filter_value`, default -10000) where a key is
//! masked, and the lowest f32 where causality (`unidirectional`) hides it, so a query whose
//! keys are all masked still attends all of them evenly, as ONNX Runtime's does.

use std::borrow::Cow;

use qforge_ir::{Tensor, MS_DOMAIN};

use super::attention::{batched_products, checked_len, concat_cache, masked_softmax, heads_to_sequence, positive_attr, rotary_dim_attr, rotate, Heads};
use super::elementwise::{from_f32, to_f32};
use super::gemm::{sgemm, MatRef};
use super::util::{input, ints, kernel, min_items, opt_input, par_chunks_mut, ELEMENT_WORK};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers Attention, MultiHeadAttention and RotaryEmbedding of `com.microsoft`.
pub fn register(r: &mut Registry) {
    r.add(MS_DOMAIN, "Attention", 1, LATEST, attention);
    r.add(MS_DOMAIN, "MultiHeadAttention", 1, LATEST, multi_head_attention);
    r.add(MS_DOMAIN, "RotaryEmbedding", 1, LATEST, rotary_embedding);
}

/// The sizes of one attention computation.
#[derive(Clone, Copy, Debug)]
struct Dims {
    batch: usize,
    heads: usize,
    /// Query positions per sequence (S).
    q_seq: usize,
    /// Cached keys before the new ones (P).
    past: usize,
    /// Keys each query may attend: the past ones and the new ones (T).
    total: usize,
    head_size: usize,
    v_head_size: usize,
}

/// Where head vectors sit in a token-major tensor `[batch, seq, ...]`: head `n` of token `t`
/// starts at `t * row + offset + n * head_stride`.
#[derive(Clone, Copy)]
struct Tokens {
    row: usize,
    offset: usize,
    head_stride: usize,
}

/// The head vectors of `src` (laid out as `at`) gathered into `[batch, heads, seq, head_size]`
/// (`h` gives the sizes), each plus `bias[n * head_size..]` of its head `n` when given.
fn to_heads(src: &[f32], h: Heads, at: Tokens, bias: Option<&[f32]>) -> Vec<f32> {
    let Heads { batch, heads, seq, head_size, .. } = h;
    let mut out = Vec::with_capacity(batch * heads * seq * head_size);
    for b in 0..batch {
        for n in 0..heads {
            for s in 0..seq {
                let start = (b * seq + s) * at.row + at.offset + n * at.head_stride;
                let x = &src[start..start + head_size];
                match bias {
                    Some(bias) => out.extend(x.iter().zip(&bias[n * head_size..(n + 1) * head_size]).map(|(a, c)| a + c)),
                    None => out.extend_from_slice(x),
                }
            }
        }
    }
    out
}

/// The additive mask `[batch, q_seq, total]` of a key mask and causality, as ONNX Runtime's
/// CPU kernels prepare it: a 1-D `[B]` mask holds how many leading keys each sequence attends
/// (later keys get `filter`), and when `with_starts` a `[2B]` one adds the first attended key
/// of each (earlier keys get `filter` too); a 2-D `[B, T]` or 3-D `[B, S, T]` mask attends
/// where it is positive and gives `filter` elsewhere. With `causal`, query `s` attends no key
/// after `past + s`: those get the lowest f32. `None` without mask and causality. The mask is
/// named `what` in errors.
fn mask_bias(mask: Option<&Tensor>, what: &str, d: Dims, causal: bool, filter: f32, with_starts: bool) -> RuntimeResult<Option<Vec<f32>>> {
    let Dims { batch, q_seq, past, total, .. } = d;
    if mask.is_none() && !causal {
        return Ok(None);
    }
    let mut out = vec![0f32; checked_len(&[batch, q_seq, total], "the attention mask")?];
    if let Some(m) = mask {
        let v = ints(m, what)?;
        let attend = |x: i64| if x > 0 { 0.0 } else { filter };
        match *m.shape() {
            [n] if n == batch || (with_starts && n == 2 * batch) => {
                for b in 0..batch {
                    let end = v[b].clamp(0, total as i64) as usize;
                    let start = if n == batch { 0 } else { v[batch + b].clamp(0, total as i64) as usize };
                    for row in out[b * q_seq * total..(b + 1) * q_seq * total].chunks_mut(total.max(1)) {
                        row[end..].fill(filter);
                        row[..start].fill(filter);
                    }
                }
            }
            [b_, t] if b_ == batch && t == total => {
                for b in 0..batch {
                    for row in out[b * q_seq * total..(b + 1) * q_seq * total].chunks_mut(total.max(1)) {
                        row.iter_mut().zip(&v[b * total..(b + 1) * total]).for_each(|(o, &x)| *o = attend(x));
                    }
                }
            }
            [b_, s, t] if b_ == batch && s == q_seq && t == total => out.iter_mut().zip(&v).for_each(|(o, &x)| *o = attend(x)),
            [_, _, _, _] => return Err(kernel_error(format!("a 4-D {what} (shape {:?}) is not supported (nor by ONNX Runtime's CPU kernel)", m.shape()))),
            _ => {
                let starts = if with_starts { format!(", [{}]", 2 * batch) } else { String::new() };
                return Err(kernel_error(format!("{what} must have shape [{batch}]{starts}, [{batch}, {total}] or [{batch}, {q_seq}, {total}], got {:?}", m.shape())));
            }
        }
    }
    if causal {
        for (r, row) in out.chunks_mut(total.max(1)).enumerate() {
            let s = r % q_seq.max(1);
            row.iter_mut().skip(past + s + 1).for_each(|x| *x = f32::MIN);
        }
    }
    Ok(Some(out))
}

/// An additive attention bias `[B or 1, N or 1, S, T]`: its values and the strides of its
/// batch and head dimensions (0 where broadcast).
struct AttnBias<'a> {
    values: Cow<'a, [f32]>,
    batch_stride: usize,
    head_stride: usize,
}

impl<'a> AttnBias<'a> {
    fn of(t: &'a Tensor, d: Dims) -> RuntimeResult<AttnBias<'a>> {
        let Dims { batch, heads, q_seq, total, .. } = d;
        let &[b, n, s, k] = t.shape() else {
            return Err(kernel_error(format!("attention_bias must be 4-D [{batch} or 1, {heads} or 1, {q_seq}, {total}], got shape {:?}", t.shape())));
        };
        if !(b == batch || b == 1) || !(n == heads || n == 1) || s != q_seq || k != total {
            return Err(kernel_error(format!("attention_bias must have shape [{batch} or 1, {heads} or 1, {q_seq}, {total}], got {:?}", t.shape())));
        }
        let block = q_seq * total;
        Ok(AttnBias { values: to_f32(t)?, batch_stride: if b == 1 { 0 } else { n * block }, head_stride: if n == 1 { 0 } else { block } })
    }
}

/// `softmax(scale · Q·Kᵀ + mask + bias) · V` for every batch and head, with Q
/// `[B, N, S, H]`, K `[B, N, T, H]`, V `[B, N, T, H_v]`, the mask `[B, S, T]` (see
/// [`mask_bias`]) and the bias; the result is token-major `[B, S, N · H_v]`.
fn attend(q: &[f32], k: &[f32], v: &[f32], d: Dims, scale: f32, mask: Option<&[f32]>, bias: Option<&AttnBias>) -> RuntimeResult<Vec<f32>> {
    let Dims { batch, heads, q_seq, total, head_size, v_head_size, .. } = d;
    let mut scores = vec![0f32; checked_len(&[batch, heads, q_seq, total], "attention scores")?];
    let out_len = checked_len(&[batch, q_seq, heads, v_head_size], "the attention output")?;
    let (q_block, k_block, v_block, p_block) = (q_seq * head_size, total * head_size, total * v_head_size, q_seq * total);
    batched_products(&mut scores, q_seq, total, head_size,
        |p| MatRef::rows(&q[p * q_block..(p + 1) * q_block], head_size),
        |p| MatRef::transposed(&k[p * k_block..(p + 1) * k_block], head_size));
    let row_len = total.max(1);
    par_chunks_mut(&mut scores, row_len, min_items(row_len * ELEMENT_WORK), || vec![0f32; total], |add, r, row| {
        let (p, s) = (r / q_seq, r % q_seq);
        let (b, h) = (p / heads, p % heads);
        match mask {
            Some(m) => add.copy_from_slice(&m[(b * q_seq + s) * total..(b * q_seq + s + 1) * total]),
            None => add.fill(0.0),
        }
        if let Some(bias) = bias {
            let at = b * bias.batch_stride + h * bias.head_stride + s * total;
            add.iter_mut().zip(&bias.values[at..at + total]).for_each(|(a, &c)| *a += c);
        }
        row.iter_mut().for_each(|x| *x *= scale);
        masked_softmax(row, add, |x| x);
    });
    let mut y = vec![0f32; out_len];
    batched_products(&mut y, q_seq, v_head_size, total,
        |p| MatRef::rows(&scores[p * p_block..(p + 1) * p_block], total),
        |p| MatRef::rows(&v[p * v_block..(p + 1) * v_block], v_head_size));
    Ok(heads_to_sequence(&y, batch, heads, q_seq, v_head_size))
}

/// The attention attributes both operators share.
#[derive(Clone, Copy)]
struct Common {
    heads: usize,
    causal: bool,
    filter: f32,
    /// The `scale` attribute; 0 means `1 / sqrt(head_size)`.
    scale: f32,
}

impl Common {
    fn of(info: &NodeInfo) -> RuntimeResult<Common> {
        let heads = positive_attr(info, "num_heads")?.ok_or_else(|| info.error("the 'num_heads' attribute is required"))?;
        Ok(Common {
            heads,
            causal: info.attr_int("unidirectional", 0) != 0,
            filter: info.attr_float("mask_filter_value", -10000.0),
            scale: info.attr_float("scale", 0.0),
        })
    }
    fn scale(&self, head_size: usize) -> f32 {
        if self.scale == 0.0 { 1.0 / (head_size as f32).sqrt() } else { self.scale }
    }
}

/// `Attention` (`com.microsoft`): inputs `(input [B, S, D_in], weights [D_in, D + D + D_v],
/// bias [D + D + D_v], mask_index?, past [2, B, N, P, H]?, attention_bias [B|1, N|1, S, T]?)`;
/// attributes `num_heads` (required), `qkv_hidden_sizes` (`[D, D, D_v]`, default three equal
/// thirds of the weights' columns), `unidirectional`, `mask_filter_value` (default -10000),
/// `scale` (default `1 / sqrt(H)`). Q, K and V are `input · weights + bias`, split into heads;
/// `past` (keys then values, which then need `D_v = D`) is prepended to K and V, giving the
/// optional output `present [2, B, N, P + S, H]`. `mask_index` is `[B]` key lengths, `[2B]`
/// key ends and starts, `[B, T]` or `[B, S, T]` 0/1 masks (see [`mask_bias`]); a `[B, 1]` or
/// `[1, 1]` one masks nothing. Output `[B, S, D_v]`. `do_rotary`, `past_present_share_buffer`
/// (with `past_sequence_length`) and 4-D masks are refused.
fn attention(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let c = Common::of(info)?;
    let sizes = match info.attr_ints("qkv_hidden_sizes") {
        None => None,
        Some(v) if v.len() == 3 && v.iter().all(|&x| x > 0 && x % c.heads as i64 == 0) && v[0] == v[1] => Some([v[0] as usize, v[1] as usize, v[2] as usize]),
        Some(v) => return Err(info.error(format!("qkv_hidden_sizes must be three positive multiples of num_heads {}, the first two equal, got {v:?}", c.heads))),
    };
    for name in ["do_rotary", "past_present_share_buffer"] {
        if info.attr_int(name, 0) != 0 {
            return Err(info.error(format!("'{name}' is not supported")));
        }
    }
    let wants_present = info.node.outputs.get(1).is_some_and(|o| o.is_some());
    kernel(move |ins| {
        let (x, w) = (input(ins, 0)?, input(ins, 1)?);
        let &[batch, q_seq, d_in] = x.shape() else {
            return Err(kernel_error(format!("input must be 3-D [batch, sequence, hidden], got shape {:?}", x.shape())));
        };
        let &[w_in, cols] = w.shape() else {
            return Err(kernel_error(format!("weights must be 2-D [{d_in}, Q + K + V hidden sizes], got shape {:?}", w.shape())));
        };
        if w_in != d_in {
            return Err(kernel_error(format!("weights has {w_in} rows, but the input's hidden size is {d_in}")));
        }
        let [dq, dk, dv] = match sizes {
            Some(s) => s,
            None if cols % (3 * c.heads) == 0 => [cols / 3; 3],
            None => return Err(kernel_error(format!("weights' {cols} columns do not split into Q, K and V of num_heads {} heads each", c.heads))),
        };
        if dq + dk + dv != cols {
            return Err(kernel_error(format!("weights has {cols} columns, not the Q, K and V hidden sizes {dq} + {dk} + {dv}")));
        }
        let bias = input(ins, 2)?;
        if bias.shape() != [cols] {
            return Err(kernel_error(format!("bias must be 1-D [{cols}], got shape {:?}", bias.shape())));
        }
        let bias = to_f32(bias)?;
        if opt_input(ins, 6).is_some() {
            return Err(kernel_error("past_sequence_length is only read with past_present_share_buffer, which is not supported"));
        }
        let (head_size, v_head_size) = (dq / c.heads, dv / c.heads);
        let past = match opt_input(ins, 4) {
            Some(p) => {
                if dk != dv {
                    return Err(kernel_error(format!("past needs equal K and V hidden sizes, got {dk} and {dv}")));
                }
                match *p.shape() {
                    [2, b, n, len, h] if b == batch && n == c.heads && h == head_size => Some((to_f32(p)?, len)),
                    _ => return Err(kernel_error(format!("past must have shape [2, {batch}, {}, past_sequence, {head_size}], got {:?}", c.heads, p.shape()))),
                }
            }
            None => None,
        };
        let past_len = past.as_ref().map_or(0, |p| p.1);
        let d = Dims { batch, heads: c.heads, q_seq, past: past_len, total: past_len + q_seq, head_size, v_head_size };
        let mut qkv = vec![0f32; checked_len(&[batch, q_seq, cols], "the Q/K/V projection")?];
        let (xv, wv) = (to_f32(x)?, to_f32(w)?);
        sgemm(batch * q_seq, cols, d_in, MatRef::rows(&xv, d_in), MatRef::rows(&wv, cols), &mut qkv, false);
        let qk_heads = Heads { batch, heads: c.heads, seq: q_seq, head_size, packed: false };
        let v_heads = Heads { head_size: v_head_size, ..qk_heads };
        let part = |from: usize, to: usize| Some(&bias[from..to]);
        let q = to_heads(&qkv, qk_heads, Tokens { row: cols, offset: 0, head_stride: head_size }, part(0, dq));
        let mut k = to_heads(&qkv, qk_heads, Tokens { row: cols, offset: dq, head_stride: head_size }, part(dq, dq + dk));
        let mut v = to_heads(&qkv, v_heads, Tokens { row: cols, offset: dq + dk, head_stride: v_head_size }, part(dq + dk, cols));
        if let Some((p, len)) = &past {
            let half = p.len() / 2;
            k = concat_cache(Some((&p[..half], *len)), &k, qk_heads);
            v = concat_cache(Some((&p[half..], *len)), &v, v_heads);
        }
        let mask = match opt_input(ins, 3) {
            // A [B, 1] or [1, 1] mask (unless it is a [B, T] one) has one value per row:
            // ONNX Runtime reads it as no mask.
            Some(m) if m.rank() == 2 && m.shape()[1] == 1 && (m.shape()[0] == 1 || m.shape()[0] == batch) && !(m.shape()[0] == batch && d.total == 1) => None,
            m => m,
        };
        let mask = mask_bias(mask, "mask_index", d, c.causal && q_seq > 1, c.filter, true)?;
        let bias = opt_input(ins, 5).map(|t| AttnBias::of(t, d)).transpose()?;
        let y = attend(&q, &k, &v, d, c.scale(head_size), mask.as_deref(), bias.as_ref())?;
        let present = match wants_present {
            true if dk != dv => return Err(kernel_error(format!("present needs equal K and V hidden sizes, got {dk} and {dv}"))),
            true => from_f32(x.dtype(), &[2, batch, c.heads, d.total, head_size], [k, v].concat())?,
            false => Tensor::scalar(0f32),
        };
        Ok(vec![from_f32(x.dtype(), &[batch, q_seq, dv], y)?, present])
    })
}

/// `MultiHeadAttention` (`com.microsoft`): inputs `(query, key?, value?, bias?,
/// key_padding_mask?, attention_bias?, past_key?, past_value?)`; attributes `num_heads`
/// (required), `unidirectional`, `mask_filter_value` (default -10000), `scale` (default
/// `1 / sqrt(H)`). Q, K and V come as `query [B, S, D]`, `key [B, L, D]` and
/// `value [B, L, D_v]` (plus the matching thirds of `bias [D + D + D_v]`), or with key and
/// value already split into heads, `[B, N, L, H]` and `[B, N, L, H_v]` (no bias, no past), or
/// packed: `query [B, S, N, 3, H]` alone, or `key [B, L, N, 2, H]` without value (ONNX
/// Runtime's CPU kernel refuses the packed forms; qforge unpacks them). `past_key
/// [B, N, P, H]` and `past_value [B, N, P, H_v]` are prepended to K and V, giving the optional
/// outputs `present_key` and `present_value`. `key_padding_mask` is `[B]` key lengths,
/// `[B, T]` or `[B, S, T]` 0/1 masks (see [`mask_bias`]); `attention_bias` is
/// `[B|1, N|1, S, T]`. Output `[B, S, N · H_v]`. The decoder inputs `past_sequence_length`
/// and `cache_indirection`, and the `qk` output, are refused.
fn multi_head_attention(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let c = Common::of(info)?;
    if info.node.outputs.get(3).is_some_and(|o| o.is_some()) {
        return Err(info.error("the 'qk' output is not supported"));
    }
    kernel(move |ins| {
        if opt_input(ins, 8).is_some() || opt_input(ins, 9).is_some() {
            return Err(kernel_error("past_sequence_length and cache_indirection (decoder attention) are not supported"));
        }
        let query = input(ins, 0)?;
        let heads = c.heads;
        let Qkv { batch, q_seq, kv_seq, head_size, v_head_size, q, k, v, projected } = mha_qkv(ins, heads)?;
        let past = match (opt_input(ins, 6), opt_input(ins, 7)) {
            (None, None) => None,
            (Some(pk), Some(pv)) => {
                if !projected {
                    return Err(kernel_error("past_key and past_value must be omitted when key and value are 4-D [B, N, L, H]"));
                }
                match (pk.shape(), pv.shape()) {
                    (&[b, n, len, h], &[b2, n2, len2, h2]) if b == batch && b2 == batch && n == heads && n2 == heads && len == len2 && h == head_size && h2 == v_head_size => Some((to_f32(pk)?, to_f32(pv)?, len)),
                    _ => return Err(kernel_error(format!("past_key and past_value must have shapes [{batch}, {heads}, P, {head_size}] and [{batch}, {heads}, P, {v_head_size}], got {:?} and {:?}", pk.shape(), pv.shape()))),
                }
            }
            _ => return Err(kernel_error("past_key and past_value must be given together")),
        };
        let past_len = past.as_ref().map_or(0, |p| p.2);
        let d = Dims { batch, heads, q_seq, past: past_len, total: past_len + kv_seq, head_size, v_head_size };
        let (k, v) = match &past {
            Some((pk, pv, len)) => {
                let layout = Heads { batch, heads, seq: kv_seq, head_size, packed: false };
                (concat_cache(Some((pk, *len)), &k, layout), concat_cache(Some((pv, *len)), &v, Heads { head_size: v_head_size, ..layout }))
            }
            None => (k, v),
        };
        let mask = mask_bias(opt_input(ins, 4), "key_padding_mask", d, c.causal && q_seq > 1, c.filter, false)?;
        let attn_bias = opt_input(ins, 5).map(|t| AttnBias::of(t, d)).transpose()?;
        let y = attend(&q, &k, &v, d, c.scale(head_size), mask.as_deref(), attn_bias.as_ref())?;
        let dtype = query.dtype();
        Ok(vec![
            from_f32(dtype, &[batch, q_seq, heads * v_head_size], y)?,
            from_f32(dtype, &[batch, heads, d.total, head_size], k)?,
            from_f32(dtype, &[batch, heads, d.total, v_head_size], v)?,
        ])
    })
}

/// MultiHeadAttention's Q, K and V split into heads (`[B, N, S or L, H or H_v]`), with their
/// sizes; `projected` unless key and value came 4-D (then no past may be added).
struct Qkv {
    batch: usize,
    q_seq: usize,
    kv_seq: usize,
    head_size: usize,
    v_head_size: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    projected: bool,
}

/// Q, K and V of a MultiHeadAttention from its inputs `(query, key?, value?, bias?)` in any of
/// the forms it takes (see [`multi_head_attention`]), the bias added.
fn mha_qkv(ins: &[Option<&Tensor>], heads: usize) -> RuntimeResult<Qkv> {
    let query = input(ins, 0)?;
    let qv = to_f32(query)?;
    let bias = opt_input(ins, 3).map(|b| to_f32(b).map(|v| (v, b.shape().to_vec()))).transpose()?;
    let (key, value) = (opt_input(ins, 1), opt_input(ins, 2));
    match (query.shape(), key) {
        (&[batch, q_seq, n, 3, h], None) if n == heads => {
            if value.is_some() {
                return Err(kernel_error("value must be omitted with a packed query [B, S, N, 3, H]"));
            }
            let hid = heads * h;
            let b = check_bias(bias.as_ref(), hid, hid)?;
            let layout = Heads { batch, heads, seq: q_seq, head_size: h, packed: false };
            let at = |j: usize| Tokens { row: heads * 3 * h, offset: j * h, head_stride: 3 * h };
            let part = |j: usize| b.map(|b| &b[j * hid..(j + 1) * hid]);
            let (q, k, v) = (to_heads(&qv, layout, at(0), part(0)), to_heads(&qv, layout, at(1), part(1)), to_heads(&qv, layout, at(2), part(2)));
            Ok(Qkv { batch, q_seq, kv_seq: q_seq, head_size: h, v_head_size: h, q, k, v, projected: true })
        }
        (&[batch, q_seq, hid], Some(key)) => {
            if hid % heads != 0 {
                return Err(kernel_error(format!("query hidden size {hid} is not divisible by num_heads {heads}")));
            }
            let h = hid / heads;
            let q_layout = Heads { batch, heads, seq: q_seq, head_size: h, packed: false };
            let q_at = Tokens { row: hid, offset: 0, head_stride: h };
            let kv = to_f32(key)?;
            match (key.shape(), value) {
                (&[kb, kv_seq, kh], Some(value)) if kb == batch && kh == hid && value.rank() == 3 && value.shape()[..2] == [batch, kv_seq] && value.shape()[2] % heads == 0 => {
                    let dv = value.shape()[2];
                    let b = check_bias(bias.as_ref(), hid, dv)?;
                    let layout = Heads { seq: kv_seq, ..q_layout };
                    let k = to_heads(&kv, layout, q_at, b.map(|b| &b[hid..2 * hid]));
                    let v = to_heads(&to_f32(value)?, Heads { head_size: dv / heads, ..layout }, Tokens { row: dv, offset: 0, head_stride: dv / heads }, b.map(|b| &b[2 * hid..]));
                    let q = to_heads(&qv, q_layout, q_at, b.map(|b| &b[..hid]));
                    Ok(Qkv { batch, q_seq, kv_seq, head_size: h, v_head_size: dv / heads, q, k, v, projected: true })
                }
                (&[kb, kv_seq, n, 2, kh], None) if kb == batch && n == heads && kh == h => {
                    let b = check_bias(bias.as_ref(), hid, hid)?;
                    let layout = Heads { seq: kv_seq, ..q_layout };
                    let at = |j: usize| Tokens { row: heads * 2 * h, offset: j * h, head_stride: 2 * h };
                    let (k, v) = (to_heads(&kv, layout, at(0), b.map(|b| &b[hid..2 * hid])), to_heads(&kv, layout, at(1), b.map(|b| &b[2 * hid..])));
                    let q = to_heads(&qv, q_layout, q_at, b.map(|b| &b[..hid]));
                    Ok(Qkv { batch, q_seq, kv_seq, head_size: h, v_head_size: h, q, k, v, projected: true })
                }
                (&[kb, n, kv_seq, kh], Some(value)) if kb == batch && n == heads && kh == h && value.rank() == 4 && value.shape()[..3] == [batch, heads, kv_seq] => {
                    if bias.is_some() {
                        return Err(kernel_error("bias must be omitted when key and value are 4-D [B, N, L, H]"));
                    }
                    let q = to_heads(&qv, q_layout, q_at, None);
                    Ok(Qkv { batch, q_seq, kv_seq, head_size: h, v_head_size: value.shape()[3], q, k: kv.into_owned(), v: to_f32(value)?.into_owned(), projected: false })
                }
                (ks, value) => Err(kernel_error(format!(
                    "with query [{batch}, {q_seq}, {hid}], key and value must be [{batch}, L, {hid}] and [{batch}, L, D_v], [{batch}, {heads}, L, {h}] and [{batch}, {heads}, L, H_v], or key [{batch}, L, {heads}, 2, {h}] alone; got {ks:?} and {:?}",
                    value.map(|v| v.shape())))),
            }
        }
        (qs, None) => Err(kernel_error(format!("key is required unless query is packed [B, S, {heads}, 3, H] (a packed [B, S, 3 * D] query is not supported, nor by ONNX Runtime's CPU kernel); got query {qs:?}"))),
        (qs, Some(k)) => Err(kernel_error(format!("query must be 3-D [B, S, D] when key is given, got {qs:?} with key {:?}", k.shape()))),
    }
}

/// The bias of a MultiHeadAttention whose Q and K have `hidden` and V `v_hidden` values per
/// token: 1-D `[hidden + hidden + v_hidden]` when given.
fn check_bias<'a>(bias: Option<&'a (Cow<'_, [f32]>, Vec<usize>)>, hidden: usize, v_hidden: usize) -> RuntimeResult<Option<&'a [f32]>> {
    match bias {
        None => Ok(None),
        Some((v, shape)) if shape[..] == [2 * hidden + v_hidden] => Ok(Some(&v[..])),
        Some((_, shape)) => Err(kernel_error(format!("bias must be 1-D [{}] (Q, K and V hidden sizes {hidden} + {hidden} + {v_hidden}), got shape {shape:?}", 2 * hidden + v_hidden))),
    }
}

/// `RotaryEmbedding` (`com.microsoft`): inputs `(input, position_ids, cos_cache, sin_cache)`,
/// attributes `interleaved`, `num_heads`, `rotary_embedding_dim` (default: the head size).
/// `input` is `[B, S, N · H]` or `[B, N, S, H]`; the head size `H` is `2 ·` the caches' width
/// without `rotary_embedding_dim`, else the hidden size over `num_heads` (required then). The
/// caches are `[max_position, rotary_embedding_dim / 2]`; `position_ids` (int64) is
/// `[B, S]`, or one value: the position of each sequence's first token, the others
/// following. The first `rotary_embedding_dim` values of each head vector are rotated (see
/// [`rotate`]), the rest copied. `is_packed_batching` is refused.
fn rotary_embedding(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let interleaved = info.attr_int("interleaved", 0) != 0;
    let num_heads = positive_attr(info, "num_heads")?;
    let rotary_dim = rotary_dim_attr(info)?;
    if rotary_dim.is_some() && num_heads.is_none() {
        return Err(info.error("num_heads is required when rotary_embedding_dim is set"));
    }
    if info.attr_int("is_packed_batching", 0) != 0 {
        return Err(info.error("'is_packed_batching' is not supported"));
    }
    kernel(move |ins| {
        let (x, pos, cos, sin) = (input(ins, 0)?, input(ins, 1)?, input(ins, 2)?, input(ins, 3)?);
        let &[max_pos, half] = cos.shape() else {
            return Err(kernel_error(format!("cos_cache must be 2-D [max_position, rotary_dim / 2], got shape {:?}", cos.shape())));
        };
        if sin.shape() != cos.shape() {
            return Err(kernel_error(format!("cos_cache and sin_cache must share one shape, got {:?} and {:?}", cos.shape(), sin.shape())));
        }
        let (batch, seq, hidden, given) = match *x.shape() {
            [b, s, hid] => (b, s, hid, None),
            [b, n, s, h] => (b, s, n * h, Some((n, h))),
            _ => return Err(kernel_error(format!("input must be 3-D [B, S, N * H] or 4-D [B, N, S, H], got shape {:?}", x.shape()))),
        };
        let head_size = match (rotary_dim, num_heads) {
            (Some(_), Some(n)) if hidden % n == 0 => hidden / n,
            (Some(_), Some(n)) => return Err(kernel_error(format!("the hidden size {hidden} is not divisible by num_heads {n}"))),
            _ => 2 * half,
        };
        if head_size == 0 || hidden % head_size != 0 {
            return Err(kernel_error(format!("the hidden size {hidden} does not split into heads of {head_size} (twice the caches' width {half})")));
        }
        let heads = hidden / head_size;
        if num_heads.is_some_and(|n| n != heads) || given.is_some_and(|g| g != (heads, head_size)) {
            return Err(kernel_error(format!("input {:?} does not have {} heads of size {head_size}", x.shape(), num_heads.unwrap_or(heads))));
        }
        let dim = rotary_dim.unwrap_or(head_size);
        if dim > head_size || dim % 2 != 0 || dim / 2 != half {
            return Err(kernel_error(format!("rotary_embedding_dim {dim} must be even, at most the head size {head_size}, and twice the caches' width {half}")));
        }
        let p = ints(pos, "position_ids")?;
        let first: Vec<i64> = match (pos.rank(), p.len()) {
            (0 | 1, 1) => (0..batch * seq).map(|t| p[0] + (t % seq) as i64).collect(),
            _ if pos.shape() == [batch, seq] => p,
            _ => return Err(kernel_error(format!("position_ids must be [{batch}, {seq}] or hold one value, got shape {:?}", pos.shape()))),
        };
        let rows = first.into_iter().map(|id| usize::try_from(id).ok().filter(|&i| i < max_pos)
            .ok_or_else(|| kernel_error(format!("position {id} is out of range for the caches' {max_pos} rows")))).collect::<RuntimeResult<Vec<_>>>()?;
        let layout = Heads { batch, heads, seq, head_size, packed: given.is_none() };
        let out = rotate(&to_f32(x)?, layout, dim, interleaved, &rows, &to_f32(cos)?, &to_f32(sin)?);
        Ok(vec![from_f32(x.dtype(), x.shape(), out)?])
    })
}
