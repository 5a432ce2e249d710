//! ONNX Runtime's `com.microsoft` QLinear kernels (`QLinearAdd`, `QLinearMul`,
//! `QLinearSigmoid`, `QLinearLeakyRelu`, `QLinearGlobalAveragePool`, `QLinearAveragePool`,
//! `QLinearConcat`, `QLinearSoftmax`) and ONNX `DynamicQuantizeLinear` match ONNX Runtime bit
//! for bit: on random
//! uint8 and int8 data over the whole range, with scales that make exact rounding ties and
//! saturate, numpy broadcasting for Add/Mul (scalar on either side, general), every table
//! entry for the lookup-table ops, pooling with pads, strides, ceil mode, `count_include_pad`,
//! 1-D to 3-D windows and channels-last layouts, and bad inputs refused with an error.

use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor, ValueId, ValueType, MS_DOMAIN};
use qforge_runtime::Session;
use qforge_testkit::{int8_range as range, int8_tensor as q8, ort_run, Rng, TempDir};

/// Random 8-bit data over the whole range.
fn data(d: DType, shape: &[usize], rng: &mut Rng) -> Tensor {
    let (lo, hi) = range(d);
    let n: usize = shape.iter().product();
    q8(d, shape, &(0..n).map(|_| rng.int(lo, hi)).collect::<Vec<_>>())
}

/// A scale: powers of two (exact ties) and awkward values.
fn scale(rng: &mut Rng) -> f32 {
    rng.pick(&[0.5f32, 0.25, 0.125, 1.0, 2.0, 0.1, 0.037, 0.0213, 7.1e-3, 0.3, 1.7])
}

fn zp(d: DType, rng: &mut Rng) -> i64 {
    let (lo, hi) = range(d);
    match rng.next() % 4 {
        0 => lo,
        1 => if d == DType::U8 { 128 } else { 0 },
        _ => rng.int(lo, hi),
    }
}

/// Builds a one-node model: `feeds` become graph inputs, `consts` initializers, inputs are
/// given by name (`""` for an omitted one).
struct Case {
    g: Graph,
    feeds: Vec<(String, Tensor)>,
}

impl Case {
    fn new() -> Case {
        Case { g: Graph::new("g"), feeds: vec![] }
    }
    fn feed(&mut self, name: &str, t: Tensor) -> ValueId {
        let dims: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
        let v = self.g.add_input(name, Some(ValueType::tensor_of(t.dtype(), &dims))).unwrap();
        self.feeds.push((name.to_string(), t));
        v
    }
    fn init(&mut self, name: &str, t: Tensor) -> ValueId {
        self.g.add_initializer(name, t).unwrap()
    }
    fn node(mut self, op: &str, domain: &str, inputs: &[Option<ValueId>], attrs: Vec<(&str, Attr)>, outputs: usize) -> (Model, Vec<(String, Tensor)>) {
        let outs: Vec<ValueId> = (0..outputs).map(|i| self.g.new_value(format!("y{i}"), None).unwrap()).collect();
        let mut n = Node::new(op, "node").with_outputs(outs.clone());
        n.domain = domain.to_string();
        n.inputs = inputs.to_vec();
        for (k, v) in attrs {
            n = n.with_attr(k, v);
        }
        self.g.add_node(n).unwrap();
        self.g.set_outputs(outs).unwrap();
        let opsets = vec![OpsetImport { domain: String::new(), version: 13 }, OpsetImport { domain: MS_DOMAIN.into(), version: 1 }];
        (Model { ir_version: 8, opset_imports: opsets, graph: self.g, ..Default::default() }, self.feeds)
    }
}

/// Runs the model in qforge and ONNX Runtime and asserts identical outputs (dtype, shape and
/// bytes). Returns the number of elements compared.
fn same_as_ort(m: &Model, feeds: &[(String, Tensor)], what: &str, dir: &TempDir) -> usize {
    let ours = Session::new(m).unwrap_or_else(|e| panic!("{what}: {e}")).run(feeds.to_vec()).unwrap_or_else(|e| panic!("{what}: {e}"));
    let path = dir.path().join("m.onnx");
    qforge_onnx::save(m, &path).unwrap();
    let theirs = ort_run(&path, feeds, 1);
    let mut n = 0;
    for (name, t) in &ours {
        let (_, o) = theirs.iter().find(|(k, _)| k == name).unwrap_or_else(|| panic!("{what}: ORT gave no {name}"));
        assert_eq!(t.dtype(), o.dtype(), "{what}: {name} dtype");
        assert_eq!(t.shape(), o.shape(), "{what}: {name} shape");
        let (a, b) = (t.to_f64_vec().unwrap(), o.to_f64_vec().unwrap());
        for i in 0..a.len() {
            assert!(a[i].to_bits() == b[i].to_bits(), "{what}: {name}[{i}] qforge {} vs ORT {}", a[i], b[i]);
        }
        n += a.len();
    }
    n
}

fn qparams(c: &mut Case, prefix: &str, d: DType, rng: &mut Rng) -> (ValueId, ValueId) {
    let s = c.init(&format!("{prefix}_s"), Tensor::scalar(scale(rng)));
    let z = c.init(&format!("{prefix}_z"), q8(d, &[], &[zp(d, rng)]));
    (s, z)
}

#[test]
fn qlinear_add_and_mul_match_onnx_runtime_with_broadcasting() {
    let dir = TempDir::new("qlms-bin");
    // The last six are large enough to be split into chunks over threads (per-channel runs,
    // scalars on either side, an odd length, a bias repeated along the outer axes of either
    // input).
    let shapes: [(&[usize], &[usize]); 13] = [
        (&[2, 3, 17], &[2, 3, 17]),
        (&[2, 3, 17], &[1]),
        (&[], &[4, 33]),
        (&[2, 1, 5], &[3, 1]),
        (&[4, 1, 6], &[1, 7, 6]),
        (&[3, 8], &[8]),
        (&[1000], &[1000]),
        (&[1, 24, 1, 1], &[1, 24, 61, 53]),
        (&[1, 5, 150, 101], &[1, 1, 1, 1]),
        (&[1, 1, 1], &[3, 170, 153]),
        (&[70_001], &[70_001]),
        (&[1, 250, 301], &[301]),
        (&[7, 301], &[2, 40, 7, 301]),
    ];
    let mut total = 0;
    let mut seed = 1;
    for op in ["QLinearAdd", "QLinearMul"] {
        for d in [DType::U8, DType::I8] {
            for (sa, sb) in shapes {
                for _ in 0..3 {
                    let mut rng = Rng::new(seed);
                    seed += 1;
                    let mut c = Case::new();
                    let a = c.feed("a", data(d, sa, &mut rng));
                    let b = c.feed("b", data(d, sb, &mut rng));
                    let (as_, az) = qparams(&mut c, "a", d, &mut rng);
                    let (bs, bz) = qparams(&mut c, "b", d, &mut rng);
                    let (cs, cz) = qparams(&mut c, "c", d, &mut rng);
                    let (m, feeds) = c.node(op, MS_DOMAIN, &[Some(a), Some(as_), Some(az), Some(b), Some(bs), Some(bz), Some(cs), Some(cz)], vec![], 1);
                    total += same_as_ort(&m, &feeds, &format!("{op} {d} {sa:?} {sb:?} seed {}", seed - 1), &dir);
                }
            }
        }
    }
    println!("{total} elements bit-identical");
}

#[test]
fn qlinear_add_saturates_like_onnx_runtime_on_extreme_scales() {
    // A scale ratio so large that the f32 result leaves the int32 range: MLAS's conversion
    // gives the integer minimum, which then saturates to the type's minimum.
    let dir = TempDir::new("qlms-extreme");
    for d in [DType::U8, DType::I8] {
        let mut c = Case::new();
        let (lo, hi) = range(d);
        let a = c.feed("a", q8(d, &[6], &[lo, hi, 0, 1, hi - 1, lo + 1]));
        let b = c.feed("b", q8(d, &[6], &[hi, hi, lo, 3, 0, lo]));
        let as_ = c.init("as", Tensor::scalar(1e8f32));
        let az = c.init("az", q8(d, &[], &[0]));
        let bs = c.init("bs", Tensor::scalar(3e7f32));
        let bz = c.init("bz", q8(d, &[], &[1]));
        let cs = c.init("cs", Tensor::scalar(1e-3f32));
        let cz = c.init("cz", q8(d, &[], &[2]));
        for op in ["QLinearAdd", "QLinearMul"] {
            let mut c2 = Case { g: c.g.clone(), feeds: c.feeds.clone() };
            c2.g.name = op.into();
            let (m, feeds) = c2.node(op, MS_DOMAIN, &[Some(a), Some(as_), Some(az), Some(b), Some(bs), Some(bz), Some(cs), Some(cz)], vec![], 1);
            same_as_ort(&m, &feeds, &format!("{op} {d} extreme"), &dir);
        }
    }
}

#[test]
fn qlinear_sigmoid_and_leaky_relu_tables_match_onnx_runtime() {
    let dir = TempDir::new("qlms-lut");
    let mut total = 0;
    for d in [DType::U8, DType::I8] {
        let (lo, hi) = range(d);
        // Every value, then random data.
        let all = q8(d, &[2, 128], &(lo..=hi).collect::<Vec<_>>());
        for seed in 0..12u64 {
            let mut rng = Rng::new(100 + seed);
            for (op, alpha) in [("QLinearSigmoid", None), ("QLinearLeakyRelu", None), ("QLinearLeakyRelu", Some(0.1f32)), ("QLinearLeakyRelu", Some(1.7f32))] {
                let mut c = Case::new();
                let x = c.feed("x", if seed % 2 == 0 { all.clone() } else { data(d, &[3, 5, 7], &mut rng) });
                // Input scales spanning the logistic's clamp at +-18 and its flat tails.
                let xs = c.init("xs", Tensor::scalar(rng.pick(&[0.02f32, 0.0625, 0.1, 0.25, 0.5, 1.0 / 255.0])));
                let xz = c.init("xz", q8(d, &[], &[zp(d, &mut rng)]));
                let ys = c.init("ys", Tensor::scalar(if op == "QLinearSigmoid" { rng.pick(&[1.0f32 / 256.0, 1.0 / 255.0, 0.0039, 0.01]) } else { scale(&mut rng) }));
                let yz = c.init("yz", q8(d, &[], &[zp(d, &mut rng)]));
                let attrs = alpha.map(|a| vec![("alpha", Attr::Float(a))]).unwrap_or_default();
                let (m, feeds) = c.node(op, MS_DOMAIN, &[Some(x), Some(xs), Some(xz), Some(ys), Some(yz)], attrs, 1);
                total += same_as_ort(&m, &feeds, &format!("{op} {d} alpha {alpha:?} seed {seed}"), &dir);
            }
        }
    }
    println!("{total} elements bit-identical");
}

#[test]
fn qlinear_global_average_pool_matches_onnx_runtime() {
    let dir = TempDir::new("qlms-gap");
    let mut total = 0;
    let mut seed = 200;
    for d in [DType::U8, DType::I8] {
        for (shape, channels_last) in [(vec![2usize, 3, 5, 7], false), (vec![2, 5, 7, 3], true), (vec![1, 4, 64, 64], false), (vec![1, 9, 13], false), (vec![3, 11, 17], true), (vec![1, 2, 3, 4, 5], false)] {
            for _ in 0..3 {
                let mut rng = Rng::new(seed);
                seed += 1;
                let mut c = Case::new();
                let x = c.feed("x", data(d, &shape, &mut rng));
                let (xs, xz) = qparams(&mut c, "x", d, &mut rng);
                let ys = c.init("y_s", Tensor::scalar(rng.pick(&[0.1f32, 0.05, 0.5, 0.25, 0.021])));
                let yz = c.init("y_z", q8(d, &[], &[zp(d, &mut rng)]));
                let (m, feeds) = c.node("QLinearGlobalAveragePool", MS_DOMAIN, &[Some(x), Some(xs), Some(xz), Some(ys), Some(yz)], vec![("channels_last", Attr::Int(channels_last as i64))], 1);
                total += same_as_ort(&m, &feeds, &format!("QLinearGlobalAveragePool {d} {shape:?} cl {channels_last} seed {}", seed - 1), &dir);
            }
        }
    }
    println!("{total} elements bit-identical");
}

#[test]
fn qlinear_average_pool_matches_onnx_runtime() {
    let dir = TempDir::new("qlms-ap");
    let mut total = 0;
    let mut seed = 300;
    // (shape, channels_last, kernel, strides, pads, auto_pad, ceil_mode, count_include_pad)
    type Geo = (Vec<usize>, bool, Vec<i64>, Vec<i64>, Option<Vec<i64>>, &'static str, i64, i64);
    let cases: Vec<Geo> = vec![
        (vec![1, 3, 9, 11], false, vec![3, 3], vec![2, 2], Some(vec![1, 1, 1, 1]), "NOTSET", 0, 0),
        (vec![1, 3, 9, 11], false, vec![3, 3], vec![2, 2], Some(vec![1, 1, 1, 1]), "NOTSET", 0, 1),
        (vec![2, 2, 8, 7], false, vec![2, 3], vec![2, 2], Some(vec![0, 1, 1, 0]), "NOTSET", 1, 0),
        (vec![2, 2, 8, 7], false, vec![2, 3], vec![2, 2], Some(vec![0, 1, 1, 0]), "NOTSET", 1, 1),
        (vec![1, 4, 10, 10], false, vec![3, 3], vec![1, 1], None, "SAME_UPPER", 0, 0),
        (vec![1, 4, 10, 10], false, vec![2, 2], vec![2, 2], None, "VALID", 0, 0),
        (vec![1, 9, 10, 3], true, vec![3, 3], vec![2, 2], Some(vec![1, 1, 1, 1]), "NOTSET", 0, 0),
        (vec![2, 3, 13], false, vec![4], vec![3], Some(vec![2, 1]), "NOTSET", 0, 1),
        (vec![2, 13, 3], true, vec![4], vec![3], Some(vec![2, 1]), "NOTSET", 1, 0),
        (vec![1, 2, 5, 6, 4], false, vec![2, 3, 2], vec![1, 2, 2], Some(vec![1, 0, 1, 0, 1, 0]), "NOTSET", 0, 0),
        // A window covering the whole image: ONNX Runtime takes its global-average path.
        (vec![1, 3, 6, 5], false, vec![6, 5], vec![1, 1], None, "NOTSET", 0, 0),
        (vec![1, 6, 5, 3], true, vec![6, 5], vec![1, 1], None, "NOTSET", 0, 0),
    ];
    for d in [DType::U8, DType::I8] {
        for (shape, cl, kernel, strides, pads, auto_pad, ceil, include) in &cases {
            let mut rng = Rng::new(seed);
            seed += 1;
            let mut c = Case::new();
            let x = c.feed("x", data(d, shape, &mut rng));
            let (xs, xz) = qparams(&mut c, "x", d, &mut rng);
            let ys = c.init("y_s", Tensor::scalar(rng.pick(&[0.1f32, 0.05, 0.5, 0.25, 0.021])));
            let yz = c.init("y_z", q8(d, &[], &[zp(d, &mut rng)]));
            let mut attrs = vec![("kernel_shape", Attr::Ints(kernel.clone())), ("strides", Attr::Ints(strides.clone())), ("auto_pad", Attr::String(auto_pad.as_bytes().to_vec())),
                ("ceil_mode", Attr::Int(*ceil)), ("count_include_pad", Attr::Int(*include)), ("channels_last", Attr::Int(*cl as i64))];
            if let Some(p) = pads {
                attrs.push(("pads", Attr::Ints(p.clone())));
            }
            let (m, feeds) = c.node("QLinearAveragePool", MS_DOMAIN, &[Some(x), Some(xs), Some(xz), Some(ys), Some(yz)], attrs, 1);
            total += same_as_ort(&m, &feeds, &format!("QLinearAveragePool {d} {shape:?} cl {cl} k {kernel:?} s {strides:?} p {pads:?} {auto_pad} ceil {ceil} incl {include}"), &dir);
        }
    }
    println!("{total} elements bit-identical");
}

#[test]
fn qlinear_concat_matches_onnx_runtime() {
    let dir = TempDir::new("qlms-concat");
    let mut total = 0;
    for d in [DType::U8, DType::I8] {
        for (axis, shapes) in [(1i64, vec![vec![2usize, 3, 4], vec![2, 5, 4], vec![2, 1, 4]]), (-1, vec![vec![3, 2], vec![3, 7], vec![3, 1]]), (0, vec![vec![300], vec![2], vec![5]])] {
            for seed in 0..4u64 {
                let mut rng = Rng::new(400 + seed + axis as u64 * 10);
                let mut c = Case::new();
                let ys = c.init("y_s", Tensor::scalar(scale(&mut rng)));
                let yzv = zp(d, &mut rng);
                let yz = c.init("y_z", q8(d, &[], &[yzv]));
                let mut inputs = vec![Some(ys), Some(yz)];
                for (k, s) in shapes.iter().enumerate() {
                    let x = c.feed(&format!("x{k}"), data(d, s, &mut rng));
                    // Input 0 shares the output's qparams (copied), the others are requantized.
                    let (xs, xz) = if k == 0 { (ys, yz) } else { qparams(&mut c, &format!("x{k}"), d, &mut rng) };
                    inputs.extend([Some(x), Some(xs), Some(xz)]);
                }
                let (m, feeds) = c.node("QLinearConcat", MS_DOMAIN, &inputs, vec![("axis", Attr::Int(axis))], 1);
                total += same_as_ort(&m, &feeds, &format!("QLinearConcat {d} axis {axis} seed {seed}"), &dir);
            }
        }
    }
    println!("{total} elements bit-identical");
}

#[test]
fn qlinear_softmax_matches_onnx_runtime() {
    // Opset 11 flattens at the axis, opset 13 normalizes along it alone (inner axes included).
    let dir = TempDir::new("qlms-softmax");
    let cases: [(&[usize], i64, i64); 7] = [
        (&[2, 3, 17], -1, 13),
        (&[4, 10], 1, 13),
        (&[2, 5, 7], 1, 13),
        (&[2, 2, 3, 3], 0, 13),
        (&[3, 4, 5], 1, 11),
        (&[2, 6], -1, 11),
        (&[1, 1000], -1, 13),
    ];
    let mut total = 0;
    let mut seed = 500;
    for d in [DType::U8, DType::I8] {
        for (shape, axis, opset) in cases {
            for y_scale in [1.0f32 / 256.0, 1.0 / 255.0, 0.0213] {
                let mut rng = Rng::new(seed);
                seed += 1;
                let mut c = Case::new();
                let x = c.feed("x", data(d, shape, &mut rng));
                let (xs, xz) = qparams(&mut c, "x", d, &mut rng);
                let ys = c.init("y_s", Tensor::scalar(y_scale));
                let z = if d == DType::U8 { 0 } else { -128 };
                let yz = c.init("y_z", q8(d, &[], &[z]));
                let attrs = vec![("axis", Attr::Int(axis)), ("opset", Attr::Int(opset))];
                let (m, feeds) = c.node("QLinearSoftmax", MS_DOMAIN, &[Some(x), Some(xs), Some(xz), Some(ys), Some(yz)], attrs, 1);
                total += same_as_ort(&m, &feeds, &format!("QLinearSoftmax {d} {shape:?} axis {axis} opset {opset} y_scale {y_scale}"), &dir);
            }
        }
    }
    println!("{total} elements bit-identical");
}

#[test]
fn dynamic_quantize_linear_matches_onnx_runtime() {
    let dir = TempDir::new("qlms-dql");
    let mut total = 0;
    for (k, (lo, hi, n)) in [(-1.0f32, 1.0f32, 257usize), (0.5, 3.0, 100), (-7.0, -0.25, 99), (-0.003, 100.0, 5000), (0.0, 0.0, 10), (-1e-3, 2.5e-4, 4096), (-3.3, 5.1, 100_003)].into_iter().enumerate() {
        let mut rng = Rng::new(500 + k as u64);
        let mut v: Vec<f32> = (0..n).map(|_| lo + (hi - lo) * rng.unit()).collect();
        // Values on exact quantization ties for the range's own scale.
        let s = (hi.max(0.0) - lo.min(0.0)) / 255.0;
        for (i, x) in v.iter_mut().enumerate().step_by(7) {
            *x = ((i % 200) as f32 - 100.0 + 0.5) * s;
        }
        if let Some(first) = v.first_mut() {
            *first = lo;
        }
        if n > 1 {
            v[1] = hi;
        }
        let mut c = Case::new();
        let x = c.feed("x", Tensor::from_vec(&[n], v).unwrap());
        let (m, feeds) = c.node("DynamicQuantizeLinear", "", &[Some(x)], vec![], 3);
        total += same_as_ort(&m, &feeds, &format!("DynamicQuantizeLinear [{lo}, {hi}] x {n}"), &dir);
    }
    println!("{total} elements bit-identical");
}

#[test]
fn bad_inputs_are_refused_with_errors() {
    let run = |op: &str, domain: &str, inputs: Vec<(&str, Tensor)>, attrs: Vec<(&str, Attr)>| -> String {
        let mut c = Case::new();
        let ids: Vec<Option<ValueId>> = inputs.into_iter().map(|(n, t)| Some(c.feed(n, t))).collect();
        let (m, feeds) = c.node(op, domain, &ids, attrs, 1);
        match Session::new(&m) {
            Err(e) => e.to_string(),
            Ok(s) => s.run(feeds).map(|_| String::from("ok")).unwrap_or_else(|e| e.to_string()),
        }
    };
    let u8s = |v: &[u8], shape: &[usize]| Tensor::from_vec(shape, v.to_vec()).unwrap();
    let sc = || Tensor::scalar(0.1f32);
    let z = || Tensor::scalar(0u8);
    // Mismatched types, non-scalar scales, shapes that do not broadcast.
    let e = run("QLinearAdd", MS_DOMAIN, vec![("a", u8s(&[1, 2], &[2])), ("as", sc()), ("az", z()), ("b", Tensor::from_vec(&[2], vec![1i8, 2]).unwrap()), ("bs", sc()), ("bz", Tensor::scalar(0i8)), ("cs", sc()), ("cz", z())], vec![]);
    assert!(e.contains("B must be uint8"), "{e}");
    let e = run("QLinearMul", MS_DOMAIN, vec![("a", u8s(&[1, 2], &[2])), ("as", Tensor::from_vec(&[2], vec![0.1f32, 0.2]).unwrap()), ("az", z()), ("b", u8s(&[1, 2], &[2])), ("bs", sc()), ("bz", z()), ("cs", sc()), ("cz", z())], vec![]);
    assert!(e.contains("A_scale must be a scalar"), "{e}");
    let e = run("QLinearAdd", MS_DOMAIN, vec![("a", u8s(&[1, 2], &[2])), ("as", sc()), ("az", z()), ("b", u8s(&[1, 2, 3], &[3])), ("bs", sc()), ("bz", z()), ("cs", sc()), ("cz", z())], vec![]);
    assert!(e.contains("cannot be broadcast"), "{e}");
    let e = run("QLinearSigmoid", MS_DOMAIN, vec![("x", Tensor::from_vec(&[2], vec![1.0f32, 2.0]).unwrap()), ("xs", sc()), ("xz", z()), ("ys", sc()), ("yz", z())], vec![]);
    assert!(e.contains("X must be uint8 or int8"), "{e}");
    let e = run("QLinearGlobalAveragePool", MS_DOMAIN, vec![("x", u8s(&[1, 2], &[2])), ("xs", sc()), ("xz", z()), ("ys", sc()), ("yz", z())], vec![]);
    assert!(e.contains("rank 3 or more"), "{e}");
    let e = run("QLinearGlobalAveragePool", MS_DOMAIN, vec![("x", u8s(&[1; 4], &[1, 1, 2, 2])), ("xs", Tensor::scalar(1000f32)), ("xz", z()), ("ys", sc()), ("yz", z())], vec![]);
    assert!(e.contains("computation range"), "{e}");
    let e = run("QLinearAveragePool", MS_DOMAIN, vec![("x", u8s(&[1; 4], &[1, 1, 2, 2])), ("xs", sc()), ("xz", z()), ("ys", sc()), ("yz", z())], vec![("kernel_shape", Attr::Ints(vec![3, 3]))]);
    assert!(e.contains("larger than the padded input"), "{e}");
    let e = run("QLinearAveragePool", MS_DOMAIN, vec![("x", u8s(&[1; 4], &[1, 1, 2, 2])), ("xs", sc()), ("xz", z()), ("ys", sc()), ("yz", z())], vec![]);
    assert!(e.contains("kernel_shape"), "{e}");
    let e = run("QLinearConcat", MS_DOMAIN, vec![("ys", sc()), ("yz", z()), ("x0", u8s(&[1, 2], &[1, 2])), ("s0", sc()), ("z0", z()), ("x1", u8s(&[1, 2, 3], &[1, 3])), ("s1", sc()), ("z1", z())], vec![("axis", Attr::Int(0))]);
    assert!(e.contains("cannot be concatenated"), "{e}");
    let e = run("QLinearConcat", MS_DOMAIN, vec![("ys", sc()), ("yz", z()), ("x0", u8s(&[1, 2], &[1, 2])), ("s0", sc())], vec![("axis", Attr::Int(0))]);
    assert!(e.contains("triples"), "{e}");
    let e = run("DynamicQuantizeLinear", "", vec![("x", u8s(&[1, 2], &[2]))], vec![]);
    assert!(e.contains("x must be float"), "{e}");
}
