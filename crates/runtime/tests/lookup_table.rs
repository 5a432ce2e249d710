//! QDQ units of pointwise ops (`DequantizeLinear -> op [-> Relu] -> QuantizeLinear`), which
//! sessions run as 256-entry lookup tables, give bit for bit the integers of the same units
//! run step by step in float (the plan runs with hooks use) and of ONNX Runtime running the
//! QDQ model: uint8 and int8, random qparams, every input byte and data large enough to be
//! split across threads. Chains of such units compose into one table, and a table after a
//! quantized convolution runs inside the convolution's kernels; both still match ONNX
//! Runtime.

use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor, ValueId, ValueType};
use qforge_runtime::{Hooks, Session, SessionOptions, ValueEvent, LOOKUP_TABLE};
use qforge_testkit::{int8_range as range, int8_tensor as q8, ort_run, Rng, TempDir};

/// Hooks that change nothing: runs with them take the unlowered plan.
struct Watch;

impl Hooks for Watch {
    fn on_value(&mut self, _: &ValueEvent, _: &Tensor) -> Option<Tensor> {
        None
    }
}

/// A pointwise op with its attributes and constant extra inputs.
struct Op {
    op: &'static str,
    attrs: Vec<(&'static str, Attr)>,
    extras: Vec<f32>,
}

fn op(op: &'static str) -> Op {
    Op { op, attrs: vec![], extras: vec![] }
}

/// `x -> DequantizeLinear -> op [-> Relu] -> QuantizeLinear -> y` with random per-tensor
/// qparams; the Relu's output zero point is the type minimum, so the lowering absorbs it.
fn unit(o: &Op, d: DType, x: Tensor, relu: bool, rng: &mut Rng) -> (Model, Vec<(String, Tensor)>) {
    let (lo, hi) = range(d);
    let mut g = Graph::new("g");
    let dims: Vec<i64> = x.shape().iter().map(|&v| v as i64).collect();
    let xv = g.add_input("x", Some(ValueType::tensor_of(d, &dims))).unwrap();
    let scale = |rng: &mut Rng| rng.pick(&[0.5f32, 0.125, 0.1, 0.037, 0.0213, 7.1e-3, 0.3, 1.7]);
    let xs = g.add_initializer("xs", Tensor::scalar(scale(rng))).unwrap();
    let xz = g.add_initializer("xz", q8(d, &[], &[rng.int(lo, hi)])).unwrap();
    let ys = g.add_initializer("ys", Tensor::scalar(scale(rng))).unwrap();
    let yz = g.add_initializer("yz", q8(d, &[], &[if relu { lo } else { rng.int(lo, hi) }])).unwrap();
    let value = |g: &mut Graph, name: &str| g.new_value(name, None).unwrap();
    let add = |g: &mut Graph, op: &str, inputs: Vec<ValueId>, out: ValueId, attrs: &[(&str, Attr)]| {
        let mut n = Node::new(op, format!("{op}_node")).with_outputs(vec![out]);
        n.inputs = inputs.into_iter().map(Some).collect();
        for (k, v) in attrs {
            n = n.with_attr(k, v.clone());
        }
        g.add_node(n).unwrap();
    };
    let f = value(&mut g, "f");
    add(&mut g, "DequantizeLinear", vec![xv, xs, xz], f, &[]);
    let extras: Vec<ValueId> = o.extras.iter().enumerate().map(|(i, &v)| g.add_initializer(format!("extra{i}"), Tensor::scalar(v)).unwrap()).collect();
    let mut h = value(&mut g, "h");
    add(&mut g, o.op, [vec![f], extras].concat(), h, &o.attrs);
    if relu {
        let r = value(&mut g, "r");
        add(&mut g, "Relu", vec![h], r, &[]);
        h = r;
    }
    let y = value(&mut g, "y");
    add(&mut g, "QuantizeLinear", vec![h, ys, yz], y, &[]);
    g.set_outputs(vec![y]).unwrap();
    let m = Model { ir_version: 10, opset_imports: vec![OpsetImport { domain: String::new(), version: 21 }], graph: g, ..Default::default() };
    (m, vec![("x".to_string(), x)])
}

#[test]
fn pointwise_units_run_as_lookup_tables_match_their_float_path_and_onnx_runtime() {
    let dir = TempDir::new("lut");
    let ops = || {
        vec![
            op("HardSwish"),
            Op { op: "HardSigmoid", attrs: vec![("alpha", Attr::Float(0.3)), ("beta", Attr::Float(0.6))], extras: vec![] },
            op("Tanh"),
            op("Erf"),
            op("Exp"),
            op("Log"),
            op("Sqrt"),
            Op { op: "Elu", attrs: vec![("alpha", Attr::Float(0.7))], extras: vec![] },
            op("Softplus"),
            op("Neg"),
            op("Abs"),
            op("Gelu"),
            op("Relu"),
            Op { op: "Clip", attrs: vec![], extras: vec![-0.5, 1.5] },
        ]
    };
    let mut total = 0;
    for d in [DType::U8, DType::I8] {
        let (lo, hi) = range(d);
        for (k, o) in ops().iter().enumerate() {
            for seed in 0..4u64 {
                let mut rng = Rng::new(1000 * k as u64 + seed);
                let big = seed == 3;
                let x = if big {
                    q8(d, &[3, 100_003], &(0..300_009).map(|_| rng.int(lo, hi)).collect::<Vec<_>>())
                } else {
                    q8(d, &[2, 128], &(lo..=hi).collect::<Vec<_>>())
                };
                let relu = seed == 2 && o.op != "Relu";
                let (m, feeds) = unit(o, d, x, relu, &mut rng);
                let what = format!("{} {d} seed {seed} relu {relu}", o.op);
                let s = Session::with_options(&m, SessionOptions { threads: if big { 2 } else { 1 } }).unwrap();
                let log = s.qdq_lowering().unwrap_or_else(|| panic!("{what}: not lowered"));
                assert!(log.lowered.iter().any(|l| l.into == LOOKUP_TABLE) && log.not_lowered.is_empty(), "{what}: {log:?}");
                let table = s.run(feeds.clone()).unwrap();
                let float = s.run_with_hooks(feeds.clone(), &mut Watch).unwrap();
                let path = dir.path().join("m.onnx");
                qforge_onnx::save(&m, &path).unwrap();
                let ort = ort_run(&path, &feeds, 1);
                let (a, b, c) = (table[0].1.to_i64_vec().unwrap(), float[0].1.to_i64_vec().unwrap(), ort[0].1.to_i64_vec().unwrap());
                assert_eq!(table[0].1.dtype(), d, "{what}");
                for i in 0..a.len() {
                    assert_eq!(a[i], b[i], "{what}: element {i} (x = {}): table vs float path", feeds[0].1.to_i64_vec().unwrap()[i]);
                    assert_eq!(a[i], c[i], "{what}: element {i} (x = {}): table vs ONNX Runtime", feeds[0].1.to_i64_vec().unwrap()[i]);
                }
                total += a.len();
            }
        }
    }
    println!("{total} elements bit-identical");
}

#[test]
fn lookup_table_refuses_bad_tables_and_inputs() {
    let mut g = Graph::new("g");
    let x = g.add_input("x", Some(ValueType::tensor_of(DType::U8, &[4]))).unwrap();
    let t = g.add_initializer("t", Tensor::from_vec(&[255], vec![0u8; 255]).unwrap()).unwrap();
    let y = g.new_value("y", None).unwrap();
    let mut n = Node::new(LOOKUP_TABLE, "lut").with_outputs(vec![y]);
    n.domain = qforge_runtime::RUNTIME_DOMAIN.into();
    n.inputs = vec![Some(x), Some(t)];
    g.add_node(n).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let m = Model { ir_version: 10, opset_imports: vec![OpsetImport { domain: String::new(), version: 21 }], graph: g, ..Default::default() };
    let err = Session::new(&m).err().expect("a 255-entry table is refused").to_string();
    assert!(err.contains("256 elements"), "{err}");
}

#[test]
fn qlinear_conv_lookup_refuses_bad_tables() {
    let bad = [(Tensor::from_vec(&[255], vec![0u8; 255]).unwrap(), "256 elements"), (Tensor::from_vec(&[256], vec![0f32; 256]).unwrap(), "uint8 or int8")];
    for (table, want) in bad {
        let mut g = Graph::new("g");
        let x = g.add_input("x", Some(ValueType::tensor_of(DType::U8, &[1, 2, 4, 4]))).unwrap();
        let inits = [
            ("xs", Tensor::scalar(0.1f32)),
            ("xz", Tensor::scalar(3u8)),
            ("w", Tensor::from_vec(&[2, 2, 1, 1], vec![1i8, 2, 3, 4]).unwrap()),
            ("ws", Tensor::scalar(0.01f32)),
            ("wz", Tensor::scalar(0i8)),
            ("ys", Tensor::scalar(0.2f32)),
            ("yz", Tensor::scalar(5u8)),
        ];
        let mut inputs = vec![Some(x)];
        for (name, t) in inits {
            inputs.push(Some(g.add_initializer(name, t).unwrap()));
        }
        inputs.push(None);
        inputs.push(Some(g.add_initializer("table", table).unwrap()));
        let y = g.new_value("y", None).unwrap();
        let mut n = Node::new(qforge_runtime::QLINEAR_CONV_LOOKUP, "conv").with_outputs(vec![y]);
        n.domain = qforge_runtime::RUNTIME_DOMAIN.into();
        n.inputs = inputs;
        g.add_node(n).unwrap();
        g.set_outputs(vec![y]).unwrap();
        let m = Model { ir_version: 10, opset_imports: vec![OpsetImport { domain: String::new(), version: 21 }], graph: g, ..Default::default() };
        let err = Session::new(&m).err().expect("a bad table is refused").to_string();
        assert!(err.contains(want) && err.contains("conv"), "{err}");
    }
}

/// `x -> hardswish as ONNX exporters decompose it -> y` in QDQ form, every intermediate
/// quantized with its own random per-tensor qparams:
/// `q(q(x * q(clip(q(x + 3), 0, 6))) * (1/6))`, plus a residual `q(y + x)` that reads `x` and
/// the chain. Every quantized value is a graph output: ONNX Runtime then fuses each unit into
/// its integer kernel, as qforge's lowering does before composing the chain (with the
/// intermediates internal, its optimizer rewrites the int8 chain otherwise and the output can
/// differ by one step).
fn hardswish_chain(d: DType, x: Tensor, rng: &mut Rng) -> Model {
    let (lo, hi) = range(d);
    let mut g = Graph::new("g");
    let dims: Vec<i64> = x.shape().iter().map(|&v| v as i64).collect();
    let xv = g.add_input("x", Some(ValueType::tensor_of(d, &dims))).unwrap();
    let mut params = 0;
    let mut qparams = |g: &mut Graph, rng: &mut Rng, scale: f32| {
        params += 1;
        let s = g.add_initializer(format!("s{params}"), Tensor::scalar(scale * rng.pick(&[0.9f32, 1.0, 1.13]))).unwrap();
        let z = g.add_initializer(format!("z{params}"), q8(d, &[], &[rng.int(lo / 4 + hi / 4, hi / 2)])).unwrap();
        (s, z)
    };
    let (xs, xz) = qparams(&mut g, rng, 0.05);
    let (lo_c, hi_c) = (g.add_initializer("zero", Tensor::scalar(0f32)).unwrap(), g.add_initializer("six", Tensor::scalar(6f32)).unwrap());
    let qdq = |g: &mut Graph, v: ValueId, p: (ValueId, ValueId), k: &mut usize| {
        *k += 1;
        let q = g.new_value(format!("q{k}"), None).unwrap();
        let mut qn = Node::new("QuantizeLinear", format!("Q_{k}")).with_outputs(vec![q]);
        qn.inputs = vec![Some(v), Some(p.0), Some(p.1)];
        g.add_node(qn).unwrap();
        let f = g.new_value(format!("f{k}"), None).unwrap();
        let mut dn = Node::new("DequantizeLinear", format!("DQ_{k}")).with_outputs(vec![f]);
        dn.inputs = vec![Some(q), Some(p.0), Some(p.1)];
        g.add_node(dn).unwrap();
        (q, f)
    };
    let plain = |g: &mut Graph, op: &str, inputs: Vec<ValueId>, k: &mut usize| {
        *k += 1;
        let out = g.new_value(format!("p{k}"), None).unwrap();
        let mut nd = Node::new(op, format!("{op}_p{k}")).with_outputs(vec![out]);
        nd.inputs = inputs.into_iter().map(Some).collect();
        g.add_node(nd).unwrap();
        out
    };
    // Constants quantized as quantizers write them: 100 steps of 0.03 and of 1/600.
    let constant = |g: &mut Graph, name: &str, scale: f32, k: &mut usize| {
        let q = g.add_initializer(format!("{name}_q"), q8(d, &[1], &[100])).unwrap();
        let s = g.add_initializer(format!("{name}_s"), Tensor::scalar(scale)).unwrap();
        let z = g.add_initializer(format!("{name}_z"), q8(d, &[], &[0])).unwrap();
        plain(g, "DequantizeLinear", vec![q, s, z], k)
    };
    let mut k = 0;
    let xf = plain(&mut g, "DequantizeLinear", vec![xv, xs, xz], &mut k);
    let three = constant(&mut g, "three", 0.03, &mut k);
    let sixth = constant(&mut g, "sixth", 1.0 / 600.0, &mut k);
    let p1 = qparams(&mut g, rng, 0.06);
    let a = plain(&mut g, "Add", vec![xf, three], &mut k);
    let (a_q, af) = qdq(&mut g, a, p1, &mut k);
    let p2 = qparams(&mut g, rng, 0.03);
    let c = plain(&mut g, "Clip", vec![af, lo_c, hi_c], &mut k);
    let (c_q, cf) = qdq(&mut g, c, p2, &mut k);
    let p3 = qparams(&mut g, rng, 0.2);
    let m = plain(&mut g, "Mul", vec![xf, cf], &mut k);
    let (m_q, mf) = qdq(&mut g, m, p3, &mut k);
    let p4 = qparams(&mut g, rng, 0.04);
    let s = plain(&mut g, "Mul", vec![mf, sixth], &mut k);
    let (y, yf) = qdq(&mut g, s, p4, &mut k);
    let p5 = qparams(&mut g, rng, 0.08);
    let r = plain(&mut g, "Add", vec![yf, xf], &mut k);
    let (res, _) = qdq(&mut g, r, p5, &mut k);
    g.set_outputs(vec![a_q, c_q, m_q, y, res]).unwrap();
    Model { ir_version: 10, opset_imports: vec![OpsetImport { domain: String::new(), version: 21 }], graph: g, ..Default::default() }
}

#[test]
fn chains_of_elementwise_integer_ops_over_one_value_compose_into_one_table_like_onnx_runtime() {
    let dir = TempDir::new("lut-chain");
    let mut total = 0;
    for d in [DType::U8, DType::I8] {
        let (lo, hi) = range(d);
        for seed in 0..6u64 {
            let mut rng = Rng::new(77 + seed);
            let big = seed >= 4;
            let x = if big {
                q8(d, &[1, 3, 301, 337], &(0..3 * 301 * 337).map(|_| rng.int(lo, hi)).collect::<Vec<_>>())
            } else {
                q8(d, &[2, 128], &(lo..=hi).collect::<Vec<_>>())
            };
            let m = hardswish_chain(d, x.clone(), &mut rng);
            let feeds = vec![("x".to_string(), x)];
            let what = format!("{d} seed {seed}");
            let s = Session::with_options(&m, SessionOptions { threads: if big { 2 } else { 1 } }).unwrap();
            let log = s.qdq_lowering().unwrap();
            let chain = ["Add_p4", "Clip_p6", "Mul_p8", "Mul_p10"];
            assert!(log.composed.iter().any(|c| chain.iter().all(|n| c.chain.iter().any(|x| x == n))), "{what}: the hardswish composes into one table: {log:?}");
            let ours = s.run(feeds.clone()).unwrap();
            let path = dir.path().join("m.onnx");
            qforge_onnx::save(&m, &path).unwrap();
            let ort = ort_run(&path, &feeds, 1);
            for (o, r) in ours.iter().zip(&ort) {
                let (a, b) = (o.1.to_i64_vec().unwrap(), r.1.to_i64_vec().unwrap());
                assert_eq!(a.len(), b.len(), "{what}: {}", o.0);
                for i in 0..a.len() {
                    assert_eq!(a[i], b[i], "{what}: output {} element {i} (x = {})", o.0, feeds[0].1.to_i64_vec().unwrap()[i]);
                }
                total += a.len();
            }
        }
    }
    println!("{total} elements bit-identical");
}

/// One convolution of [`conv_then_hardswish`]: input channels, output channels, group, input
/// height and width, kernel size, stride and padding (both axes).
type ConvCase = (usize, usize, usize, usize, usize, usize, usize, usize);

/// `x -> QLinearConv -> DequantizeLinear -> HardSwish -> QuantizeLinear -> y` over `batch`
/// images: activations of type `d` (`y` of type `y_type`) with random per-tensor qparams,
/// symmetric int8 weights with one scale per output channel and an int32 bias. Weights stay
/// within `[-64, 63]`, where ONNX Runtime's u8 x s8 kernels are exact on every x86 CPU.
fn conv_then_hardswish(d: DType, y_type: DType, batch: usize, c: &ConvCase, rng: &mut Rng) -> (Model, Vec<(String, Tensor)>) {
    let &(ci, co, group, ih, iw, k, stride, pad) = c;
    let (lo, hi) = range(d);
    let mut g = Graph::new("g");
    let xv = g.add_input("x", Some(ValueType::tensor_of(d, &[batch as i64, ci as i64, ih as i64, iw as i64]))).unwrap();
    let init = |g: &mut Graph, name: &str, t: Tensor| g.add_initializer(name, t).unwrap();
    let xs = init(&mut g, "xs", Tensor::scalar(rng.pick(&[0.02f32, 0.05, 0.013])));
    let xz = init(&mut g, "xz", q8(d, &[], &[rng.int(lo / 2, hi / 2)]));
    let w = (0..co * ci / group * k * k).map(|_| rng.int(-64, 63)).collect::<Vec<_>>();
    let wq = init(&mut g, "wq", q8(DType::I8, &[co, ci / group, k, k], &w));
    let ws = init(&mut g, "ws", Tensor::from_vec(&[co], (0..co).map(|_| rng.pick(&[0.01f32, 0.004, 0.02, 0.0071])).collect()).unwrap());
    let wz = init(&mut g, "wz", Tensor::from_vec(&[co], vec![0i8; co]).unwrap());
    let bias = init(&mut g, "bias", Tensor::from_vec(&[co], (0..co).map(|_| rng.int(-3000, 3000) as i32).collect()).unwrap());
    let s1 = init(&mut g, "s1", Tensor::scalar(rng.pick(&[0.03f32, 0.06, 0.11])));
    let z1 = init(&mut g, "z1", q8(d, &[], &[rng.int(lo, hi)]));
    let s2 = init(&mut g, "s2", Tensor::scalar(rng.pick(&[0.02f32, 0.05])));
    let (ylo, yhi) = range(y_type);
    let z2 = init(&mut g, "z2", q8(y_type, &[], &[rng.int(ylo, yhi)]));
    let add = |g: &mut Graph, op: &str, inputs: Vec<ValueId>, attrs: Vec<(&str, Attr)>| {
        let out = g.new_value(format!("{op}_out"), None).unwrap();
        let mut n = Node::new(op, format!("{op}_node")).with_outputs(vec![out]);
        n.inputs = inputs.into_iter().map(Some).collect();
        for (k, v) in attrs {
            n = n.with_attr(k, v);
        }
        g.add_node(n).unwrap();
        out
    };
    let attrs = vec![
        ("group", Attr::Int(group as i64)),
        ("kernel_shape", Attr::Ints(vec![k as i64; 2])),
        ("strides", Attr::Ints(vec![stride as i64; 2])),
        ("pads", Attr::Ints(vec![pad as i64; 4])),
    ];
    let conv = add(&mut g, "QLinearConv", vec![xv, xs, xz, wq, ws, wz, s1, z1, bias], attrs);
    let f = add(&mut g, "DequantizeLinear", vec![conv, s1, z1], vec![]);
    let h = add(&mut g, "HardSwish", vec![f], vec![]);
    let y = add(&mut g, "QuantizeLinear", vec![h, s2, z2], vec![]);
    g.set_outputs(vec![y]).unwrap();
    let x = q8(d, &[batch, ci, ih, iw], &(0..batch * ci * ih * iw).map(|_| rng.int(lo, hi)).collect::<Vec<_>>());
    let m = Model { ir_version: 10, opset_imports: vec![OpsetImport { domain: String::new(), version: 21 }], graph: g, ..Default::default() };
    (m, vec![("x".to_string(), x)])
}

#[test]
fn lookup_tables_after_convolutions_run_inside_them_like_onnx_runtime() {
    let dir = TempDir::new("lut-conv");
    // Pointwise over 7 panels of positions (split unevenly across 2 threads), dense 3 x 3,
    // depthwise with stride 2, depthwise 5 x 5 over two rows, a grouped convolution, and a
    // 7 x 7 image (too few positions for the NCHW kernels). Every other case has two images,
    // and every third a table whose type differs from the convolution's.
    let cases: [ConvCase; 6] = [
        (96, 128, 1, 14, 14, 1, 1, 0),
        (8, 24, 1, 20, 30, 3, 1, 1),
        (32, 32, 32, 33, 29, 3, 2, 1),
        (40, 40, 40, 2, 96, 5, 1, 2),
        (12, 18, 3, 16, 16, 3, 1, 1),
        (64, 48, 1, 7, 7, 1, 1, 0),
    ];
    let mut total = 0;
    for d in [DType::U8, DType::I8] {
        for (i, case) in cases.iter().enumerate() {
            let mut rng = Rng::new(500 + i as u64);
            let y_type = if i % 3 == 2 { if d == DType::U8 { DType::I8 } else { DType::U8 } } else { d };
            let (m, feeds) = conv_then_hardswish(d, y_type, 1 + i % 2, case, &mut rng);
            let path = dir.path().join("m.onnx");
            qforge_onnx::save(&m, &path).unwrap();
            let ort = ort_run(&path, &feeds, 1);
            for threads in [1, 2] {
                let what = format!("{d} -> {y_type} case {case:?} images {} threads {threads}", 1 + i % 2);
                let s = Session::with_options(&m, SessionOptions { threads }).unwrap();
                let log = s.qdq_lowering().unwrap();
                assert_eq!(log.tables_in_convs.len(), 1, "{what}: the HardSwish table runs inside the convolution: {log:?}");
                let ours = s.run(feeds.clone()).unwrap();
                assert_eq!(ours[0].1.dtype(), y_type, "{what}");
                let (a, b) = (ours[0].1.to_i64_vec().unwrap(), ort[0].1.to_i64_vec().unwrap());
                assert_eq!(a.len(), b.len(), "{what}");
                let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
                assert_eq!(differ, 0, "{what}: {differ} of {} outputs differ from ONNX Runtime's", a.len());
                total += a.len();
            }
        }
    }
    println!("{total} elements bit-identical");
}
