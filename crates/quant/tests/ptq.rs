//! Static PTQ end to end: golden QDQ structure on small graphs (conv-bn-relu, residual add,
//! concat sharing, fixed-qparams sigmoid, float-only node), qparams checked against the
//! observed data with ONNX Runtime's formulas, and the QDQ model's outputs in ONNX Runtime
//! equal to qforge's own execution of the same QDQ model on a real model.

use qforge_ir::{Attr, Graph, Model, Node, OpsetImport, Tensor, ValueId};
use qforge_quant::backend::BackendConfig;
use qforge_quant::pipeline::{quantize, QuantizeOptions, SampleSource};
use qforge_quant::qconfig::{QConfig, QConfigMapping, RangeName, TensorQConfig};
use qforge_quant::quantizer::{default_mapping, ConfigQuantizer};
use qforge_quant::report::Report;
use qforge_quant::{Convention, QScheme, QType};
use qforge_testkit::{compare, make_inputs, ort_run_qdq, ort_run_with, real_models, TempDir};

use qforge_testkit::noise;

fn model(g: Graph, opset: i64) -> Model {
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: opset }], graph: g, ..Default::default() }
}

fn op(g: &mut Graph, op: &str, name: &str, inputs: &[ValueId]) -> ValueId {
    let out = g.new_value(format!("{name}_out"), None).unwrap();
    g.add_node(Node::new(op, name).with_inputs(inputs.iter().copied()).with_outputs([out])).unwrap();
    out
}

fn weight(g: &mut Graph, name: &str, shape: &[usize], seed: u64) -> ValueId {
    let n = shape.iter().product();
    g.add_initializer(name, Tensor::from_vec(shape, noise(seed, n, -0.5, 0.5)).unwrap()).unwrap()
}

fn input(g: &mut Graph, name: &str, shape: &[i64]) -> ValueId {
    g.add_input(name, Some(qforge_ir::ValueType::tensor_of(qforge_ir::DType::F32, shape))).unwrap()
}

fn run(m: &Model, backend: &str, inputs: &[(&str, &[usize])]) -> (Model, Report) {
    let backend = BackendConfig::load(backend).unwrap();
    let mapping = default_mapping(&backend, RangeName::Minmax, true);
    let q = ConfigQuantizer { backend, mapping };
    let samples = qforge_testkit::seeded_feeds(inputs, 4);
    quantize(m, &q, &samples, &QuantizeOptions::default(), &mut |_, _| {}).unwrap()
}

/// Op types of the nodes reading value `name` of the main graph.
fn readers(m: &Model, name: &str) -> Vec<String> {
    let g = &m.graph;
    let v = g.value_by_name(name).unwrap_or_else(|| panic!("no value {name}"));
    g.consumers(v).iter().map(|(n, _)| g.node(*n).unwrap().op_type.clone()).collect()
}

/// The op type producing input `i` of the node named `node`.
fn producer_of_input(m: &Model, node: &str, i: usize) -> String {
    let g = &m.graph;
    let (_, n) = g.nodes().find(|(_, n)| n.name == node).unwrap_or_else(|| panic!("no node {node}"));
    let v = n.input(i).unwrap();
    match g.producer(v) {
        Some((p, _)) => g.node(p).unwrap().op_type.clone(),
        None => "initializer".into(),
    }
}

fn dq_scale(m: &Model, dq_output_of: &str) -> Vec<f32> {
    let g = &m.graph;
    let (_, n) = g.nodes().find(|(_, n)| n.op_type == "DequantizeLinear" && n.name.starts_with(dq_output_of)).unwrap_or_else(|| panic!("no DequantizeLinear for {dq_output_of}"));
    g.value(n.input(1).unwrap()).unwrap().initializer().unwrap().as_slice::<f32>().unwrap().to_vec()
}

#[test]
fn conv_bn_relu_is_one_unit_with_per_channel_weights_and_int32_bias() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 3, 8, 8]);
    let w = weight(&mut g, "w", &[4, 3, 3, 3], 1);
    let b = weight(&mut g, "b", &[4], 2);
    let c = op(&mut g, "Conv", "conv", &[x, w, b]);
    let bn: Vec<ValueId> = ["scale", "shift", "mean", "var"].iter().enumerate()
        .map(|(i, n)| g.add_initializer(*n, Tensor::from_vec(&[4], vec![0.5 + i as f32 * 0.25; 4]).unwrap()).unwrap()).collect();
    let y = op(&mut g, "BatchNormalization", "bn", &[c, bn[0], bn[1], bn[2], bn[3]]);
    let r = op(&mut g, "Relu", "relu", &[y]);
    g.set_outputs(vec![r]).unwrap();
    let (q, report) = run(&model(g, 13), "ort", &[("x", &[1, 3, 8, 8])]);
    q.graph.check().unwrap();
    assert_eq!(report.affine_folded, 1);
    assert_eq!(producer_of_input(&q, "conv", 0), "DequantizeLinear", "activation input through Q/DQ");
    assert_eq!(producer_of_input(&q, "conv", 1), "DequantizeLinear", "weight stored quantized");
    assert_eq!(producer_of_input(&q, "conv", 2), "DequantizeLinear", "bias stored quantized");
    assert_eq!(producer_of_input(&q, "relu", 0), "Conv", "no Q/DQ inside the fused Conv+Relu");
    assert_eq!(readers(&q, "relu_out_replaced"), vec!["QuantizeLinear"], "the unit's output is quantized");
    // The dequantized graph output keeps a float tensor type: ONNX's checker accepts the model.
    let tmp = TempDir::new("ptq_cbr");
    let path = tmp.path().join("cbr.onnx");
    qforge_onnx::save(&q, &path).unwrap();
    let check = qforge_testkit::oracle("onnx_check.py", &[path.as_os_str()]);
    assert!(check.status.success(), "onnx.checker: {}", String::from_utf8_lossy(&check.stdout));
    // Weight DQ is per axis 0 with one scale per output channel; bias scale = x scale * w scale.
    let g = &q.graph;
    let (_, wdq) = g.nodes().find(|(_, n)| n.op_type == "DequantizeLinear" && n.name.starts_with("conv.weight_folded")).unwrap();
    assert_eq!(wdq.attr_int("axis"), Some(0));
    let ws = dq_scale(&q, "conv.weight_folded");
    let bs = dq_scale(&q, "conv.bias_folded");
    let xs = dq_scale(&q, "x_DequantizeLinear")[0];
    assert_eq!(ws.len(), 4);
    for c in 0..4 {
        assert_eq!(bs[c], xs * ws[c], "bias scale of channel {c}");
    }
    let bq = g.value(g.value_by_name("conv.bias_folded_quantized").unwrap()).unwrap().initializer().unwrap().clone();
    assert_eq!(bq.dtype(), qforge_ir::DType::I32);
    // The input's qparams are ORT's compute_scale_zp of the observed range.
    let rec = report.activations.iter().find(|a| a.value == "x").unwrap();
    let (lo, hi) = rec.observed.unwrap();
    let want = QScheme::new(QType::U8, false, Convention::Ort).qparams(lo, hi);
    assert_eq!((rec.scale, rec.zero_point), (want.scale, want.zero_point));
}

/// Conv + BatchNormalization whose weight, bias and statistics are also graph inputs, as ONNX IR
/// version 3 required of every initializer: they are quantized as constants (BatchNormalization
/// folds, the weight is stored as int8), the report names them, the output lists only `x` as
/// an input, and its bytes equal those of the same model with plain initializers.
#[test]
fn initializers_listed_as_inputs_are_quantized_as_constants() {
    let build = |as_inputs: bool| {
        let mut g = Graph::new("g");
        let x = input(&mut g, "x", &[1, 3, 8, 8]);
        let constant = |g: &mut Graph, name: &str, t: Tensor| {
            if as_inputs {
                let v = g.add_input(name, None).unwrap();
                g.set_initializer(v, t).unwrap();
                v
            } else {
                g.add_initializer(name, t).unwrap()
            }
        };
        let w = constant(&mut g, "w", Tensor::from_vec(&[4, 3, 3, 3], noise(1, 108, -0.5, 0.5)).unwrap());
        let b = constant(&mut g, "b", Tensor::from_vec(&[4], noise(2, 4, -0.5, 0.5)).unwrap());
        let bn: Vec<ValueId> = ["scale", "shift", "mean", "var"].iter().enumerate()
            .map(|(i, n)| constant(&mut g, n, Tensor::from_vec(&[4], vec![0.5 + i as f32 * 0.25; 4]).unwrap())).collect();
        let c = op(&mut g, "Conv", "conv", &[x, w, b]);
        let y = op(&mut g, "BatchNormalization", "bn", &[c, bn[0], bn[1], bn[2], bn[3]]);
        g.set_outputs(vec![y]).unwrap();
        run(&model(g, 13), "ort", &[("x", &[1, 3, 8, 8])])
    };
    let (q, report) = build(true);
    assert_eq!(report.constant_inputs, ["w", "b", "scale", "shift", "mean", "var"]);
    assert_eq!(report.affine_folded, 1);
    assert_eq!(producer_of_input(&q, "conv", 1), "DequantizeLinear", "weight stored quantized");
    assert!(report.constants.iter().any(|c| c.dtype == "s8"), "an int8 weight");
    assert_eq!(q.graph.inputs().iter().map(|&v| q.graph.value_name(v)).collect::<Vec<_>>(), ["x"]);
    let (plain, plain_report) = build(false);
    assert!(plain_report.constant_inputs.is_empty());
    assert_eq!(qforge_onnx::to_bytes(&q).unwrap(), qforge_onnx::to_bytes(&plain).unwrap());
}

#[test]
fn residual_add_concat_sharing_fixed_sigmoid_and_float_nodes() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 4, 6, 6]);
    let w1 = weight(&mut g, "w1", &[4, 4, 1, 1], 3);
    let w2 = weight(&mut g, "w2", &[4, 4, 1, 1], 4);
    let a = op(&mut g, "Conv", "conv_a", &[x, w1]);
    let b = op(&mut g, "Conv", "conv_b", &[a, w2]);
    let add = op(&mut g, "Add", "add", &[a, b]);
    let cat_out = g.new_value("cat_out", None).unwrap();
    g.add_node(Node::new("Concat", "cat").with_inputs([a, add]).with_outputs([cat_out]).with_attr("axis", Attr::Int(1))).unwrap();
    let sig = op(&mut g, "Sigmoid", "sig", &[cat_out]);
    let w3 = weight(&mut g, "w3", &[4, 8, 1, 1], 5);
    let c = op(&mut g, "Conv", "conv_c", &[sig, w3]);
    let erf = op(&mut g, "Erf", "erf", &[c]);
    let head = op(&mut g, "Sigmoid", "head", &[c]);
    g.set_outputs(vec![erf, head]).unwrap();
    let m = model(g, 13);
    let (q, report) = run(&m, "x86", &[("x", &[1, 4, 6, 6])]);
    q.graph.check().unwrap();
    assert_eq!(producer_of_input(&q, "add", 0), "DequantizeLinear");
    assert_eq!(producer_of_input(&q, "add", 1), "DequantizeLinear");
    // Concat shares one observer between its inputs and its output.
    let group = |v: &str| report.activations.iter().find(|r| r.value == v).unwrap_or_else(|| panic!("{v} not quantized")).group;
    assert_eq!(group("conv_a_out"), group("add_out"), "concat inputs share qparams");
    assert_eq!(group("conv_a_out"), group("cat_out"), "concat output shares its inputs' qparams");
    let observed = report.activations.iter().find(|r| r.value == "cat_out").unwrap();
    let (lo, hi) = observed.observed.unwrap();
    // x86 activations are PyTorch's x86 qconfig's: quint8 with reduce_range, [0, 127].
    let want = QScheme { reduce_range: true, ..QScheme::new(QType::U8, false, Convention::PyTorch) }.qparams(lo, hi);
    assert_eq!((observed.scale, observed.zero_point), (want.scale, want.zero_point), "one range over all members");
    // Sigmoid's output has fixed qparams on x86: scale 1/256, zero point 0.
    let s = report.activations.iter().find(|r| r.value == "sig_out").unwrap();
    assert!(s.fixed);
    assert_eq!((s.scale, s.zero_point), (1.0 / 256.0, 0));
    // Erf has no quantized form: reported in float with the reason; it reads dequantized data.
    let erf_rec = report.nodes.iter().find(|n| n.name == "erf").unwrap();
    assert!(!erf_rec.quantized && erf_rec.reason.as_deref().unwrap().contains("no quantized pattern for Erf"), "{erf_rec:?}");
    assert_eq!(producer_of_input(&q, "erf", 0), "DequantizeLinear");
    // A Sigmoid read only by a graph output gains no integer kernel: float, with the reason.
    let head_rec = report.nodes.iter().find(|n| n.name == "head").unwrap();
    assert!(!head_rec.quantized && head_rec.reason.as_deref().unwrap().contains("only float nodes or graph outputs read its output"), "{head_rec:?}");
    // The graph output keeps its name and float type.
    assert_eq!(q.graph.value_name(q.graph.outputs()[0]), "erf_out");
}

/// The x86 target takes u8 activations within `[0, 127]` (PyTorch's x86 qconfig observes them
/// with `reduce_range`): a qconfig asking for the full `[0, 255]` leaves the Conv in float with
/// the constraint and its fix in the reason, and the same qconfig with `quant_range = [0, 127]`
/// quantizes it, with PyTorch's reduce-range qparams.
#[test]
fn x86_takes_seven_bit_activations_and_says_how_to_ask_for_them() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 4, 6, 6]);
    let w = weight(&mut g, "w", &[4, 4, 1, 1], 21);
    let c = op(&mut g, "Conv", "conv", &[x, w]);
    let r = op(&mut g, "Relu", "relu", &[c]);
    g.set_outputs(vec![r]).unwrap();
    let m = model(g, 13);
    let backend = BackendConfig::load("x86").unwrap();
    let samples = qforge_testkit::seeded_feeds(&[("x", &[1, 4, 6, 6])], 4);
    let with_range = |quant_range: Option<(i64, i64)>| {
        let mut weights = TensorQConfig::of(QType::S8);
        (weights.symmetric, weights.per_channel) = (true, true);
        let activation = TensorQConfig { quant_range, ..TensorQConfig::of(QType::U8) };
        let mapping = QConfigMapping::global(QConfig { activation: Some(activation), weight: Some(weights) });
        quantize(&m, &ConfigQuantizer { backend: backend.clone(), mapping }, &samples, &QuantizeOptions::default(), &mut |_, _| {}).unwrap().1
    };
    let full = with_range(None);
    let conv = full.nodes.iter().find(|n| n.name == "conv").unwrap();
    let why = conv.reason.as_deref().unwrap_or_default();
    assert!(!conv.quantized && why.contains("[0, 255] exceeds the target's [0, 127]") && why.contains("quant_range = [0, 127]"), "{conv:?}");
    let seven = with_range(Some((0, 127)));
    assert!(seven.nodes.iter().all(|n| n.quantized), "{:?}", seven.nodes);
    let default = run(&m, "x86", &[("x", &[1, 4, 6, 6])]).1;
    for report in [&seven, &default] {
        let input = report.activations.iter().find(|a| a.value == "x").unwrap();
        let (lo, hi) = input.observed.unwrap();
        let want = QScheme { reduce_range: true, ..QScheme::new(QType::U8, false, Convention::PyTorch) }.qparams(lo, hi);
        assert_eq!((input.scale, input.zero_point), (want.scale, want.zero_point));
        assert!(((hi.max(0.0) - lo.min(0.0)) / input.scale - 127.0).abs() < 1e-3, "the observed range spans 127 steps: {input:?}");
    }
}

/// A Concat of a Sigmoid's output and a Conv's output cannot share the Sigmoid's fixed [0, 1]
/// qparams: the Conv's values would be clamped. Its other input and its output share one group
/// over the observed range, and the Sigmoid's output keeps its fixed qparams, while a Reshape
/// of a Sigmoid's output (values still in [0, 1]) shares them.
#[test]
fn concat_of_a_fixed_qparams_output_and_a_wider_one_keeps_the_wider_range() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 4, 6, 6]);
    let w1 = weight(&mut g, "w1", &[4, 4, 1, 1], 6);
    let w2 = g.add_initializer("w2", Tensor::from_vec(&[4, 4, 1, 1], noise(7, 16, -4.0, 4.0)).unwrap()).unwrap();
    let a = op(&mut g, "Conv", "conv_a", &[x, w1]);
    let sig = op(&mut g, "Sigmoid", "sig", &[a]);
    let shape = g.add_initializer("shape", Tensor::from_vec(&[4], vec![1i64, 4, 6, 6]).unwrap()).unwrap();
    let flat = op(&mut g, "Reshape", "flat", &[sig, shape]);
    let b = op(&mut g, "Conv", "conv_b", &[x, w2]);
    let cat_out = g.new_value("cat_out", None).unwrap();
    g.add_node(Node::new("Concat", "cat").with_inputs([flat, b]).with_outputs([cat_out]).with_attr("axis", Attr::Int(1))).unwrap();
    let w3 = weight(&mut g, "w3", &[4, 8, 1, 1], 8);
    let c = op(&mut g, "Conv", "conv_c", &[cat_out, w3]);
    g.set_outputs(vec![c]).unwrap();
    let (q, report) = run(&model(g, 13), "x86", &[("x", &[1, 4, 6, 6])]);
    q.graph.check().unwrap();
    let rec = |v: &str| report.activations.iter().find(|r| r.value == v).unwrap_or_else(|| panic!("{v} not quantized"));
    for fixed in ["sig_out", "flat_out"] {
        assert!(rec(fixed).fixed && (rec(fixed).scale, rec(fixed).zero_point) == (1.0 / 256.0, 0), "{fixed}: {:?}", rec(fixed));
    }
    assert_eq!(rec("sig_out").group, rec("flat_out").group, "a Reshape of a [0, 1] output shares its fixed qparams");
    assert_eq!(rec("conv_b_out").group, rec("cat_out").group, "the Concat's other input shares with its output");
    assert_ne!(rec("conv_b_out").group, rec("sig_out").group);
    let cat = rec("cat_out");
    assert!(!cat.fixed);
    let (lo, hi) = cat.observed.unwrap();
    assert!(lo < -1.0 && hi > 1.0, "conv_b spans more than [0, 1]: {lo} {hi}");
    let want = QScheme { reduce_range: true, ..QScheme::new(QType::U8, false, Convention::PyTorch) }.qparams(lo, hi);
    assert_eq!((cat.scale, cat.zero_point), (want.scale, want.zero_point), "the Concat's qparams cover its observed range");
}

/// A Concat of two tensors whose ranges differ ~1000x quantizes the narrow one to a few levels
/// of the shared qparams; the report names that input, with its range and level count, and
/// not the wide one.
#[test]
fn concat_inputs_left_with_few_levels_are_reported() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 4, 6, 6]);
    let w1 = weight(&mut g, "w1", &[4, 4, 1, 1], 9);
    let w2 = g.add_initializer("w2", Tensor::from_vec(&[4, 4, 1, 1], noise(10, 16, -500.0, 500.0)).unwrap()).unwrap();
    let a = op(&mut g, "Conv", "conv_a", &[x, w1]);
    let b = op(&mut g, "Conv", "conv_b", &[x, w2]);
    let cat_out = g.new_value("cat_out", None).unwrap();
    g.add_node(Node::new("Concat", "cat").with_inputs([a, b]).with_outputs([cat_out]).with_attr("axis", Attr::Int(1))).unwrap();
    let w3 = weight(&mut g, "w3", &[4, 8, 1, 1], 11);
    let c = op(&mut g, "Conv", "conv_c", &[cat_out, w3]);
    g.set_outputs(vec![c]).unwrap();
    let (_, report) = run(&model(g, 13), "x86", &[("x", &[1, 4, 6, 6])]);
    assert_eq!(report.narrow_inputs.len(), 1, "{:?}", report.narrow_inputs);
    let r = &report.narrow_inputs[0];
    assert_eq!((r.node.as_str(), r.op.as_str(), r.value.as_str()), ("cat", "Concat", "conv_a_out"));
    let cat = report.activations.iter().find(|a| a.value == "cat_out").unwrap();
    let (lo, hi) = r.observed;
    assert!(lo < hi && r.output_range == cat.clip_range, "{r:?} {cat:?}");
    assert_eq!(r.levels, ((hi - lo) / cat.scale).floor() as u64 + 1);
    assert!(r.levels < 16);
    assert!(report.summary().contains("Concat 'cat' (g) quantizes its input 'conv_a_out'"), "{}", report.summary());
    assert!(report.widened.is_empty(), "x86 has no wider activation type: {:?}", report.widened);
}

/// On ONNX Runtime's target a MatMul of two activations reads both in the activation type:
/// its second input, a Conv's output, goes through that Conv's own u8 Q/DQ (one rounding,
/// shared), not through a second quantization of the float value.
#[test]
fn a_matmul_of_two_activations_reads_both_producers_quantized_outputs_on_ort() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 4, 4, 4]);
    let w1 = weight(&mut g, "w1", &[4, 4, 1, 1], 21);
    let w2 = weight(&mut g, "w2", &[4, 4, 1, 1], 22);
    let a = op(&mut g, "Conv", "conv_a", &[x, w1]);
    let b = op(&mut g, "Conv", "conv_b", &[x, w2]);
    let y = op(&mut g, "MatMul", "mm", &[a, b]);
    g.set_outputs(vec![y]).unwrap();
    let (q, _) = run(&model(g, 13), "ort", &[("x", &[1, 4, 4, 4])]);
    let g = &q.graph;
    let (_, mm) = g.nodes().find(|(_, n)| n.name == "mm").unwrap();
    let (dq, _) = g.producer(mm.input(1).unwrap()).unwrap();
    let (qn, _) = g.producer(g.node(dq).unwrap().input(0).unwrap()).unwrap();
    let qn = g.node(qn).unwrap();
    assert_eq!(qn.op_type, "QuantizeLinear");
    assert_eq!(g.value(qn.input(2).unwrap()).unwrap().initializer().unwrap().dtype(), qforge_ir::DType::U8);
    assert_eq!(producer_of_input(&q, &qn.name, 0), "Conv", "the Q reads the Conv's float output");
    assert_eq!(readers(&q, "conv_b_out"), ["QuantizeLinear"], "one Q/DQ for the Conv's output");
}

/// Attention over short rows: Score MatMul -> Softmax (float by default) -> MatMul. Both of the
/// Softmax's neighbours are quantized, so ONNX Runtime fuses DQ -> Softmax -> Q into its
/// QLinearSoftmax; the probabilities therefore take the ort target's fixed Softmax qparams
/// (1/256 from 0), with which that kernel is exact. With the observed range of these flat rows
/// (probabilities up to ~0.2, a scale near 1/1300) the kernel's float lookup overflows and
/// ONNX Runtime's output is garbage.
#[test]
fn probabilities_of_a_float_softmax_between_quantized_nodes_take_its_fixed_qparams() {
    let mut g = Graph::new("g");
    let q_in = input(&mut g, "q", &[1, 2, 8, 16]);
    let k_in = input(&mut g, "k", &[1, 2, 16, 6]);
    let v_in = input(&mut g, "v", &[1, 2, 6, 16]);
    let s = op(&mut g, "MatMul", "score", &[q_in, k_in]);
    let p = op(&mut g, "Softmax", "softmax", &[s]);
    let id = op(&mut g, "Identity", "prob", &[p]);
    let y = op(&mut g, "MatMul", "attend", &[id, v_in]);
    g.set_outputs(vec![y]).unwrap();
    let m = model(g, 13);
    let feed = |seed: u64| -> Vec<(String, Tensor)> {
        [("q", [1, 2, 8, 16], 0.1f32), ("k", [1, 2, 16, 6], 1.0), ("v", [1, 2, 6, 16], 1.0)].iter().enumerate()
            .map(|(i, (name, shape, r))| (name.to_string(), Tensor::from_vec(shape, noise(seed * 3 + i as u64, shape.iter().product(), -r, *r)).unwrap()))
            .collect()
    };
    let samples: Vec<_> = (1..5).map(feed).collect();
    let backend = BackendConfig::load("ort").unwrap();
    let quantizer = ConfigQuantizer { mapping: default_mapping(&backend, RangeName::Minmax, true), backend };
    let (q, report) = quantize(&m, &quantizer, &samples, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    let prob = report.activations.iter().find(|a| a.value == "prob_out").expect("the probabilities are quantized for the MatMul");
    assert!(prob.fixed && prob.scale == 1.0 / 256.0 && prob.zero_point == 0, "{prob:?}");
    assert!(report.activations.iter().any(|a| a.value == "score_out"), "the scores reach the Softmax quantized");

    let tmp = TempDir::new("ptq_softmax");
    let path = tmp.path().join("q.onnx");
    qforge_onnx::save(&q, &path).unwrap();
    let test = samples[0].clone();
    let want = qforge_runtime::Session::new(&m).unwrap().run(test.clone()).unwrap();
    let got = ort_run_with(&path, &test, 1, true);
    let (worst, ok) = compare(&got[0].1, &want[0].1, 0.0, 0.05);
    assert!(ok, "ONNX Runtime's fused output is {worst} from float");
}

/// A classifier head `Softmax(MatMul(x, W) + b)`: the MatMul and its bias Add become one Gemm
/// (int32 bias), whose logits stay float on the ort target because only the float Softmax reads
/// them; ONNX Runtime runs that Gemm as QGemm with a float output and matches qforge's own run
/// of the QDQ model. A MatMul whose output a quantized node reads keeps its output Q/DQ.
#[test]
fn a_classifier_head_becomes_a_gemm_with_float_logits() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[4, 24]);
    let w1 = weight(&mut g, "w1", &[24, 32], 1);
    let w2 = weight(&mut g, "w2", &[32, 10], 2);
    let b2 = weight(&mut g, "b2", &[10], 3);
    let hidden = op(&mut g, "MatMul", "hidden", &[x, w1]);
    let relu = op(&mut g, "Relu", "relu", &[hidden]);
    let logits = op(&mut g, "MatMul", "head", &[relu, w2]);
    let biased = op(&mut g, "Add", "head_bias", &[logits, b2]);
    let p = op(&mut g, "Softmax", "softmax", &[biased]);
    g.set_outputs(vec![p]).unwrap();
    let m = model(g, 13);
    let (q, report) = run(&m, "ort", &[("x", &[4, 24])]);
    assert_eq!(report.matmul_add_fused, 1);
    let (_, head) = q.graph.nodes().find(|(_, n)| n.name == "head").expect("the head keeps its name");
    assert_eq!(head.op_type, "Gemm");
    assert_eq!(producer_of_input(&q, "head", 0), "DequantizeLinear", "the head reads a quantized activation");
    let bias_dq = q.graph.producer(head.input(2).unwrap()).map(|(n, _)| q.graph.node(n).unwrap()).expect("the bias is dequantized");
    let bias_data = q.graph.value(bias_dq.input(0).unwrap()).unwrap().initializer().unwrap();
    assert_eq!(bias_data.dtype(), qforge_ir::DType::I32);
    assert_eq!(readers(&q, "head_bias_out"), ["Softmax"], "the logits reach the Softmax unquantized");
    assert!(report.activations.iter().all(|a| a.value != "head_bias_out"), "no observer on the logits");
    assert!(readers(&q, "hidden_out").contains(&"QuantizeLinear".to_string()), "the hidden MatMul's output, read by the quantized Relu/head, keeps its Q/DQ");

    let tmp = TempDir::new("ptq_head");
    let path = tmp.path().join("q.onnx");
    qforge_onnx::save(&q, &path).unwrap();
    let test = qforge_testkit::seeded_feeds(&[("x", &[4, 24])], 9).pop().unwrap();
    let (theirs, ops) = qforge_testkit::ort_run_fused_ops(&path, &test);
    assert!(ops.iter().any(|o| o == "QGemm") && !ops.iter().any(|o| o == "Gemm"), "ONNX Runtime runs the head as QGemm: {ops:?}");
    let ours = qforge_runtime::Session::new(&q).unwrap().run(test.clone()).unwrap();
    let (worst, ok) = compare(&ours[0].1, &theirs[0].1, 0.0, 1e-5);
    assert!(ok, "probabilities differ by {worst} between qforge and ONNX Runtime");
}

/// The xnnpack target (PyTorch's XNNPACK quantizer constraints): int8 asymmetric activations,
/// int8 symmetric weights on the narrow range [-127, 127], every scale at least 2^-12, and
/// ONNX Runtime runs the result with qforge's outputs within one activation step.
#[test]
fn xnnpack_target_is_symmetric_int8_with_its_constraints() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 3, 8, 8]);
    let w = weight(&mut g, "w", &[4, 3, 3, 3], 21);
    let b = weight(&mut g, "b", &[4], 22);
    let c = op(&mut g, "Conv", "conv", &[x, w, b]);
    let r = op(&mut g, "Relu", "relu", &[c]);
    let w2 = weight(&mut g, "w2", &[2, 4, 1, 1], 23);
    let y = op(&mut g, "Conv", "conv2", &[r, w2]);
    g.set_outputs(vec![y]).unwrap();
    let (q, report) = run(&model(g, 13), "xnnpack", &[("x", &[1, 3, 8, 8])]);
    let gq = &q.graph;
    let mut weights = 0;
    for (_, n) in gq.nodes().filter(|(_, n)| n.op_type == "DequantizeLinear") {
        let data = gq.value(n.input(0).unwrap()).unwrap();
        let scale = gq.value(n.input(1).unwrap()).unwrap().initializer().unwrap().as_slice::<f32>().unwrap().to_vec();
        let zp = gq.value(n.input(2).unwrap()).unwrap().initializer().unwrap().clone();
        match data.initializer() {
            Some(t) if t.dtype() == qforge_ir::DType::I8 => {
                weights += 1;
                assert!(t.to_i64_vec().unwrap().iter().all(|v| (-127..=127).contains(v)), "{}: weights on [-127, 127]", n.name);
                assert!(zp.to_i64_vec().unwrap().iter().all(|&z| z == 0), "{}: symmetric weights", n.name);
                assert!(scale.iter().all(|&s| s >= 2f32.powi(-12)), "{}: weight scale >= 2^-12", n.name);
            }
            Some(_) => {}
            None => {
                assert_eq!(zp.dtype(), qforge_ir::DType::I8, "{}: int8 activations", n.name);
                assert!(scale[0] >= 2f32.powi(-12), "{}: activation scale {} >= 2^-12", n.name, scale[0]);
            }
        }
    }
    assert_eq!(weights, 2, "both Conv weights stored as int8");
    let tmp = TempDir::new("ptq_xnn");
    let path = tmp.path().join("xnn.onnx");
    qforge_onnx::save(&q, &path).unwrap();
    let feed = vec![("x".to_string(), Tensor::from_vec(&[1, 3, 8, 8], noise(5, 192, -1.0, 1.0)).unwrap())];
    let ours = qforge_runtime::Session::new(&q).unwrap().run(feed.clone()).unwrap();
    let theirs = ort_run_qdq(&path, &feed, 1);
    let step = report.activations.iter().map(|a| a.scale).fold(0f32, f32::max);
    let (worst, ok) = compare(&ours[0].1, &theirs[0].1, 0.0, step as f64);
    assert!(ok, "qforge and ORT differ by {worst}, more than one step {step}");
}

#[test]
fn same_input_gives_the_same_bytes() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 3, 5, 5]);
    let w = weight(&mut g, "w", &[2, 3, 3, 3], 9);
    let c = op(&mut g, "Conv", "conv", &[x, w]);
    g.set_outputs(vec![c]).unwrap();
    let m = model(g, 11);
    let a = qforge_onnx::to_bytes(&run(&m, "ort", &[("x", &[1, 3, 5, 5])]).0).unwrap();
    let b = qforge_onnx::to_bytes(&run(&m, "ort", &[("x", &[1, 3, 5, 5])]).0).unwrap();
    assert_eq!(a, b);
    let q = run(&m, "ort", &[("x", &[1, 3, 5, 5])]).1;
    assert_eq!(q.opset, (11, 13), "per-axis weights raise the opset to 13");
}

/// A 3-D convolution (video, volumes) is quantized like a 2-D one: its weight per output
/// channel, its bias int32. qforge's integer convolution kernel computes 1-D and 2-D ones, so
/// the output check runs this unit as Q/DQ around the float kernel, and the quantized model's
/// outputs in ONNX Runtime equal qforge's own within one output quantization step.
#[test]
fn three_d_convolutions_are_quantized_and_checked() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 2, 4, 6, 6]);
    let w = weight(&mut g, "w", &[3, 2, 3, 3, 3], 21);
    let b = weight(&mut g, "b", &[3], 22);
    let c = op(&mut g, "Conv", "conv3d", &[x, w, b]);
    let r = op(&mut g, "Relu", "relu", &[c]);
    g.set_outputs(vec![r]).unwrap();
    let m = model(g, 13);
    let backend = BackendConfig::load("ort").unwrap();
    let mapping = default_mapping(&backend, RangeName::Minmax, true);
    let samples = qforge_testkit::seeded_feeds(&[("x", &[1, 2, 4, 6, 6])], 4);
    let opts = QuantizeOptions { check_samples: 2, ..QuantizeOptions::default() };
    let (q, report) = quantize(&m, &ConfigQuantizer { backend, mapping }, &samples, &opts, &mut |_, _| {}).unwrap();
    assert_eq!(producer_of_input(&q, "conv3d", 1), "DequantizeLinear", "weight stored quantized");
    assert_eq!(dq_scale(&q, "w").len(), 3, "one weight scale per output channel");
    assert!(report.output_check.is_some(), "the output check ran");
    ort_agrees_within_a_step(&q, &samples[0], "relu_out", "ptq_conv3d");
}

/// ONNX Runtime (fusions on) and qforge run the QDQ model `q` on `feed` to first outputs at
/// most one quantization step of the activation upstream of `output` apart.
fn ort_agrees_within_a_step(q: &Model, feed: &[(String, Tensor)], output: &str, tag: &str) {
    let tmp = TempDir::new(tag);
    let path = tmp.path().join("q.onnx");
    qforge_onnx::save(q, &path).unwrap();
    let ours = qforge_runtime::Session::new(q).unwrap().run(feed.to_vec()).unwrap();
    let theirs = ort_run_with(&path, feed, 1, true);
    let step = nearest_activation_step(q, output);
    let (worst, ok) = compare(&ours[0].1, &theirs[0].1, 0.0, step as f64 * 1.01);
    assert!(ok, "{tag}: qforge and ONNX Runtime differ by {worst} (step {step})");
}

/// The zero-point dtype and the number of scales of the DequantizeLinear feeding input `i` of
/// the node named `node`.
fn input_dq(m: &Model, node: &str, i: usize) -> (qforge_ir::DType, usize) {
    let g = &m.graph;
    let (_, n) = g.nodes().find(|(_, n)| n.name == node).unwrap_or_else(|| panic!("no node {node}"));
    let (p, _) = g.producer(n.input(i).unwrap()).unwrap_or_else(|| panic!("input {i} of {node} has no producer"));
    let dq = g.node(p).unwrap();
    assert_eq!(dq.op_type, "DequantizeLinear", "input {i} of {node}");
    let tensor = |k: usize| g.value(dq.input(k).unwrap()).unwrap().initializer().unwrap().clone();
    (tensor(2).dtype(), tensor(1).len())
}

/// On the `ort` target, a MatMul of two activations (attention's `Q x K^T`) quantizes both
/// to the activation type, u8, as ONNX Runtime's and PyTorch's quantizers do: a u8 x s8
/// product of two activations has no fitted weight to keep ONNX Runtime's 16-bit pair sums on
/// CPUs without VNNI from saturating. A batched constant weight (`[B, K, N]`) is quantized per
/// tensor: ONNX Runtime's QLinearMatMul takes a per-column zero point only for a 2-D weight
/// and fails at run time on a batched one. ONNX Runtime, with its fusions on, runs the model
/// and agrees with qforge's execution of it.
#[test]
fn activation_products_and_batched_weights_quantize_as_onnx_runtime_runs_them() {
    let mut g = Graph::new("g");
    let q = input(&mut g, "q", &[1, 4, 6, 8]);
    let k = input(&mut g, "k", &[1, 4, 8, 6]);
    let scores = op(&mut g, "MatMul", "scores", &[q, k]);
    let w = weight(&mut g, "w", &[1, 4, 6, 5], 31);
    let y = op(&mut g, "MatMul", "batched", &[scores, w]);
    g.set_outputs(vec![y]).unwrap();
    let m = model(g, 13);
    let backend = BackendConfig::load("ort").unwrap();
    let mapping = default_mapping(&backend, RangeName::Minmax, true);
    let samples = qforge_testkit::seeded_feeds(&[("q", &[1, 4, 6, 8]), ("k", &[1, 4, 8, 6])], 4);
    let (qm, _) = quantize(&m, &ConfigQuantizer { backend, mapping }, &samples, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    assert_eq!(input_dq(&qm, "scores", 0).0, qforge_ir::DType::U8);
    assert_eq!(input_dq(&qm, "scores", 1).0, qforge_ir::DType::U8, "the second activation takes the activation type");
    assert_eq!(input_dq(&qm, "batched", 1), (qforge_ir::DType::I8, 1), "a batched weight: s8, one scale");
    ort_agrees_within_a_step(&qm, &samples[1], "batched_out", "ptq_matmul");
}

/// The output check compares an integer output (ArgMax's indices) by exact match: the count
/// of equal elements over the checked samples, which the float and quantized models' own runs
/// give, and it is not reported as a float comparison.
#[test]
fn the_output_check_counts_equal_elements_of_integer_outputs() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 3, 6, 6]);
    let w = weight(&mut g, "w", &[5, 3, 3, 3], 41);
    let c = op(&mut g, "Conv", "conv", &[x, w]);
    let out = g.new_value("classes", None).unwrap();
    g.add_node(Node::new("ArgMax", "argmax").with_inputs([c]).with_outputs([out]).with_attr("axis", Attr::Int(1))).unwrap();
    g.set_outputs(vec![c, out]).unwrap();
    let m = model(g, 13);
    let backend = BackendConfig::load("ort").unwrap();
    let mapping = default_mapping(&backend, RangeName::Minmax, true);
    let samples = qforge_testkit::seeded_feeds(&[("x", &[1, 3, 6, 6])], 6);
    let opts = QuantizeOptions { check_samples: 6, ..QuantizeOptions::default() };
    let (q, report) = quantize(&m, &ConfigQuantizer { backend, mapping }, &samples, &opts, &mut |_, _| {}).unwrap();
    let check = report.output_check.as_ref().expect("the output check ran");
    let classes = check.outputs.iter().find(|o| o.name == "classes").expect("the integer output is checked");
    let conv = check.outputs.iter().find(|o| o.name == "conv_out").expect("the float output is checked");
    assert!(conv.exact.is_none() && conv.metrics.count == 6 * 5 * 16, "{conv:?}");
    let (float, quant) = (qforge_runtime::Session::new(&m).unwrap(), qforge_runtime::Session::new(&q).unwrap());
    let mut equal = 0;
    for feed in &samples {
        let (a, b) = (float.run(feed.clone()).unwrap(), quant.run(feed.clone()).unwrap());
        let (a, b) = (a[1].1.as_slice::<i64>().unwrap().to_vec(), b[1].1.as_slice::<i64>().unwrap().to_vec());
        equal += a.iter().zip(&b).filter(|(p, q)| p == q).count() as u64;
    }
    let exact = classes.exact.expect("compared by exact match");
    assert_eq!((exact.equal, exact.count), (equal, 6 * 16));
    assert!(check.summary().contains(&format!("output 'classes' (not float) against float on 6 calibration sample(s): {equal} of 96 elements equal")), "{}", check.summary());
}

/// The quantization step of the activation DequantizeLinear nearest upstream of value `name`.
fn nearest_activation_step(m: &Model, name: &str) -> f32 {
    let g = &m.graph;
    let mut frontier = vec![g.value_by_name(name).unwrap()];
    while let Some(v) = frontier.pop() {
        let Some((p, _)) = g.producer(v) else { continue };
        let n = g.node(p).unwrap();
        if n.op_type == "DequantizeLinear" && !g.value(n.input(0).unwrap()).unwrap().is_constant() {
            let s = g.value(n.input(1).unwrap()).unwrap().initializer().unwrap().as_slice::<f32>().unwrap().to_vec();
            assert_eq!(s.len(), 1, "activations are quantized per tensor");
            return s[0];
        }
        frontier.extend(n.inputs.iter().flatten());
    }
    panic!("no activation DequantizeLinear upstream of {name}")
}

/// The QDQ model passes ONNX's checker (full check), runs in ONNX Runtime with its fusions on
/// (QLinearConv, QGemm, ...: its integer kernels, which the weights fitted to its 16-bit pair
/// sums keep exact on every x86 CPU), and ORT's outputs equal qforge's own execution of the
/// same QDQ graph on the real models within 1 step of the nearest upstream activation
/// quantization scale (0 measured on an AVX2 CPU without VNNI: both compute the same integers,
/// and a float epilogue one ulp apart could at most flip one rounding).
#[test]
fn qdq_models_match_ort_on_real_models() {
    let tmp = TempDir::new("ptq");
    for m in real_models().into_iter().filter(|m| ["ocr_cls", "orientation"].contains(&m.name.as_str())) {
        let mut original = qforge_onnx::load(&m.path).unwrap();
        qforge_onnx::fold_constant_nodes(&mut original);
        let inputs = make_inputs(&original.graph, &m, 5);
        let samples: Vec<_> = (0..4).map(|s| make_inputs(&original.graph, &m, 10 + s)).collect();
        let backend = BackendConfig::load("ort").unwrap();
        let mapping = default_mapping(&backend, RangeName::Minmax, true);
        let (q, report) = quantize(&original, &ConfigQuantizer { backend, mapping }, &samples, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
        assert!(report.activations.len() > 50, "{}: {} activations", m.name, report.activations.len());
        let path = tmp.path().join(format!("{}.onnx", m.name));
        qforge_onnx::save(&q, &path).unwrap();
        let check = qforge_testkit::oracle("onnx_check.py", &[path.as_os_str()]);
        assert!(check.status.success(), "{}: onnx.checker rejects the QDQ model: {}", m.name, String::from_utf8_lossy(&check.stdout));
        let ours = qforge_runtime::Session::new(&q).unwrap().run(inputs.clone()).unwrap();
        let theirs = ort_run_with(&path, &inputs, 1, true);
        for ((name, a), (_, b)) in ours.iter().zip(&theirs) {
            let step = nearest_activation_step(&q, name);
            let (worst, ok) = compare(a, b, 0.0, step as f64);
            println!("{:<12} '{name}' qforge vs ORT on the QDQ model: max |diff| {worst:.2e} ({:.1} steps)", m.name, worst / step as f64);
            assert!(ok, "{} '{name}': max |diff| {worst}", m.name);
        }
    }
}

/// The default config keeps a BERT-class encoder's sentence embeddings (cosine >= 0.99 against
/// float, in ONNX Runtime): LayerNormalization, Softmax and the attention-mask arithmetic stay
/// float because nothing quantized feeds them.
#[test]
fn transformer_embeddings_survive_default_quantization() {
    let repo = qforge_testkit::repo();
    let path = repo.join("models/bert_tiny.onnx");
    let original = qforge_onnx::load(&path).unwrap();
    let batch = qforge_data::read_npz(&repo.join("models/bert_tiny_inputs.npz")).unwrap();
    let rows = batch[0].1.shape()[0];
    struct Rows(Vec<(String, Tensor)>, usize);
    impl SampleSource for Rows {
        fn len(&self) -> usize { self.1 }
        fn name(&self, i: usize) -> String { format!("row {i}") }
        fn load(&self, i: usize) -> Result<Vec<(String, Tensor)>, String> {
            Ok(self.0.iter().map(|(n, t)| {
                let len = t.shape()[1];
                let v = t.as_slice::<i64>().unwrap()[i * len..(i + 1) * len].to_vec();
                (n.clone(), Tensor::from_vec(&[1, len], v).unwrap())
            }).collect())
        }
    }
    let backend = BackendConfig::load("ort").unwrap();
    let mapping = default_mapping(&backend, RangeName::Minmax, true);
    let (q, report) = quantize(&original, &ConfigQuantizer { backend, mapping }, &Rows(batch.clone(), rows), &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    let quantized_matmuls = report.nodes.iter().filter(|n| n.quantized && n.op == "MatMul").count();
    assert!(quantized_matmuls >= 8, "only {quantized_matmuls} MatMul quantized");
    for n in report.nodes.iter().filter(|n| ["LayerNormalization", "Softmax"].contains(&n.op.as_str())) {
        assert!(!n.quantized, "{} {} was quantized", n.op, n.name);
    }
    let tmp = TempDir::new("bertq");
    let qpath = tmp.path().join("bert_q.onnx");
    qforge_onnx::save(&q, &qpath).unwrap();
    let (f, g) = (qforge_testkit::ort_run(&path, &batch, 1), qforge_testkit::ort_run(&qpath, &batch, 1));
    let (_, fe) = f.iter().find(|(n, _)| n == "sentence_embedding").unwrap();
    let (_, ge) = g.iter().find(|(n, _)| n == "sentence_embedding").unwrap();
    let dim = fe.shape()[1];
    let (a, b) = (fe.as_slice::<f32>().unwrap(), ge.as_slice::<f32>().unwrap());
    for r in 0..rows {
        let (x, y) = (&a[r * dim..(r + 1) * dim], &b[r * dim..(r + 1) * dim]);
        let dot: f32 = x.iter().zip(y).map(|(p, q)| p * q).sum();
        let cos = dot / (x.iter().map(|p| p * p).sum::<f32>().sqrt() * y.iter().map(|q| q * q).sum::<f32>().sqrt());
        println!("bert_tiny sentence {r}: cosine {cos:.6}");
        assert!(cos >= 0.99, "sentence {r}: cosine {cos}");
    }
}

/// If bodies are quantized: calibration sees values inside the branch that runs (including a
/// value the branch reads from the main graph, observed where it is defined), Q/DQ is inserted
/// inside the branch, and a branch calibration never reached stays float with the reason.
#[test]
fn if_branches_are_calibrated_and_quantized() {
    let branch = |name: &str, seed: u64| {
        let mut b = Graph::new(name);
        let x = b.add_outer("x").unwrap();
        let w = weight(&mut b, &format!("{name}_w"), &[2, 3, 1, 1], seed);
        let c = op(&mut b, "Conv", &format!("{name}_conv"), &[x, w]);
        let r = op(&mut b, "Relu", &format!("{name}_relu"), &[c]);
        b.set_outputs(vec![r]).unwrap();
        b
    };
    let mut g = Graph::new("g");
    let xm = input(&mut g, "x", &[1, 3, 4, 4]);
    let cond = g.add_initializer("cond", Tensor::from_bools(&[], &[true]).unwrap()).unwrap();
    let out = g.new_value("y", None).unwrap();
    g.add_node(Node::new("If", "if").with_inputs([cond]).with_outputs([out])
        .with_attr("then_branch", Attr::Graph(Box::new(branch("then", 11))))
        .with_attr("else_branch", Attr::Graph(Box::new(branch("else", 12))))).unwrap();
    // x is also quantized in the main graph: the branch's Q/DQ of x must not shadow it.
    let wm = weight(&mut g, "main_w", &[2, 3, 1, 1], 13);
    let main_out = op(&mut g, "Conv", "main_conv", &[xm, wm]);
    g.set_outputs(vec![out, main_out]).unwrap();
    let (q, report) = run(&model(g, 13), "ort", &[("x", &[1, 3, 4, 4])]);
    q.graph.check().unwrap();
    assert!(report.activations.iter().any(|a| a.graph == "g" && a.value == "x"), "x quantized in the main graph");
    let tmp = TempDir::new("ptq_if");
    let path = tmp.path().join("if.onnx");
    qforge_onnx::save(&q, &path).unwrap();
    let feed = vec![("x".to_string(), Tensor::from_vec(&[1, 3, 4, 4], noise(99, 48, -1.0, 1.0)).unwrap())];
    let ours = qforge_runtime::Session::new(&q).unwrap().run(feed.clone()).unwrap();
    let theirs = ort_run_qdq(&path, &feed, 1);
    let coarsest_step = report.activations.iter().map(|a| a.scale).fold(0f32, f32::max);
    for ((name, a), (_, b)) in ours.iter().zip(&theirs) {
        let (worst, ok) = compare(a, b, 0.0, coarsest_step as f64);
        assert!(ok, "'{name}': qforge and ORT differ by {worst}, more than one step {coarsest_step}");
    }
    let (_, node) = q.graph.nodes().find(|(_, n)| n.op_type == "If").unwrap();
    let then = node.attr("then_branch").and_then(|a| match a { Attr::Graph(b) => Some(b), _ => None }).unwrap();
    let conv = then.nodes().find(|(_, n)| n.op_type == "Conv").unwrap().1;
    for i in 0..2 {
        let (p, _) = then.producer(conv.input(i).unwrap()).unwrap();
        assert_eq!(then.node(p).unwrap().op_type, "DequantizeLinear", "then-branch Conv input {i}");
    }
    let x = report.activations.iter().find(|a| a.graph == "then" && a.value == "x").expect("outer x quantized inside the branch");
    assert!(x.observed.is_some_and(|(lo, hi)| lo < 0.0 && hi > 0.0), "{x:?}");
    assert!(report.activations.iter().any(|a| a.graph == "then" && a.value == "then_relu_out"));
    assert!(report.skipped.iter().any(|(graph, _, why)| graph == "else" && why.contains("calibration")), "{:?}", report.skipped);
}

/// Quantizes `g` (inputs `x` [1, 3, 4, 4] and a boolean `cond`; its subgraphs read the main
/// graph's initializers `shared_w` and `shared_b` as Conv weight and bias) and checks that the
/// float copies left the main graph, that each of the `convs` Convs of the subgraphs reads an s8
/// weight and an s32 bias behind DequantizeLinear in its own graph, and that ORT runs the result
/// like qforge, within one step of the coarsest activation, for both conditions.
fn assert_captured_weights_stored_quantized(g: Graph, convs: usize, tag: &str) {
    let backend = BackendConfig::load("ort").unwrap();
    let q = ConfigQuantizer { mapping: default_mapping(&backend, RangeName::Minmax, true), backend };
    let feed = |seed: u64, cond: bool| vec![
        ("x".to_string(), Tensor::from_vec(&[1, 3, 4, 4], noise(seed, 48, -1.0, 1.0)).unwrap()),
        ("cond".to_string(), Tensor::from_bools(&[], &[cond]).unwrap()),
    ];
    let samples: Vec<_> = (0..4).map(|s| feed(30 + s, s % 2 == 0)).collect();
    let (q, report) = quantize(&model(g, 13), &q, &samples, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    q.graph.check().unwrap();
    assert!(q.graph.value_by_name("shared_w").is_none() && q.graph.value_by_name("shared_b").is_none(), "{tag}: float copies left in the main graph");
    let mut seen = 0;
    for (path, sub) in q.graph.graphs() {
        for (_, conv) in sub.nodes().filter(|(_, n)| n.op_type == "Conv") {
            seen += 1;
            for (i, dtype) in [(1, qforge_ir::DType::I8), (2, qforge_ir::DType::I32)] {
                let (p, _) = sub.producer(conv.input(i).unwrap()).unwrap_or_else(|| panic!("{tag} {path:?}: Conv input {i} has no producer"));
                let dq = sub.node(p).unwrap();
                assert_eq!(dq.op_type, "DequantizeLinear", "{tag} {path:?}: Conv input {i}");
                let stored = sub.value(dq.input(0).unwrap()).unwrap();
                assert!(stored.is_constant() && stored.initializer().unwrap().dtype() == dtype, "{tag} {path:?}: Conv input {i} stored as {:?}", stored.initializer().map(|t| t.dtype()));
            }
        }
    }
    assert_eq!(seen, convs, "{tag}: Convs in the subgraphs");
    let tmp = TempDir::new("ptq_captured");
    let path = tmp.path().join(format!("{tag}.onnx"));
    qforge_onnx::save(&q, &path).unwrap();
    let coarsest_step = report.activations.iter().map(|a| a.scale).fold(0f32, f32::max);
    for cond in [true, false] {
        let inputs = feed(99, cond);
        let ours = qforge_runtime::Session::new(&q).unwrap().run(inputs.clone()).unwrap();
        let theirs = ort_run_qdq(&path, &inputs, 1);
        let (worst, ok) = compare(&ours[0].1, &theirs[0].1, 0.0, coarsest_step as f64);
        assert!(ok, "{tag}, cond {cond}: qforge and ORT differ by {worst}, more than one step {coarsest_step}");
    }
}

/// `Relu(Conv(x, shared_w, shared_b))` in `b`, capturing the weight and bias from the main graph.
fn captured_conv_relu(b: &mut Graph, name: &str, x: ValueId) -> ValueId {
    let mut captured = |name: &str| match b.value_by_name(name) {
        Some(v) => v,
        None => b.add_outer(name).unwrap(),
    };
    let (w, bias) = (captured("shared_w"), captured("shared_b"));
    let c = op(b, "Conv", &format!("{name}_conv"), &[x, w, bias]);
    op(b, "Relu", &format!("{name}_relu"), &[c])
}

/// A graph computing `captured_conv_relu` of the captured `x`.
fn captured_branch(name: &str) -> Graph {
    let mut b = Graph::new(name);
    let x = b.add_outer("x").unwrap();
    let r = captured_conv_relu(&mut b, name, x);
    b.set_outputs(vec![r]).unwrap();
    b
}

/// The main graph: `y = If(cond, then_branch, else_branch)` over `x`, with the shared 3 -> 3
/// channel 1x1 weight and bias as initializers.
fn if_over_shared_weights(then_branch: Graph, else_branch: Graph) -> Graph {
    let mut g = Graph::new("g");
    input(&mut g, "x", &[1, 3, 4, 4]);
    weight(&mut g, "shared_w", &[3, 3, 1, 1], 21);
    weight(&mut g, "shared_b", &[3], 22);
    let cond = g.add_input("cond", Some(qforge_ir::ValueType::tensor_of(qforge_ir::DType::Bool, &[]))).unwrap();
    let out = g.new_value("y", None).unwrap();
    g.add_node(Node::new("If", "if").with_inputs([cond]).with_outputs([out])
        .with_attr("then_branch", Attr::Graph(Box::new(then_branch)))
        .with_attr("else_branch", Attr::Graph(Box::new(else_branch)))).unwrap();
    g.set_outputs(vec![out]).unwrap();
    g
}

/// A Conv inside an If branch whose weight and bias are initializers of the main graph (as
/// torch exports with control flow write them, e.g. silero-vad's opset-18 export) gets them
/// stored quantized inside the branch, in both branches.
#[test]
fn weights_captured_from_the_enclosing_graph_are_stored_quantized_in_each_branch() {
    let g = if_over_shared_weights(captured_branch("then"), captured_branch("else"));
    assert_captured_weights_stored_quantized(g, 2, "one_level");
}

/// A weight read two subgraph levels below the graph that defines it (a Conv in an If nested in
/// an If branch) is stored quantized in the graph that reads it, like the one read a level up.
#[test]
fn weights_captured_two_levels_down_are_stored_quantized_where_they_are_read() {
    // then: Relu(Conv(x)) -> If(cond) { Relu(Conv(.)) } ; else: Relu(Conv(x)).
    let mut outer = Graph::new("outer");
    let x = outer.add_outer("x").unwrap();
    let cond = outer.add_outer("cond").unwrap();
    let first = captured_conv_relu(&mut outer, "outer", x);
    let first_name = outer.value(first).unwrap().name.clone();
    let inner = |name: &str| {
        let mut b = Graph::new(name);
        let h = b.add_outer(&first_name).unwrap();
        let r = captured_conv_relu(&mut b, name, h);
        b.set_outputs(vec![r]).unwrap();
        b
    };
    let inner_out = outer.new_value("inner_y", None).unwrap();
    outer.add_node(Node::new("If", "inner_if").with_inputs([cond]).with_outputs([inner_out])
        .with_attr("then_branch", Attr::Graph(Box::new(inner("inner_then"))))
        .with_attr("else_branch", Attr::Graph(Box::new(inner("inner_else"))))).unwrap();
    outer.set_outputs(vec![inner_out]).unwrap();
    let g = if_over_shared_weights(outer, captured_branch("else"));
    assert_captured_weights_stored_quantized(g, 4, "two_levels");
}

/// With one weight scale per tensor, an output channel ~1000x narrower than the widest keeps a
/// level or two of it: the report names the weight, how many channels and the fewest levels.
/// Per-channel weights (the default) give that channel its own scale and nothing is reported.
#[test]
fn per_tensor_weights_with_narrow_channels_are_reported() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 4, 6, 6]);
    let mut w = noise(12, 16, -0.5, 0.5);
    for v in &mut w[4..8] {
        *v *= 1e-3;
    }
    let w = g.add_initializer("w", Tensor::from_vec(&[4, 4, 1, 1], w).unwrap()).unwrap();
    let c = op(&mut g, "Conv", "conv", &[x, w]);
    let r = op(&mut g, "Relu", "relu", &[c]);
    g.set_outputs(vec![r]).unwrap();
    let m = model(g, 13);
    let backend = BackendConfig::load("x86").unwrap();
    let samples = qforge_testkit::seeded_feeds(&[("x", &[1, 4, 6, 6])], 4);
    for per_channel in [false, true] {
        let mapping = default_mapping(&backend, RangeName::Minmax, per_channel);
        let q = ConfigQuantizer { backend: backend.clone(), mapping };
        let (_, report) = quantize(&m, &q, &samples, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
        if per_channel {
            assert!(report.narrow_weight_channels.is_empty(), "{:?}", report.narrow_weight_channels);
            continue;
        }
        assert_eq!(report.narrow_weight_channels.len(), 1, "{:?}", report.narrow_weight_channels);
        let n = &report.narrow_weight_channels[0];
        assert_eq!((n.weight.as_str(), n.op.as_str(), n.narrow_channels, n.channels), ("w", "Conv", 1, 4), "{n:?}");
        assert!(n.fewest_levels <= 2, "{n:?}");
        assert!(report.summary().contains("weight 'w' of Conv 'conv'"), "{}", report.summary());
    }
}

/// Inserted Q/DQ never take a name an existing node has (ONNX keeps node and value names apart,
/// and ONNX Runtime refuses a model with two nodes of one name).
#[test]
fn inserted_nodes_never_reuse_an_existing_node_name() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 4, 6, 6]);
    let w = weight(&mut g, "w", &[4, 4, 1, 1], 31);
    let c = op(&mut g, "Conv", "conv", &[x, w]);
    let s = op(&mut g, "Sigmoid", "conv_out_QuantizeLinear", &[c]);
    let y = op(&mut g, "Add", "conv_out_DequantizeLinear", &[s, c]);
    g.set_outputs(vec![y]).unwrap();
    let (q, _) = run(&model(g, 13), "ort", &[("x", &[1, 4, 6, 6])]);
    let mut names: Vec<&str> = q.graph.nodes().map(|(_, n)| n.name.as_str()).collect();
    let count = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), count, "duplicate node names: {names:?}");
    assert!(q.graph.nodes().filter(|(_, n)| n.op_type == "QuantizeLinear").count() >= 2);
    let tmp = TempDir::new("ptq_names");
    let path = tmp.path().join("q.onnx");
    qforge_onnx::save(&q, &path).unwrap();
    let feed = qforge_testkit::seeded_feeds(&[("x", &[1, 4, 6, 6])], 1).remove(0);
    assert_eq!(ort_run_qdq(&path, &feed, 1).len(), 1, "ONNX Runtime loads and runs it");
}

/// `t` narrowed to float16 (the test's own conversion; the model's float16 reference output
/// comes from ONNX Runtime).
fn to_f16(t: &Tensor) -> Tensor {
    let v: Vec<half::f16> = t.to_f64_vec().unwrap().into_iter().map(half::f16::from_f64).collect();
    Tensor::from_vec(t.shape(), v).unwrap()
}

/// Signal-to-quantization-noise ratio of `got` against `want`, in dB.
fn sqnr_db(want: &Tensor, got: &Tensor) -> f64 {
    let (w, g) = (want.to_f64_vec().unwrap(), got.to_f64_vec().unwrap());
    let signal: f64 = w.iter().map(|x| x * x).sum();
    let noise: f64 = w.iter().zip(&g).map(|(a, b)| (a - b) * (a - b)).sum();
    10.0 * (signal / noise.max(1e-30)).log10()
}

/// A float16 model (tiny_cnn with its weights and interface in float16) is quantized as
/// the float32 model it approximates: its input and output stay float16, ONNX Runtime runs
/// it, and its output is as close to ONNX Runtime's float16 run of the float model as the
/// float32 model's quantized output is to the float32 model. Without the upcast, qforge
/// quantized none of its nodes.
#[test]
fn a_float16_model_is_quantized_computing_in_float32_behind_its_float16_interface() {
    let wide = qforge_onnx::load(&qforge_testkit::repo().join("examples/tiny_cnn.onnx")).unwrap();
    let mut narrow = wide.clone();
    let ids: Vec<_> = narrow.graph.values().map(|(id, _)| id).collect();
    for id in ids {
        if let Some(t) = narrow.graph.value(id).unwrap().initializer().cloned() {
            narrow.graph.set_initializer(id, to_f16(&t)).unwrap();
        }
        if let Some(qforge_ir::ValueType::Tensor { elem: Some(e), .. }) = narrow.graph.value_mut(id).unwrap().ty.as_mut() {
            *e = qforge_ir::DType::F16;
        }
    }
    let feeds = qforge_testkit::seeded_feeds(&[("x", &[1, 3, 32, 32])], 8);
    let narrow_feeds: Vec<Vec<(String, Tensor)>> = feeds.iter().map(|f| f.iter().map(|(n, t)| (n.clone(), to_f16(t))).collect()).collect();
    let backend = BackendConfig::load("ort").unwrap();
    let q = ConfigQuantizer { mapping: default_mapping(&backend, RangeName::Minmax, true), backend };
    let (qn, report) = quantize(&narrow, &q, &narrow_feeds, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    let (qw, _) = quantize(&wide, &q, &feeds, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    let up = report.upcast.as_ref().expect("the report says the model was upcast");
    assert_eq!((up.from.as_slice(), up.boundary.as_slice()), (&["float16".to_string()][..], &["x".to_string(), "probs".to_string()][..]), "{up:?}");
    assert!(up.constants == 6, "six float16 initializers widened: {up:?}");
    assert_eq!(report.nodes.iter().filter(|n| n.quantized && n.op == "Conv").count(), 2, "both Convs quantized");
    let tmp = TempDir::new("ptq-f16");
    let paths: Vec<_> = [("narrow", &narrow), ("qn", &qn), ("wide", &wide), ("qw", &qw)].into_iter().map(|(name, m)| {
        let p = tmp.path().join(format!("{name}.onnx"));
        qforge_onnx::save(m, &p).unwrap();
        p
    }).collect();
    for (f16_feed, f32_feed) in narrow_feeds.iter().zip(&feeds).take(3) {
        let float16 = ort_run_with(&paths[0], f16_feed, 1, true).remove(0).1;
        let quant16 = ort_run_with(&paths[1], f16_feed, 1, true).remove(0).1;
        let float32 = ort_run_with(&paths[2], f32_feed, 1, true).remove(0).1;
        let quant32 = ort_run_with(&paths[3], f32_feed, 1, true).remove(0).1;
        assert_eq!(quant16.dtype(), qforge_ir::DType::F16, "the output stays float16");
        let (s16, s32) = (sqnr_db(&float16, &quant16), sqnr_db(&float32, &quant32));
        println!("float16 model quantized: {s16:.1} dB against ONNX Runtime's float16 run; float32 model: {s32:.1} dB");
        assert!(s16 > s32 - 1.0 && s16 > 20.0, "float16: {s16:.1} dB, float32: {s32:.1} dB");
    }
}

/// A scalar constant of the main graph.
fn scalar(g: &mut Graph, name: &str, v: f32) -> ValueId {
    g.add_initializer(name, Tensor::from_vec(&[], vec![v]).unwrap()).unwrap()
}

/// Activations that a scalar Add, Clip or Mul computes from another observed one (a hardswish
/// written out, then an affine) are not observed: their ranges follow from the source's (with
/// `mse`, not through a scale by -0.4 or a shift by -0.3). The report names each one's map, and its observed
/// extremes equal those ONNX Runtime computes for the value on the calibration samples, with
/// `minmax` and `mse`.
#[test]
fn ranges_of_scalar_maps_of_an_observed_activation_follow_from_it() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 3, 8, 8]);
    let w = weight(&mut g, "w", &[4, 3, 3, 3], 21);
    let b = weight(&mut g, "b", &[4], 22);
    let y = op(&mut g, "Conv", "conv", &[x, w, b]);
    let three = scalar(&mut g, "three", 3.0);
    let a = op(&mut g, "Add", "gate_shift", &[y, three]);
    let (zero, six) = (scalar(&mut g, "zero", 0.0), scalar(&mut g, "six", 6.0));
    let c = op(&mut g, "Clip", "gate", &[a, zero, six]);
    let m = op(&mut g, "Mul", "swish", &[y, c]);
    let k = scalar(&mut g, "k", -0.4);
    let s = op(&mut g, "Mul", "scale", &[k, m]);
    let t = scalar(&mut g, "t", -0.3);
    let o = op(&mut g, "Add", "shift", &[s, t]);
    let w2 = weight(&mut g, "w2", &[2, 4, 1, 1], 23);
    let out = op(&mut g, "Conv", "conv2", &[o, w2]);
    g.set_outputs(vec![out]).unwrap();
    let float = model(g, 13);
    // The reference: every intermediate value as computed by ONNX Runtime.
    let tmp = TempDir::new("ptq_derived");
    let mut probe = float.clone();
    let names = ["conv_out", "gate_shift_out", "gate_out", "swish_out", "scale_out", "shift_out"];
    probe.graph.set_outputs(names.iter().map(|n| probe.graph.value_by_name(n).unwrap()).collect()).unwrap();
    let path = tmp.path().join("probe.onnx");
    qforge_onnx::save(&probe, &path).unwrap();
    let samples = qforge_testkit::seeded_feeds(&[("x", &[1, 3, 8, 8])], 4);
    let mut extremes = std::collections::HashMap::<String, (f32, f32)>::new();
    for feed in &samples {
        for (name, v) in qforge_testkit::ort_run(&path, feed, 1) {
            let e = extremes.entry(name).or_insert((f32::INFINITY, f32::NEG_INFINITY));
            for &x in v.as_slice::<f32>().unwrap() {
                *e = (e.0.min(x), e.1.max(x));
            }
        }
    }
    let backend = BackendConfig::load("ort").unwrap();
    for range in [RangeName::Minmax, RangeName::Mse] {
        let q = ConfigQuantizer { mapping: default_mapping(&backend, range, true), backend: backend.clone() };
        let (_, report) = quantize(&float, &q, &samples, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
        let record = |v: &str| report.activations.iter().find(|r| r.value == v).unwrap_or_else(|| panic!("{v} is not quantized"));
        let derived: Vec<(&str, Option<&str>)> = names.iter().map(|&n| (n, record(n).derived.as_deref())).collect();
        // A histogram's bins are not carried through a scale other than a power of two, or
        // a shift off the grid.
        let (scaled, shifted) = match range {
            RangeName::Minmax => (Some("swish_out * -0.4"), Some("swish_out * -0.4 - 0.3")),
            _ => (None, None),
        };
        assert_eq!(derived, [
            ("conv_out", None),
            // One group: the Clip's output shares its input's qparams.
            ("gate_shift_out", Some("min(max(conv_out + 3, 0), 6)")),
            ("gate_out", Some("min(max(conv_out + 3, 0), 6)")),
            ("swish_out", None),
            ("scale_out", scaled),
            ("shift_out", shifted),
        ], "{range:?}");
        for n in names {
            // The Clip's group observes what the Clip outputs.
            let of = if n == "gate_shift_out" { "gate_out" } else { n };
            let (want, got) = (extremes[of], record(n).observed.unwrap());
            let tolerance = 1e-5 * want.0.abs().max(want.1.abs()).max(1.0);
            assert!((want.0 - got.0).abs() <= tolerance && (want.1 - got.1).abs() <= tolerance, "{range:?} {n}: ONNX Runtime's extremes {want:?}, qforge's {got:?}");
        }
    }
}
