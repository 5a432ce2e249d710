//! Linear quantization: `QuantizeLinear` and `DequantizeLinear` (opsets 10 and later) with
//! integer types u8, i8, u16, i16, i32 (dequantization only), u4, i4, u2, i2, per-tensor,
//! per-axis (opset 13+) and blocked (opset 21+) parameters. Results are bit-identical to
//! ONNX Runtime's CPU kernels. Float8, float6 and float4 formats are refused.

use qforge_ir::{DType, Tensor, MS_DOMAIN};

use super::elementwise::{from_f32, to_f32};
use super::math::round_even_int;
use std::mem::MaybeUninit;

use super::util::{axis as norm_axis, input, kernel, map_into, opt_input, par_chunks_mut, tensor, threads, written};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers `QuantizeLinear` and `DequantizeLinear`, and ONNX Runtime's `com.microsoft`
/// contrib forms of both.
pub fn register(r: &mut Registry) {
    r.add("", "QuantizeLinear", 10, LATEST, quantize_linear);
    r.add("", "DequantizeLinear", 10, LATEST, dequantize_linear);
    r.add(MS_DOMAIN, "QuantizeLinear", 1, 1, quantize_linear);
    r.add(MS_DOMAIN, "DequantizeLinear", 1, 1, dequantize_linear);
}

/// The ONNX opset whose QuantizeLinear/DequantizeLinear a `com.microsoft` Q/DQ (version 1)
/// behaves like: it takes opset 21's 8-, 16- and 4-bit types and `axis`, but has no
/// `block_size` or `output_dtype`.
const CONTRIB_EQUIVALENT_OPSET: i64 = 21;

/// Elements per parallel chunk (a multiple of 4, so chunks of packed outputs end on bytes).
const CHUNK: usize = 1 << 15;

/// Attributes shared by both operators, read when the session is planned.
#[derive(Clone, Copy)]
struct Attrs {
    opset: i64,
    axis: i64,
    block_size: i64,
    output_dtype: Option<DType>,
}

fn read_attrs(info: &NodeInfo) -> RuntimeResult<Attrs> {
    let contrib = info.node.domain == MS_DOMAIN;
    let opset = if contrib { CONTRIB_EQUIVALENT_OPSET } else { info.opset };
    let block_size = if opset >= 21 && !contrib { info.attr_int("block_size", 0) } else { 0 };
    if block_size < 0 {
        return Err(info.error(format!("block_size must be positive, got {block_size}")));
    }
    let code = if opset >= 21 && !contrib { info.attr_int("output_dtype", 0) } else { 0 };
    let output_dtype = match code {
        0 => None,
        c => Some(i32::try_from(c).ok().and_then(DType::from_onnx).ok_or_else(|| info.error(format!("output_dtype {c} is not an ONNX type")))?),
    };
    Ok(Attrs { opset, axis: if opset >= 13 { info.attr_int("axis", 1) } else { 1 }, block_size, output_dtype })
}

/// Refuses element types of the quantized side that qforge does not implement or that the
/// node's opset does not allow.
fn check_quantized_type(dtype: DType, opset: i64, dequantize: bool) -> RuntimeResult<()> {
    use DType::*;
    let since = match dtype {
        U8 | I8 => 10,
        I32 if dequantize => 10,
        U16 | I16 | U4 | I4 => 21,
        U2 | I2 => 25,
        F8E4M3FN | F8E4M3FNUZ | F8E5M2 | F8E5M2FNUZ => {
            return Err(kernel_error(format!("float8 quantization ({dtype}) is not supported; use an integer type")))
        }
        F4E2M1 | F6E2M3 | F6E3M2 => return Err(kernel_error(format!("{dtype} quantization is not supported; use an integer type"))),
        d => return Err(kernel_error(format!("{d} is not a quantized type of {}", if dequantize { "DequantizeLinear" } else { "QuantizeLinear" }))),
    };
    if opset < since {
        return Err(kernel_error(format!("{dtype} quantization needs opset {since}, the model imports opset {opset}")));
    }
    Ok(())
}

/// Refuses float types (of `x`, the scale, or the dequantized output) outside f32 before
/// opset 19 and outside f32/f16/bf16 after.
fn check_float_type(dtype: DType, opset: i64, what: &str) -> RuntimeResult<()> {
    match dtype {
        DType::F32 => Ok(()),
        DType::F16 | DType::BF16 if opset >= 19 => Ok(()),
        DType::F16 | DType::BF16 => Err(kernel_error(format!("{what} of type {dtype} needs opset 19, the model imports opset {opset}"))),
        d => Err(kernel_error(format!("{what} must be float, float16 or bfloat16, got {d}"))),
    }
}

/// Inclusive value range of an integer quantized type (the int32 range for others).
fn range(dtype: DType) -> (i32, i32) {
    dtype.int_range().filter(|_| dtype != DType::U32).map_or((i32::MIN, i32::MAX), |(lo, hi)| (lo as i32, hi as i32))
}

/// Bits per element of the packed types (4 or 2), 0 for byte-addressed types.
fn packed_bits(dtype: DType) -> usize {
    match dtype {
        DType::U4 | DType::I4 => 4,
        DType::U2 | DType::I2 => 2,
        _ => 0,
    }
}

/// Integer element types the kernels read and write directly.
trait QInt: Copy + Default + Send + Sync + 'static {
    fn get(self) -> i32;
    /// `v` must be in the type's range.
    fn put(v: i32) -> Self;
}

macro_rules! qint {
    ($($t:ty),*) => { $(impl QInt for $t {
        #[inline(always)] fn get(self) -> i32 { self as i32 }
        #[inline(always)] fn put(v: i32) -> Self { v as $t }
    })* };
}
qint!(u8, i8, u16, i16, i32);

/// Unpacks `n` packed elements of `bits` bits (low bits first), sign-extending when `signed`.
fn unpack(raw: &[u8], bits: usize, signed: bool, n: usize) -> Vec<i8> {
    let per = 8 / bits;
    let mask = (1u8 << bits) - 1;
    let shift = 8 - bits as u32;
    let mut out = vec![0i8; n];
    par_chunks_mut(&mut out, CHUNK, 1, || (), |_, c, dst| {
        let base = c * CHUNK / per;
        for (i, d) in dst.iter_mut().enumerate() {
            let v = (raw[base + i / per] >> (bits * (i % per))) & mask;
            *d = if signed { ((v << shift) as i8) >> shift } else { v as i8 };
        }
    });
    out
}

/// Packs values of `bits` bits two or four to a byte, first element in the low bits.
fn pack(vals: &[i8], bits: usize) -> Vec<u8> {
    let per = 8 / bits;
    let mask = (1u8 << bits) - 1;
    let mut out = vec![0u8; vals.len().div_ceil(per)];
    par_chunks_mut(&mut out, CHUNK / per, 1, || (), |_, c, dst| {
        for (d, group) in dst.iter_mut().zip(vals[c * CHUNK..].chunks(per)) {
            *d = group.iter().enumerate().fold(0u8, |acc, (k, &v)| acc | ((v as u8 & mask) << (bits * k)));
        }
    });
    out
}

/// The elements of a quantized-side tensor as `i32` (small, for zero points).
fn ints_of(t: &Tensor) -> RuntimeResult<Vec<i32>> {
    Ok(match t.dtype() {
        DType::U8 => t.as_slice::<u8>().unwrap().iter().map(|&v| v as i32).collect(),
        DType::I8 => t.as_slice::<i8>().unwrap().iter().map(|&v| v as i32).collect(),
        DType::U16 => t.as_slice::<u16>().unwrap().iter().map(|&v| v as i32).collect(),
        DType::I16 => t.as_slice::<i16>().unwrap().iter().map(|&v| v as i32).collect(),
        DType::I32 => t.as_slice::<i32>().unwrap().to_vec(),
        d if packed_bits(d) > 0 => unpack(t.raw_bytes().unwrap(), packed_bits(d), d.is_signed(), t.len()).into_iter().map(|v| v as i32).collect(),
        d => return Err(kernel_error(format!("zero point of type {d} is not supported"))),
    })
}

/// How parameters apply to one contiguous run of elements: one parameter for the whole run,
/// or consecutive parameters from an index on, one per element.
#[derive(Clone, Copy)]
enum Param {
    Same(usize),
    Each(usize),
}

/// Which parameter each element of `x` uses. `x` is seen as rows of `row_len` contiguous
/// elements.
#[derive(Clone, Copy)]
enum Kind {
    /// One parameter.
    Tensor,
    /// Per-axis, the axis not last: row `r` uses parameter `r % d`.
    Axis { d: usize },
    /// Per-axis along the last axis: element `i` of a row uses parameter `i`.
    AxisLast,
    /// Blocked, the axis not last: rows are `(p, i)` over `[pre, d]`; element `q` uses
    /// parameter `(p * sd + i / b) * row_len + q`.
    Block { d: usize, b: usize, sd: usize },
    /// Blocked along the last axis: element `i` of row `r` uses parameter `r * sd + i / b`.
    BlockLast { b: usize, sd: usize },
}

#[derive(Clone, Copy)]
struct Plan {
    row_len: usize,
    kind: Kind,
}

impl Plan {
    /// Works out the granularity from the shapes of `x` and the scale, as ONNX Runtime does:
    /// a scalar or one-element scale is per-tensor; otherwise per-axis without `block_size`
    /// and blocked with it.
    fn new(x: &[usize], scale: &[usize], a: &Attrs) -> RuntimeResult<Plan> {
        let n: usize = x.iter().product();
        let count: usize = scale.iter().product();
        if scale.len() <= 1 && count == 1 {
            return Ok(Plan { row_len: n, kind: Kind::Tensor });
        }
        if a.opset < 13 {
            return Err(kernel_error(format!("scale of shape {scale:?} is not per-tensor; per-axis quantization needs opset 13")));
        }
        let ax = norm_axis(a.axis, x.len())?;
        let (d, post) = (x[ax], x[ax + 1..].iter().product::<usize>());
        let kind = if a.block_size == 0 {
            if scale.len() != 1 || scale[0] != d {
                return Err(kernel_error(format!("per-axis scale must be 1-D of length {d} (dimension {ax} of x {x:?}), got shape {scale:?}")));
            }
            if post == 1 { Kind::AxisLast } else { Kind::Axis { d } }
        } else {
            let b = a.block_size as usize;
            let mut want = x.to_vec();
            want[ax] = d.div_ceil(b);
            if scale != want.as_slice() {
                return Err(kernel_error(format!("blocked scale for x {x:?}, axis {ax} and block_size {b} must have shape {want:?}, got {scale:?}")));
            }
            let sd = want[ax];
            if post == 1 { Kind::BlockLast { b, sd } } else { Kind::Block { d, b, sd } }
        };
        Ok(match kind {
            Kind::AxisLast | Kind::BlockLast { .. } => Plan { row_len: d, kind },
            _ => Plan { row_len: post, kind },
        })
    }

    /// Calls `f(offset in row, length, parameters)` for the runs of row `r` within `lo..hi`.
    #[inline]
    fn runs(&self, r: usize, lo: usize, hi: usize, mut f: impl FnMut(usize, usize, Param)) {
        match self.kind {
            Kind::Tensor => f(lo, hi - lo, Param::Same(0)),
            Kind::Axis { d } => f(lo, hi - lo, Param::Same(r % d)),
            Kind::AxisLast => f(lo, hi - lo, Param::Each(lo)),
            Kind::Block { d, b, sd } => f(lo, hi - lo, Param::Each(((r / d) * sd + (r % d) / b) * self.row_len + lo)),
            Kind::BlockLast { b, sd } => {
                let mut s = lo;
                while s < hi {
                    let k = s / b;
                    let e = ((k + 1) * b).min(hi);
                    f(s, e - s, Param::Same(r * sd + k));
                    s = e;
                }
            }
        }
    }

    /// Fills `out` (one element per element of `x`) run by run: `f(flat start, dst, params)`,
    /// split across the thread pool for large tensors.
    fn fill<O: Send>(&self, out: &mut [O], f: impl Fn(usize, &mut [O], Param) + Sync) {
        use rayon::prelude::*;
        if out.is_empty() {
            return;
        }
        let work = |start: usize, chunk: &mut [O]| {
            let end = start + chunk.len();
            let mut i = start;
            while i < end {
                let r = i / self.row_len;
                let lo = i - r * self.row_len;
                let hi = self.row_len.min(lo + end - i);
                self.runs(r, lo, hi, |off, len, p| {
                    let s = r * self.row_len + off;
                    f(s, &mut chunk[s - start..s - start + len], p)
                });
                i += hi - lo;
            }
        };
        if out.len() < 2 * CHUNK || threads() == 1 {
            work(0, out);
        } else {
            out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| work(c * CHUNK, chunk));
        }
    }
}

/// `clamp(round_half_to_even(v / s) + z, qmin, qmax)` as ONNX Runtime computes it: clamping
/// `v / s` to `[qmin - z, qmax - z]` before rounding gives the same integer, and NaN becomes
/// `qmin` (`f32::max` returns the non-NaN operand), as in ONNX Runtime's vector kernels.
#[inline(always)]
fn quantize_one(v: f32, s: f32, z: i32, lo: f32, hi: f32) -> i32 {
    round_even_int((v / s).max(lo).min(hi)) + z
}

/// Quantizes one run into `out` (every element written).
#[inline(always)]
fn quantize_run<O: QInt>(x: &[f32], out: &mut [MaybeUninit<O>], scale: &[f32], zp: &[i32], p: Param, (qmin, qmax): (i32, i32)) {
    match p {
        Param::Same(k) => {
            let (s, z) = (scale[k], zp[k]);
            let (lo, hi) = ((qmin - z) as f32, (qmax - z) as f32);
            map_into(out, x, |v| MaybeUninit::new(O::put(quantize_one(v, s, z, lo, hi))));
        }
        Param::Each(k) => {
            let n = out.len();
            for (((o, &v), &s), &z) in out.iter_mut().zip(x).zip(&scale[k..k + n]).zip(&zp[k..k + n]) {
                *o = MaybeUninit::new(O::put(quantize_one(v, s, z, (qmin - z) as f32, (qmax - z) as f32)));
            }
        }
    }
}

/// Dequantizes one run into `out` (every element written): `f32(x - z) * s`, the subtraction
/// in 32-bit integers.
#[inline(always)]
fn dequantize_run<I: QInt>(x: &[I], out: &mut [MaybeUninit<f32>], scale: &[f32], zp: &[i32], p: Param) {
    match p {
        Param::Same(k) => {
            let (s, z) = (scale[k], zp[k]);
            map_into(out, x, |v| MaybeUninit::new(v.get().wrapping_sub(z) as f32 * s));
        }
        Param::Each(k) => {
            let n = out.len();
            for (((o, &v), &s), &z) in out.iter_mut().zip(x).zip(&scale[k..k + n]).zip(&zp[k..k + n]) {
                *o = MaybeUninit::new(v.get().wrapping_sub(z) as f32 * s);
            }
        }
    }
}

/// Scale as f32 values (float, float16 or bfloat16) and the zero point as i32 values (zeros
/// when omitted), checked to have the same shape.
fn params(scale: &Tensor, zp: Option<&Tensor>, opset: i64) -> RuntimeResult<(Vec<f32>, Vec<i32>)> {
    check_float_type(scale.dtype(), opset, "scale")?;
    let s = to_f32(scale)?.into_owned();
    let z = match zp {
        Some(z) => {
            let same = z.shape() == scale.shape() || (z.len() == 1 && s.len() == 1 && z.rank() <= 1 && scale.rank() <= 1);
            if !same {
                return Err(kernel_error(format!("zero point shape {:?} differs from scale shape {:?}", z.shape(), scale.shape())));
            }
            ints_of(z)?
        }
        None => vec![0; s.len()],
    };
    Ok((s, z))
}

/// `QuantizeLinear`: `y = saturate(round_half_to_even(x / y_scale) + y_zero_point)`, the
/// division in f32 (x and scale may be float, float16 or bfloat16 from opset 19). The output
/// type is `y_zero_point`'s, else `output_dtype` (opset 21+), else uint8. Per-tensor,
/// per-axis and blocked scales are told apart by their shape and `block_size`.
fn quantize_linear(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = read_attrs(info)?;
    if info.opset >= 23 {
        let p = info.attr_int("precision", 0);
        if p != 0 && p != DType::F32 as i64 {
            return Err(info.error(format!("precision {p} is not supported; only float (1) division is implemented")));
        }
    }
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let scale = input(ins, 1)?;
        let zp = opt_input(ins, 2);
        let out_type = match (zp, a.output_dtype) {
            (Some(z), Some(d)) if z.dtype() != d => {
                return Err(kernel_error(format!("output_dtype {d} differs from the zero point type {}", z.dtype())))
            }
            (Some(z), _) => z.dtype(),
            (None, Some(d)) => d,
            (None, None) => DType::U8,
        };
        check_quantized_type(out_type, a.opset, false)?;
        check_float_type(x.dtype(), a.opset, "x")?;
        let (s, z) = params(scale, zp, a.opset)?;
        let plan = Plan::new(x.shape(), scale.shape(), &a)?;
        let xs = to_f32(x)?;
        let r = range(out_type);
        fn run<O: QInt>(plan: &Plan, x: &[f32], s: &[f32], z: &[i32], r: (i32, i32)) -> Vec<O> {
            // SAFETY: `Plan::fill` visits every element once, and `quantize_run` writes each.
            unsafe { written(x.len(), |out| plan.fill(out, |at, dst, p| quantize_run(&x[at..at + dst.len()], dst, s, z, p, r))) }
        }
        let shape = x.shape();
        let y = match out_type {
            DType::U8 => tensor(shape, run::<u8>(&plan, &xs, &s, &z, r))?,
            DType::I8 => tensor(shape, run::<i8>(&plan, &xs, &s, &z, r))?,
            DType::U16 => tensor(shape, run::<u16>(&plan, &xs, &s, &z, r))?,
            DType::I16 => tensor(shape, run::<i16>(&plan, &xs, &s, &z, r))?,
            d => {
                let v = run::<i8>(&plan, &xs, &s, &z, r);
                Tensor::from_raw(d, shape, &pack(&v, packed_bits(d))).map_err(|e| kernel_error(e.to_string()))?
            }
        };
        Ok(vec![y])
    })
}

/// `DequantizeLinear`: `y = (x - x_zero_point) * x_scale`, the subtraction in int32 and the
/// product in f32, for every integer `x` type including int32 and packed 4- and 2-bit. The
/// output type is `output_dtype` (opset 23+), else the scale's; float16 and bfloat16
/// outputs are the f32 result rounded to nearest even.
fn dequantize_linear(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = read_attrs(info)?;
    let a = Attrs { output_dtype: if a.opset >= 23 { a.output_dtype } else { None }, ..a };
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let scale = input(ins, 1)?;
        let zp = opt_input(ins, 2);
        check_quantized_type(x.dtype(), a.opset, true)?;
        if let Some(z) = zp.filter(|z| z.dtype() != x.dtype()) {
            return Err(kernel_error(format!("zero point type {} differs from x type {}", z.dtype(), x.dtype())));
        }
        let (s, z) = params(scale, zp, a.opset)?;
        let out_type = a.output_dtype.unwrap_or(scale.dtype());
        check_float_type(out_type, a.opset, "output")?;
        let plan = Plan::new(x.shape(), scale.shape(), &a)?;
        fn run<I: QInt>(plan: &Plan, x: &[I], s: &[f32], z: &[i32]) -> Vec<f32> {
            // SAFETY: `Plan::fill` visits every element once, and `dequantize_run` writes each.
            unsafe { written(x.len(), |out| plan.fill(out, |at, dst, p| dequantize_run(&x[at..at + dst.len()], dst, s, z, p))) }
        }
        let y = match x.dtype() {
            DType::U8 => run(&plan, x.as_slice::<u8>().unwrap(), &s, &z),
            DType::I8 => run(&plan, x.as_slice::<i8>().unwrap(), &s, &z),
            DType::U16 => run(&plan, x.as_slice::<u16>().unwrap(), &s, &z),
            DType::I16 => run(&plan, x.as_slice::<i16>().unwrap(), &s, &z),
            DType::I32 => run(&plan, x.as_slice::<i32>().unwrap(), &s, &z),
            d => {
                let v = unpack(x.raw_bytes().unwrap(), packed_bits(d), d.is_signed(), x.len());
                run(&plan, &v, &s, &z)
            }
        };
        Ok(vec![from_f32(out_type, x.shape(), y)?])
    })
}

