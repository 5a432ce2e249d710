//! ONNX Runtime's `com.microsoft` quantized elementwise, activation, pooling and concat
//! operators, and ONNX `DynamicQuantizeLinear`, bit-exact with ONNX Runtime's CPU kernels on
//! x86-64 with AVX2/FMA (the kernels MLAS dispatches there):
//!
//! * `QLinearAdd`: `c = sat(rne(a·ra + (b·rb + (zc - (za·ra + zb·rb)))))` with `r = s / sc`,
//!   the products and sums as the fused multiply-adds of MLAS's AVX2 kernel (whose operand
//!   order depends on which input is broadcast).
//! * `QLinearMul`: `c = sat(rne(f32((a - za)(b - zb))·(sa·sb/sc) + zc))`, the product exact in
//!   integers (MLAS's SSE2 kernel).
//! * `QLinearSigmoid`, `QLinearLeakyRelu`: a 256-entry table built in f32 (dequantize, the
//!   function, `QuantizeLinear`); Sigmoid is MLAS's rational logistic approximation with FMA.
//! * `QLinearGlobalAveragePool` (and `QLinearAveragePool` when the window covers the whole
//!   image): int32 sums, requantized by `f32(sum - zx·n)·(sx / (sy·n))`.
//! * `QLinearAveragePool`: dequantized f32 sums over the window, divided by the count,
//!   `rne(y / sy + zy)`.
//! * `QLinearConcat`: each input copied when its qparams equal the output's, else mapped by a
//!   256-entry requantization table.
//! * `QLinearSoftmax`: a 256-entry f32 table of `exp((x - xmax + shift)·sx)` (built in f64),
//!   summed in f32 along the softmax axis, `y = rne(t·floor(1/sy) / sum) + zy` (see
//!   [`qlinear_softmax`]).
//! * `LookupTable` (qforge's own, sessions only): `Y[i] = Table[byte of X[i]]` over a constant
//!   256-entry table, vectorized with AVX-512 VBMI byte permutes.
//! * `DynamicQuantizeLinear`: uint8 with `scale = (max(0, xmax) - min(0, xmin)) / 255` (1 when
//!   the range is empty) and `zp = rne(clamp(-xmin / scale, 0, 255))`, as ONNX Runtime computes
//!   them.
//!
//! `rne` is round to nearest even; where the hardware conversion would overflow int32 (or see
//! NaN) the result is the integer minimum, then saturated, as `cvtps2dq` gives in MLAS. Element
//! types are uint8 and int8; every scale and zero point is a scalar or a one-element 1-D
//! tensor. Errors name the input and never panic.

use qforge_ir::{DType, Tensor, MS_DOMAIN};

use super::conv::Window;
use super::math::round_even_int;
use super::util::{axis as norm_axis, binary, broadcast_shape, input, kernel, opt_input, tensor, threads, vectorized_wide, written};
use std::mem::MaybeUninit;
use crate::qgemm::Out8;
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST, LOOKUP_TABLE, RUNTIME_DOMAIN};

/// Registers the `com.microsoft` QLinear operators of this file and `DynamicQuantizeLinear`.
pub fn register(r: &mut Registry) {
    r.add(MS_DOMAIN, "QLinearAdd", 1, LATEST, qlinear_binary);
    r.add(MS_DOMAIN, "QLinearMul", 1, LATEST, qlinear_binary);
    r.add(MS_DOMAIN, "QLinearSigmoid", 1, LATEST, qlinear_lookup);
    r.add(MS_DOMAIN, "QLinearLeakyRelu", 1, LATEST, qlinear_lookup);
    r.add(MS_DOMAIN, "QLinearGlobalAveragePool", 1, LATEST, qlinear_global_average_pool);
    r.add(MS_DOMAIN, "QLinearAveragePool", 1, LATEST, qlinear_average_pool);
    r.add(MS_DOMAIN, "QLinearConcat", 1, LATEST, qlinear_concat);
    r.add(MS_DOMAIN, "QLinearSoftmax", 1, LATEST, qlinear_softmax);
    r.add(RUNTIME_DOMAIN, LOOKUP_TABLE, 1, LATEST, lookup_table_op);
    r.add("", "DynamicQuantizeLinear", 11, LATEST, dynamic_quantize_linear);
}

/// `cvtps2dq` in the default rounding mode: round to nearest even, and the integer minimum for
/// NaN and values outside the int32 range.
#[inline(always)]
fn cvt(v: f32) -> i32 {
    if !(-2_147_483_648.0..2_147_483_648.0).contains(&v) {
        // NaN is outside every range too.
        i32::MIN
    } else {
        let r = v.round_ties_even();
        r as i32
    }
}

/// `cvt(v)` saturated to `T` (out-of-range and NaN `v` give `T::MIN`, as `cvtps2dq`'s
/// integer minimum does), computed without a rounding call: `v` is clamped to `T`'s range
/// first (its bounds are integers, so rounding then clamping gives the same), then rounded to
/// nearest even by adding 1.5 * 2^23, which vectorizes.
#[inline(always)]
fn saturate<T: Out8>(v: f32) -> T {
    let in_range = (-2_147_483_648.0..2_147_483_648.0).contains(&v);
    let r = round_even_int(v.max(T::MIN as f32).min(T::MAX as f32));
    T::from_i32(if in_range { r } else { T::MIN })
}

/// The value of a scale input: a float32 scalar or one-element 1-D tensor.
fn scale_of(t: &Tensor, what: &str) -> RuntimeResult<f32> {
    if t.dtype() != DType::F32 {
        return Err(kernel_error(format!("{what} must be float, got {}", t.dtype())));
    }
    if t.rank() > 1 || t.len() != 1 {
        return Err(kernel_error(format!("{what} must be a scalar or a 1-D tensor of one element, got shape {:?}", t.shape())));
    }
    Ok(t.as_slice::<f32>().expect("checked f32")[0])
}

/// The value of an optional zero point input of element type `dtype` (0 when omitted).
fn zero_point_of(t: Option<&Tensor>, dtype: DType, what: &str) -> RuntimeResult<i32> {
    let Some(t) = t else { return Ok(0) };
    if t.dtype() != dtype {
        return Err(kernel_error(format!("{what} must be {dtype} like the data, got {}", t.dtype())));
    }
    if t.rank() > 1 || t.len() != 1 {
        return Err(kernel_error(format!("{what} must be a scalar or a 1-D tensor of one element, got shape {:?}", t.shape())));
    }
    Ok(match dtype {
        DType::U8 => t.as_slice::<u8>().expect("checked")[0] as i32,
        DType::I8 => t.as_slice::<i8>().expect("checked")[0] as i32,
        d => return Err(kernel_error(format!("{what}: {d} is not an 8-bit quantized type"))),
    })
}

/// Refuses data that is not uint8 or int8.
fn check_8bit(t: &Tensor, what: &str) -> RuntimeResult<DType> {
    match t.dtype() {
        DType::U8 | DType::I8 => Ok(t.dtype()),
        d => Err(kernel_error(format!("{what} must be uint8 or int8, got {d}"))),
    }
}

/// `QuantizeLinear` of one f32 value as MLAS computes it: `x / s` clamped to
/// `[qmin - z, qmax - z]` (NaN to the minimum), rounded to nearest even, plus `z`.
#[inline(always)]
fn quantize_one<T: Out8>(x: f32, scale: f32, zp: i32) -> T {
    let (lo, hi) = ((T::MIN - zp) as f32, (T::MAX - zp) as f32);
    let v = x / scale;
    let v = if v.is_nan() { lo } else { v.max(lo).min(hi) };
    T::from_i32((cvt(v) + zp).clamp(T::MIN, T::MAX))
}

/// The 256-entry table mapping every byte of the input type through
/// `dequantize -> f -> quantize`, indexed by the input's byte (ONNX Runtime's
/// `QlinearBuildLookupTable`).
fn lookup_table<T: Out8>(x_scale: f32, x_zp: i32, y_scale: f32, y_zp: i32, f: impl Fn(f32) -> f32) -> [T; 256] {
    let mut table = [T::default(); 256];
    for (b, slot) in table.iter_mut().enumerate() {
        let x = T::from_byte(b as u8);
        let deq = x_scale * (x.get() - x_zp) as f32;
        *slot = quantize_one::<T>(f(deq), y_scale, y_zp);
    }
    table
}

/// Maps every element of `x` through `table`, indexed by the element's byte (see
/// [`lookup_all`]).
fn apply_table<T: Out8, O: Out8>(x: &[T], table: &[O; 256]) -> Vec<O> {
    let src: &[u8] = bytemuck::cast_slice(x);
    let bytes: [u8; 256] = std::array::from_fn(|b| table[b].byte());
    // SAFETY: `lookup_all` writes every element of `dst`, which has `src`'s length.
    let out: Vec<u8> = unsafe { written(src.len(), |dst| lookup_all(src, &bytes, dst)) };
    bytemuck::allocation::cast_vec(out)
}

/// `dst[i] = table[src[i]]` over slices of equal length, split across [`threads`] when they
/// are large enough to be worth it.
fn lookup_all(src: &[u8], table: &[u8; 256], dst: &mut [MaybeUninit<u8>]) {
    use rayon::prelude::*;
    match lookup_chunk(src.len()) {
        Some(chunk) => dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| lookup_bytes(s, table, d)),
        None => lookup_bytes(src, table, dst),
    }
}

/// [`lookup_all`] in place: `bytes[i] = table[bytes[i]]`.
pub(crate) fn lookup_all_in_place(bytes: &mut [u8], table: &[u8; 256]) {
    use rayon::prelude::*;
    // SAFETY: each call maps one exclusively borrowed chunk: one run of all its bytes.
    let map = |c: &mut [u8]| unsafe { lookup_in_place(c.as_mut_ptr(), c.len(), 1, 0, table) };
    match lookup_chunk(bytes.len()) {
        Some(chunk) => bytes.par_chunks_mut(chunk).for_each(map),
        None => map(bytes),
    }
}

/// The chunk size [`lookup_all`] splits `len` bytes into across [`threads`], or `None` when
/// one thread should map them all.
fn lookup_chunk(len: usize) -> Option<usize> {
    const MIN_CHUNK: usize = 1 << 17;
    let threads = threads();
    (threads > 1 && len >= 2 * MIN_CHUNK).then(|| len.div_ceil(threads * 2).max(MIN_CHUNK))
}

/// `dst[i] = table[src[i]]` over slices of equal length, 64 bytes per step with AVX-512 VBMI
/// byte permutes when the CPU has them, else 32 bytes per step with AVX2 byte shuffles.
fn lookup_bytes(src: &[u8], table: &[u8; 256], dst: &mut [MaybeUninit<u8>]) {
    let n = src.len().min(dst.len());
    // SAFETY: `src` and `dst` are distinct slices of at least `n` bytes: one row.
    unsafe { lookup_raw(Rows { src: src.as_ptr(), dst: dst.as_mut_ptr().cast(), len: n, count: 1, stride: 0 }, table) }
}

/// Maps `count` runs of `len` bytes, `stride` bytes apart from `at`, through `table` in place,
/// as [`lookup_bytes`] computes it: a lookup table applied to a kernel's output while it is
/// still in cache.
///
/// # Safety
/// The runs must be valid for reads and writes, must not overlap one another (a byte would be
/// mapped twice), and no one else may access them meanwhile.
pub(crate) unsafe fn lookup_in_place(at: *mut u8, len: usize, count: usize, stride: usize, table: &[u8; 256]) {
    // SAFETY: the caller's runs, each read before it is written.
    unsafe { lookup_raw(Rows { src: at, dst: at, len, count, stride }, table) }
}

/// `count` runs of `len` bytes to map, `stride` bytes apart, read from `src` and written to
/// `dst` (the same bytes, or bytes disjoint from them).
#[derive(Clone, Copy)]
struct Rows {
    src: *const u8,
    dst: *mut u8,
    len: usize,
    count: usize,
    stride: usize,
}

/// `dst[i] = table[src[i]]` over the runs, with the best instructions of this CPU.
///
/// # Safety
/// `src`'s runs must be readable and `dst`'s writable, with no other access to either
/// meanwhile; `dst`'s runs are `src`'s or disjoint from them (each step reads its bytes before
/// it writes them, so mapping in place is fine).
unsafe fn lookup_raw(rows: Rows, table: &[u8; 256]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512vbmi") && std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU supports AVX-512 F/BW/VBMI, checked just above; the runs are
            // the caller's.
            return unsafe { lookup_vbmi(rows, table) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above; the runs are the caller's.
            return unsafe { lookup_avx2(rows, table) };
        }
    }
    // SAFETY: the runs are the caller's.
    unsafe { lookup_scalar(rows, table) }
}

/// [`lookup_raw`] one byte at a time.
///
/// # Safety
/// As [`lookup_raw`].
unsafe fn lookup_scalar(rows: Rows, table: &[u8; 256]) {
    for r in 0..rows.count {
        for i in r * rows.stride..r * rows.stride + rows.len {
            // SAFETY: byte `i` of run `r`, inside the caller's runs.
            unsafe { *rows.dst.add(i) = table[*rows.src.add(i) as usize] };
        }
    }
}

/// [`lookup_raw`] with AVX2: the table is sixteen 16-entry rows, one per high nibble. For
/// row `h`, `vpshufb` looks up the low nibble of every index in row `h` and gives 0 where the
/// shuffle index has its top bit set; the index passed is `(x - 16 h) +sat 0x70`, whose top
/// bit is clear exactly when `x`'s high nibble is `h` (then it is `0x70 | low nibble`), so
/// OR-ing the sixteen lookups leaves each byte's own entry. Tails run one byte at a time.
///
/// # Safety
/// The CPU supports AVX2; the runs are as for [`lookup_raw`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn lookup_avx2(rows: Rows, table: &[u8; 256]) {
    use std::arch::x86_64::*;
    let t = table.as_ptr();
    // SAFETY: the table has 256 bytes (row `h` at `16 h`); every load and store below covers
    // bytes `i..i + 32` of a run with `i + 32 <= len`; the tails are inside the runs too.
    unsafe {
        let lut: [__m256i; 16] = std::array::from_fn(|h| _mm256_broadcastsi128_si256(_mm_loadu_si128(t.add(16 * h).cast())));
        let (step, bias) = (_mm256_set1_epi8(16), _mm256_set1_epi8(0x70));
        for r in 0..rows.count {
            let (src, dst) = (rows.src.add(r * rows.stride), rows.dst.add(r * rows.stride));
            let mut i = 0;
            while i + 32 <= rows.len {
                let mut x = _mm256_loadu_si256(src.add(i).cast());
                let mut y = _mm256_setzero_si256();
                for row in &lut {
                    y = _mm256_or_si256(y, _mm256_shuffle_epi8(*row, _mm256_adds_epu8(x, bias)));
                    x = _mm256_sub_epi8(x, step);
                }
                _mm256_storeu_si256(dst.add(i).cast(), y);
                i += 32;
            }
            lookup_scalar(Rows { src: src.add(i), dst: dst.add(i), len: rows.len - i, count: 1, stride: 0 }, table);
        }
    }
}

/// [`lookup_raw`] with AVX-512 VBMI: two `vpermi2b` look up each index's low seven bits in
/// the table's halves and its top bit picks between them; tails are masked.
///
/// # Safety
/// The CPU supports AVX-512 F, BW and VBMI; the runs are as for [`lookup_raw`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn lookup_vbmi(rows: Rows, table: &[u8; 256]) {
    use std::arch::x86_64::*;
    let t = table.as_ptr();
    // SAFETY: the table has 256 bytes; every load and store below covers bytes `i..i + 64`
    // of a run with `i + 64 <= len`, or its masked bytes `i..len`.
    unsafe {
        let (t0, t1) = (_mm512_loadu_si512(t.cast()), _mm512_loadu_si512(t.add(64).cast()));
        let (t2, t3) = (_mm512_loadu_si512(t.add(128).cast()), _mm512_loadu_si512(t.add(192).cast()));
        let map = |idx: __m512i| {
            let lo = _mm512_permutex2var_epi8(t0, idx, t1);
            let hi = _mm512_permutex2var_epi8(t2, idx, t3);
            _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), lo, hi)
        };
        let n = rows.len;
        for r in 0..rows.count {
            let (src, dst) = (rows.src.add(r * rows.stride), rows.dst.add(r * rows.stride));
            let mut i = 0;
            while i + 64 <= n {
                _mm512_storeu_si512(dst.add(i).cast(), map(_mm512_loadu_si512(src.add(i).cast())));
                i += 64;
            }
            if i < n {
                let mask: __mmask64 = u64::MAX >> (64 - (n - i));
                _mm512_mask_storeu_epi8(dst.add(i).cast(), mask, map(_mm512_maskz_loadu_epi8(mask, src.add(i).cast())));
            }
        }
    }
}

/// Inputs `(a, a_scale, a_zp, b, b_scale, b_zp, c_scale, c_zp)` of a binary QLinear op, read
/// and checked.
struct BinaryParams {
    sa: f32,
    za: i32,
    sb: f32,
    zb: i32,
    sc: f32,
    zc: i32,
}

/// Whether `A` (of `a` shape) is broadcast along the innermost output axis longer than 1, or
/// the output has a single element: ONNX Runtime then runs `A` as the scalar operand of each
/// span.
fn a_is_broadcast_innermost(a: &[usize], out: &[usize]) -> bool {
    match out.iter().rposition(|&d| d > 1) {
        None => true,
        Some(k) => {
            let offset = out.len() - a.len();
            k < offset || a[k - offset] == 1
        }
    }
}

/// `f` with numpy broadcasting, as [`binary`] computes it, with fast loops compiled for
/// AVX-512 or AVX2 with FMA (so `mul_add` is one fused instruction, not a call) when the
/// shapes are equal or one input is constant over each contiguous run of the other
/// (per-channel scales of a `[N, C, H, W]` tensor by `[N, C, 1, 1]`) or one input repeats
/// along the outer axes of the other (a `[C]` bias added to `[N, T, C]`), split over the
/// current rayon pool in chunks of whole runs; other broadcasts go through [`binary`].
fn broadcast_fma<T: Copy + Sync, O: Copy + Default + Send + Sync>(a: &[T], ashape: &[usize], b: &[T], bshape: &[usize], f: impl Fn(T, T) -> O + Sync + Copy) -> RuntimeResult<(Vec<O>, Vec<usize>)> {
    let shape = broadcast_shape(ashape, bshape)?;
    let n: usize = shape.iter().product();
    /// Elements of `shape` per element of `part`, when `part` (right-aligned) equals `shape` up
    /// to some axis and is 1 after it.
    fn run_length(part: &[usize], shape: &[usize]) -> Option<usize> {
        let full: Vec<usize> = std::iter::repeat_n(1, shape.len() - part.len()).chain(part.iter().copied()).collect();
        let k = full.iter().zip(shape).position(|(p, s)| p != s).unwrap_or(shape.len());
        full[k..].iter().all(|&d| d == 1).then(|| shape[k..].iter().product())
    }
    /// Elements of `shape` per repetition of `part`, when `part` (right-aligned, leading 1s
    /// dropped) equals the innermost axes of `shape`: `part` is then read cyclically.
    fn period(part: &[usize], shape: &[usize]) -> Option<usize> {
        let tail = &part[part.iter().position(|&d| d != 1).unwrap_or(part.len())..];
        shape.ends_with(tail).then(|| tail.iter().product())
    }
    if n == 0 {
        return Ok((vec![], shape));
    }
    let (ra, rb) = (run_length(ashape, &shape), run_length(bshape, &shape));
    let (a_full, b_full) = (a.len() == n && ra == Some(1), b.len() == n && rb == Some(1));
    // Each fast loop below writes every element of its chunk: the chunks of `in_chunks` cover
    // the output, and the zipped inputs are at least as long as each chunk.
    let out = if a_full && b_full {
        // SAFETY: see above.
        unsafe { written(n, |out| in_chunks(out, 1, #[inline(always)] |at, o| o.iter_mut().zip(&a[at..]).zip(&b[at..]).for_each(|((o, &x), &y)| *o = MaybeUninit::new(f(x, y))))) }
    } else if a_full && b.len() == 1 {
        let y = b[0];
        // SAFETY: see above.
        unsafe { written(n, |out| in_chunks(out, 1, #[inline(always)] |at, o| o.iter_mut().zip(&a[at..]).for_each(|(o, &x)| *o = MaybeUninit::new(f(x, y))))) }
    } else if b_full && a.len() == 1 {
        let x = a[0];
        // SAFETY: see above.
        unsafe { written(n, |out| in_chunks(out, 1, #[inline(always)] |at, o| o.iter_mut().zip(&b[at..]).for_each(|(o, &y)| *o = MaybeUninit::new(f(x, y))))) }
    } else if let (true, Some(inner)) = (a_full, rb) {
        // SAFETY: see above; chunks hold whole runs of `inner`, one element of `b` each.
        unsafe {
            written(n, |out| in_chunks(out, inner, #[inline(always)] |at, o| {
                o.chunks_mut(inner).zip(a[at..].chunks(inner)).zip(&b[at / inner..]).for_each(|((o, xs), &y)| o.iter_mut().zip(xs).for_each(|(o, &x)| *o = MaybeUninit::new(f(x, y))))
            }))
        }
    } else if let (true, Some(inner)) = (b_full, ra) {
        // SAFETY: see above; chunks hold whole runs of `inner`, one element of `a` each.
        unsafe {
            written(n, |out| in_chunks(out, inner, #[inline(always)] |at, o| {
                o.chunks_mut(inner).zip(b[at..].chunks(inner)).zip(&a[at / inner..]).for_each(|((o, ys), &x)| o.iter_mut().zip(ys).for_each(|(o, &y)| *o = MaybeUninit::new(f(x, y))))
            }))
        }
    } else if let (true, Some(p)) = (a_full, period(bshape, &shape)) {
        // SAFETY: see above; chunks hold whole periods, each zipped with all of `b`.
        unsafe {
            written(n, |out| in_chunks(out, p, #[inline(always)] |at, o| {
                o.chunks_mut(p).zip(a[at..].chunks(p)).for_each(|(o, xs)| o.iter_mut().zip(xs).zip(b).for_each(|((o, &x), &y)| *o = MaybeUninit::new(f(x, y))))
            }))
        }
    } else if let (true, Some(p)) = (b_full, period(ashape, &shape)) {
        // SAFETY: see above; chunks hold whole periods, each zipped with all of `a`.
        unsafe {
            written(n, |out| in_chunks(out, p, #[inline(always)] |at, o| {
                o.chunks_mut(p).zip(b[at..].chunks(p)).for_each(|(o, ys)| o.iter_mut().zip(ys).zip(a).for_each(|((o, &y), &x)| *o = MaybeUninit::new(f(x, y))))
            }))
        }
    } else {
        return binary(a, ashape, b, bshape, f);
    };
    Ok((out, shape))
}

/// Runs `body(start, chunk)` over `out` split into chunks of whole runs of `run` elements,
/// on the current rayon pool when `out` is large enough to be worth it, each chunk compiled
/// for the widest vectors the CPU has ([`vectorized_wide`]).
#[inline(always)]
fn in_chunks<O: Send>(out: &mut [O], run: usize, body: impl Fn(usize, &mut [O]) + Sync) {
    const MIN_CHUNK: usize = 1 << 15;
    let threads = threads();
    let n = out.len();
    if threads == 1 || n < 2 * MIN_CHUNK {
        return vectorized_wide(#[inline(always)] || body(0, out));
    }
    let chunk = n.div_ceil(threads * 4).max(MIN_CHUNK).div_ceil(run) * run;
    use rayon::prelude::*;
    out.par_chunks_mut(chunk).enumerate().for_each(|(i, o)| vectorized_wide(#[inline(always)] || body(i * chunk, o)));
}

/// `QLinearAdd` and `QLinearMul` (`com.microsoft`): numpy broadcasting of `A` and `B`, all
/// three tensors of one 8-bit type; see the module documentation for the arithmetic.
fn qlinear_binary(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let add = info.node.op_type == "QLinearAdd";
    kernel(move |ins| {
        let a = input(ins, 0)?;
        let b = input(ins, 3)?;
        let dtype = check_8bit(a, "A")?;
        if b.dtype() != dtype {
            return Err(kernel_error(format!("B must be {dtype} like A, got {}", b.dtype())));
        }
        let p = BinaryParams {
            sa: scale_of(input(ins, 1)?, "A_scale")?,
            za: zero_point_of(opt_input(ins, 2), dtype, "A_zero_point")?,
            sb: scale_of(input(ins, 4)?, "B_scale")?,
            zb: zero_point_of(opt_input(ins, 5), dtype, "B_zero_point")?,
            sc: scale_of(input(ins, 6)?, "C_scale")?,
            zc: zero_point_of(opt_input(ins, 7), dtype, "C_zero_point")?,
        };
        fn run<T: Out8>(a: &Tensor, b: &Tensor, p: &BinaryParams, add: bool) -> RuntimeResult<Tensor> {
            let (av, bv) = (a.as_slice::<T>().expect("checked"), b.as_slice::<T>().expect("checked"));
            let (out, shape) = if add {
                // MLAS's AVX2 kernel walks one input as a span ("S") and adds the other ("O"):
                // `fma(s, rS, fma(o, rO, zc - fma(rS, zS, rO·zO)))` with `r = scale / sc` and
                // raw (not zero-point-shifted) integers. The span is B when A is broadcast
                // along the innermost axis (ONNX Runtime then swaps the operands), else A.
                let out_shape = broadcast_shape(a.shape(), b.shape())?;
                let (ra, rb) = (p.sa / p.sc, p.sb / p.sc);
                let (za, zb, zc) = (p.za as f32, p.zb as f32, p.zc as f32);
                if a_is_broadcast_innermost(a.shape(), &out_shape) {
                    let fixed = zc - rb.mul_add(zb, ra * za);
                    broadcast_fma(av, a.shape(), bv, b.shape(), #[inline(always)] |x: T, y: T| {
                        saturate::<T>((y.get() as f32).mul_add(rb, (x.get() as f32).mul_add(ra, fixed)))
                    })?
                } else {
                    let fixed = zc - ra.mul_add(za, rb * zb);
                    broadcast_fma(av, a.shape(), bv, b.shape(), #[inline(always)] |x: T, y: T| {
                        saturate::<T>((x.get() as f32).mul_add(ra, (y.get() as f32).mul_add(rb, fixed)))
                    })?
                }
            } else {
                let ratio = p.sa * p.sb / p.sc;
                let zc = p.zc as f32;
                broadcast_fma(av, a.shape(), bv, b.shape(), #[inline(always)] |x: T, y: T| {
                    let prod = (x.get() - p.za) * (y.get() - p.zb);
                    saturate::<T>(prod as f32 * ratio + zc)
                })?
            };
            tensor(&shape, out)
        }
        Ok(vec![match dtype {
            DType::U8 => run::<u8>(a, b, &p, add)?,
            _ => run::<i8>(a, b, &p, add)?,
        }])
    })
}

/// MLAS's logistic function on x86-64 with FMA3 (`MlasComputeLogisticF32KernelFma3`): the
/// input clamped to `[-18, 18]`, an odd rational approximation `p(x) / q(x) + 0.5` with Horner
/// steps as fused multiply-adds, clamped below at 0. NaN stays NaN.
#[allow(clippy::excessive_precision)] // MLAS's decimal constants, rounded to f32 as C++ does.
fn mlas_logistic(x: f32) -> f32 {
    const A9: f32 = 4.37031012579801e-11;
    const A7: f32 = 1.15627324459942e-07;
    const A5: f32 = 6.08574864600143e-05;
    const A3: f32 = 8.51377133304701e-03;
    const A1: f32 = 2.48287947061529e-01;
    const B10: f32 = 6.10247389755681e-13;
    const B8: f32 = 5.76102136993427e-09;
    const B6: f32 = 6.29106785017040e-06;
    const B4: f32 = 1.70198817374094e-03;
    const B2: f32 = 1.16817656904453e-01;
    const B0: f32 = 9.93151921023180e-01;
    let x = if x.is_nan() { x } else { x.clamp(-18.0, 18.0) };
    let x2 = x * x;
    let mut p = x2.mul_add(A9, A7);
    p = x2.mul_add(p, A5);
    p = x2.mul_add(p, A3);
    p = x2.mul_add(p, A1);
    let mut q = x2.mul_add(B10, B8);
    q = x2.mul_add(q, B6);
    q = x2.mul_add(q, B4);
    q = x2.mul_add(q, B2);
    q = x2.mul_add(q, B0);
    let r = (x * p) / q + 0.5;
    if r.is_nan() { r } else { r.max(0.0) }
}

/// `QLinearSigmoid` and `QLinearLeakyRelu` (`com.microsoft`): inputs `(X, X_scale, X_zp,
/// Y_scale, Y_zp)`, the output of X's 8-bit type, computed through a 256-entry table built as
/// ONNX Runtime builds it (LeakyRelu: `v >= 0 ? v : alpha·v`, `alpha` default 0.01).
fn qlinear_lookup(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let sigmoid = info.node.op_type == "QLinearSigmoid";
    let alpha = info.attr_float("alpha", 0.01);
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let dtype = check_8bit(x, "X")?;
        let sx = scale_of(input(ins, 1)?, "X_scale")?;
        let zx = zero_point_of(opt_input(ins, 2), dtype, "X_zero_point")?;
        let sy = scale_of(input(ins, 3)?, "Y_scale")?;
        let zy = zero_point_of(opt_input(ins, 4), dtype, "Y_zero_point")?;
        let f = move |v: f32| if sigmoid { mlas_logistic(v) } else if v >= 0.0 { v } else { alpha * v };
        Ok(vec![match dtype {
            DType::U8 => tensor(x.shape(), apply_table(x.as_slice::<u8>().expect("checked"), &lookup_table::<u8>(sx, zx, sy, zy, f)))?,
            _ => tensor(x.shape(), apply_table(x.as_slice::<i8>().expect("checked"), &lookup_table::<i8>(sx, zx, sy, zy, f)))?,
        }])
    })
}

/// `LookupTable` (qforge's own operator, made by sessions for QDQ units of a pointwise op, see
/// [`crate::LowerOptions`]): inputs `(X, Table)`, `X` uint8 or int8 and `Table` a constant of
/// 256 uint8 or int8 elements; `Y[i] = Table[byte of X[i]]`, of `Table`'s type and `X`'s shape.
fn lookup_table_op(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let table = info.const_input(1).ok_or_else(|| info.error("the table (input 1) must be a constant"))?;
    let out_type = check_8bit(table, "the table").map_err(|e| info.error(e.to_string()))?;
    let bytes: [u8; 256] = table.raw_bytes().and_then(|b| b.try_into().ok())
        .ok_or_else(|| info.error(format!("the table must have 256 elements, got shape {:?}", table.shape())))?;
    kernel(move |ins| {
        let x = input(ins, 0)?;
        check_8bit(x, "X")?;
        let src = x.raw_bytes().ok_or_else(|| kernel_error("X has no element bytes"))?;
        // SAFETY: `lookup_all` writes every element of `dst`, which has `src`'s length.
        let out: Vec<u8> = unsafe { written(src.len(), |dst| lookup_all(src, &bytes, dst)) };
        Ok(vec![match out_type {
            DType::U8 => tensor(x.shape(), out)?,
            _ => tensor(x.shape(), bytemuck::allocation::cast_vec::<u8, i8>(out))?,
        }])
    })
}

/// The scales and zero points of a pooling op's input and output.
#[derive(Clone, Copy)]
struct PoolParams {
    sx: f32,
    zx: i32,
    sy: f32,
    zy: i32,
}

/// The global average over `image` elements of each of `batch x channels` planes (NCHW, or
/// channels interleaved when channels-last), as MLAS computes it; see
/// [`qlinear_global_average_pool`].
fn global_average<T: Out8>(x: &[T], batch: usize, channels: usize, image: usize, channels_last: bool, p: PoolParams) -> RuntimeResult<Vec<T>> {
    let PoolParams { sx, zx, sy, zy } = p;
    let n = i32::try_from(image).ok().filter(|&n| n < 0x100_0000);
    let scale = n.map(|n| sx / (sy * n as f32));
    let Some((n, scale)) = n.zip(scale).filter(|&(_, s)| !(s < 2f32.powi(-32) || s >= 256.0)) else {
        return Err(kernel_error(format!(
            "QLinearGlobalAveragePool parameters out of ONNX Runtime's computation range: x_scale / (y_scale * image size {image}) must be in [2^-32, 256) and the image size below 2^24"
        )));
    };
    let bias = zx.wrapping_neg().wrapping_mul(n);
    let (lo, hi) = ((T::MIN - zy) as f32, (T::MAX - zy) as f32);
    let requantize = |sum: i32| {
        let v = sum.wrapping_add(bias) as f32 * scale;
        let v = if v.is_nan() { lo } else { v.max(lo).min(hi) };
        T::from_i32((cvt(v) + zy).clamp(T::MIN, T::MAX))
    };
    let mut out = Vec::with_capacity(batch * channels);
    for b in 0..batch {
        for c in 0..channels {
            let sum = if channels_last {
                (0..image).fold(0i32, |acc, i| acc.wrapping_add(x[(b * image + i) * channels + c].get()))
            } else {
                plane_sum(&x[(b * channels + c) * image..(b * channels + c + 1) * image])
            };
            out.push(requantize(sum));
        }
    }
    // Channels-last output [N, 1.., C] has the same layout as [N, C].
    Ok(out)
}

/// The sum of 8-bit values wrapped to `i32`, as a wrapping `i32` fold computes it: with AVX2,
/// 32 bytes per `vpsadbw` into 64-bit sums (int8 values are summed as `v + 128` bytes, then
/// `128 n` is taken off).
fn plane_sum<T: Out8>(v: &[T]) -> i32 {
    let bytes: &[u8] = bytemuck::cast_slice(v);
    let flip = if T::MIN < 0 { 0x80u8 } else { 0 };
    let offset = if T::MIN < 0 { (128i64 * v.len() as i64) as i32 } else { 0 };
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return (unsafe { byte_sum_avx2(bytes, flip) } as i32).wrapping_sub(offset);
    }
    (bytes.iter().map(|&b| (b ^ flip) as u64).sum::<u64>() as i32).wrapping_sub(offset)
}

/// The sum of `bytes[i] ^ flip` as unsigned bytes.
///
/// # Safety
/// The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn byte_sum_avx2(bytes: &[u8], flip: u8) -> u64 {
    use std::arch::x86_64::*;
    let (n, p) = (bytes.len(), bytes.as_ptr());
    let (f, zero) = (_mm256_set1_epi8(flip as i8), _mm256_setzero_si256());
    let mut acc = _mm256_setzero_si256();
    let mut i = 0;
    // SAFETY: every load covers bytes `i..i + 32` with `i + 32 <= n`.
    unsafe {
        while i + 32 <= n {
            let v = _mm256_xor_si256(_mm256_loadu_si256(p.add(i).cast()), f);
            acc = _mm256_add_epi64(acc, _mm256_sad_epu8(v, zero));
            i += 32;
        }
    }
    let mut lanes = [0u64; 4];
    // SAFETY: `lanes` holds 32 bytes.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), acc) };
    lanes.iter().sum::<u64>() + bytes[i..].iter().map(|&b| (b ^ flip) as u64).sum::<u64>()
}

/// Shape facts of a pooled NCHW or NHWC input: `(batch, channels, spatial dims)`.
fn pool_dims(s: &[usize], channels_last: bool) -> RuntimeResult<(usize, usize, Vec<usize>)> {
    if s.len() < 3 {
        return Err(kernel_error(format!("the input must have rank 3 or more, got shape {s:?}")));
    }
    Ok(if channels_last { (s[0], s[s.len() - 1], s[1..s.len() - 1].to_vec()) } else { (s[0], s[1], s[2..].to_vec()) })
}

/// The output shape for `spatial` output dims.
fn pool_shape(batch: usize, channels: usize, spatial: &[usize], channels_last: bool) -> Vec<usize> {
    if channels_last {
        [vec![batch], spatial.to_vec(), vec![channels]].concat()
    } else {
        [vec![batch, channels], spatial.to_vec()].concat()
    }
}

/// `QLinearGlobalAveragePool` (`com.microsoft`): inputs `(X, x_scale, x_zp, y_scale, y_zp)`,
/// attribute `channels_last` (default 0); the output keeps X's rank with spatial dims of 1.
/// Each average is `sum(x) - zx·n` in int32, times `x_scale / (y_scale·n)` in f32, clamped to
/// the output range minus `zy`, rounded to nearest even, plus `zy`. ONNX Runtime refuses
/// (and so does this kernel) image sizes of 2^24 and more and a combined scale outside
/// `[2^-32, 256)`.
fn qlinear_global_average_pool(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let channels_last = info.attr_int("channels_last", 0) != 0;
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let dtype = check_8bit(x, "X")?;
        let sx = scale_of(input(ins, 1)?, "x_scale")?;
        let zx = zero_point_of(opt_input(ins, 2), dtype, "x_zero_point")?;
        let sy = scale_of(input(ins, 3)?, "y_scale")?;
        let zy = zero_point_of(opt_input(ins, 4), dtype, "y_zero_point")?;
        let p = PoolParams { sx, zx, sy, zy };
        let (batch, channels, spatial) = pool_dims(x.shape(), channels_last)?;
        let image: usize = spatial.iter().product();
        let shape = pool_shape(batch, channels, &vec![1; spatial.len()], channels_last);
        Ok(vec![match dtype {
            DType::U8 => tensor(&shape, global_average(x.as_slice::<u8>().expect("checked"), batch, channels, image, channels_last, p)?)?,
            _ => tensor(&shape, global_average(x.as_slice::<i8>().expect("checked"), batch, channels, image, channels_last, p)?)?,
        }])
    })
}

/// `QLinearAveragePool` (`com.microsoft`): inputs `(X, x_scale, x_zp, y_scale, y_zp)`,
/// AveragePool's attributes (`kernel_shape`, `strides`, `pads`, `auto_pad`, `ceil_mode`,
/// `count_include_pad`; no dilations) and `channels_last`, 1-D to 3-D windows. As in ONNX
/// Runtime: a window covering the whole unpadded image is a global average
/// ([`qlinear_global_average_pool`]); otherwise X is dequantized to f32
/// (`x_scale·(x - zx)`), summed over the window clipped to the image in (h, w, d) order,
/// divided by the element count (the full kernel size with `count_include_pad`), and
/// quantized as `rne(y / y_scale + zy)` saturated.
fn qlinear_average_pool(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let channels_last = info.attr_int("channels_last", 0) != 0;
    let include_pad = info.attr_int("count_include_pad", 0) != 0;
    let window = Window::from_node(info)?;
    let kernel_shape = window.kernel.clone().ok_or_else(|| info.error("'kernel_shape' is required"))?;
    if kernel_shape.is_empty() || kernel_shape.len() > 3 || kernel_shape.contains(&0) {
        return Err(info.error(format!("kernel_shape {kernel_shape:?} must have 1 to 3 positive entries")));
    }
    if window.dilations.as_ref().is_some_and(|d| d.iter().any(|&v| v != 1)) {
        return Err(info.error("dilations are not supported by QLinearAveragePool"));
    }
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let dtype = check_8bit(x, "X")?;
        let sx = scale_of(input(ins, 1)?, "x_scale")?;
        let zx = zero_point_of(opt_input(ins, 2), dtype, "x_zero_point")?;
        let sy = scale_of(input(ins, 3)?, "y_scale")?;
        let zy = zero_point_of(opt_input(ins, 4), dtype, "y_zero_point")?;
        let p = PoolParams { sx, zx, sy, zy };
        let (batch, channels, spatial) = pool_dims(x.shape(), channels_last)?;
        if spatial.len() != kernel_shape.len() {
            return Err(kernel_error(format!("kernel_shape {kernel_shape:?} does not match the {} spatial dims of X {:?}", spatial.len(), x.shape())));
        }
        if spatial.contains(&0) {
            return Err(kernel_error(format!("X has an empty spatial dimension: {:?}", x.shape())));
        }
        let axes = window.axes(&spatial, &kernel_shape)?;
        let pads_zero = axes.iter().all(|a| a.pad_begin == 0 && a.pad_end == 0);
        if pads_zero && spatial == kernel_shape {
            let image: usize = spatial.iter().product();
            let shape = pool_shape(batch, channels, &vec![1; spatial.len()], channels_last);
            return Ok(vec![match dtype {
                DType::U8 => tensor(&shape, global_average(x.as_slice::<u8>().expect("checked"), batch, channels, image, channels_last, p)?)?,
                _ => tensor(&shape, global_average(x.as_slice::<i8>().expect("checked"), batch, channels, image, channels_last, p)?)?,
            }]);
        }
        let out_spatial: Vec<usize> = axes.iter().map(|a| a.output).collect();
        let shape = pool_shape(batch, channels, &out_spatial, channels_last);
        #[derive(Clone, Copy)]
        struct Geometry<'a> {
            batch: usize,
            channels: usize,
            spatial: &'a [usize],
            axes: &'a [super::conv::Axis],
            include_pad: bool,
            channels_last: bool,
        }
        fn run<T: Out8>(x: &[T], geo: &Geometry, p: PoolParams) -> Vec<T> {
            let Geometry { batch, channels, spatial, axes, include_pad, channels_last } = *geo;
            let PoolParams { sx, zx, sy, zy } = p;
            // Pad the geometry to 3-D with unit trailing axes (ONNX Runtime's loop order).
            let dim = |v: &[usize], i: usize| v.get(i).copied().unwrap_or(1);
            let (ih, iw, id) = (dim(spatial, 0), dim(spatial, 1), dim(spatial, 2));
            let get = |i: usize| axes.get(i).map(|a| (a.output, a.stride, a.pad_begin, a.kernel)).unwrap_or((1, 1, 0, 1));
            let ((oh, sh, ph, kh), (ow, sw, pw, kw), (od, sd, pd, kd)) = (get(0), get(1), get(2));
            let kernel_size = kh * kw * kd;
            let image = ih * iw * id;
            let deq: Vec<f32> = x.iter().map(|v| sx * (v.get() - zx) as f32).collect();
            let range = |o: usize, s: usize, p: usize, k: usize, n: usize| {
                let start = (o * s) as i64 - p as i64;
                let end = (start + k as i64).min(n as i64);
                (start.max(0) as usize, end.max(0) as usize)
            };
            let mut out = vec![T::default(); batch * channels * oh * ow * od];
            for b in 0..batch {
                for c in 0..channels {
                    let at = |h: usize, w: usize, d: usize| {
                        let p = (h * iw + w) * id + d;
                        if channels_last { (b * image + p) * channels + c } else { (b * channels + c) * image + p }
                    };
                    for yh in 0..oh {
                        let (h0, h1) = range(yh, sh, ph, kh, ih);
                        for yw in 0..ow {
                            let (w0, w1) = range(yw, sw, pw, kw, iw);
                            for yd in 0..od {
                                let (d0, d1) = range(yd, sd, pd, kd, id);
                                let mut y = 0f32;
                                for h in h0..h1 {
                                    for w in w0..w1 {
                                        for d in d0..d1 {
                                            y += deq[at(h, w, d)];
                                        }
                                    }
                                }
                                let count = if include_pad { kernel_size } else { (h1 - h0) * (w1 - w0) * (d1 - d0) };
                                y /= count as f32;
                                let q = cvt(y / sy + zy as f32).clamp(T::MIN, T::MAX);
                                let o = (yh * ow + yw) * od + yd;
                                let dst = if channels_last { (b * oh * ow * od + o) * channels + c } else { (b * channels + c) * oh * ow * od + o };
                                out[dst] = T::from_i32(q);
                            }
                        }
                    }
                }
            }
            out
        }
        let geo = Geometry { batch, channels, spatial: &spatial, axes: &axes, include_pad, channels_last };
        Ok(vec![match dtype {
            DType::U8 => tensor(&shape, run(x.as_slice::<u8>().expect("checked"), &geo, p))?,
            _ => tensor(&shape, run(x.as_slice::<i8>().expect("checked"), &geo, p))?,
        }])
    })
}

/// `QLinearConcat` (`com.microsoft`): inputs `(Y_scale, Y_zp, X1, X1_scale, X1_zp, ...)`,
/// attribute `axis`; every X of Y_zp's 8-bit type. An input whose scale and zero point equal
/// the output's is copied, any other is requantized through a 256-entry table (dequantize,
/// `QuantizeLinear`).
fn qlinear_concat(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let axis = info.node.attr_int("axis").ok_or_else(|| info.error("'axis' is required"))?;
    let count = info.node.inputs.len();
    if count < 5 || !(count - 2).is_multiple_of(3) {
        return Err(info.error(format!("inputs must be Y_scale, Y_zero_point and (tensor, scale, zero point) triples, got {count} inputs")));
    }
    kernel(move |ins| {
        let sy = scale_of(input(ins, 0)?, "Y_scale")?;
        let yz = input(ins, 1)?;
        let dtype = check_8bit(yz, "Y_zero_point")?;
        let zy = zero_point_of(Some(yz), dtype, "Y_zero_point")?;
        let n = (ins.len() - 2) / 3;
        let mut parts = Vec::with_capacity(n);
        for k in 0..n {
            let x = input(ins, 2 + 3 * k)?;
            if x.dtype() != dtype {
                return Err(kernel_error(format!("input {} must be {dtype} like Y_zero_point, got {}", 2 + 3 * k, x.dtype())));
            }
            let s = scale_of(input(ins, 3 + 3 * k)?, &format!("input {} (scale)", 3 + 3 * k))?;
            let z = zero_point_of(opt_input(ins, 4 + 3 * k), dtype, &format!("input {} (zero point)", 4 + 3 * k))?;
            parts.push((x, s, z));
        }
        let first = parts[0].0.shape().to_vec();
        let ax = norm_axis(axis, first.len())?;
        let mut out_shape = first.clone();
        out_shape[ax] = 0;
        for (x, _, _) in &parts {
            let s = x.shape();
            if s.len() != first.len() || s.iter().zip(&first).enumerate().any(|(i, (a, b))| i != ax && a != b) {
                return Err(kernel_error(format!("inputs of shapes {first:?} and {s:?} cannot be concatenated on axis {ax}")));
            }
            out_shape[ax] += s[ax];
        }
        fn run<T: Out8>(parts: &[(&Tensor, f32, i32)], ax: usize, out_shape: &[usize], sy: f32, zy: i32) -> RuntimeResult<Tensor> {
            let outer: usize = out_shape[..ax].iter().product();
            let inner: usize = out_shape[ax + 1..].iter().product();
            let mapped: Vec<Vec<T>> = parts.iter().map(|&(x, s, z)| {
                let v = x.as_slice::<T>().expect("checked");
                if s == sy && z == zy { v.to_vec() } else { apply_table(v, &lookup_table::<T>(s, z, sy, zy, |f| f)) }
            }).collect();
            let mut out = Vec::with_capacity(out_shape.iter().product());
            for o in 0..outer {
                for ((x, _, _), m) in parts.iter().zip(&mapped) {
                    let run = x.shape()[ax] * inner;
                    out.extend_from_slice(&m[o * run..(o + 1) * run]);
                }
            }
            tensor(out_shape, out)
        }
        Ok(vec![match dtype {
            DType::U8 => run::<u8>(&parts, ax, &out_shape, sy, zy)?,
            _ => run::<i8>(&parts, ax, &out_shape, sy, zy)?,
        }])
    })
}

/// ONNX Runtime's table of exponentials for `QLinearSoftmax` over `len` elements:
/// `exp((i - 255 + shift)·sx)` for `i` in `0..256`, in f64 and stored as f32, where
/// `shift = max(0, ln(f32::MAX / len) - 5) / sx` keeps the f32 sum of `len` entries finite. Int8
/// data indexes it by the byte of `x - xmax + 127`, uint8 data by `x + 255 - xmax`.
fn softmax_table(sx: f32, len: usize, signed: bool) -> [f32; 256] {
    let limit = f32::MAX / len as f32;
    let shift = ((limit as f64).ln() - 5.0).max(0.0) / sx as f64;
    let mut table = [0f32; 256];
    for i in 0..256i32 {
        let e = ((i as f64 - 255.0 + shift) * sx as f64).exp();
        let slot = if signed { (i - 128) as u8 } else { i as u8 };
        table[slot as usize] = e as f32;
    }
    table
}

/// One softmax row of `QLinearSoftmax`, read from `x` at `stride` and written to `y` at the
/// same positions: entries of the table shifted so the row's maximum reads entry 255, their
/// f32 sum in order, `q = rne(t·sy_inv / sum) + zy`, saturated to `T`.
fn softmax_row<T: Out8>(x: &[T], y: &mut [T], start: usize, len: usize, stride: usize, table: &[f32; 256], sy_inv: f32, zy: i32) {
    let at = |k: usize| start + k * stride;
    let xmax = (0..len).map(|k| x[at(k)].get()).max().expect("rows are not empty");
    let index = |v: i32| -> usize {
        if T::MIN < 0 { (v + 127 - xmax) as u8 as usize } else { (v + 255 - xmax) as usize }
    };
    let sum = (0..len).fold(0f32, |acc, k| acc + table[index(x[at(k)].get())]);
    for k in 0..len {
        let t = table[index(x[at(k)].get())];
        let q = ((t * sy_inv) / sum).round_ties_even() as i32 + zy;
        y[at(k)] = T::from_i32(q.clamp(T::MIN, T::MAX));
    }
}

/// `QLinearSoftmax` (`com.microsoft`): inputs `(X, X_scale, X_zero_point, Y_scale,
/// Y_zero_point)`, attributes `opset` (required: the version of the ONNX `Softmax` it computes)
/// and `axis` (default 1 below opset 13, else -1). Below opset 13 the input is flattened to 2-D
/// at `axis` and each row normalized; from 13 the softmax runs along `axis` alone. X's zero
/// point is not read (softmax ignores shifts). Computed as ONNX Runtime's CPU kernel does (see
/// [`softmax_table`], [`softmax_row`]), including its output scale `floor(1 / Y_scale)`.
fn qlinear_softmax(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let opset = info.node.attr_int("opset").ok_or_else(|| info.error("'opset' is required (the version of the Softmax it computes)"))?;
    let axis = info.node.attr_int("axis").unwrap_or(if opset < 13 { 1 } else { -1 });
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let dtype = check_8bit(x, "X")?;
        let sx = scale_of(input(ins, 1)?, "X_scale")?;
        let sy = scale_of(input(ins, 3)?, "Y_scale")?;
        let zy = zero_point_of(opt_input(ins, 4), dtype, "Y_zero_point")?;
        let shape = x.shape();
        if x.is_empty() {
            return Ok(vec![x.clone()]);
        }
        let ax = norm_axis(axis, shape.len().max(1))?;
        let (outer, len, inner) = if opset < 13 {
            (shape[..ax].iter().product::<usize>(), shape[ax..].iter().product::<usize>(), 1)
        } else {
            (shape[..ax].iter().product(), shape.get(ax).copied().unwrap_or(1), shape[ax + 1..].iter().product())
        };
        let table = softmax_table(sx, len, dtype == DType::I8);
        let sy_inv = (1.0f32 / sy).floor();
        fn run<T: Out8>(x: &[T], outer: usize, len: usize, inner: usize, table: &[f32; 256], sy_inv: f32, zy: i32) -> Vec<T> {
            let mut y = vec![T::default(); x.len()];
            for o in 0..outer {
                for i in 0..inner {
                    softmax_row(x, &mut y, o * len * inner + i, len, inner, table, sy_inv, zy);
                }
            }
            y
        }
        Ok(vec![match dtype {
            DType::U8 => tensor(shape, run(x.as_slice::<u8>().expect("checked"), outer, len, inner, &table, sy_inv, zy))?,
            _ => tensor(shape, run(x.as_slice::<i8>().expect("checked"), outer, len, inner, &table, sy_inv, zy))?,
        }])
    })
}

/// `DynamicQuantizeLinear` (opset 11): float32 `x` to uint8 `y` with the scalar `y_scale` and
/// `y_zero_point` computed from x's range as ONNX Runtime does: `min = min(0, min(x))`,
/// `max = max(0, max(x))` (NaN ignored), `scale = (max - min) / 255` (1 when `max == min`),
/// `zp = rne(clamp(-min / scale, 0, 255))`, then `y = QuantizeLinear(x, scale, zp)` with f32
/// division and round to nearest even.
fn dynamic_quantize_linear(_info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    kernel(|ins| {
        let x = input(ins, 0)?;
        let xv = x.as_slice::<f32>().map_err(|_| kernel_error(format!("x must be float, got {}", x.dtype())))?;
        let (lo, hi) = xv.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let (lo, hi) = (lo.min(0.0), hi.max(0.0));
        let scale = if hi == lo { 1.0 } else { (hi - lo) / 255.0 };
        let initial = 0.0 - lo / scale;
        let clamped = if initial.is_nan() { 255.0 } else { initial.clamp(0.0, 255.0) };
        let zp = clamped.round_ties_even() as i32;
        let y: Vec<u8> = xv.iter().map(|&v| quantize_one::<u8>(v, scale, zp)).collect();
        Ok(vec![tensor(x.shape(), y)?, Tensor::scalar(scale), Tensor::scalar(zp as u8)])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_lookup_matches_the_table_out_of_place_and_in_place() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let table: [u8; 256] = std::array::from_fn(|i| (i as u8).wrapping_mul(167).wrapping_add(29) ^ (i >> 3) as u8);
        let src: Vec<u8> = (0..300u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).chain(0..=255).collect();
        for len in (0..70).chain([255, 256, src.len()]) {
            let mut dst = vec![0u8; len];
            // SAFETY: the CPU supports AVX2, checked above; `src` and `dst` hold `len` bytes.
            unsafe { lookup_avx2(Rows { src: src.as_ptr(), dst: dst.as_mut_ptr(), len, count: 1, stride: 0 }, &table) };
            for (i, (&d, &x)) in dst.iter().zip(&src).enumerate() {
                assert_eq!(d, table[x as usize], "length {len}, byte {i}");
            }
            // In place, in three runs of `len / 4` bytes `len / 4 + 1` apart.
            let (run, count) = (len / 4, 3);
            let mut same = src.clone();
            // SAFETY: as above; the runs end within `3 (len / 4 + 1) <= src.len()` bytes.
            unsafe { lookup_avx2(Rows { src: same.as_ptr(), dst: same.as_mut_ptr(), len: run, count, stride: run + 1 }, &table) };
            for (i, (&d, &x)) in same.iter().zip(&src).enumerate() {
                let mapped = i % (run + 1) < run && i < count * (run + 1);
                assert_eq!(d, if mapped { table[x as usize] } else { x }, "length {len}, byte {i} in place");
            }
        }
    }

    #[test]
    fn conversion_overflow_gives_the_integer_minimum() {
        assert_eq!(cvt(2.5), 2);
        assert_eq!(cvt(-2.5), -2);
        assert_eq!(cvt(3.5), 4);
        assert_eq!(cvt(f32::NAN), i32::MIN);
        assert_eq!(cvt(3e9), i32::MIN);
        assert_eq!(cvt(-3e9), i32::MIN);
    }

    #[test]
    fn logistic_is_close_to_the_exact_function() {
        for i in -200..=200 {
            let x = i as f32 / 10.0;
            let exact = 1.0 / (1.0 + (-x as f64).exp());
            assert!((mlas_logistic(x) as f64 - exact).abs() < 1e-6, "{x}");
        }
        assert!(mlas_logistic(f32::NAN).is_nan());
    }

    #[test]
    fn table_indexes_signed_bytes() {
        let t = lookup_table::<i8>(1.0, 0, 1.0, 0, |v| v);
        assert_eq!(t[0xff], -1);
        assert_eq!(t[0x80], -128);
        assert_eq!(t[5], 5);
    }
}
