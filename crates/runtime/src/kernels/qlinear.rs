//! Integer matrix products and convolutions on 8-bit operands, bit-identical to ONNX
//! Runtime's CPU kernels, on the [`qgemm`](crate::qgemm) GEMM:
//!
//! * `MatMulInteger` (10+): `Y[i32] = (A - a_zp)(B - b_zp)`, numpy batch broadcasting; A's zero
//!   point per tensor or per row (`[M]`, or A's shape with the last dimension 1), B's per
//!   tensor or per column (`[N]`, or B's shape with the second-to-last dimension 1).
//! * `QLinearMatMul` (10+; 21 adds float16/bfloat16 scales): the same product requantized,
//!   `y = sat(rne(f32(acc) * m_j) + y_zp)` with `m_j = (a_scale * b_scale_j) / y_scale` in
//!   f32 (per tensor or per column of B).
//! * `ConvInteger` (10+) and `QLinearConv` (10+): 1-D and 2-D NCHW convolutions with groups,
//!   pads (or `auto_pad`), strides and dilations; weight zero points and scales per tensor or
//!   per output channel; QLinearConv's int32 bias is added to the accumulator before
//!   requantizing with `m_oc = (x_scale * w_scale_oc) / y_scale`. The image is transposed to
//!   channels-last and unfolded (im2col) block by block inside the GEMM (pointwise
//!   convolutions read it in place), or, for QLinearConv on CPUs with AVX-512 VNNI, run on
//!   NCHW kernels that need no transposes: `qgemm::conv` (`W x im2col(X)`, when the im2col
//!   is cheap) and, for depthwise convolutions (`group == C == M`) on CPUs that also have
//!   VBMI, `qgemm::depthwise`. Other depthwise convolutions run a direct sliding-window
//!   kernel on the channels-last image.
//! * `com.microsoft` `QGemm` (1): `alpha (A - a_zp)(B - b_zp) + C` with `transA`/`transB`, an
//!   optional int32 `C` broadcast to `M x N` (added to the accumulator), and either an 8-bit
//!   output (`y_zero_point` given: multiplier `((alpha * a_scale) * b_scale_j) / y_scale`) or
//!   an f32 one (`f32(acc) * (alpha * a_scale) * b_scale_j`, divided by `y_scale` when given).
//!
//! Activations and weights may each be uint8 or int8 (ONNX Runtime implements a subset of
//! the combinations; qforge all four). Constant weights are packed once when the session is
//! planned. Zero points must have their data's type; scales are f32 (QLinearMatMul 21: also
//! f16/bf16, widened exactly, which is what ONNX Runtime computes with).

use std::mem::MaybeUninit;
use std::sync::Arc;

use qforge_ir::{DType, Tensor, MS_DOMAIN};

use super::conv::{Axis, Window};
use super::util::{assume_init, broadcast_shape, input, opt_input, par_chunks_mut, par_steps, tensor, threads, uninit, vectorized_wide};
use crate::qgemm::{self, gemm, gemm_i32, ASource, Block, FillRows, Gemm, Int8, Isa, Out8, PackedB, Scale, SharedOut, ZeroPoints};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RunCtx, RuntimeResult, LATEST, QLINEAR_CONV_LOOKUP, RUNTIME_DOMAIN};

/// Registers MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv, `com.microsoft` QGemm and
/// the sessions' [`QLINEAR_CONV_LOOKUP`].
pub fn register(r: &mut Registry) {
    r.add("", "MatMulInteger", 10, LATEST, matmul_integer);
    r.add("", "QLinearMatMul", 10, LATEST, qlinear_matmul);
    r.add("", "ConvInteger", 10, LATEST, conv_integer);
    r.add("", "QLinearConv", 10, LATEST, qlinear_conv);
    r.add(RUNTIME_DOMAIN, QLINEAR_CONV_LOOKUP, 1, LATEST, qlinear_conv_lookup);
    r.add(MS_DOMAIN, "QGemm", 1, 1, qgemm_op);
}

// ---------------------------------------------------------------------------------------
// Shared input handling
// ---------------------------------------------------------------------------------------

/// The element type and bytes of an 8-bit integer tensor named `what`.
fn int8_of<'a>(t: &'a Tensor, what: &str) -> RuntimeResult<(Int8, &'a [u8])> {
    let kind = match t.dtype() {
        DType::U8 => Int8::U8,
        DType::I8 => Int8::I8,
        d @ (DType::F8E4M3FN | DType::F8E4M3FNUZ | DType::F8E5M2 | DType::F8E5M2FNUZ) => {
            return Err(kernel_error(format!("{what} is {d}: float8 products are not supported; quantize to uint8 or int8")))
        }
        d => return Err(kernel_error(format!("{what} must be uint8 or int8, got {d}"))),
    };
    Ok((kind, t.raw_bytes().expect("8-bit tensors have bytes")))
}

/// The ONNX element type of an 8-bit operand type.
fn dtype_of(t: Int8) -> DType {
    match t {
        Int8::U8 => DType::U8,
        Int8::I8 => DType::I8,
    }
}

/// The values of a zero point tensor, which must have `data`'s element type (a single 0
/// when it is omitted).
fn zero_points(zp: Option<&Tensor>, data: Int8, what: &str, of: &str) -> RuntimeResult<Vec<i32>> {
    let Some(z) = zp else { return Ok(vec![0]) };
    if z.dtype() != dtype_of(data) {
        return Err(kernel_error(format!("{what} must have the type of {of} ({}), got {}", dtype_of(data), z.dtype())));
    }
    let raw = z.raw_bytes().expect("8-bit tensors have bytes");
    Ok(match data {
        Int8::U8 => raw.iter().map(|&v| v as i32).collect(),
        Int8::I8 => raw.iter().map(|&v| v as i8 as i32).collect(),
    })
}

/// The values of a scale tensor: float, or float16/bfloat16 when `half_ok`.
fn scales(t: &Tensor, what: &str, half_ok: bool) -> RuntimeResult<Vec<f32>> {
    match t.dtype() {
        DType::F32 => Ok(t.as_slice::<f32>().unwrap().to_vec()),
        DType::F16 if half_ok => Ok(t.as_slice::<half::f16>().unwrap().iter().map(|v| v.to_f32()).collect()),
        DType::BF16 if half_ok => Ok(t.as_slice::<half::bf16>().unwrap().iter().map(|v| v.to_f32()).collect()),
        d => Err(kernel_error(format!("{what} must be float{}, got {d}", if half_ok { ", float16 or bfloat16" } else { "" }))),
    }
}

/// Checks that a quantization parameter is one value (a scalar or any one-element tensor).
fn single(t: &Tensor, what: &str) -> RuntimeResult<()> {
    if t.len() != 1 {
        return Err(kernel_error(format!("{what} must be a scalar (per-tensor), got shape {:?}", t.shape())));
    }
    Ok(())
}

/// How a parameter of B (scale or zero point) applies to B's matrices.
#[derive(Clone, Copy, PartialEq, Debug)]
enum PerB {
    /// One value for everything.
    Tensor,
    /// One value per column, shared by all matrices.
    Columns,
    /// One value per column of each matrix (B's shape with the second-to-last dimension 1).
    BatchColumns,
}

impl PerB {
    /// Classifies a parameter of shape `p` for B of (promoted) shape `b` with `n` columns.
    fn of(p: &[usize], b: &[usize], n: usize, what: &str) -> RuntimeResult<PerB> {
        let len: usize = p.iter().product();
        if len == 1 {
            return Ok(PerB::Tensor);
        }
        if p == [n] {
            return Ok(PerB::Columns);
        }
        let r = b.len();
        if p.len() == r && r >= 2 && p[r - 2] == 1 && p.iter().zip(b).enumerate().all(|(i, (x, y))| i == r - 2 || x == y) {
            return Ok(PerB::BatchColumns);
        }
        Err(kernel_error(format!("{what} of shape {p:?} does not fit B of shape {b:?}: use a scalar, [{n}], or B's shape with the second-to-last dimension 1")))
    }

    /// The values of matrix `ib` (`values` as read; a scalar stays one value).
    fn slice<T>(self, values: &[T], ib: usize, n: usize) -> &[T] {
        match self {
            PerB::Tensor | PerB::Columns => values,
            PerB::BatchColumns => &values[ib * n..(ib + 1) * n],
        }
    }
}

/// Zero points as the GEMM takes them.
fn zp_arg(v: &[i32]) -> ZeroPoints<'_> {
    if v.len() == 1 {
        ZeroPoints::Tensor(v[0])
    } else {
        ZeroPoints::Each(v)
    }
}

/// Scales as the output stage takes them.
fn scale_arg(v: &[f32]) -> Scale<'_> {
    if v.len() == 1 {
        Scale::Tensor(v[0])
    } else {
        Scale::Each(v)
    }
}

// ---------------------------------------------------------------------------------------
// MatMulInteger and QLinearMatMul
// ---------------------------------------------------------------------------------------

/// Shapes of a batched product with numpy broadcasting.
struct Batched {
    m: usize,
    k: usize,
    n: usize,
    out_shape: Vec<usize>,
    /// A's and B's shapes with 1-D operands promoted to matrices.
    a_shape: Vec<usize>,
    b_shape: Vec<usize>,
    /// For each output matrix, the indices of its A and B matrices.
    pairs: Vec<(usize, usize)>,
    b_count: usize,
}

impl Batched {
    /// The product of A and B of these shapes (1-D operands promoted as numpy does), or an
    /// error when the inner dimensions differ or the batch dimensions do not broadcast.
    fn new(ashape: &[usize], bshape: &[usize]) -> RuntimeResult<Batched> {
        if ashape.is_empty() || bshape.is_empty() {
            return Err(kernel_error(format!("matrix product operands must have rank at least 1, got {ashape:?} and {bshape:?}")));
        }
        let (mut a, mut b) = (ashape.to_vec(), bshape.to_vec());
        let (a1, b1) = (a.len() == 1, b.len() == 1);
        if a1 {
            a.insert(0, 1);
        }
        if b1 {
            b.push(1);
        }
        let (m, k) = (a[a.len() - 2], a[a.len() - 1]);
        let (k2, n) = (b[b.len() - 2], b[b.len() - 1]);
        if k != k2 {
            return Err(kernel_error(format!("A of shape {ashape:?} and B of shape {bshape:?} do not align (A has {k} columns, B {k2} rows)")));
        }
        let (ab, bb) = (&a[..a.len() - 2], &b[..b.len() - 2]);
        let batch = broadcast_shape(ab, bb)?;
        let count: usize = batch.iter().product();
        let source = |shape: &[usize], flat: usize| -> usize {
            let off = batch.len() - shape.len();
            let (mut rem, mut idx, mut mult) = (flat, 0, 1);
            let mut coords = vec![0; batch.len()];
            for d in (0..batch.len()).rev() {
                coords[d] = rem % batch[d];
                rem /= batch[d];
            }
            for d in (0..shape.len()).rev() {
                idx += if shape[d] == 1 { 0 } else { coords[d + off] } * mult;
                mult *= shape[d];
            }
            idx
        };
        let pairs = (0..count).map(|i| (source(ab, i), source(bb, i))).collect();
        let mut out_shape = batch;
        if !a1 {
            out_shape.push(m);
        }
        if !b1 {
            out_shape.push(n);
        }
        Ok(Batched { m, k, n, out_shape, b_count: bb.iter().product(), a_shape: a, b_shape: b, pairs })
    }

    /// Whether every output matrix uses B's only matrix and A's matrices in order, so the
    /// batch folds into the rows of one product.
    fn folds(&self) -> bool {
        self.b_count == 1 && self.pairs.iter().enumerate().all(|(i, &(ia, _))| ia == i)
    }
}

/// Packs each matrix of B (`[..., K, N]`, or `[K]` as a column) for `isa`.
fn pack_matrices(b: &Tensor, isa: Isa) -> RuntimeResult<Vec<PackedB>> {
    let (bt, bytes) = int8_of(b, "B")?;
    let s = b.shape();
    let (k, n) = match s.len() {
        0 => return Err(kernel_error("B must have rank at least 1")),
        1 => (s[0], 1),
        r => (s[r - 2], s[r - 1]),
    };
    let count = if s.len() <= 2 { 1 } else { s[..s.len() - 2].iter().product() };
    Ok((0..count).map(|i| PackedB::pack(isa, bt, &bytes[i * k * n..(i + 1) * k * n], k, n, n, 1)).collect())
}

/// Packed constant weights, with the shape they were packed from.
struct Packed {
    shape: Vec<usize>,
    dtype: DType,
    mats: Vec<PackedB>,
}

/// Packs a constant weight input once, when it is an 8-bit tensor; other inputs are left for
/// the run to report.
fn pack_const(info: &NodeInfo, i: usize, isa: Isa) -> Option<Arc<Packed>> {
    let b = info.const_input(i)?;
    let mats = pack_matrices(b, isa).ok()?;
    Some(Arc::new(Packed { shape: b.shape().to_vec(), dtype: b.dtype(), mats }))
}

/// Which matrix-product operator a [`QMatMul`] implements.
#[derive(Clone, Copy, PartialEq)]
enum MatMulKind {
    Integer,
    QLinear { half_scales: bool },
}

/// MatMulInteger and QLinearMatMul.
struct QMatMul {
    kind: MatMulKind,
    isa: Isa,
    packed: Option<Arc<Packed>>,
}

/// `MatMulInteger`: B is packed now when it is a constant.
fn matmul_integer(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let isa = Isa::best();
    Ok(Box::new(QMatMul { kind: MatMulKind::Integer, isa, packed: pack_const(info, 1, isa) }))
}

/// `QLinearMatMul`: B is packed now when it is a constant; opset 21 accepts half-precision
/// scales.
fn qlinear_matmul(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let isa = Isa::best();
    Ok(Box::new(QMatMul { kind: MatMulKind::QLinear { half_scales: info.opset >= 21 }, isa, packed: pack_const(info, 3, isa) }))
}

/// Where the requantized or integer results of one product go.
enum MatOut<'a> {
    I32(SharedOut<'a, i32>),
    U8(SharedOut<'a, u8>, i32),
    I8(SharedOut<'a, i8>, i32),
}

impl QMatMul {
    /// The input index of B.
    fn b_index(&self) -> usize {
        if self.kind == MatMulKind::Integer { 1 } else { 3 }
    }
}

impl Kernel for QMatMul {
    fn run(&self, ins: &[Option<&Tensor>], _: &RunCtx) -> RuntimeResult<Vec<Tensor>> {
        let a = input(ins, 0)?;
        let b = input(ins, self.b_index())?;
        let (at, abytes) = int8_of(a, "A")?;
        let (bt, _) = int8_of(b, "B")?;
        let d = Batched::new(a.shape(), b.shape())?;
        let (m, n) = (d.m, d.n);
        // Zero points and scales.
        let (a_zp_t, b_zp_t) = match self.kind {
            MatMulKind::Integer => (opt_input(ins, 2), opt_input(ins, 3)),
            MatMulKind::QLinear { .. } => (Some(input(ins, 2)?), Some(input(ins, 5)?)),
        };
        let a_zp = zero_points(a_zp_t, at, "a_zero_point", "A")?;
        let a_zp_rows = match a_zp_t {
            Some(z) if z.len() != 1 => {
                let per_row = (d.a_shape.len() == 2 && z.shape() == [m]) || (z.rank() == d.a_shape.len() && z.shape()[..z.rank() - 1] == d.a_shape[..z.rank() - 1] && z.shape()[z.rank() - 1] == 1);
                if !per_row || self.kind != MatMulKind::Integer {
                    return Err(kernel_error(format!("a_zero_point of shape {:?} is not supported: use a scalar{}", z.shape(), if self.kind == MatMulKind::Integer { format!(", [{m}] or A's shape with the last dimension 1") } else { String::new() })));
                }
                true
            }
            _ => false,
        };
        let b_zp = zero_points(b_zp_t, bt, "b_zero_point", "B")?;
        let b_zp_kind = match b_zp_t {
            Some(z) => PerB::of(z.shape(), &d.b_shape, n, "b_zero_point")?,
            None => PerB::Tensor,
        };
        let mut out_scales: Vec<f32> = vec![];
        let mut scale_kind = PerB::Tensor;
        let mut y_zp = (Int8::U8, 0);
        if let MatMulKind::QLinear { half_scales } = self.kind {
            let (sa, sb, sy) = (input(ins, 1)?, input(ins, 4)?, input(ins, 6)?);
            single(sa, "a_scale")?;
            single(sy, "y_scale")?;
            if sa.dtype() != sb.dtype() || sa.dtype() != sy.dtype() {
                return Err(kernel_error(format!("a_scale, b_scale and y_scale must have one type, got {}, {} and {}", sa.dtype(), sb.dtype(), sy.dtype())));
            }
            let (va, vb, vy) = (scales(sa, "a_scale", half_scales)?[0], scales(sb, "b_scale", half_scales)?, scales(sy, "y_scale", half_scales)?[0]);
            scale_kind = PerB::of(sb.shape(), &d.b_shape, n, "b_scale")?;
            out_scales = vb.iter().map(|&s| va * s / vy).collect();
            let yz = input(ins, 7)?;
            single(yz, "y_zero_point")?;
            let (yt, _) = int8_of(yz, "y_zero_point")?;
            y_zp = (yt, zero_points(Some(yz), yt, "y_zero_point", "y_zero_point")?[0]);
        }
        // B packed once (constant) or now.
        let owned;
        let mats: &[PackedB] = match &self.packed {
            Some(p) if p.shape == b.shape() && p.dtype == b.dtype() => &p.mats,
            _ => {
                owned = pack_matrices(b, self.isa)?;
                &owned
            }
        };
        let total: usize = d.out_shape.iter().product();
        let mut out_i32 = vec![];
        let mut out_u8 = vec![];
        let mut out_i8 = vec![];
        let sink = match (self.kind, y_zp.0) {
            (MatMulKind::Integer, _) => {
                out_i32 = vec![0i32; total];
                MatOut::I32(SharedOut::new(&mut out_i32))
            }
            (_, Int8::U8) => {
                out_u8 = vec![0u8; total];
                MatOut::U8(SharedOut::new(&mut out_u8), y_zp.1)
            }
            (_, Int8::I8) => {
                out_i8 = vec![0i8; total];
                MatOut::I8(SharedOut::new(&mut out_i8), y_zp.1)
            }
        };
        let (k, mk) = (d.k, d.m * d.k);
        // One product: output matrices `first..first + count` (A matrices in order) with B
        // matrix `ib`, rows of all of them stacked.
        let product = |first: usize, count: usize, ib: usize, parallel: bool| {
            let ia = d.pairs[first].0;
            let rows = count * m;
            let a_rows = &abytes[ia * mk..(ia + count) * mk];
            let azp = if a_zp_rows { ZeroPoints::Each(&a_zp[ia * m..(ia + count) * m]) } else { ZeroPoints::Tensor(a_zp[0]) };
            let g = Gemm { m: rows, a: ASource::Rows { data: a_rows, lda: k }, a_type: at, a_zp: azp, b: &mats[ib], b_zp: zp_arg(b_zp_kind.slice(&b_zp, ib, n)) };
            let base = first * m * n;
            let scales = scale_kind.slice(&out_scales, ib, n);
            match &sink {
                // SAFETY: products of different output matrices write disjoint ranges; the
                // buffer outlives them.
                MatOut::I32(o) => gemm_i32(&g, unsafe { o.slice(base, rows * n) }, parallel),
                MatOut::U8(o, zp) => gemm(&g, &|blk: Block| requant_rows(o, &blk, base, n, scale_arg(scales), *zp), parallel),
                MatOut::I8(o, zp) => gemm(&g, &|blk: Block| requant_rows(o, &blk, base, n, scale_arg(scales), *zp), parallel),
            }
        };
        if total > 0 {
            if d.folds() {
                product(0, d.pairs.len(), 0, true);
            } else {
                let small = m * n * k < 1 << 18 && d.pairs.len() >= 2 * threads();
                if small {
                    par_steps(d.pairs.len(), 1, 1, || (), |_, i| product(i, 1, d.pairs[i].1, false));
                } else {
                    (0..d.pairs.len()).for_each(|i| product(i, 1, d.pairs[i].1, true));
                }
            }
        }
        Ok(vec![match (self.kind, y_zp.0) {
            (MatMulKind::Integer, _) => tensor(&d.out_shape, out_i32)?,
            (_, Int8::U8) => tensor(&d.out_shape, out_u8)?,
            (_, Int8::I8) => tensor(&d.out_shape, out_i8)?,
        }])
    }
}

/// Requantizes a finished block into a row-major `n`-column output at `base`.
fn requant_rows<T: Out8>(o: &SharedOut<T>, blk: &Block, base: usize, n: usize, scale: Scale, zp: i32) {
    let start = base + blk.row0 * n + blk.col0;
    // SAFETY: blocks of one product cover disjoint output elements (rows `rows`, columns
    // `cols` of the matrix at `base`), products of different batches write disjoint matrices,
    // and the buffer outlives the product; no reference to those elements is live.
    unsafe {
        let out = o.ptr(start, (blk.rows - 1) * n + blk.cols);
        qgemm::requantize_block(blk.data, blk.ld, blk.rows, blk.cols, None, scale.columns(blk.col0, blk.cols), zp, out, n);
    }
}

// ---------------------------------------------------------------------------------------
// QGemm (com.microsoft)
// ---------------------------------------------------------------------------------------

/// ONNX Runtime's `com.microsoft` QGemm.
struct QGemmOp {
    alpha: f32,
    trans_a: bool,
    trans_b: bool,
    isa: Isa,
    packed: Option<Arc<Packed>>,
}

/// `com.microsoft` `QGemm`: reads `alpha`, `transA`, `transB`; a constant 2-D B is packed now.
fn qgemm_op(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let isa = Isa::best();
    let (trans_a, trans_b) = (info.attr_int("transA", 0) != 0, info.attr_int("transB", 0) != 0);
    let packed = info.const_input(3).filter(|b| b.rank() == 2).and_then(|b| {
        let (bt, bytes) = int8_of(b, "B").ok()?;
        let s = b.shape();
        let (k, n, rs, cs) = if trans_b { (s[1], s[0], 1, s[1]) } else { (s[0], s[1], s[1], 1) };
        Some(Arc::new(Packed { shape: s.to_vec(), dtype: b.dtype(), mats: vec![PackedB::pack(isa, bt, bytes, k, n, rs, cs)] }))
    });
    Ok(Box::new(QGemmOp { alpha: info.attr_float("alpha", 1.0), trans_a, trans_b, isa, packed }))
}

/// An int32 `C` broadcast to `M x N`: where element `(i, j)` is read.
#[derive(Clone, Copy)]
enum Bias<'a> {
    None,
    Scalar(i32),
    Row(&'a [i32]),
    Col(&'a [i32]),
    Full(&'a [i32], usize),
}

impl Bias<'_> {
    /// Reads an int32 `C` of shape `[]`, `[1]`, `[N]`, `[1, N]`, `[M, 1]` or `[M, N]` (any
    /// one-element shape of rank up to 2 counts as a scalar).
    fn of<'a>(c: Option<&'a Tensor>, m: usize, n: usize) -> RuntimeResult<Bias<'a>> {
        let Some(c) = c else { return Ok(Bias::None) };
        let v = c.as_slice::<i32>().map_err(|_| kernel_error(format!("C must be int32, got {}", c.dtype())))?;
        let s = c.shape();
        Ok(match s {
            _ if v.len() == 1 && s.len() <= 2 => Bias::Scalar(v[0]),
            [x] | [1, x] if *x == n => Bias::Row(v),
            [x, 1] if *x == m => Bias::Col(v),
            [x, y] if *x == m && *y == n => Bias::Full(v, n),
            _ => return Err(kernel_error(format!("C of shape {s:?} does not broadcast to [{m}, {n}]"))),
        })
    }

    /// Adds the bias of row `i`, columns `j0..j0 + row.len()`, in wrapping arithmetic.
    fn add(&self, i: usize, j0: usize, row: &mut [i32]) {
        let add = |row: &mut [i32], b: &[i32]| row.iter_mut().zip(b).for_each(|(v, &b)| *v = v.wrapping_add(b));
        match *self {
            Bias::None => {}
            Bias::Scalar(b) => row.iter_mut().for_each(|v| *v = v.wrapping_add(b)),
            Bias::Row(b) => add(row, &b[j0..j0 + row.len()]),
            Bias::Col(b) => row.iter_mut().for_each(|v| *v = v.wrapping_add(b[i])),
            Bias::Full(b, n) => add(row, &b[i * n + j0..i * n + j0 + row.len()]),
        }
    }
}

impl Kernel for QGemmOp {
    fn run(&self, ins: &[Option<&Tensor>], _: &RunCtx) -> RuntimeResult<Vec<Tensor>> {
        let (a, sa, za, b, sb, zb) = (input(ins, 0)?, input(ins, 1)?, input(ins, 2)?, input(ins, 3)?, input(ins, 4)?, input(ins, 5)?);
        let (c, sy, zy) = (opt_input(ins, 6), opt_input(ins, 7), opt_input(ins, 8));
        if a.rank() != 2 || b.rank() != 2 {
            return Err(kernel_error(format!("QGemm needs 2-D A and B, got {:?} and {:?}", a.shape(), b.shape())));
        }
        let (at, abytes) = int8_of(a, "A")?;
        let (bt, _) = int8_of(b, "B")?;
        let (m, k) = if self.trans_a { (a.shape()[1], a.shape()[0]) } else { (a.shape()[0], a.shape()[1]) };
        let (k2, n) = if self.trans_b { (b.shape()[1], b.shape()[0]) } else { (b.shape()[0], b.shape()[1]) };
        if k != k2 {
            return Err(kernel_error(format!("A {:?} and B {:?} do not align (transA={}, transB={})", a.shape(), b.shape(), self.trans_a as u8, self.trans_b as u8)));
        }
        single(sa, "a_scale")?;
        single(za, "a_zero_point")?;
        let a_zp = zero_points(Some(za), at, "a_zero_point", "A")?;
        let b_zp = zero_points(Some(zb), bt, "b_zero_point", "B")?;
        let per = |t: &Tensor, what: &str| -> RuntimeResult<()> {
            if t.len() == 1 && t.rank() <= 1 || t.shape() == [n] {
                Ok(())
            } else {
                Err(kernel_error(format!("{what} must be a scalar or have shape [{n}], got {:?}", t.shape())))
            }
        };
        per(sb, "b_scale")?;
        per(zb, "b_zero_point")?;
        let (va, vb) = (scales(sa, "a_scale", false)?[0], scales(sb, "b_scale", false)?);
        let vy = match sy {
            Some(t) => {
                single(t, "y_scale")?;
                Some(scales(t, "y_scale", false)?[0])
            }
            None => None,
        };
        let mult: Vec<f32> = vb.iter().map(|&s| {
            let v = self.alpha * va * s;
            match vy {
                Some(y) => v / y,
                None => v,
            }
        }).collect();
        let bias = Bias::of(c, m, n)?;
        let y_zp = match zy {
            Some(z) => {
                if vy.is_none() {
                    return Err(kernel_error("y_zero_point is given without y_scale; give both for a quantized output or neither for float"));
                }
                single(z, "y_zero_point")?;
                let (yt, _) = int8_of(z, "y_zero_point")?;
                Some((yt, zero_points(Some(z), yt, "y_zero_point", "y_zero_point")?[0]))
            }
            None => None,
        };
        let a_t;
        let a_rows: &[u8] = if self.trans_a {
            a_t = transpose_bytes(abytes, k, m);
            &a_t
        } else {
            abytes
        };
        let owned;
        let pb: &PackedB = match &self.packed {
            Some(p) if p.shape == b.shape() && p.dtype == b.dtype() => &p.mats[0],
            _ => {
                let bytes = b.raw_bytes().unwrap();
                let (rs, cs) = if self.trans_b { (1, k) } else { (n, 1) };
                owned = PackedB::pack(self.isa, bt, bytes, k, n, rs, cs);
                &owned
            }
        };
        let g = Gemm { m, a: ASource::Rows { data: a_rows, lda: k }, a_type: at, a_zp: ZeroPoints::Tensor(a_zp[0]), b: pb, b_zp: zp_arg(&b_zp) };
        let scale = scale_arg(&mult);
        /// The `m x n` output: each finished row of the product plus the bias, converted by `f`.
        fn run<T: Send + Default + Clone>(g: &Gemm, m: usize, n: usize, bias: Bias, f: impl Fn(&[i32], Scale, &mut [T]) + Sync, scale: Scale) -> Vec<T> {
            let mut out = vec![T::default(); m * n];
            let o = SharedOut::new(&mut out);
            gemm(g, &|mut blk: Block| {
                for r in 0..blk.rows {
                    let (i, j0) = (blk.row0 + r, blk.col0);
                    bias.add(i, j0, blk.row_mut(r));
                    // SAFETY: blocks cover disjoint elements of `out`, which outlives the product.
                    let dst = unsafe { o.slice(i * n + blk.col0, blk.cols) };
                    f(blk.row(r), scale.columns(blk.col0, blk.cols), dst);
                }
            }, true);
            out
        }
        let y = match y_zp {
            Some((Int8::U8, z)) => tensor(&[m, n], run(&g, m, n, bias, |s, sc, d: &mut [u8]| qgemm::requantize(s, sc, z, d), scale))?,
            Some((Int8::I8, z)) => tensor(&[m, n], run(&g, m, n, bias, |s, sc, d: &mut [i8]| qgemm::requantize(s, sc, z, d), scale))?,
            None => tensor(&[m, n], run(&g, m, n, bias, |s, sc, d: &mut [f32]| qgemm::scale_to_f32(s, sc, d), scale))?,
        };
        Ok(vec![y])
    }
}

/// The transpose of a row-major `rows x cols` byte matrix.
fn transpose_bytes(src: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; rows * cols];
    const T: usize = 32;
    for r0 in (0..rows).step_by(T) {
        for c0 in (0..cols).step_by(T) {
            for r in r0..(r0 + T).min(rows) {
                for c in c0..(c0 + T).min(cols) {
                    out[c * rows + r] = src[r * cols + c];
                }
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// ConvInteger and QLinearConv
// ---------------------------------------------------------------------------------------

/// Which convolution operator a [`QConv`] implements.
#[derive(Clone, Copy, PartialEq)]
enum ConvKind {
    Integer,
    QLinear,
}

/// Constant convolution weights prepared once: packed per group for the GEMM (depth order
/// `(ki, kj, c)`) and, when the convolution may run on the NCHW kernel ([`nchw_kernel`]),
/// per group for that kernel too; a depthwise QLinearConv's for the depthwise kernel when
/// the CPU runs it.
struct ConvWeights {
    shape: Vec<usize>,
    dtype: DType,
    groups: Vec<PackedB>,
    #[cfg(target_arch = "x86_64")]
    nchw: Vec<qgemm::conv::ConvW>,
    #[cfg(target_arch = "x86_64")]
    depthwise: Option<qgemm::depthwise::DepthwiseW>,
}

/// ConvInteger and QLinearConv (with a lookup table on its output: [`QLINEAR_CONV_LOOKUP`]).
struct QConv {
    kind: ConvKind,
    window: Window,
    group: usize,
    isa: Isa,
    weights: Option<Arc<ConvWeights>>,
    /// The table each requantized output byte is mapped through, and the output type it gives.
    table: Option<([u8; 256], Int8)>,
}

/// `ConvInteger` (weights at input 1).
fn conv_integer(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    qconv(info, ConvKind::Integer, 1)
}

/// `QLinearConv` (weights at input 3).
fn qlinear_conv(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    qconv(info, ConvKind::QLinear, 3)
}

/// [`QLINEAR_CONV_LOOKUP`]: `QLinearConv` with a constant table of 256 8-bit elements at
/// input 9.
fn qlinear_conv_lookup(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let t = info.const_input(9).ok_or_else(|| info.error("the table (input 9) must be a constant"))?;
    let (kind, bytes) = int8_of(t, "the table").map_err(|e| info.error(e.to_string()))?;
    let bytes: [u8; 256] = bytes.try_into().map_err(|_| info.error(format!("the table must have 256 elements, got shape {:?}", t.shape())))?;
    let mut conv = qconv_kernel(info, ConvKind::QLinear, 3)?;
    conv.table = Some((bytes, kind));
    Ok(Box::new(conv))
}

/// The kernel of [`qconv_kernel`], boxed.
fn qconv(info: &NodeInfo, kind: ConvKind, w_index: usize) -> RuntimeResult<Box<dyn Kernel>> {
    Ok(Box::new(qconv_kernel(info, kind, w_index)?))
}

/// Reads the window attributes and `group` (an error names the node when it is below 1), and
/// packs constant 1-D/2-D weights per group unless the convolution is depthwise.
fn qconv_kernel(info: &NodeInfo, kind: ConvKind, w_index: usize) -> RuntimeResult<QConv> {
    let window = Window::from_node(info)?;
    let group = info.attr_int("group", 1);
    if group < 1 {
        return Err(info.error(format!("group must be at least 1, got {group}")));
    }
    let group = group as usize;
    let isa = Isa::best();
    let weights = info.const_input(w_index).and_then(|w| {
        let (wt, bytes) = int8_of(w, "w").ok()?;
        let s = w.shape();
        if !(s.len() == 3 || s.len() == 4) || s[0] % group != 0 || s[0] == 0 {
            return None;
        }
        let geo = ConvGeometry::weights(s, group);
        let groups = if geo.depthwise_shape() { vec![] } else { (0..group).map(|g| geo.pack(isa, wt, bytes, g)).collect() };
        Some(Arc::new(ConvWeights {
            shape: s.to_vec(),
            dtype: w.dtype(),
            groups,
            #[cfg(target_arch = "x86_64")]
            nchw: if !nchw_kernel(kind, &geo, &window) { vec![] } else { (0..group).map(|g| geo.pack_nchw(wt, bytes, g)).collect() },
            #[cfg(target_arch = "x86_64")]
            depthwise: (kind == ConvKind::QLinear && geo.depthwise_shape() && qgemm::depthwise::available()).then(|| qgemm::depthwise::DepthwiseW::pack(wt, bytes, geo.m, geo.kh, geo.kw)),
        }))
    });
    Ok(QConv { kind, window, group, isa, weights, table: None })
}

/// Whether a convolution of this kind, weight geometry and window may run on the NCHW kernel
/// ([`qgemm::conv`]): QLinearConv with strides of at most 2 on CPUs with AVX-512 VNNI, unless
/// its im2col is deep and shared by few output channels (a `3 x 3` kernel over 96 channels
/// into 24, say), where gathering the im2col of the NCHW image costs more than the
/// channels-last GEMM's transposes. Images of fewer than [`NCHW_MIN_PLANE`] output positions
/// still take the GEMM (the kernel's tiles are 32 positions wide).
fn nchw_kernel(kind: ConvKind, geo: &ConvGeometry, window: &Window) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let cheap_im2col = geo.kh * geo.kw == 1 || geo.kdim() <= 64 || geo.mg >= 64;
        let strides_ok = window.strides.as_ref().is_none_or(|s| s.iter().all(|&v| v <= 2));
        kind == ConvKind::QLinear && !geo.depthwise_shape() && cheap_im2col && strides_ok && qgemm::conv::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (kind, geo, window);
        false
    }
}

/// The fewest output positions per image for which [`nchw_kernel`] convolutions take the NCHW
/// kernel.
const NCHW_MIN_PLANE: usize = 64;

/// The weight side of a convolution.
#[derive(Clone, Copy)]
struct ConvGeometry {
    /// Output channels, in total and per group.
    m: usize,
    mg: usize,
    /// Input channels per group.
    cg: usize,
    kh: usize,
    kw: usize,
}

impl ConvGeometry {
    /// The geometry of weights of shape `w` (`[M, C/group, (kh,) kw]`, rank 3 or 4).
    fn weights(w: &[usize], group: usize) -> ConvGeometry {
        let one_d = w.len() == 3;
        let (kh, kw) = if one_d { (1, w[2]) } else { (w[2], w[3]) };
        ConvGeometry { m: w[0], mg: w[0] / group, cg: w[1], kh, kw }
    }

    /// Whether each output channel reads exactly one input channel of its own.
    fn depthwise_shape(&self) -> bool {
        self.cg == 1 && self.mg == 1
    }

    /// Depth of one group's product.
    fn kdim(&self) -> usize {
        self.cg * self.kh * self.kw
    }

    /// Packs group `g`'s weights as `B[k][j]` with `k = (ki * kw + kj) * cg + c` (the order
    /// of the channels-last im2col rows) and `j` the output channel within the group.
    fn pack(&self, isa: Isa, wt: Int8, w: &[u8], g: usize) -> PackedB {
        let (cg, kh, kw, mg) = (self.cg, self.kh, self.kw, self.mg);
        PackedB::pack_with(isa, wt, self.kdim(), mg, |k, j| {
            let (tap, c) = (k / cg, k % cg);
            let (ki, kj) = (tap / kw, tap % kw);
            w[(((g * mg + j) * cg + c) * kh + ki) * kw + kj]
        })
    }

    /// Packs group `g`'s weights for the NCHW kernel: rows are the group's output channels,
    /// depths in ONNX order `(c, ki, kj)`.
    #[cfg(target_arch = "x86_64")]
    fn pack_nchw(&self, wt: Int8, w: &[u8], g: usize) -> qgemm::conv::ConvW {
        let k = self.kdim();
        qgemm::conv::ConvW::pack(wt, &w[g * self.mg * k..(g + 1) * self.mg * k], self.mg, k)
    }
}

/// The im2col rows of one image and group: row `p` (an output position) holds, for each
/// kernel tap `(ki, kj)` and channel `c` of the group, the input at that tap, or the input
/// zero point where the tap falls in the padding.
struct Im2Col<'a> {
    /// The image, channels-last: `x[(iy * iw + ix) * channels + c]`.
    x: &'a [u8],
    channels: usize,
    c0: usize,
    cg: usize,
    h: Axis,
    w: Axis,
    pad: u8,
}

impl FillRows for Im2Col<'_> {
    fn fill(&self, rows: std::ops::Range<usize>, ks: std::ops::Range<usize>, dst: &mut [u8], ld: usize) {
        let (h, w, cg) = (self.h, self.w, self.cg);
        let ow = w.output;
        if ks.is_empty() {
            return;
        }
        let (tap0, c0) = (ks.start / cg, ks.start % cg);
        let (mut oy, mut ox) = (rows.start / ow, rows.start % ow);
        for r in 0..rows.len() {
            let row = &mut dst[r * ld..r * ld + ks.len()];
            let (mut ki, mut kj) = (tap0 / w.kernel, tap0 % w.kernel);
            let (mut c, mut at) = (c0, 0);
            let iy0 = (oy * h.stride) as isize - h.pad_begin as isize;
            let ix0 = (ox * w.stride) as isize - w.pad_begin as isize;
            while at < row.len() {
                let iy = iy0 + (ki * h.dilation) as isize;
                let ix = ix0 + (kj * w.dilation) as isize;
                let row_inside = iy >= 0 && (iy as usize) < h.input;
                // With every channel of the image in the group and no dilation, the rest of
                // this kernel row is one contiguous run of the channels-last image when all
                // its taps are inside.
                let last_ix = ix0 + (w.kernel - 1) as isize;
                if c == 0 && cg == self.channels && w.dilation == 1 && row_inside && ix >= 0 && last_ix < w.input as isize {
                    let taps = w.kernel - kj;
                    let take = (taps * cg).min(row.len() - at);
                    let from = (iy as usize * w.input + ix as usize) * self.channels;
                    copy_small(&mut row[at..at + take], &self.x[from..from + take]);
                    at += take;
                    kj = 0;
                    ki += 1;
                    continue;
                }
                let take = (cg - c).min(row.len() - at);
                let out = &mut row[at..at + take];
                if row_inside && ix >= 0 && (ix as usize) < w.input {
                    let from = (iy as usize * w.input + ix as usize) * self.channels + self.c0 + c;
                    copy_small(out, &self.x[from..from + take]);
                } else {
                    out.fill(self.pad);
                }
                at += take;
                c = 0;
                kj += 1;
                if kj == w.kernel {
                    kj = 0;
                    ki += 1;
                }
            }
            ox += 1;
            if ox == ow {
                ox = 0;
                oy += 1;
            }
        }
    }
}

/// Copies a short run of bytes with overlapping 16- or 8-byte moves instead of a `memcpy` call.
#[inline(always)]
fn copy_small(dst: &mut [u8], src: &[u8]) {
    let n = dst.len();
    assert_eq!(n, src.len());
    // SAFETY: every access lies within the first `n` bytes of both slices (`n` checked
    // above); unaligned reads and writes of plain integers.
    unsafe {
        let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
        if n >= 16 {
            let mut i = 0;
            while i + 16 <= n {
                (d.add(i) as *mut u128).write_unaligned((s.add(i) as *const u128).read_unaligned());
                i += 16;
            }
            if i < n {
                (d.add(n - 16) as *mut u128).write_unaligned((s.add(n - 16) as *const u128).read_unaligned());
            }
        } else if n >= 8 {
            (d as *mut u64).write_unaligned((s as *const u64).read_unaligned());
            (d.add(n - 8) as *mut u64).write_unaligned((s.add(n - 8) as *const u64).read_unaligned());
        } else {
            for i in 0..n {
                *d.add(i) = *s.add(i);
            }
        }
    }
}

/// `dst[c * ld + r] = src[r * cols + c]` for a `rows x cols` row-major block: 16 x 16 tiles
/// transposed in SSE2 registers, the edges element by element.
///
/// # Safety
/// `dst` must be valid for writes at `c * ld + r` for every `r < rows`, `c < cols`, and not
/// aliased by any live reference.
unsafe fn transpose_u8(src: &[u8], rows: usize, cols: usize, dst: *mut u8, ld: usize) {
    assert!(src.len() >= rows * cols);
    let (r16, c16) = (rows / 16 * 16, cols / 16 * 16);
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        for r0 in (0..r16).step_by(16) {
            for c0 in (0..c16).step_by(16) {
                let mut v: [__m128i; 16] = std::array::from_fn(|i| _mm_loadu_si128(src.as_ptr().add((r0 + i) * cols + c0) as *const __m128i));
                // Four rounds of interleaving: bytes, words, dwords, qwords.
                for round in 0..4 {
                    let mut t = [_mm_setzero_si128(); 16];
                    for i in 0..8 {
                        let (a, b) = (v[2 * i], v[2 * i + 1]);
                        let (lo, hi) = match round {
                            0 => (_mm_unpacklo_epi8(a, b), _mm_unpackhi_epi8(a, b)),
                            1 => (_mm_unpacklo_epi16(a, b), _mm_unpackhi_epi16(a, b)),
                            2 => (_mm_unpacklo_epi32(a, b), _mm_unpackhi_epi32(a, b)),
                            _ => (_mm_unpacklo_epi64(a, b), _mm_unpackhi_epi64(a, b)),
                        };
                        t[i] = lo;
                        t[i + 8] = hi;
                    }
                    v = t;
                }
                // After the rounds, register `i` holds source column `perm(i)`.
                for (i, x) in v.iter().enumerate() {
                    let c = ((i & 1) << 3) | ((i & 2) << 1) | ((i & 4) >> 1) | ((i & 8) >> 3);
                    _mm_storeu_si128(dst.add((c0 + c) * ld + r0) as *mut __m128i, *x);
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let (r16, c16) = (0, 0);
    for r in 0..rows {
        let from = if r < r16 { c16 } else { 0 };
        for c in from..cols {
            *dst.add(c * ld + r) = src[r * cols + c];
        }
    }
}

thread_local! {
    /// Per-thread buffers for channels-last images, reused across runs (a fresh allocation
    /// per run costs page faults comparable to the convolution itself).
    static IMAGE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    static IMAGE_OUT: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's buffer `which`, `len` bytes long (contents unspecified). While
/// `f` waits for the parallel work it split off, the thread may run a job of another session
/// run (rayon's work stealing: two samples in flight from a `par_iter`), whose convolution
/// finds the buffer taken; that one runs on a fresh buffer.
fn with_buffer<R>(which: &'static std::thread::LocalKey<std::cell::RefCell<Vec<u8>>>, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    which.with(|b| match b.try_borrow_mut() {
        Ok(mut b) => {
            if b.len() < len {
                b.resize(len, 0);
            }
            f(&mut b[..len])
        }
        Err(_) => f(&mut vec![0u8; len]),
    })
}

/// Channels-last copy of one `channels x plane` image.
fn to_channels_last(x: &[u8], channels: usize, plane: usize, out: &mut [u8]) {
    assert!(out.len() >= channels * plane);
    // SAFETY: `out` holds `plane x channels` bytes and is exclusively borrowed.
    unsafe { transpose_u8(x, channels, plane, out.as_mut_ptr(), channels) };
}

/// Output of a convolution: `i32` (ConvInteger) or requantized 8-bit (QLinearConv), in
/// storage that starts uninitialized and that every path writes whole.
enum ConvOut {
    I32(Vec<MaybeUninit<i32>>),
    U8(Vec<MaybeUninit<u8>>, i32),
    I8(Vec<MaybeUninit<i8>>, i32),
}

/// Requantization parameters of QLinearConv: the per-channel (or single) multiplier, the
/// optional int32 bias per output channel and the optional table of [`QLINEAR_CONV_LOOKUP`].
struct Requant<'a> {
    mult: Vec<f32>,
    bias: Option<Vec<i32>>,
    table: Option<&'a [u8; 256]>,
}

impl Kernel for QConv {
    fn run(&self, ins: &[Option<&Tensor>], _: &RunCtx) -> RuntimeResult<Vec<Tensor>> {
        let q = self.kind == ConvKind::QLinear;
        let (xi, wi, xzi, wzi) = if q { (0, 3, 2, 5) } else { (0, 1, 2, 3) };
        let x = input(ins, xi)?;
        let w = input(ins, wi)?;
        let (xt, xb) = int8_of(x, "x")?;
        let (wt, wb) = int8_of(w, "w")?;
        let (xs, ws) = (x.shape(), w.shape());
        let one_d = xs.len() == 3;
        if !(xs.len() == 4 || one_d) || ws.len() != xs.len() {
            return Err(kernel_error(format!("only 1-D and 2-D convolutions are supported (x {xs:?}, w {ws:?})")));
        }
        let (n, c) = (xs[0], xs[1]);
        let (ih, iw) = if one_d { (1, xs[2]) } else { (xs[2], xs[3]) };
        let group = self.group;
        if ws[0] % group != 0 || c != ws[1] * group {
            return Err(kernel_error(format!("x has {c} channels, w has shape {ws:?}: with group {group}, w must be [M, {}, ...] with M a multiple of {group}", c / group.max(1))));
        }
        let geo = ConvGeometry::weights(ws, group);
        if geo.kh == 0 || geo.kw == 0 {
            return Err(kernel_error(format!("w of shape {ws:?} has an empty kernel")));
        }
        if let Some(ks) = &self.window.kernel {
            let want: Vec<usize> = if one_d { vec![geo.kw] } else { vec![geo.kh, geo.kw] };
            if *ks != want {
                return Err(kernel_error(format!("kernel_shape {ks:?} differs from the weight's spatial shape {want:?}")));
            }
        }
        let lifted;
        let win = if one_d {
            lifted = self.window.lifted_1d();
            &lifted
        } else {
            &self.window
        };
        let axes = win.axes(&[ih, iw], &[geo.kh, geo.kw])?;
        let (h, wa) = (axes[0], axes[1]);
        let (oh, ow) = (h.output, wa.output);
        let m = geo.m;
        // Zero points, scales, bias.
        let xz = input_or_none(ins, xzi, q)?;
        if let Some(z) = xz {
            single(z, "x_zero_point")?;
        }
        let x_zp = zero_points(xz, xt, "x_zero_point", "x")?[0];
        let wz = input_or_none(ins, wzi, q)?;
        let w_zp = zero_points(wz, wt, "w_zero_point", "w")?;
        if let Some(z) = wz {
            if !(z.len() == 1 && z.rank() <= 1 || z.shape() == [m]) {
                return Err(kernel_error(format!("w_zero_point must be a scalar or have shape [{m}], got {:?}", z.shape())));
            }
        }
        let (requant, mut out) = if q {
            let (sx, sw, sy) = (input(ins, 1)?, input(ins, 4)?, input(ins, 6)?);
            single(sx, "x_scale")?;
            single(sy, "y_scale")?;
            if !(sw.len() == 1 && sw.rank() <= 1 || sw.shape() == [m]) {
                return Err(kernel_error(format!("w_scale must be a scalar or have shape [{m}], got {:?}", sw.shape())));
            }
            let (vx, vw, vy) = (scales(sx, "x_scale", false)?[0], scales(sw, "w_scale", false)?, scales(sy, "y_scale", false)?[0]);
            let mult = vw.iter().map(|&s| vx * s / vy).collect();
            let bias = match opt_input(ins, 8) {
                Some(b) => {
                    let v = b.as_slice::<i32>().map_err(|_| kernel_error(format!("B (bias) must be int32, got {}", b.dtype())))?;
                    if b.shape() != [m] {
                        return Err(kernel_error(format!("B (bias) must have shape [{m}], got {:?}", b.shape())));
                    }
                    Some(v.to_vec())
                }
                None => None,
            };
            let yz = input(ins, 7)?;
            single(yz, "y_zero_point")?;
            let (yt, _) = int8_of(yz, "y_zero_point")?;
            let z = zero_points(Some(yz), yt, "y_zero_point", "y_zero_point")?[0];
            let len = n * m * oh * ow;
            let out = match yt {
                Int8::U8 => ConvOut::U8(uninit(len), z),
                Int8::I8 => ConvOut::I8(uninit(len), z),
            };
            (Some(Requant { mult, bias, table: self.table.as_ref().map(|t| &t.0) }), out)
        } else {
            (None, ConvOut::I32(uninit(n * m * oh * ow)))
        };
        let plane_in = ih * iw;
        let plane = oh * ow;
        if plane_in == 0 && n * m * plane > 0 {
            return Err(kernel_error(format!("x of shape {xs:?} has no positions, but the padding gives {oh} x {ow} outputs: convolving an empty image is not supported")));
        }
        // Whether the kernel that ran applied the table itself, block by block.
        let mut table_applied = false;
        if n > 0 && m > 0 && plane > 0 {
            if geo.depthwise_shape() {
                #[cfg(target_arch = "x86_64")]
                let prepared = self.weights.as_ref().filter(|p| p.shape == ws && p.dtype == w.dtype()).and_then(|p| p.depthwise.as_ref());
                #[cfg(not(target_arch = "x86_64"))]
                let prepared = None;
                let dw = DepthwiseWeights { w: wb, wt, w_zp: &w_zp, prepared };
                for b in 0..n {
                    let img = &xb[b * c * plane_in..(b + 1) * c * plane_in];
                    table_applied = depthwise(img, xt, x_zp, &dw, h, wa, requant.as_ref(), &mut out, b * m * plane);
                }
            } else if plane >= NCHW_MIN_PLANE && nchw_kernel(self.kind, &geo, &self.window) {
                #[cfg(target_arch = "x86_64")]
                {
                    let owned;
                    let packed: &[qgemm::conv::ConvW] = match &self.weights {
                        Some(p) if p.shape == ws && p.dtype == w.dtype() && !p.nchw.is_empty() => &p.nchw,
                        _ => {
                            owned = (0..group).map(|g| geo.pack_nchw(wt, wb, g)).collect::<Vec<_>>();
                            &owned
                        }
                    };
                    let rq = requant.as_ref().expect("QLinearConv has an output stage");
                    let (cg, mg) = (geo.cg, geo.mg);
                    for b in 0..n {
                        for (g, cw) in packed.iter().enumerate() {
                            let x = &xb[(b * c + g * cg) * plane_in..(b * c + (g + 1) * cg) * plane_in];
                            let inp = qgemm::conv::ConvInput { x, xt, x_zp, channels: cg, h, w: wa };
                            let j0 = g * mg;
                            let y_zp = match &out {
                                ConvOut::U8(_, z) | ConvOut::I8(_, z) => *z,
                                ConvOut::I32(_) => 0,
                            };
                            let crq = qgemm::conv::ConvRequant {
                                scale: if rq.mult.len() == 1 { Scale::Tensor(rq.mult[0]) } else { Scale::Each(&rq.mult[j0..j0 + mg]) },
                                bias: rq.bias.as_ref().map(|v| &v[j0..j0 + mg]),
                                w_zp: if w_zp.len() == 1 { ZeroPoints::Tensor(w_zp[0]) } else { ZeroPoints::Each(&w_zp[j0..j0 + mg]) },
                                y_zp,
                                table: rq.table,
                            };
                            let at = (b * m + j0) * plane..(b * m + j0 + mg) * plane;
                            match &mut out {
                                ConvOut::U8(v, _) => qgemm::conv::conv_requant(cw, &inp, &crq, &mut v[at], true),
                                ConvOut::I8(v, _) => qgemm::conv::conv_requant(cw, &inp, &crq, &mut v[at], true),
                                ConvOut::I32(_) => unreachable!("ConvInteger does not run on the NCHW kernel"),
                            }
                        }
                    }
                    table_applied = true;
                }
            } else {
                let owned;
                let packed: &[PackedB] = match &self.weights {
                    Some(p) if p.shape == ws && p.dtype == w.dtype() && !p.groups.is_empty() => &p.groups,
                    _ => {
                        owned = (0..group).map(|g| geo.pack(self.isa, wt, wb, g)).collect::<Vec<_>>();
                        &owned
                    }
                };
                let pointwise = geo.kh == 1 && geo.kw == 1 && h.stride == 1 && wa.stride == 1 && h.pad_begin + h.pad_end + wa.pad_begin + wa.pad_end == 0;
                with_buffer(&IMAGE, c * plane_in, |xt_buf| for b in 0..n {
                    to_channels_last(&xb[b * c * plane_in..(b + 1) * c * plane_in], c, plane_in, xt_buf);
                    for (g, pb) in packed.iter().enumerate() {
                        let im2col = Im2Col { x: xt_buf, channels: c, c0: g * geo.cg, cg: geo.cg, h, w: wa, pad: x_zp as u8 };
                        let a = if pointwise { ASource::Rows { data: &xt_buf[g * geo.cg..], lda: c } } else { ASource::Fill(&im2col) };
                        let wzg = if w_zp.len() == 1 { ZeroPoints::Tensor(w_zp[0]) } else { ZeroPoints::Each(&w_zp[g * geo.mg..(g + 1) * geo.mg]) };
                        let gm = Gemm { m: plane, a, a_type: xt, a_zp: ZeroPoints::Tensor(x_zp), b: pb, b_zp: wzg };
                        conv_gemm(&gm, requant.as_ref(), &mut out, (b * m + g * geo.mg) * plane, plane, g * geo.mg);
                    }
                });
            }
        }
        let shape = if one_d { vec![n, m, ow] } else { vec![n, m, oh, ow] };
        // SAFETY: every path above writes each output element (the kernels' contracts; with
        // no image, channel or position there is no element).
        let (mut bytes, own_type) = unsafe {
            match out {
                ConvOut::I32(v) => return Ok(vec![tensor(&shape, assume_init(v))?]),
                ConvOut::U8(v, _) => (assume_init(v), Int8::U8),
                ConvOut::I8(v, _) => (bytemuck::allocation::cast_vec(assume_init(v)), Int8::I8),
            }
        };
        let out_type = match self.table {
            Some((table, table_type)) => {
                if !table_applied {
                    super::qlinear_ms::lookup_all_in_place(&mut bytes, &table);
                }
                table_type
            }
            None => own_type,
        };
        Ok(vec![match out_type {
            Int8::U8 => tensor(&shape, bytes)?,
            Int8::I8 => tensor(&shape, bytemuck::allocation::cast_vec::<u8, i8>(bytes))?,
        }])
    }
}

/// Input `i`: required when `required`, optional otherwise.
fn input_or_none<'a>(ins: &[Option<&'a Tensor>], i: usize, required: bool) -> RuntimeResult<Option<&'a Tensor>> {
    if required {
        input(ins, i).map(Some)
    } else {
        Ok(opt_input(ins, i))
    }
}

/// One group's product of one image: rows are output positions, columns the group's output
/// channels (from channel `oc0` of the image); blocks are biased, requantized and written
/// transposed into the NCHW output starting at `base` (the group's first channel), channel
/// stride `plane`.
fn conv_gemm(g: &Gemm, rq: Option<&Requant>, out: &mut ConvOut, base: usize, plane: usize, oc0: usize) {
    /// Runs the product, `convert`s each block to `rows x cols` outputs and writes them
    /// transposed (channel-major) into `out` at `base`.
    fn store<T: Copy + Default + Send>(g: &Gemm, out: &mut [MaybeUninit<T>], base: usize, plane: usize, convert: impl Fn(&mut Block, &mut [T]) + Sync) {
        let o = SharedOut::uninit(out);
        gemm(g, &|mut blk: Block| {
            let mut t = vec![T::default(); blk.rows * blk.cols];
            convert(&mut blk, &mut t);
            // SAFETY: blocks cover disjoint (position, channel) pairs of this image and
            // group, so the elements written here (channels `col0..col0 + cols`, positions
            // `row0..row0 + rows`) are written by this block only; the output outlives the
            // product.
            unsafe {
                let at = o.ptr(base + blk.col0 * plane + blk.row0, (blk.cols - 1) * plane + blk.rows);
                if std::mem::size_of::<T>() == 1 {
                    transpose_u8(std::slice::from_raw_parts(t.as_ptr() as *const u8, t.len()), blk.rows, blk.cols, at as *mut u8, plane);
                } else {
                    for r in 0..blk.rows {
                        for (j, &v) in t[r * blk.cols..(r + 1) * blk.cols].iter().enumerate() {
                            *at.add(j * plane + r) = v;
                        }
                    }
                }
            }
        }, true);
    }
    match out {
        ConvOut::I32(v) => store(g, v, base, plane, |blk, t| {
            for r in 0..blk.rows {
                t[r * blk.cols..(r + 1) * blk.cols].copy_from_slice(blk.row(r));
            }
        }),
        ConvOut::U8(v, z) => store(g, v, base, plane, |blk, t| requant_block(blk, t, rq.unwrap(), oc0, *z)),
        ConvOut::I8(v, z) => store(g, v, base, plane, |blk, t| requant_block(blk, t, rq.unwrap(), oc0, *z)),
    }
}

/// Adds the bias and requantizes a block (columns are output channels from `oc0 + col0`)
/// into `t` (`rows x cols`).
fn requant_block<T: Out8>(blk: &mut Block, t: &mut [T], rq: &Requant, oc0: usize, zp: i32) {
    let (c0, cols) = (oc0 + blk.col0, blk.cols);
    let scale = if rq.mult.len() == 1 { Scale::Tensor(rq.mult[0]) } else { Scale::Each(&rq.mult[c0..c0 + cols]) };
    let bias = rq.bias.as_ref().map(|b| &b[c0..c0 + cols]);
    assert!(t.len() >= blk.rows * cols);
    // SAFETY: `t` holds `rows x cols` elements and is exclusively borrowed.
    unsafe { qgemm::requantize_block(blk.data, blk.ld, blk.rows, cols, bias, scale, zp, t.as_mut_ptr(), cols) };
}

/// The weights of a depthwise convolution: the bytes (`[C, 1, kh, kw]`, type `wt`), their
/// zero points (one or one per channel), and the depthwise kernel's packing of them when
/// prepared with the session.
#[derive(Clone, Copy)]
struct DepthwiseWeights<'a> {
    w: &'a [u8],
    wt: Int8,
    w_zp: &'a [i32],
    #[cfg(target_arch = "x86_64")]
    prepared: Option<&'a qgemm::depthwise::DepthwiseW>,
    #[cfg(not(target_arch = "x86_64"))]
    prepared: Option<&'a ()>,
}

/// Depthwise convolution of one image (`group == C == M`) by a direct sliding window on the
/// channels-last image, vectorized across channels: for each output position, `acc[c] +=
/// (x[c] - x_zp) * (w[c][tap] - w_zp[c])` in `i32` over the taps inside the input (padding
/// adds nothing). Each output row is then biased and requantized (QLinearConv) or kept
/// (ConvInteger) channels-last and transposed into the NCHW output at `base`. Output rows run
/// in parallel; the inner loops are compiled for AVX-512 or AVX2 when the CPU has them.
///
/// QLinearConv runs on the NCHW kernel of [`qgemm::depthwise`] instead when the CPU and the
/// horizontal geometry allow, and on the NCHW AVX2 kernel of [`qgemm::depthwise_avx2`] on
/// CPUs with AVX2 but without the former's extensions.
///
/// Returns whether the kernel that ran applied `rq`'s table (the NCHW kernels do, block by
/// block); when it did not, the caller applies it to the whole output.
#[allow(clippy::too_many_arguments)]
fn depthwise(img: &[u8], xt: Int8, x_zp: i32, dw: &DepthwiseWeights, h: Axis, wa: Axis, rq: Option<&Requant>, out: &mut ConvOut, base: usize) -> bool {
    let DepthwiseWeights { w, wt, w_zp, .. } = *dw;
    let plane_in = h.input * wa.input;
    let c = img.len() / plane_in.max(1);
    #[cfg(target_arch = "x86_64")]
    if let Some(rq) = rq {
        let inp = qgemm::conv::ConvInput { x: img, xt, x_zp, channels: c, h, w: wa };
        let crq = |y_zp| qgemm::conv::ConvRequant {
            scale: scale_arg(&rq.mult),
            bias: rq.bias.as_deref(),
            w_zp: zp_arg(w_zp),
            y_zp,
            table: rq.table,
        };
        let at = base..base + c * h.output * wa.output;
        if qgemm::depthwise::available() && qgemm::depthwise::supports(&wa) {
            let owned;
            let packed = match dw.prepared {
                Some(p) => p,
                None => {
                    owned = qgemm::depthwise::DepthwiseW::pack(wt, w, c, h.kernel, wa.kernel);
                    &owned
                }
            };
            match out {
                ConvOut::U8(v, z) => qgemm::depthwise::depthwise_requant(&inp, packed, &crq(*z), &mut v[at], true),
                ConvOut::I8(v, z) => qgemm::depthwise::depthwise_requant(&inp, packed, &crq(*z), &mut v[at], true),
                ConvOut::I32(_) => unreachable!("ConvInteger has no output stage"),
            }
            return true;
        }
        if !qgemm::depthwise::available() && qgemm::depthwise_avx2::available() && qgemm::depthwise_avx2::worth_it(&wa) {
            match out {
                ConvOut::U8(v, z) => qgemm::depthwise_avx2::depthwise_requant(&inp, w, wt, &crq(*z), &mut v[at], true),
                ConvOut::I8(v, z) => qgemm::depthwise_avx2::depthwise_requant(&inp, w, wt, &crq(*z), &mut v[at], true),
                ConvOut::I32(_) => unreachable!("ConvInteger has no output stage"),
            }
            return true;
        }
    }
    with_buffer(&IMAGE, img.len(), |x| {
        to_channels_last(img, c, plane_in, x);
        depthwise_nhwc(x, c, xt, x_zp, w, wt, w_zp, h, wa, rq, out, base)
    });
    false
}

/// [`depthwise`] on the channels-last image `x` (`c` channels).
#[allow(clippy::too_many_arguments)]
fn depthwise_nhwc(x: &[u8], c: usize, xt: Int8, x_zp: i32, w: &[u8], wt: Int8, w_zp: &[i32], h: Axis, wa: Axis, rq: Option<&Requant>, out: &mut ConvOut, base: usize) {
    let (oh, ow) = (h.output, wa.output);
    let plane = oh * ow;
    let taps = h.kernel * wa.kernel;
    let widen = |v: u8, t: Int8| if t == Int8::I8 { v as i8 as i32 } else { v as i32 };
    // Weights tap-major: wq[tap * c + ch] = w[ch][tap] - w_zp[ch].
    let mut wq = vec![0i32; taps * c];
    for ch in 0..c {
        let z = w_zp[if w_zp.len() == 1 { 0 } else { ch }];
        for t in 0..taps {
            wq[t * c + ch] = widen(w[ch * taps + t], wt) - z;
        }
    }
    let mut wtile = vec![];
    if wa.stride == 1 && c > 0 {
        wtile.reserve(taps * ow * c);
        for t in wq.chunks(c) {
            for _ in 0..ow {
                wtile.extend_from_slice(t);
            }
        }
    }
    let dw = DepthwiseRows { x, c, h, wa, wq: &wq, wtile: &wtile, x_zp, signed: xt == Int8::I8 };
    let scale = rq.map(|r| if r.mult.len() == 1 { Scale::Tensor(r.mult[0]) } else { Scale::Each(&r.mult) });
    let bias = rq.and_then(|r| r.bias.as_deref());
    /// Computes every output row in parallel and hands its `ow x c` sums to `finish` with the
    /// row's channels-last output.
    fn rows<T: Copy + Default + Send + Sync>(dw: &DepthwiseRows, ow: usize, c: usize, out: &mut [T], finish: impl Fn(&[i32], &mut [T]) + Sync) {
        par_chunks_mut(out, ow * c, 1, Vec::new, |acc: &mut Vec<i32>, oy, dst| {
            acc.clear();
            acc.resize(ow * c, 0);
            dw.row(oy, acc);
            finish(acc, dst);
        });
    }
    match out {
        ConvOut::I32(v) => {
            let mut nhwc = vec![0i32; plane * c];
            rows(&dw, ow, c, &mut nhwc, |acc, dst| dst.copy_from_slice(acc));
            let dst = &mut v[base..base + c * plane];
            for p in 0..plane {
                for ch in 0..c {
                    dst[ch * plane + p].write(nhwc[p * c + ch]);
                }
            }
        }
        ConvOut::U8(v, z) => {
            let z = *z;
            with_buffer(&IMAGE_OUT, plane * c, |nhwc| {
                // SAFETY: `dst` holds `ow` rows of `c` bytes and is exclusively borrowed.
                rows(&dw, ow, c, nhwc, |acc, dst: &mut [u8]| unsafe { qgemm::requantize_block(acc, c, ow, c, bias, scale.unwrap(), z, dst.as_mut_ptr(), c) });
                let dst = &mut v[base..base + c * plane];
                // SAFETY: `dst` holds `c` rows of `plane` bytes and is exclusively borrowed.
                unsafe { transpose_u8(nhwc, plane, c, dst.as_mut_ptr().cast::<u8>(), plane) };
            })
        }
        ConvOut::I8(v, z) => {
            let z = *z;
            with_buffer(&IMAGE_OUT, plane * c, |nhwc| {
                // SAFETY: `dst` holds `ow` rows of `c` bytes and is exclusively borrowed; i8
                // and u8 have the same layout.
                rows(&dw, ow, c, nhwc, |acc, dst: &mut [u8]| unsafe { qgemm::requantize_block(acc, c, ow, c, bias, scale.unwrap(), z, dst.as_mut_ptr() as *mut i8, c) });
                let dst = &mut v[base..base + c * plane];
                // SAFETY: `dst` holds `c` rows of `plane` bytes and is exclusively borrowed.
                unsafe { transpose_u8(nhwc, plane, c, dst.as_mut_ptr().cast::<u8>(), plane) };
            })
        }
    }
}

/// The sliding window of a depthwise convolution over a channels-last image.
struct DepthwiseRows<'a> {
    /// The image, channels-last: `x[(iy * iw + ix) * c + ch]`.
    x: &'a [u8],
    c: usize,
    h: Axis,
    wa: Axis,
    /// Weights minus their zero points, tap-major: `wq[tap * c + ch]`.
    wq: &'a [i32],
    /// For stride 1: each tap's weights repeated for every output column,
    /// `wtile[(tap * ow + ox) * c + ch]`; empty otherwise.
    wtile: &'a [i32],
    x_zp: i32,
    signed: bool,
}

impl DepthwiseRows<'_> {
    /// Adds the window sums of output row `oy` to `acc` (`ow x c`, channels-last).
    fn row(&self, oy: usize, acc: &mut [i32]) {
        vectorized_wide(#[inline(always)] || self.row_body(oy, acc))
    }

    /// [`DepthwiseRows::row`]'s loops: per kernel tap, the output columns whose input column is
    /// inside the image (stride 1: one flat run against the tap's tiled weights).
    #[inline(always)]
    fn row_body(&self, oy: usize, acc: &mut [i32]) {
        let (h, wa, c) = (self.h, self.wa, self.c);
        let (ow, s) = (wa.output, wa.stride);
        let zp = self.x_zp;
        let mac = |a: &mut [i32], x: &[u8], w: &[i32]| {
            if self.signed {
                a.iter_mut().zip(x).zip(w).for_each(|((a, &x), &w)| *a = a.wrapping_add((x as i8 as i32 - zp).wrapping_mul(w)));
            } else {
                a.iter_mut().zip(x).zip(w).for_each(|((a, &x), &w)| *a = a.wrapping_add((x as i32 - zp).wrapping_mul(w)));
            }
        };
        for ki in 0..h.kernel {
            let iy = (oy * h.stride + ki * h.dilation) as isize - h.pad_begin as isize;
            if iy < 0 || iy >= h.input as isize {
                continue;
            }
            let line = &self.x[iy as usize * wa.input * c..(iy as usize + 1) * wa.input * c];
            for kj in 0..wa.kernel {
                let tap = ki * wa.kernel + kj;
                // Output columns whose input column `ox * s + off` is inside the row.
                let off = (kj * wa.dilation) as isize - wa.pad_begin as isize;
                let lo = if off >= 0 { 0 } else { ((-off) as usize).div_ceil(s) }.min(ow);
                let hi = if (wa.input as isize) <= off { 0 } else { ((wa.input as isize - off - 1) as usize / s + 1).min(ow) };
                if lo >= hi {
                    continue;
                }
                if s == 1 {
                    // Consecutive output columns read consecutive input columns: one flat
                    // run against the tap's weights tiled across the row.
                    let from = (lo as isize + off) as usize * c;
                    let len = (hi - lo) * c;
                    mac(&mut acc[lo * c..hi * c], &line[from..from + len], &self.wtile[tap * ow * c..tap * ow * c + len]);
                } else {
                    let wt = &self.wq[tap * c..(tap + 1) * c];
                    for ox in lo..hi {
                        let ix = (ox as isize * s as isize + off) as usize;
                        mac(&mut acc[ox * c..(ox + 1) * c], &line[ix * c..(ix + 1) * c], wt);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_taken_on_this_thread_gives_a_nested_run_its_own() {
        let sums = with_buffer(&IMAGE, 8, |outer| {
            outer.fill(1);
            let inner = with_buffer(&IMAGE, 16, |inner| {
                inner.fill(2);
                inner.iter().map(|&b| b as u32).sum::<u32>()
            });
            (outer.iter().map(|&b| b as u32).sum::<u32>(), inner)
        });
        assert_eq!(sums, (8, 32), "the nested run must not share the outer buffer");
        assert_eq!(with_buffer(&IMAGE, 4, |b| b.len()), 4);
    }

    #[test]
    fn byte_transpose_matches_the_definition() {
        for (rows, cols) in [(1, 1), (16, 16), (17, 33), (144, 64), (5, 40), (40, 5), (32, 48)] {
            let src: Vec<u8> = (0..rows * cols).map(|i| (i * 7 + i / 5) as u8).collect();
            let ld = rows + 3;
            let mut dst = vec![0u8; cols * ld];
            // SAFETY: `dst` holds `cols` rows of `ld >= rows` bytes.
            unsafe { transpose_u8(&src, rows, cols, dst.as_mut_ptr(), ld) };
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(dst[c * ld + r], src[r * cols + c], "{rows}x{cols} at ({r}, {c})");
                }
            }
        }
    }
}
