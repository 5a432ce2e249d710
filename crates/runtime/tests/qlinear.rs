//! Integer matrix products and convolutions against ONNX Runtime, bit for bit:
//! `MatMulInteger`, `QLinearMatMul` (opset 10, and 21 with float16 scales), `ConvInteger`,
//! `QLinearConv` and `com.microsoft` `QGemm`, over random shapes (odd M/N/K, batches with
//! broadcasting, depths and widths that span several GEMM blocks), u8/i8 operands, zero
//! points other than 0, per-column/per-channel parameters, groups, depthwise, strides, pads,
//! dilations, 1-D, constant (prepacked) and dynamic weights, and data with runs of extreme
//! values that would saturate 16-bit intermediate sums. Features ONNX Runtime's kernels lack
//! (per-row A zero points, per-channel weight zero points that differ, int8 ConvInteger) are
//! checked against ONNX Runtime running the same arithmetic as an exact float32 graph.
//!
//! The GEMM itself is tested path by path: every micro-kernel family the CPU has (AVX-512
//! VNNI, AVX2, portable) is forced in turn and compared with a naive 64-bit product and with
//! the portable kernel; a family the CPU lacks is reported on stderr.

use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor, ValueId, ValueType, MS_DOMAIN};
use qforge_runtime::qgemm::{gemm_i32, ASource, FillRows, Gemm, Int8, Isa, PackedB, ZeroPoints};
use qforge_runtime::{Session, SessionOptions};
use qforge_testkit::{ort_run, ort_u8s8_exact, Rng, TempDir};

/// The ONNX element type of an 8-bit operand type.
fn dtype(t: Int8) -> DType {
    match t {
        Int8::U8 => DType::U8,
        Int8::I8 => DType::I8,
    }
}

/// The value range of an 8-bit operand type.
fn range(t: Int8) -> (i32, i32) {
    match t {
        Int8::U8 => (0, 255),
        Int8::I8 => (-128, 127),
    }
}

/// `n` bytes of type `t`: mostly uniform, with runs at the type's extremes (which make
/// 16-bit pair sums overflow if a kernel used them).
fn data(rng: &mut Rng, t: Int8, n: usize) -> Vec<u8> {
    let (lo, hi) = range(t);
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let run = 1 + rng.below(40);
        let kind = rng.below(6);
        for _ in 0..run.min(n - v.len()) {
            let x = match kind {
                0 => hi,
                1 => lo,
                _ => lo + rng.below((hi - lo + 1) as usize) as i32,
            };
            v.push(x as u8);
        }
    }
    v
}

/// `b`, the second operand of a product whose first operand has type `at`, made comparable
/// bit for bit with ONNX Runtime: on a CPU where its u8 x s8 products saturate
/// ([`ort_u8s8_exact`]), s8 values against u8 are halved into `[-64, 63]`. Our kernels meet
/// saturating data in the GEMM path tests, against the naive product.
fn for_ort(at: Int8, bt: Int8, mut b: Vec<u8>) -> Vec<u8> {
    if at == Int8::U8 && bt == Int8::I8 && !ort_u8s8_exact() {
        b.iter_mut().for_each(|v| *v = (*v as i8 / 2) as u8);
    }
    b
}

/// A zero point: 0, either extreme, or anything in the type's range.
fn zp(rng: &mut Rng, t: Int8) -> i32 {
    let (lo, hi) = range(t);
    match rng.below(4) {
        0 => 0,
        1 => hi,
        2 => lo,
        _ => lo + rng.below((hi - lo + 1) as usize) as i32,
    }
}

/// An 8-bit tensor of type `t` from raw bytes.
fn int_tensor(t: Int8, shape: &[usize], v: &[u8]) -> Tensor {
    Tensor::from_raw(dtype(t), shape, v).unwrap()
}

/// An 8-bit tensor of type `t` from values in its range.
fn zp_tensor(t: Int8, shape: &[usize], v: &[i32]) -> Tensor {
    int_tensor(t, shape, &v.iter().map(|&x| x as u8).collect::<Vec<_>>())
}

/// A scale: awkward values and powers of two (which give exact .5 ties after the multiply).
fn scale(rng: &mut Rng) -> f32 {
    const PICKS: [f32; 8] = [0.5, 0.25, 0.037, 0.0078125, 1.0 / 255.0, 0.0123, 2.0, 0.1];
    if rng.below(3) == 0 { 0.001 + rng.unit() * 0.05 } else { PICKS[rng.below(PICKS.len())] }
}

/// Several independent nodes in one model, so ONNX Runtime runs them in one process.
struct Builder {
    g: Graph,
    feeds: Vec<(String, Tensor)>,
    outs: Vec<ValueId>,
    what: Vec<String>,
    count: usize,
}

impl Builder {
    /// An empty model.
    fn new() -> Builder {
        Builder { g: Graph::new("qlinear"), feeds: vec![], outs: vec![], what: vec![], count: 0 }
    }

    /// A fresh value or node name.
    fn name(&mut self, tag: &str) -> String {
        self.count += 1;
        format!("{tag}_{}", self.count)
    }

    /// A graph input fed with `t`.
    fn input(&mut self, t: Tensor) -> ValueId {
        let name = self.name("in");
        let dims: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
        let v = self.g.add_input(name.clone(), Some(ValueType::tensor_of(t.dtype(), &dims))).unwrap();
        self.feeds.push((name, t));
        v
    }

    /// An initializer.
    fn constant(&mut self, t: Tensor) -> ValueId {
        let name = self.name("c");
        self.g.add_initializer(name, t).unwrap()
    }

    /// An input or an initializer.
    fn value(&mut self, t: Tensor, constant: bool) -> ValueId {
        if constant { self.constant(t) } else { self.input(t) }
    }

    /// Adds a node with one output of type `out`.
    fn node(&mut self, op: &str, domain: &str, inputs: Vec<Option<ValueId>>, attrs: Vec<(&str, Attr)>, out: DType) -> ValueId {
        let oname = self.name("out");
        let y = self.g.new_value(oname, Some(ValueType::Tensor { elem: Some(out), shape: None })).unwrap();
        let mut n = Node::new(op, self.name("node")).with_outputs([y]);
        n.inputs = inputs;
        n.domain = domain.to_string();
        for (k, v) in attrs {
            n = n.with_attr(k, v);
        }
        self.g.add_node(n).unwrap();
        y
    }

    /// Marks `v` as a compared output.
    fn output(&mut self, v: ValueId, what: String) {
        self.outs.push(v);
        self.what.push(what);
    }

    /// The model importing `opsets`, its feeds, and the description of each output.
    fn model(mut self, opsets: &[(&str, i64)]) -> (Model, Vec<(String, Tensor)>, Vec<String>) {
        self.g.set_outputs(self.outs.clone()).unwrap();
        let opset_imports = opsets.iter().map(|&(d, v)| OpsetImport { domain: d.to_string(), version: v }).collect();
        (Model { ir_version: 10, opset_imports, graph: self.g, ..Default::default() }, self.feeds, self.what)
    }
}

/// Runs the model in qforge and ONNX Runtime and requires every output to be identical
/// (dtype, shape and bytes). Returns the number of elements compared.
fn check_against_ort(model: &Model, feeds: &[(String, Tensor)], what: &[String], tag: &str) -> usize {
    check_against_ort_on(model, feeds, what, tag, 0)
}

/// [`check_against_ort`] with qforge on `threads` worker threads (0: every core).
fn check_against_ort_on(model: &Model, feeds: &[(String, Tensor)], what: &[String], tag: &str, threads: usize) -> usize {
    let tmp = TempDir::new(tag);
    let path = tmp.path().join("model.onnx");
    qforge_onnx::save(model, &path).unwrap();
    #[allow(clippy::needless_update)]
    let opts = SessionOptions { threads, ..Default::default() };
    let ours = Session::with_options(model, opts).unwrap_or_else(|e| panic!("{tag}: {e}")).run(feeds.to_vec()).unwrap_or_else(|e| panic!("{tag}: {e}"));
    let theirs = ort_run(&path, feeds, 1);
    assert_eq!(ours.len(), theirs.len());
    let mut total = 0;
    for (i, ((name, a), (_, b))) in ours.iter().zip(&theirs).enumerate() {
        let w = &what[i];
        assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{tag} {name}: {w}");
        let (x, y) = (a.raw_bytes().unwrap(), b.raw_bytes().unwrap());
        if x != y {
            let width = a.dtype().bits() / 8;
            let at = (0..x.len() / width).find(|&j| x[j * width..(j + 1) * width] != y[j * width..(j + 1) * width]).unwrap();
            let (va, vb) = (a.to_f64_vec().unwrap()[at], b.to_f64_vec().unwrap()[at]);
            panic!("{tag} {name}: {w}: element {at} of {:?} is {va}, ONNX Runtime gives {vb}", a.shape());
        }
        total += a.len();
    }
    total
}

// ---------------------------------------------------------------------------------------
// GEMM paths
// ---------------------------------------------------------------------------------------

/// The exact product in 64 bits, wrapped to 32 as the GEMM defines it.
#[allow(clippy::too_many_arguments)]
fn naive(a: &[u8], at: Int8, a_zp: &[i32], b: &[u8], bt: Int8, b_zp: &[i32], m: usize, k: usize, n: usize) -> Vec<i32> {
    let val = |x: u8, t: Int8| if t == Int8::I8 { x as i8 as i64 } else { x as i64 };
    let mut c = vec![0i32; m * n];
    for i in 0..m {
        let az = a_zp[if a_zp.len() == 1 { 0 } else { i }] as i64;
        for j in 0..n {
            let bz = b_zp[if b_zp.len() == 1 { 0 } else { j }] as i64;
            let s: i64 = (0..k).map(|p| (val(a[i * k + p], at) - az) * (val(b[p * n + j], bt) - bz)).sum();
            c[i * n + j] = s as i32;
        }
    }
    c
}

/// A row-major A handed out through [`FillRows`], as an im2col view would.
struct Rows<'a> {
    a: &'a [u8],
    k: usize,
}

impl FillRows for Rows<'_> {
    fn fill(&self, rows: std::ops::Range<usize>, ks: std::ops::Range<usize>, dst: &mut [u8], ld: usize) {
        for (r, i) in rows.enumerate() {
            dst[r * ld..r * ld + ks.len()].copy_from_slice(&self.a[i * self.k + ks.start..i * self.k + ks.end]);
        }
    }
}

/// Weights of type `t` moved halfway to the value the byte kernel stores as 0 (0 for i8,
/// 128 for u8), so that every stored value lies in `[-64, 64]`.
fn halved(b: &[u8], t: Int8) -> Vec<u8> {
    b.iter().map(|&x| match t {
        Int8::I8 => ((x as i8 as i32) / 2) as i8 as u8,
        Int8::U8 => (128 + (x as i32 - 128) / 2) as u8,
    }).collect()
}

#[test]
fn avx2_pairs_packs_only_weights_whose_pair_sums_fit_and_is_exact_at_their_limit() {
    if !Isa::Avx2Pairs.available() {
        eprintln!("GEMM path avx2pairs NOT TESTED: this CPU lacks AVX2");
        return;
    }
    // Columns of paired stored values at the limit (positive or negative parts summing to
    // 128, mixed signs at full range), against rows of 255s, 0s and alternations: exact on
    // the byte kernel. One pair over the limit packs for AVX2 on 16-bit values, still exact.
    let pairs: [(i32, i32); 8] = [(64, 64), (-64, -64), (127, 1), (-128, 0), (127, -128), (1, 127), (-1, -127), (0, 0)];
    let (k, n) = (8, 16);
    for bt in [Int8::I8, Int8::U8] {
        let raw = |v: i32| if bt == Int8::I8 { v as i8 as u8 } else { (v + 128) as u8 };
        let mut b = vec![0u8; k * n];
        for j in 0..n {
            for m in 0..k / 2 {
                let (x, y) = pairs[(j + m) % pairs.len()];
                b[2 * m * n + j] = raw(x);
                b[(2 * m + 1) * n + j] = raw(y);
            }
        }
        let rows: Vec<u8> = [vec![255u8; k], vec![0; k], (0..k).map(|i| if i % 2 == 0 { 255 } else { 0 }).collect(), (0..k).map(|i| (i * 37) as u8).collect()].concat();
        let m = rows.len() / k;
        let b_zp = [if bt == Int8::I8 { 0 } else { 128 }];
        let want = naive(&rows, Int8::U8, &[7], &b, bt, &b_zp, m, k, n);
        let product = |b: &[u8]| {
            let pb = PackedB::pack(Isa::Avx2Pairs, bt, b, k, n, n, 1);
            let g = Gemm { m, a: ASource::Rows { data: &rows, lda: k }, a_type: Int8::U8, a_zp: ZeroPoints::Tensor(7), b: &pb, b_zp: ZeroPoints::Tensor(b_zp[0]) };
            let mut c = vec![i32::MIN; m * n];
            gemm_i32(&g, &mut c, false);
            (pb.isa(), c)
        };
        assert_eq!(product(&b), (Isa::Avx2Pairs, want), "B {bt:?} at the limit");
        b[3 * n + 5] = raw(2);
        b[2 * n + 5] = raw(127);
        let want = naive(&rows, Int8::U8, &[7], &b, bt, &b_zp, m, k, n);
        assert_eq!(product(&b), (Isa::Avx2, want), "B {bt:?} with the pair (127, 2)");
    }
}

/// Zero points as the GEMM takes them.
fn zps(v: &[i32]) -> ZeroPoints<'_> {
    if v.len() == 1 { ZeroPoints::Tensor(v[0]) } else { ZeroPoints::Each(v) }
}

#[test]
fn every_gemm_path_matches_a_naive_product_and_the_portable_kernel() {
    let mut rng = Rng::new(7);
    // Odd sizes, depths over one block (512) and not a multiple of 4, widths over one block
    // (384), rows over one block (144), last panels of at most 24 columns (their own tile;
    // for AVX2, last panels of at most 8), and the degenerate ones.
    let shapes = [(1, 1, 1), (1, 7, 1), (5, 3, 2), (13, 17, 33), (12, 64, 32), (31, 129, 47), (145, 301, 70), (3, 1100, 9), (150, 41, 500), (40, 2051, 33), (20, 1100, 64), (37, 200, 24), (14, 75, 40), (6, 9, 8), (7, 0, 5), (0, 5, 3)];
    let types = [(Int8::U8, Int8::I8), (Int8::U8, Int8::U8), (Int8::I8, Int8::I8), (Int8::I8, Int8::U8)];
    let mut checked = vec![];
    for isa in Isa::ALL {
        if !isa.available() {
            eprintln!("GEMM path {} NOT TESTED: this CPU lacks it", isa.name());
            continue;
        }
        checked.push(isa.name());
        for (si, &(m, k, n)) in shapes.iter().enumerate() {
            let (at, bt) = types[si % types.len()];
            let a = data(&mut rng, at, m * k);
            let b = data(&mut rng, bt, k * n);
            // The byte kernel takes weights whose pair sums fit (the others pack for AVX2 on
            // 16-bit values, tested by that family): halved around the stored zero.
            let b = if isa == Isa::Avx2Pairs { halved(&b, bt) } else { b };
            let a_zp: Vec<i32> = if si % 3 == 1 { (0..m).map(|_| zp(&mut rng, at)).collect() } else { vec![zp(&mut rng, at)] };
            let b_zp: Vec<i32> = if si % 2 == 1 { (0..n).map(|_| zp(&mut rng, bt)).collect() } else { vec![zp(&mut rng, bt)] };
            let want = naive(&a, at, &a_zp, &b, bt, &b_zp, m, k, n);
            let run = |isa: Isa, parallel: bool| {
                let pb = PackedB::pack(isa, bt, &b, k, n, n, 1);
                let g = Gemm { m, a: ASource::Rows { data: &a, lda: k }, a_type: at, a_zp: zps(&a_zp), b: &pb, b_zp: zps(&b_zp) };
                let mut c = vec![i32::MIN; m * n];
                gemm_i32(&g, &mut c, parallel);
                c
            };
            let what = format!("{} {m}x{k}x{n} A {at:?} B {bt:?} a_zp {} b_zp {}", isa.name(), a_zp.len(), b_zp.len());
            assert_eq!(PackedB::pack(isa, bt, &b, k, n, n, 1).isa(), isa, "{what}: packed for another family");
            let got = run(isa, false);
            assert_eq!(got, want, "{what}: differs from the naive product");
            assert_eq!(run(isa, true), want, "{what}, parallel: differs from the naive product");
            assert_eq!(got, run(Isa::Portable, false), "{what}: differs from the portable kernel");
            // The same A produced on demand (as convolutions produce their im2col rows), with
            // the output going through a caller's output stage instead of in place.
            let src = Rows { a: &a, k };
            let pb = PackedB::pack(isa, bt, &b, k, n, n, 1);
            let g = Gemm { m, a: ASource::Fill(&src), a_type: at, a_zp: zps(&a_zp), b: &pb, b_zp: zps(&b_zp) };
            let out = std::sync::Mutex::new(vec![i32::MIN; m * n]);
            qforge_runtime::qgemm::gemm(&g, &|blk| {
                let mut o = out.lock().unwrap();
                for r in 0..blk.rows {
                    let at = (blk.row0 + r) * n + blk.col0;
                    o[at..at + blk.cols].copy_from_slice(blk.row(r));
                }
            }, true);
            assert_eq!(out.into_inner().unwrap(), want, "{what}, rows filled on demand: differs from the naive product");
        }
    }
    // B given transposed (n x k) packs to the same product.
    let isa = Isa::best();
    let (m, k, n) = (9, 37, 21);
    let a = data(&mut rng, Int8::U8, m * k);
    let b = data(&mut rng, Int8::I8, k * n);
    let bt: Vec<u8> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
    let pb = PackedB::pack(isa, Int8::I8, &bt, k, n, 1, k);
    let g = Gemm { m, a: ASource::Rows { data: &a, lda: k }, a_type: Int8::U8, a_zp: ZeroPoints::Tensor(3), b: &pb, b_zp: ZeroPoints::Tensor(-2) };
    let mut c = vec![0; m * n];
    gemm_i32(&g, &mut c, true);
    assert_eq!(c, naive(&a, Int8::U8, &[3], &b, Int8::I8, &[-2], m, k, n), "transposed B");
    println!("GEMM paths checked: {}", checked.join(", "));
    assert!(checked.contains(&"portable"));
}

// ---------------------------------------------------------------------------------------
// MatMulInteger and QLinearMatMul
// ---------------------------------------------------------------------------------------

/// A batched matrix product case: A and B shapes.
fn matmul_shapes(rng: &mut Rng) -> Vec<(Vec<usize>, Vec<usize>)> {
    let mut v: Vec<(Vec<usize>, Vec<usize>)> = vec![
        (vec![1, 1], vec![1, 1]),
        (vec![7, 13], vec![13, 5]),
        (vec![33, 17], vec![17, 65]),
        (vec![130, 47], vec![47, 33]),
        (vec![3, 1100], vec![1100, 9]),
        (vec![150, 41], vec![41, 500]),
        (vec![2, 3, 9, 20], vec![20, 11]),
        (vec![9, 20], vec![2, 20, 11]),
        (vec![2, 1, 5, 12], vec![3, 12, 7]),
        (vec![17], vec![17, 6]),
        (vec![4, 17], vec![17]),
    ];
    for _ in 0..3 {
        let (m, k, n) = (1 + rng.below(70), 1 + rng.below(300), 1 + rng.below(90));
        v.push((vec![m, k], vec![k, n]));
    }
    v
}

/// Zero point (and scale) shape of B: per tensor, or per column in the form ONNX Runtime
/// accepts for B's rank.
fn b_param_shape(b: &[usize], per_column: bool) -> Vec<usize> {
    if !per_column || b.len() == 1 {
        return vec![];
    }
    if b.len() == 2 {
        return vec![b[1]];
    }
    let mut s = b.to_vec();
    let r = s.len();
    s[r - 2] = 1;
    s
}

#[test]
fn matmul_integer_matches_onnx_runtime() {
    let mut rng = Rng::new(11);
    let mut bld = Builder::new();
    let types = [(Int8::U8, Int8::U8), (Int8::U8, Int8::I8), (Int8::I8, Int8::I8)];
    for (ci, (ash, bsh)) in matmul_shapes(&mut rng).into_iter().enumerate() {
        let (at, bt) = types[ci % types.len()];
        let constant_b = ci % 2 == 0;
        let per_column = ci % 3 != 0;
        let a = data(&mut rng, at, ash.iter().product());
        let b = for_ort(at, bt, data(&mut rng, bt, bsh.iter().product()));
        let zs = b_param_shape(&bsh, per_column);
        let bz: Vec<i32> = (0..zs.iter().product::<usize>()).map(|_| zp(&mut rng, bt)).collect();
        let az = zp(&mut rng, at);
        let va = bld.input(int_tensor(at, &ash, &a));
        let vb = bld.value(int_tensor(bt, &bsh, &b), constant_b);
        let vaz = bld.constant(zp_tensor(at, &[], &[az]));
        let vbz = bld.constant(zp_tensor(bt, &zs, &bz));
        let what = format!("A {ash:?} {at:?} zp {az}, B {bsh:?} {bt:?} (constant {constant_b}) zp {zs:?}");
        let inputs = if ci == 3 { vec![Some(va), Some(vb)] } else { vec![Some(va), Some(vb), Some(vaz), Some(vbz)] };
        let y = bld.node("MatMulInteger", "", inputs, vec![], DType::I32);
        bld.output(y, what);
    }
    let (model, feeds, what) = bld.model(&[("", 10)]);
    let n = check_against_ort(&model, &feeds, &what, "matmulinteger");
    println!("MatMulInteger: {} cases, {n} elements identical to ONNX Runtime", what.len());
}

#[test]
fn qlinear_matmul_matches_onnx_runtime() {
    for opset in [10, 21] {
        let mut rng = Rng::new(23 + opset as u64);
        let mut bld = Builder::new();
        let types = [(Int8::U8, Int8::I8), (Int8::U8, Int8::U8), (Int8::I8, Int8::I8)];
        for (ci, (ash, bsh)) in matmul_shapes(&mut rng).into_iter().enumerate() {
            let (at, bt) = types[ci % types.len()];
            let yt = at;
            let constant_b = ci % 2 == 1;
            let per_column = ci % 3 != 1;
            let half = opset == 21 && ci % 2 == 0;
            let a = data(&mut rng, at, ash.iter().product());
            let b = for_ort(at, bt, data(&mut rng, bt, bsh.iter().product()));
            let ps = b_param_shape(&bsh, per_column);
            let count: usize = ps.iter().product();
            let bz: Vec<i32> = (0..count).map(|_| zp(&mut rng, bt)).collect();
            let bs: Vec<f32> = (0..count).map(|_| scale(&mut rng)).collect();
            let (az, yz) = (zp(&mut rng, at), zp(&mut rng, yt));
            let (sa, sy) = (scale(&mut rng), scale(&mut rng) * 40.0);
            let s = |bld: &mut Builder, shape: &[usize], v: &[f32]| {
                if half {
                    bld.constant(Tensor::from_vec(shape, v.iter().map(|&x| half::f16::from_f32(x)).collect::<Vec<_>>()).unwrap())
                } else {
                    bld.constant(Tensor::from_vec(shape, v.to_vec()).unwrap())
                }
            };
            let va = bld.input(int_tensor(at, &ash, &a));
            let vsa = s(&mut bld, &[], &[sa]);
            let vaz = bld.constant(zp_tensor(at, &[], &[az]));
            let vb = bld.value(int_tensor(bt, &bsh, &b), constant_b);
            let vbs = s(&mut bld, &ps, &bs);
            let vbz = bld.constant(zp_tensor(bt, &ps, &bz));
            let vsy = s(&mut bld, &[], &[sy]);
            let vyz = bld.constant(zp_tensor(yt, &[], &[yz]));
            let what = format!("opset {opset}: A {ash:?} {at:?}, B {bsh:?} {bt:?} (constant {constant_b}), params {ps:?}, f16 scales {half}");
            let inputs = [va, vsa, vaz, vb, vbs, vbz, vsy, vyz].map(Some).to_vec();
            let y = bld.node("QLinearMatMul", "", inputs, vec![], dtype(yt));
            bld.output(y, what);
        }
        let (model, feeds, what) = bld.model(&[("", opset)]);
        let n = check_against_ort(&model, &feeds, &what, "qlinearmatmul");
        println!("QLinearMatMul opset {opset}: {} cases, {n} elements identical to ONNX Runtime", what.len());
    }
}

// ---------------------------------------------------------------------------------------
// ConvInteger and QLinearConv
// ---------------------------------------------------------------------------------------

/// A convolution case.
#[derive(Clone, Debug)]
struct ConvCase {
    n: usize,
    c: usize,
    m: usize,
    group: usize,
    /// Spatial input and kernel sizes (one entry for 1-D).
    input: Vec<usize>,
    kernel: Vec<usize>,
    strides: Vec<usize>,
    dilations: Vec<usize>,
    pads: Vec<usize>,
    auto_pad: Option<&'static str>,
}

/// Convolutions covering groups, depthwise, strides, pads, dilations, 1-D, `auto_pad`,
/// pointwise and a depth over one GEMM block.
fn conv_cases() -> Vec<ConvCase> {
    let c2 = |n, c, m, group, input: [usize; 2], kernel: [usize; 2], strides: [usize; 2], dilations: [usize; 2], pads: [usize; 4]| ConvCase {
        n, c, m, group, input: input.to_vec(), kernel: kernel.to_vec(), strides: strides.to_vec(), dilations: dilations.to_vec(), pads: pads.to_vec(), auto_pad: None,
    };
    let mut v = vec![
        c2(1, 3, 8, 1, [9, 11], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
        c2(2, 5, 7, 1, [8, 7], [3, 2], [2, 1], [1, 1], [0, 1, 2, 0]),
        c2(1, 16, 32, 1, [14, 14], [1, 1], [1, 1], [1, 1], [0, 0, 0, 0]),
        c2(1, 32, 40, 1, [10, 9], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
        c2(1, 8, 12, 4, [9, 9], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
        c2(1, 6, 9, 3, [11, 8], [3, 3], [2, 2], [2, 1], [2, 1, 1, 2]),
        c2(1, 24, 24, 24, [13, 12], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
        c2(2, 16, 16, 16, [15, 14], [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),
        c2(1, 10, 10, 10, [9, 17], [5, 5], [1, 3], [1, 2], [2, 4, 3, 1]),
        c2(1, 4, 6, 2, [7, 7], [1, 1], [2, 2], [1, 1], [0, 0, 0, 0]),
        c2(1, 3, 64, 1, [40, 36], [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),
        c2(1, 72, 20, 1, [9, 9], [3, 3], [1, 1], [1, 1], [0, 0, 0, 0]),
        c2(1, 96, 24, 1, [23, 29], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
    ];
    v.push(ConvCase { n: 1, c: 4, m: 5, group: 1, input: vec![13], kernel: vec![3], strides: vec![2], dilations: vec![1], pads: vec![1, 0], auto_pad: None });
    v.push(ConvCase { n: 1, c: 6, m: 6, group: 6, input: vec![20], kernel: vec![5], strides: vec![1], dilations: vec![2], pads: vec![4, 4], auto_pad: None });
    v.push(ConvCase { auto_pad: Some("SAME_UPPER"), pads: vec![], ..c2(1, 4, 8, 1, [10, 7], [3, 3], [2, 2], [1, 1], [0; 4]) });
    v.push(ConvCase { auto_pad: Some("SAME_LOWER"), pads: vec![], ..c2(1, 8, 8, 8, [9, 10], [3, 3], [2, 2], [1, 1], [0; 4]) });
    v
}

/// The node attributes of a case.
fn conv_attrs(c: &ConvCase) -> Vec<(&'static str, Attr)> {
    let ints = |v: &[usize]| Attr::Ints(v.iter().map(|&x| x as i64).collect());
    let mut a = vec![("group", Attr::Int(c.group as i64)), ("strides", ints(&c.strides)), ("dilations", ints(&c.dilations)), ("kernel_shape", ints(&c.kernel))];
    match c.auto_pad {
        Some(p) => a.push(("auto_pad", Attr::String(p.as_bytes().to_vec()))),
        None => a.push(("pads", ints(&c.pads))),
    }
    a
}

/// The input shape of a case.
fn x_shape(c: &ConvCase) -> Vec<usize> {
    [vec![c.n, c.c], c.input.clone()].concat()
}

/// The weight shape of a case.
fn w_shape(c: &ConvCase) -> Vec<usize> {
    [vec![c.m, c.c / c.group], c.kernel.clone()].concat()
}

#[test]
fn qlinear_conv_matches_onnx_runtime() {
    let mut rng = Rng::new(31);
    let mut bld = Builder::new();
    for (ci, case) in conv_cases().into_iter().enumerate() {
        // ONNX Runtime: u8 activations with u8 or i8 weights, i8 with i8.
        let (xt, wt) = [(Int8::U8, Int8::I8), (Int8::U8, Int8::U8), (Int8::I8, Int8::I8)][ci % 3];
        let per_channel = ci % 2 == 0;
        let constant_w = ci % 4 != 3;
        let with_bias = ci % 5 != 4;
        let (xs, ws) = (x_shape(&case), w_shape(&case));
        let x = data(&mut rng, xt, xs.iter().product());
        let w = for_ort(xt, wt, data(&mut rng, wt, ws.iter().product()));
        let ps: Vec<usize> = if per_channel { vec![case.m] } else { vec![] };
        // ONNX Runtime requires one weight zero point for all channels.
        let wz = zp(&mut rng, wt);
        let wzs = vec![wz; if per_channel { case.m } else { 1 }];
        // Every third case has power-of-two scales: multipliers 2^-8..2^-11, so odd
        // accumulators hit exact .5 ties.
        let ties = ci % 3 == 0;
        let wsc: Vec<f32> = (0..wzs.len()).map(|_| if ties { [0.25, 0.125, 0.0625, 0.03125][rng.below(4)] } else { scale(&mut rng) }).collect();
        let (xz, yz) = (zp(&mut rng, xt), zp(&mut rng, xt));
        let (sx, sy) = if ties { (0.0625, 1.0) } else { (scale(&mut rng), scale(&mut rng) * 30.0) };
        let bias: Vec<i32> = (0..case.m).map(|_| rng.below(200_000) as i32 - 100_000).collect();
        let vx = bld.input(int_tensor(xt, &xs, &x));
        let vsx = bld.constant(Tensor::scalar(sx));
        let vxz = bld.constant(zp_tensor(xt, &[], &[xz]));
        let vw = bld.value(int_tensor(wt, &ws, &w), constant_w);
        let vws = bld.constant(Tensor::from_vec(&ps, wsc).unwrap());
        let vwz = bld.constant(zp_tensor(wt, &ps, &wzs));
        let vsy = bld.constant(Tensor::scalar(sy));
        let vyz = bld.constant(zp_tensor(xt, &[], &[yz]));
        let mut inputs = [vx, vsx, vxz, vw, vws, vwz, vsy, vyz].map(Some).to_vec();
        if with_bias {
            inputs.push(Some(bld.constant(Tensor::from_vec(&[case.m], bias).unwrap())));
        }
        let what = format!("{case:?} x {xt:?} w {wt:?} (constant {constant_w}) per-channel {per_channel} bias {with_bias}");
        let y = bld.node("QLinearConv", "", inputs, conv_attrs(&case), dtype(xt));
        bld.output(y, what);
    }
    let (model, feeds, what) = bld.model(&[("", 10)]);
    let n = check_against_ort(&model, &feeds, &what, "qlinearconv");
    println!("QLinearConv: {} cases, {n} elements identical to ONNX Runtime", what.len());
}

/// Random depthwise QLinearConvs (`group == C == M`) on 1 and 2 threads: channel counts from
/// 1 (split into bands of rows) to 64, rows up to 200 positions wide (more than one run of
/// registers), kernels 1..=7 with strides 1..=4 and dilations 1..=2 on each axis (horizontal
/// stride 4 is beyond the VNNI kernel and takes the channels-last one), asymmetric pads,
/// weight zero points at 0 / 128 (no window sums) or anywhere.
#[test]
fn depthwise_qlinear_conv_matches_onnx_runtime() {
    let mut rng = Rng::new(41);
    for threads in [1, 2] {
        let mut bld = Builder::new();
        for ci in 0..40 {
            let c = [1, 3, 8, 17, 40, 64][rng.below(6)];
            let kernel = [1 + rng.below(7), 1 + rng.below(7)];
            let strides = [1 + rng.below(3), [1, 1, 2, 3, 4][rng.below(5)]];
            let dilations = [1 + rng.below(2), 1 + rng.below(2)];
            let pads: Vec<usize> = (0..4).map(|i| rng.below(kernel[i % 2])).collect();
            let span = |i: usize| (kernel[i] - 1) * dilations[i] + 1;
            let input = [span(0) + rng.below(24), span(1) + rng.below(if ci % 4 == 0 { 400 } else { 60 })];
            let case = ConvCase { n: 1 + rng.below(2), c, m: c, group: c, input: input.to_vec(), kernel: kernel.to_vec(), strides: strides.to_vec(), dilations: dilations.to_vec(), pads, auto_pad: None };
            let (xt, wt) = [(Int8::U8, Int8::I8), (Int8::U8, Int8::U8), (Int8::I8, Int8::I8)][ci % 3];
            let per_channel = ci % 2 == 0;
            let (xs, ws) = (x_shape(&case), w_shape(&case));
            let x = data(&mut rng, xt, xs.iter().product());
            let w = for_ort(xt, wt, data(&mut rng, wt, ws.iter().product()));
            let ps: Vec<usize> = if per_channel { vec![c] } else { vec![] };
            let wz = if rng.below(2) == 0 { if wt == Int8::U8 { 128 } else { 0 } } else { zp(&mut rng, wt) };
            let wzs = vec![wz; if per_channel { c } else { 1 }];
            let wsc: Vec<f32> = (0..wzs.len()).map(|_| scale(&mut rng)).collect();
            let (xz, yz) = (zp(&mut rng, xt), zp(&mut rng, xt));
            let (sx, sy) = (scale(&mut rng), scale(&mut rng) * 30.0);
            let vx = bld.input(int_tensor(xt, &xs, &x));
            let vsx = bld.constant(Tensor::scalar(sx));
            let vxz = bld.constant(zp_tensor(xt, &[], &[xz]));
            let vw = bld.value(int_tensor(wt, &ws, &w), ci % 5 != 4);
            let vws = bld.constant(Tensor::from_vec(&ps, wsc).unwrap());
            let vwz = bld.constant(zp_tensor(wt, &ps, &wzs));
            let vsy = bld.constant(Tensor::scalar(sy));
            let vyz = bld.constant(zp_tensor(xt, &[], &[yz]));
            let mut inputs = [vx, vsx, vxz, vw, vws, vwz, vsy, vyz].map(Some).to_vec();
            if ci % 3 != 2 {
                let bias: Vec<i32> = (0..c).map(|_| rng.below(200_000) as i32 - 100_000).collect();
                inputs.push(Some(bld.constant(Tensor::from_vec(&[c], bias).unwrap())));
            }
            let what = format!("{case:?} x {xt:?} w {wt:?} wz {wz} per-channel {per_channel} inputs {}", inputs.len());
            let y = bld.node("QLinearConv", "", inputs, conv_attrs(&case), dtype(xt));
            bld.output(y, what);
        }
        let (model, feeds, what) = bld.model(&[("", 10)]);
        let n = check_against_ort_on(&model, &feeds, &what, "depthwise", threads);
        println!("depthwise QLinearConv on {threads} threads: {} cases, {n} elements identical to ONNX Runtime", what.len());
    }
}

#[test]
fn conv_integer_matches_onnx_runtime() {
    let mut rng = Rng::new(37);
    let mut bld = Builder::new();
    for (ci, case) in conv_cases().into_iter().enumerate() {
        // ONNX Runtime's ConvInteger takes uint8 only, one weight zero point.
        let (xs, ws) = (x_shape(&case), w_shape(&case));
        let x = data(&mut rng, Int8::U8, xs.iter().product());
        let w = data(&mut rng, Int8::U8, ws.iter().product());
        let vx = bld.input(int_tensor(Int8::U8, &xs, &x));
        let vw = bld.value(int_tensor(Int8::U8, &ws, &w), ci % 2 == 0);
        let mut inputs = vec![Some(vx), Some(vw)];
        if ci % 4 != 1 {
            inputs.push(Some(bld.constant(zp_tensor(Int8::U8, &[], &[zp(&mut rng, Int8::U8)]))));
            if ci % 4 != 2 {
                inputs.push(Some(bld.constant(zp_tensor(Int8::U8, &[1], &[zp(&mut rng, Int8::U8)]))));
            }
        }
        let what = format!("{case:?} zero points given: {}", inputs.len() - 2);
        let y = bld.node("ConvInteger", "", inputs, conv_attrs(&case), DType::I32);
        bld.output(y, what);
    }
    let (model, feeds, what) = bld.model(&[("", 10)]);
    let n = check_against_ort(&model, &feeds, &what, "convinteger");
    println!("ConvInteger: {} cases, {n} elements identical to ONNX Runtime", what.len());
}

// ---------------------------------------------------------------------------------------
// QGemm (com.microsoft)
// ---------------------------------------------------------------------------------------

#[test]
fn qgemm_matches_onnx_runtime() {
    let mut rng = Rng::new(41);
    let mut bld = Builder::new();
    let shapes = [(1, 1, 1), (7, 13, 5), (33, 70, 65), (130, 47, 33), (3, 600, 9), (50, 40, 400)];
    let mut ci = 0;
    for &(m, k, n) in &shapes {
        for variant in 0..4 {
            ci += 1;
            let (at, bt) = [(Int8::U8, Int8::I8), (Int8::U8, Int8::U8), (Int8::I8, Int8::I8)][ci % 3];
            let (ta, tb) = (variant & 1 == 1, variant & 2 == 2);
            let quantized = ci % 3 != 0;
            let per_column = ci % 2 == 0;
            let alpha = [1.0f32, 0.5, 1.7][ci % 3];
            let ash = if ta { vec![k, m] } else { vec![m, k] };
            let bsh = if tb { vec![n, k] } else { vec![k, n] };
            let ps: Vec<usize> = if per_column { vec![n] } else { vec![] };
            let count = if per_column { n } else { 1 };
            let bz: Vec<i32> = (0..count).map(|_| zp(&mut rng, bt)).collect();
            let az = zp(&mut rng, at);
            // Every third case has power-of-two scales (and alpha) giving multipliers of 1,
            // 1/2 and 1/4, and data within 3 of the zero points, so accumulators stay small
            // and many land on exact .5 ties.
            let ties = ci % 3 == 1;
            let (a, b) = if ties {
                let near = |rng: &mut Rng, t: Int8, z: i32| {
                    let (lo, hi) = range(t);
                    (z + rng.below(7) as i32 - 3).clamp(lo, hi) as u8
                };
                let a = (0..m * k).map(|_| near(&mut rng, at, az)).collect();
                let b = (0..k * n).map(|i| {
                    let j = if tb { i / k } else { i % n };
                    near(&mut rng, bt, bz[if per_column { j } else { 0 }])
                }).collect();
                (a, for_ort(at, bt, b))
            } else {
                (data(&mut rng, at, m * k), for_ort(at, bt, data(&mut rng, bt, k * n)))
            };
            let bs: Vec<f32> = (0..count).map(|_| if ties { [0.25, 0.125, 0.0625][rng.below(3)] } else { scale(&mut rng) }).collect();
            let alpha = if ties { 0.5 } else { alpha };
            let cshape = [vec![], vec![n], vec![1, n], vec![m, 1], vec![m, n]][ci % 5].clone();
            let spread = if ties { 40 } else { 100_000 };
            let cvals: Vec<i32> = (0..cshape.iter().product::<usize>()).map(|_| (rng.below(spread) as i32) - spread as i32 / 2).collect();
            let va = bld.input(int_tensor(at, &ash, &a));
            let vsa = bld.constant(Tensor::scalar(if ties { 0.0625 } else { scale(&mut rng) }));
            let vaz = bld.constant(zp_tensor(at, &[], &[az]));
            let vb = bld.value(int_tensor(bt, &bsh, &b), ci % 2 == 1);
            let vbs = bld.constant(Tensor::from_vec(&ps, bs).unwrap());
            let vbz = bld.constant(zp_tensor(bt, &ps, &bz));
            let vc = if ci % 4 == 3 { None } else { Some(bld.constant(Tensor::from_vec(&cshape, cvals).unwrap())) };
            let mut inputs = vec![Some(va), Some(vsa), Some(vaz), Some(vb), Some(vbs), Some(vbz), vc];
            let out = if quantized {
                let yt = at;
                inputs.push(Some(bld.constant(Tensor::scalar(if ties { 1.0 / 128.0 } else { scale(&mut rng) * 30.0 }))));
                inputs.push(Some(bld.constant(zp_tensor(yt, &[], &[zp(&mut rng, yt)]))));
                dtype(yt)
            } else {
                if ci % 4 == 1 {
                    inputs.push(Some(bld.constant(Tensor::scalar(scale(&mut rng) * 30.0))));
                }
                DType::F32
            };
            let attrs = vec![("transA", Attr::Int(ta as i64)), ("transB", Attr::Int(tb as i64)), ("alpha", Attr::Float(alpha))];
            let what = format!("{m}x{k}x{n} A {at:?} B {bt:?} transA {ta} transB {tb} alpha {alpha} C {:?} out {out} per-column {per_column}", if inputs[6].is_some() { Some(cshape) } else { None });
            let y = bld.node("QGemm", MS_DOMAIN, inputs, attrs, out);
            bld.output(y, what);
        }
    }
    let (model, feeds, what) = bld.model(&[("", 13), (MS_DOMAIN, 1)]);
    let n = check_against_ort(&model, &feeds, &what, "qgemm");
    println!("QGemm: {} cases, {n} elements identical to ONNX Runtime", what.len());
}

// ---------------------------------------------------------------------------------------
// Beyond ONNX Runtime's kernels: exact float32 graphs in ONNX Runtime as the oracle
// ---------------------------------------------------------------------------------------

/// `Cast(v, float) - zp` in the graph (`zp` a float constant broadcast against `v`).
fn dezero(bld: &mut Builder, v: ValueId, zp: Tensor) -> ValueId {
    let f = bld.node("Cast", "", vec![Some(v)], vec![("to", Attr::Int(DType::F32.onnx_code() as i64))], DType::F32);
    let z = bld.constant(zp);
    bld.node("Sub", "", vec![Some(f), Some(z)], vec![], DType::F32)
}

/// Runs the integer model in qforge and the float one in ONNX Runtime and requires equal
/// values, output by output.
fn check_against_float_graph(ours: &Model, theirs: &Model, our_feeds: &[(String, Tensor)], their_feeds: &[(String, Tensor)], what: &[String], tag: &str) -> usize {
    let tmp = TempDir::new(tag);
    let path = tmp.path().join("float.onnx");
    qforge_onnx::save(theirs, &path).unwrap();
    let got = Session::new(ours).unwrap().run(our_feeds.to_vec()).unwrap_or_else(|e| panic!("{tag}: {e}"));
    let want = ort_run(&path, their_feeds, 1);
    assert_eq!(got.len(), want.len());
    let mut total = 0;
    for (i, ((_, a), (_, b))) in got.iter().zip(&want).enumerate() {
        assert_eq!(a.shape(), b.shape(), "{tag}: {}", what[i]);
        let (x, y) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
        for (j, (p, q)) in x.iter().zip(&y).enumerate() {
            assert_eq!(p, q, "{tag}: {}: element {j} differs from the float graph", what[i]);
        }
        total += x.len();
    }
    total
}

#[test]
fn features_onnx_runtime_lacks_match_exact_float_graphs() {
    let mut rng = Rng::new(53);
    let (mut q, mut f) = (Builder::new(), Builder::new());
    let mut what = vec![];
    // Depths stay small enough (K * 255^2 < 2^24) for float32 sums to be exact.
    // 1. MatMulInteger: per-row A zero points, i8 A with u8 B, per-column B zero points.
    for (ci, &(m, k, n)) in [(9, 40, 13), (33, 200, 7), (1, 17, 30)].iter().enumerate() {
        let (at, bt) = [(Int8::I8, Int8::U8), (Int8::U8, Int8::I8), (Int8::I8, Int8::I8)][ci];
        let a = data(&mut rng, at, m * k);
        let b = data(&mut rng, bt, k * n);
        let az: Vec<i32> = (0..m).map(|_| zp(&mut rng, at)).collect();
        let bz: Vec<i32> = (0..n).map(|_| zp(&mut rng, bt)).collect();
        let (ta, tb) = (int_tensor(at, &[m, k], &a), int_tensor(bt, &[k, n], &b));
        let (qa, qb) = (q.input(ta.clone()), q.constant(tb.clone()));
        let (qaz, qbz) = (q.constant(zp_tensor(at, &[m], &az)), q.constant(zp_tensor(bt, &[n], &bz)));
        let w = format!("MatMulInteger {m}x{k}x{n} A {at:?} per-row zp, B {bt:?} per-column zp");
        let y = q.node("MatMulInteger", "", vec![Some(qa), Some(qb), Some(qaz), Some(qbz)], vec![], DType::I32);
        q.output(y, w.clone());
        let fa = f.input(ta);
        let fa = dezero(&mut f, fa, Tensor::from_vec(&[m, 1], az.iter().map(|&v| v as f32).collect()).unwrap());
        let fb = f.constant(tb);
        let fb = dezero(&mut f, fb, Tensor::from_vec(&[n], bz.iter().map(|&v| v as f32).collect()).unwrap());
        let y = f.node("MatMul", "", vec![Some(fa), Some(fb)], vec![], DType::F32);
        f.output(y, w.clone());
        what.push(w);
    }
    // 2. ConvInteger with int8 operands and per-channel weight zero points; 3. QLinearConv
    // whose per-channel weight zero points differ.
    for (ci, case) in conv_cases().into_iter().filter(|c| c.c / c.group * c.kernel.iter().product::<usize>() <= 200).enumerate().take(8) {
        let (xt, wt) = [(Int8::I8, Int8::I8), (Int8::U8, Int8::I8), (Int8::I8, Int8::U8), (Int8::U8, Int8::U8)][ci % 4];
        let (xs, ws) = (x_shape(&case), w_shape(&case));
        let x = data(&mut rng, xt, xs.iter().product());
        let w = data(&mut rng, wt, ws.iter().product());
        let xz = zp(&mut rng, xt);
        let wz: Vec<i32> = (0..case.m).map(|_| zp(&mut rng, wt)).collect();
        let mut cz = vec![case.m];
        cz.extend(vec![1; case.kernel.len() + 1]);
        let wzf = Tensor::from_vec(&cz, wz.iter().map(|&v| v as f32).collect()).unwrap();
        let fx = f.input(int_tensor(xt, &xs, &x));
        let fx = dezero(&mut f, fx, Tensor::scalar(xz as f32));
        let fw = f.constant(int_tensor(wt, &ws, &w));
        let fw = dezero(&mut f, fw, wzf);
        let acc = f.node("Conv", "", vec![Some(fx), Some(fw)], conv_attrs(&case), DType::F32);
        if ci % 2 == 0 {
            let qx = q.input(int_tensor(xt, &xs, &x));
            let qw = q.constant(int_tensor(wt, &ws, &w));
            let qxz = q.constant(zp_tensor(xt, &[], &[xz]));
            let qwz = q.constant(zp_tensor(wt, &[case.m], &wz));
            let w = format!("ConvInteger {case:?} x {xt:?} w {wt:?} per-channel zero points");
            let y = q.node("ConvInteger", "", vec![Some(qx), Some(qw), Some(qxz), Some(qwz)], conv_attrs(&case), DType::I32);
            q.output(y, w.clone());
            f.output(acc, w.clone());
            what.push(w);
        } else {
            let (sx, sy) = (scale(&mut rng), scale(&mut rng) * 30.0);
            let wsc: Vec<f32> = (0..case.m).map(|_| scale(&mut rng)).collect();
            let bias: Vec<i32> = (0..case.m).map(|_| rng.below(20_000) as i32 - 10_000).collect();
            let yz = zp(&mut rng, xt);
            let inputs = vec![
                q.input(int_tensor(xt, &xs, &x)),
                q.constant(Tensor::scalar(sx)),
                q.constant(zp_tensor(xt, &[], &[xz])),
                q.constant(int_tensor(wt, &ws, &w)),
                q.constant(Tensor::from_vec(&[case.m], wsc.clone()).unwrap()),
                q.constant(zp_tensor(wt, &[case.m], &wz)),
                q.constant(Tensor::scalar(sy)),
                q.constant(zp_tensor(xt, &[], &[yz])),
                q.constant(Tensor::from_vec(&[case.m], bias.clone()).unwrap()),
            ];
            let w = format!("QLinearConv {case:?} x {xt:?} w {wt:?} differing per-channel zero points");
            let y = q.node("QLinearConv", "", inputs.into_iter().map(Some).collect(), conv_attrs(&case), dtype(xt));
            q.output(y, w.clone());
            // y = clip(round(f32(acc + bias) * ((sx * ws) / sy)) + yz): all steps exact or
            // the same single f32 rounding as the integer kernel's.
            let mult: Vec<f32> = wsc.iter().map(|&s| sx * s / sy).collect();
            let co = &cz[..cz.len() - 1];
            let b = f.constant(Tensor::from_vec(co, bias.iter().map(|&v| v as f32).collect()).unwrap());
            let biased = f.node("Add", "", vec![Some(acc), Some(b)], vec![], DType::F32);
            let mc = f.constant(Tensor::from_vec(co, mult).unwrap());
            let scaled = f.node("Mul", "", vec![Some(biased), Some(mc)], vec![], DType::F32);
            let rounded = f.node("Round", "", vec![Some(scaled)], vec![], DType::F32);
            let z = f.constant(Tensor::scalar(yz as f32));
            let shifted = f.node("Add", "", vec![Some(rounded), Some(z)], vec![], DType::F32);
            let (lo, hi) = range(xt);
            let (vlo, vhi) = (f.constant(Tensor::scalar(lo as f32)), f.constant(Tensor::scalar(hi as f32)));
            let clipped = f.node("Clip", "", vec![Some(shifted), Some(vlo), Some(vhi)], vec![], DType::F32);
            f.output(clipped, w.clone());
            what.push(w);
        }
    }
    // Both models take the same inputs (under their own names) in the same order.
    let (qm, qfeeds, _) = q.model(&[("", 13)]);
    let (fm, ffeeds, _) = f.model(&[("", 13)]);
    let total = check_against_float_graph(&qm, &fm, &qfeeds, &ffeeds, &what, "float-oracle");
    println!("{} cases beyond ONNX Runtime's kernels, {total} elements equal to exact float graphs", what.len());
}

// ---------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------

/// Runs a one-node model and returns the error text (the run must fail, not panic).
fn error_of(op: &str, domain: &str, inputs: Vec<Tensor>, attrs: Vec<(&str, Attr)>) -> String {
    let mut bld = Builder::new();
    let vals: Vec<Option<ValueId>> = inputs.into_iter().map(|t| Some(bld.input(t))).collect();
    let y = bld.node(op, domain, vals, attrs, DType::F32);
    bld.output(y, String::new());
    let (model, feeds, _) = bld.model(&[("", 13), (MS_DOMAIN, 1)]);
    match Session::new(&model).and_then(|s| s.run(feeds)) {
        Ok(_) => panic!("{op} accepted bad input"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_inputs_are_refused_with_the_node_named() {
    let u8s = |shape: &[usize]| Tensor::zeros(DType::U8, shape).unwrap();
    let i8s = |shape: &[usize]| Tensor::zeros(DType::I8, shape).unwrap();
    let f = |v: f32| Tensor::scalar(v);
    let cases: Vec<(String, &str)> = vec![
        (error_of("MatMulInteger", "", vec![Tensor::zeros(DType::F32, &[2, 3]).unwrap(), u8s(&[3, 4])], vec![]), "A must be uint8 or int8"),
        (error_of("MatMulInteger", "", vec![u8s(&[2, 3]), u8s(&[4, 4])], vec![]), "do not align"),
        (error_of("MatMulInteger", "", vec![u8s(&[2, 3]), u8s(&[3, 4]), i8s(&[])], vec![]), "a_zero_point must have the type of A"),
        (error_of("MatMulInteger", "", vec![u8s(&[2, 3]), u8s(&[3, 4]), u8s(&[]), u8s(&[3])], vec![]), "b_zero_point of shape [3]"),
        (error_of("QLinearMatMul", "", vec![u8s(&[2, 3]), f(0.1), u8s(&[]), i8s(&[3, 4]), f(0.1), i8s(&[]), f(0.2), u8s(&[2])], vec![]), "y_zero_point must be a scalar"),
        (error_of("QLinearMatMul", "", vec![u8s(&[2, 3]), Tensor::scalar(1i32), u8s(&[]), i8s(&[3, 4]), f(0.1), i8s(&[]), f(0.2), u8s(&[])], vec![]), "must have one type"),
        (error_of("QLinearConv", "", vec![u8s(&[1, 2, 5, 5]), f(0.1), u8s(&[]), i8s(&[3, 2, 3, 3]), Tensor::from_vec(&[2], vec![0.1f32, 0.2]).unwrap(), i8s(&[]), f(0.2), u8s(&[])], vec![]), "w_scale must be a scalar or have shape [3]"),
        (error_of("QLinearConv", "", vec![u8s(&[1, 2, 5, 5]), f(0.1), u8s(&[]), i8s(&[3, 2, 3, 3]), f(0.1), i8s(&[]), f(0.2), u8s(&[]), Tensor::zeros(DType::I32, &[2]).unwrap()], vec![]), "bias) must have shape [3]"),
        (error_of("QLinearConv", "", vec![u8s(&[1, 4, 5, 5]), f(0.1), u8s(&[]), i8s(&[3, 2, 3, 3]), f(0.1), i8s(&[]), f(0.2), u8s(&[])], vec![("group", Attr::Int(1))]), "with group 1"),
        (error_of("ConvInteger", "", vec![u8s(&[1, 2, 5, 5, 5]), u8s(&[3, 2, 3, 3, 3])], vec![]), "only 1-D and 2-D"),
        (error_of("ConvInteger", "", vec![u8s(&[1, 2, 2, 2]), u8s(&[3, 2, 3, 3])], vec![]), "larger than the padded input"),
        (error_of("QLinearConv", "", vec![u8s(&[1, 2, 0, 3]), f(0.1), u8s(&[]), i8s(&[2, 1, 1, 1]), f(0.1), i8s(&[]), f(0.2), u8s(&[])], vec![("group", Attr::Int(2)), ("pads", Attr::Ints(vec![1, 0, 0, 0]))]), "convolving an empty image"),
        (error_of("QGemm", MS_DOMAIN, vec![u8s(&[2, 3]), f(0.1), u8s(&[]), i8s(&[3, 4]), f(0.1), i8s(&[]), Tensor::zeros(DType::I32, &[3]).unwrap()], vec![]), "does not broadcast to [2, 4]"),
    ];
    for (err, want) in &cases {
        assert!(err.contains(want), "expected '{want}' in: {err}");
        assert!(err.contains("node 'node_"), "the error does not name the node: {err}");
    }
    let mut bld = Builder::new();
    let ins: Vec<Option<ValueId>> = vec![u8s(&[2, 3]), f(0.1), u8s(&[]), i8s(&[3, 4]), f(0.1), i8s(&[])]
        .into_iter().map(|t| Some(bld.input(t))).collect();
    let mut ins = ins;
    ins.push(None);
    ins.push(None);
    let zy = bld.input(u8s(&[]));
    ins.push(Some(zy));
    let y = bld.node("QGemm", MS_DOMAIN, ins, vec![], DType::U8);
    bld.output(y, String::new());
    let (model, feeds, _) = bld.model(&[("", 13), (MS_DOMAIN, 1)]);
    let err = Session::new(&model).and_then(|s| s.run(feeds)).unwrap_err().to_string();
    assert!(err.contains("without y_scale"), "{err}");
}

// ---------------------------------------------------------------------------------------
// The requantization multiplier, to the last bit
// ---------------------------------------------------------------------------------------

/// Scales for which the multiplier's evaluation order is visible: `formula(s)` gives the f32
/// multiplier of the order under test and one alternative (another order, or the exact f64
/// value), and on the accumulators `products` the two round some in-range value differently.
/// Found by a deterministic search; the alternatives are computed here with plain f32
/// arithmetic only to prove the data can tell the orders apart, the expected outputs come
/// from ONNX Runtime.
fn telling_scales(seed: u64, products: &[i32], count: usize, formula: impl Fn(&[f32]) -> (f32, f32)) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    for _ in 0..200_000 {
        let s: Vec<f32> = (0..count).map(|_| 0.002 + rng.unit() * 0.2).collect();
        let (want, alt) = formula(&s);
        if want != alt && products.iter().any(|&p| {
            let r = |m: f32| (p as f32 * m).round_ties_even().clamp(-128.0, 127.0);
            r(want) != r(alt)
        }) {
            return s;
        }
    }
    panic!("no scales distinguish the multiplier orders");
}

#[test]
fn the_requantization_multiplier_follows_onnx_runtimes_order() {
    // acc = i * j for i in 0..=255 (u8 A, zero point 0) and j in -128..=127 (i8 B); the
    // output zero point 128 keeps products up to +-127 visible.
    let products: Vec<i32> = (0..256).flat_map(|i| (-128..128).map(move |j| i * j)).collect();
    let a: Vec<u8> = (0..=255u8).collect();
    let b: Vec<u8> = (-128i32..128).map(|v| v as u8).collect();
    let mut bld = Builder::new();
    let z8 = |bld: &mut Builder, t: Int8, v: i32| bld.constant(zp_tensor(t, &[], &[v]));
    let sc = |bld: &mut Builder, v: f32| bld.constant(Tensor::scalar(v));
    // QLinearMatMul and QLinearConv compute (a_scale * b_scale) / y_scale.
    // The third number picks the multiplier (about 0.0005..0.0045, so i * j spans the range).
    let three = |s: &[f32]| (s[0], s[1], s[0] * s[1] / (0.0005 + s[2] * 0.02));
    let alts3: [fn(f32, f32, f32) -> f32; 3] = [|x, w, y| x * (w / y), |x, w, y| (x / y) * w, |x, w, y| (x as f64 * w as f64 / y as f64) as f32];
    for (i, alt) in alts3.iter().enumerate() {
        let s = telling_scales(10 + i as u64, &products, 3, |s| {
            let (x, w, y) = three(s);
            (x * w / y, alt(x, w, y))
        });
        let (sa, sb, sy) = three(&s);
        let (xa, xb) = (bld.input(int_tensor(Int8::U8, &[256, 1], &a)), bld.input(int_tensor(Int8::I8, &[1, 256], &b)));
        let ins = vec![xa, sc(&mut bld, sa), z8(&mut bld, Int8::U8, 0), xb, sc(&mut bld, sb), z8(&mut bld, Int8::I8, 0), sc(&mut bld, sy), z8(&mut bld, Int8::U8, 128)];
        let y = bld.node("QLinearMatMul", "", ins.into_iter().map(Some).collect(), vec![], DType::U8);
        bld.output(y, format!("QLinearMatMul, scales {sa:e} {sb:e} {sy:e} (against alternative {i})"));
        // The same products as a 1x1 convolution: 256 positions x 256 output channels.
        let s = telling_scales(20 + i as u64, &products, 3, |s| {
            let (x, w, y) = three(s);
            (x * w / y, alt(x, w, y))
        });
        let (sx, sw, sy) = three(&s);
        let x = bld.input(int_tensor(Int8::U8, &[1, 1, 16, 16], &a));
        let w = bld.constant(int_tensor(Int8::I8, &[256, 1, 1, 1], &b));
        let ins = vec![x, sc(&mut bld, sx), z8(&mut bld, Int8::U8, 0), w, sc(&mut bld, sw), z8(&mut bld, Int8::I8, 0), sc(&mut bld, sy), z8(&mut bld, Int8::U8, 128)];
        let y = bld.node("QLinearConv", "", ins.into_iter().map(Some).collect(), vec![], DType::U8);
        bld.output(y, format!("QLinearConv, scales {sx:e} {sw:e} {sy:e} (against alternative {i})"));
    }
    // QGemm computes ((alpha * a_scale) * b_scale) / y_scale.
    let four = |s: &[f32]| (s[0] * 10.0, s[1], s[2], s[0] * 10.0 * s[1] * s[2] / (0.0005 + s[3] * 0.02));
    type Order4 = fn(f32, f32, f32, f32) -> f32;
    let alts4: [Order4; 4] = [
        |al, x, w, y| al * (x * w / y),
        |al, x, w, y| al * (x * w) / y,
        |al, x, w, y| (al * x) * (w / y),
        |al, x, w, y| (al as f64 * x as f64 * w as f64 / y as f64) as f32,
    ];
    for (i, alt) in alts4.iter().enumerate() {
        let s = telling_scales(30 + i as u64, &products, 4, |s| {
            let (al, x, w, y) = four(s);
            (al * x * w / y, alt(al, x, w, y))
        });
        let (al, sx, sw, sy) = four(&s);
        let (xa, xb) = (bld.input(int_tensor(Int8::U8, &[256, 1], &a)), bld.input(int_tensor(Int8::I8, &[1, 256], &b)));
        let ins = vec![
            Some(xa), Some(sc(&mut bld, sx)), Some(z8(&mut bld, Int8::U8, 0)), Some(xb), Some(sc(&mut bld, sw)),
            Some(z8(&mut bld, Int8::I8, 0)), None, Some(sc(&mut bld, sy)), Some(z8(&mut bld, Int8::U8, 128)),
        ];
        let y = bld.node("QGemm", MS_DOMAIN, ins, vec![("alpha", Attr::Float(al))], DType::U8);
        bld.output(y, format!("QGemm, alpha {al:e} scales {sx:e} {sw:e} {sy:e} (against alternative {i})"));
    }
    let (model, feeds, what) = bld.model(&[("", 13), (MS_DOMAIN, 1)]);
    let n = check_against_ort(&model, &feeds, &what, "multiplier");
    println!("multiplier order: {} cases, {n} elements identical to ONNX Runtime", what.len());
}
