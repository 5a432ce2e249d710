//! The HTP quantizer end to end on the shared prepare/convert: golden Q/DQ structure on small
//! hand-built graphs (Concat sharing, int32 bias scales, fixed-qparams outputs, block-wise int4
//! weights, per-node overrides, fused Conv+Relu, rule replacement), the validator against every
//! constraint of the SoC table, and ONNX Runtime running every precision with outputs equal to
//! qforge's own execution of the QDQ model.
//!
//! Expected values are restated from their definitions (PyTorch's affine qparams, QNN's fixed
//! encodings, the brief's SoC facts), never read back from the quantizer.

use std::collections::HashMap;
use std::path::Path;

use qforge_ir::{Attr, DType, Graph, Model, Node, NodeId, OpsetImport, Tensor, ValueId, ValueType};
use qforge_quant::htp::rules;
use qforge_quant::htp::{HtpConfig, HtpOptions, HtpQuantizer, Precision, PrecisionOptions, SocTable};
use qforge_quant::pipeline::{quantize, QuantizeOptions, SampleSource};
use qforge_quant::backend::BackendConfig;
use qforge_quant::qconfig::RangeName;
use qforge_quant::quantizer::{default_mapping, ConfigQuantizer, Quantizer};
use qforge_quant::report::Report;
use qforge_testkit::{compare, make_inputs, ort_run_qdq, ort_run_with, repo, TempDir};

use qforge_testkit::noise;

/// Seeded uniform [-1, 1) calibration feeds of the given inputs.
type Seeded = Vec<Vec<(String, Tensor)>>;

fn seeded(inputs: &[(&str, &[usize])]) -> Seeded {
    qforge_testkit::seeded_feeds(inputs, 4)
}

fn model(g: Graph, opset: i64) -> Model {
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: opset }], graph: g, ..Default::default() }
}

fn op(g: &mut Graph, op: &str, name: &str, inputs: &[ValueId]) -> ValueId {
    let out = g.new_value(format!("{name}_out"), None).unwrap();
    g.add_node(Node::new(op, name).with_inputs(inputs.iter().copied()).with_outputs([out])).unwrap();
    out
}

fn weight(g: &mut Graph, name: &str, shape: &[usize], seed: u64, amplitude: f32) -> ValueId {
    g.add_initializer(name, Tensor::from_vec(shape, noise(seed, shape.iter().product(), -amplitude, amplitude)).unwrap()).unwrap()
}

fn input(g: &mut Graph, name: &str, shape: &[usize]) -> ValueId {
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    g.add_input(name, Some(ValueType::tensor_of(DType::F32, &dims))).unwrap()
}

fn htp(precision: Precision, soc: &str, config: Option<&str>) -> HtpQuantizer {
    let config = config.map(|c| HtpConfig::from_toml(c).unwrap());
    let options = HtpOptions { precision, precision_options: PrecisionOptions::default(), soc: Some(soc.into()) };
    HtpQuantizer::new(&options, config.as_ref()).unwrap()
}

fn run(m: &Model, q: &HtpQuantizer, samples: &Seeded) -> (Model, Report) {
    let (out, report) = quantize(m, q, samples, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    out.graph.check().unwrap();
    (out, report)
}

fn node_named<'a>(m: &'a Model, name: &str) -> &'a Node {
    m.graph.nodes().find(|(_, n)| n.name == name).unwrap_or_else(|| panic!("no node {name}")).1
}

fn init(m: &Model, v: ValueId) -> &Tensor {
    m.graph.value(v).unwrap().initializer().unwrap_or_else(|| panic!("{} is not an initializer", m.graph.value_name(v)))
}

/// The DequantizeLinear producing input `i` of node `node`.
fn dq_of_input<'a>(m: &'a Model, node: &str, i: usize) -> &'a Node {
    let v = node_named(m, node).input(i).unwrap();
    let (p, _) = m.graph.producer(v).unwrap_or_else(|| panic!("{node} input {i} has no producer"));
    let n = m.graph.node(p).unwrap();
    assert_eq!(n.op_type, "DequantizeLinear", "{node} input {i} is read from {}", n.op_type);
    n
}

/// (scale, zero point) of a DequantizeLinear.
fn dq_params<'a>(m: &'a Model, dq: &Node) -> (&'a Tensor, &'a Tensor) {
    (init(m, dq.input(1).unwrap()), init(m, dq.input(2).unwrap()))
}

/// The QuantizeLinear reading output 0 of node `node`.
fn q_of_output<'a>(m: &'a Model, node: &str) -> &'a Node {
    let v = node_named(m, node).output(0).unwrap();
    let (n, _) = m.graph.consumers(v).iter().find(|(n, _)| m.graph.node(*n).unwrap().op_type == "QuantizeLinear").unwrap_or_else(|| panic!("the output of {node} is not quantized"));
    m.graph.node(*n).unwrap()
}

/// PyTorch's affine qparams (`_calculate_qparams`, float32) over `[lo, hi]` for `[qmin, qmax]`.
fn torch_affine(lo: f32, hi: f32, qmin: i64, qmax: i64, eps: f32) -> (f32, i64) {
    let (lo, hi) = (lo.min(0.0), hi.max(0.0));
    let scale = ((hi - lo) / (qmax - qmin) as f32).max(eps);
    (scale, (qmin - (lo / scale).round_ties_even() as i64).clamp(qmin, qmax))
}

fn float_outputs(m: &Model, samples: &Seeded, i: usize) -> Vec<(String, Tensor)> {
    qforge_runtime::Session::new(m).unwrap().run(samples[i].clone()).unwrap()
}

#[test]
fn concat_inputs_and_output_share_one_scale() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 4, 6, 6]);
    let w1 = weight(&mut g, "w1", &[4, 4, 1, 1], 3, 0.5);
    let w2 = weight(&mut g, "w2", &[4, 4, 1, 1], 4, 2.0);
    let a = op(&mut g, "Conv", "conv_a", &[x, w1]);
    let b = op(&mut g, "Conv", "conv_b", &[x, w2]);
    let cat = g.new_value("cat_out", None).unwrap();
    g.add_node(Node::new("Concat", "cat").with_inputs([a, b]).with_outputs([cat]).with_attr("axis", Attr::Int(1))).unwrap();
    g.set_outputs(vec![cat]).unwrap();
    let m = model(g, 13);
    let samples = seeded(&[("x", &[1, 4, 6, 6])]);
    // The range of the concatenation over the calibration samples, from the float model.
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for i in 0..samples.len() {
        for &v in float_outputs(&m, &samples, i)[0].1.as_slice::<f32>().unwrap() {
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    for (precision, qmax, eps) in [(Precision::A8W8, 255, 2f32.powi(-12)), (Precision::A16W8, 65535, 2f32.powi(-20))] {
        let (q, _) = run(&m, &htp(precision, "v75", None), &samples);
        let want = torch_affine(lo, hi, 0, qmax, eps);
        for i in 0..2 {
            let (s, z) = dq_params(&q, dq_of_input(&q, "cat", i));
            assert_eq!((s.as_slice::<f32>().unwrap()[0], z.to_i64_vec().unwrap()[0]), want, "{precision}: concat input {i}");
        }
        let (s, z) = dq_params(&q, q_of_output(&q, "cat"));
        assert_eq!((s.as_slice::<f32>().unwrap()[0], z.to_i64_vec().unwrap()[0]), want, "{precision}: concat output");
    }
}

/// Per-channel symmetric weights and int32 bias; weights far below 2^-12 (as BatchNormalization
/// folding leaves them) keep their own scales.
#[test]
fn bias_scale_is_input_scale_times_weight_scale_per_channel() {
    let samples = seeded(&[("x", &[1, 3, 8, 8])]);
    for (precision, amplitude) in [(Precision::A8W8, 0.5), (Precision::A16W8, 0.5), (Precision::A16W16, 0.5), (Precision::A8W8, 1e-5), (Precision::A16W8, 1e-5)] {
        let mut g = Graph::new("g");
        let x = input(&mut g, "x", &[1, 3, 8, 8]);
        let w = weight(&mut g, "w", &[4, 3, 3, 3], 1, amplitude);
        let b = weight(&mut g, "b", &[4], 2, amplitude);
        let y = op(&mut g, "Conv", "conv", &[x, w, b]);
        g.set_outputs(vec![y]).unwrap();
        let m = model(g, 13);
        let wdata = init(&m, w).as_slice::<f32>().unwrap().to_vec();
        let (q, report) = run(&m, &htp(precision, "v75", None), &samples);
        assert!(report.bias_adjusted.is_empty(), "no bias here needs a larger weight scale");
        let wdq = dq_of_input(&q, "conv", 1);
        assert_eq!(wdq.attr_int("axis"), Some(0), "{precision}: weights per output channel");
        let ws = dq_params(&q, wdq).0.as_slice::<f32>().unwrap().to_vec();
        let narrow = precision.weight().range().1 as f32;
        for (c, &s) in ws.iter().enumerate() {
            let amax = wdata[c * 27..(c + 1) * 27].iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(s, amax / narrow, "{precision}, amplitude {amplitude}: weight scale of channel {c} (symmetric on [-{narrow}, {narrow}])");
        }
        let xs = dq_params(&q, dq_of_input(&q, "conv", 0)).0.as_slice::<f32>().unwrap()[0];
        let bdq = dq_of_input(&q, "conv", 2);
        assert_eq!(init(&q, bdq.input(0).unwrap()).dtype(), DType::I32, "{precision}: int32 bias");
        let bs = dq_params(&q, bdq).0.as_slice::<f32>().unwrap().to_vec();
        assert_eq!(bs.len(), 4);
        for c in 0..4 {
            assert_eq!(bs[c], xs * ws[c], "{precision}: bias scale of channel {c}");
        }
    }
}

/// Single-head attention over `x [2, 6, 8]` with an additive mask `[2, 1, 6]` in front of the
/// Softmax, and calibration feeds whose mask hides the last two keys of the second sequence
/// with `mask_value` (0 elsewhere).
fn masked_attention(mask_value: f32) -> (Model, Seeded) {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[2, 6, 8]);
    let mask = input(&mut g, "mask", &[2, 1, 6]);
    let (wq, wk, wv) = (weight(&mut g, "wq", &[8, 8], 11, 1.5), weight(&mut g, "wk", &[8, 8], 12, 1.5), weight(&mut g, "wv", &[8, 8], 13, 1.0));
    let q = op(&mut g, "MatMul", "q", &[x, wq]);
    let k = op(&mut g, "MatMul", "k", &[x, wk]);
    let v = op(&mut g, "MatMul", "v", &[x, wv]);
    let kt = g.new_value("kt", None).unwrap();
    g.add_node(Node::new("Transpose", "kt").with_inputs([k]).with_outputs([kt]).with_attr("perm", Attr::Ints(vec![0, 2, 1]))).unwrap();
    let scores = op(&mut g, "MatMul", "scores", &[q, kt]);
    let masked = op(&mut g, "Add", "masked", &[scores, mask]);
    let probs = g.new_value("probs", None).unwrap();
    g.add_node(Node::new("Softmax", "softmax").with_inputs([masked]).with_outputs([probs]).with_attr("axis", Attr::Int(-1))).unwrap();
    let out = op(&mut g, "MatMul", "context", &[probs, v]);
    g.set_outputs(vec![out]).unwrap();
    let mut hide = vec![0f32; 12];
    hide[10] = mask_value;
    hide[11] = mask_value;
    let samples = seeded(&[("x", &[2, 6, 8])]).into_iter().map(|mut feed| {
        feed.push(("mask".into(), Tensor::from_vec(&[2, 1, 6], hide.clone()).unwrap()));
        feed
    }).collect();
    (model(g, 13), samples)
}

#[test]
fn attention_mask_values_saturate_below_every_softmax_row() {
    // Softmax weighs an input by exp(x - row max): the mask's -10000, float minimum or -inf
    // only has to land far enough below every row's maximum. Quantizing the masked scores over
    // their whole range instead leaves every real score on one or two integer levels, and a
    // -inf mask over its finite range [0, 0] saturates at 0: unmasked.
    for mask_value in [-10000.0, f32::MIN, f32::NEG_INFINITY] {
        let (m, samples) = masked_attention(mask_value);
        for precision in [Precision::A8W8, Precision::A16W8] {
            let (q, _) = run(&m, &htp(precision, "v75", None), &samples);
            let (s, z) = dq_params(&q, dq_of_input(&q, "softmax", 0));
            let (s, z) = (s.as_slice::<f32>().unwrap()[0], z.to_i64_vec().unwrap()[0]);
            // HTP activations are unsigned: integer 0 is the range's lower end.
            let lowest = -(z as f32) * s;
            // The least row maximum of the masked scores, from the float model.
            let mut least_row_max = f32::INFINITY;
            let mut worst = 0f32;
            for (i, feed) in samples.iter().enumerate() {
                let mut probe = m.clone();
                let masked = probe.graph.value_by_name("masked_out").unwrap();
                probe.graph.set_outputs(vec![masked]).unwrap();
                let scores = qforge_runtime::Session::new(&probe).unwrap().run(feed.clone()).unwrap().remove(0).1;
                for row in scores.as_slice::<f32>().unwrap().chunks(6) {
                    least_row_max = least_row_max.min(row.iter().copied().fold(f32::NEG_INFINITY, f32::max));
                }
                let want = float_outputs(&m, &samples, i).remove(0).1;
                let got = qforge_runtime::Session::new(&q).unwrap().run(feed.clone()).unwrap().remove(0).1;
                let peak = want.as_slice::<f32>().unwrap().iter().fold(0f32, |a, v| a.max(v.abs()));
                for (a, b) in want.as_slice::<f32>().unwrap().iter().zip(got.as_slice::<f32>().unwrap()) {
                    worst = worst.max((a - b).abs() / peak);
                }
            }
            assert!((lowest - (least_row_max - 16.0)).abs() <= 2.0 * s, "{precision} mask {mask_value}: range starts at {lowest}, want {} (least row max {least_row_max} - 16)", least_row_max - 16.0);
            // The mask itself needs no level below where the sum saturates: its scale stays
            // of the scores' order (over [f32::MIN, 0], 8 bits would step 1.3e36, and the
            // integer Add's scale ratio would overflow).
            let (mask_scale, _) = dq_params(&q, dq_of_input(&q, "masked", 1));
            assert!(mask_scale.as_slice::<f32>().unwrap()[0] < 1.0, "{precision} mask {mask_value}: mask scale {mask_scale:?}");
            // Without the floors: 0.94-0.95 of the peak for -10000 and the float minimum
            // (0.029 for -10000 at 16 bits), 1.19 for -inf.
            let bound = if precision == Precision::A8W8 { 0.08 } else { 0.03 };
            assert!(worst < bound, "{precision} mask {mask_value}: context off by {worst} of its peak");
        }
    }
}

#[test]
fn sigmoid_and_tanh_outputs_have_fixed_qparams() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 2, 4, 4]);
    let w = weight(&mut g, "w", &[2, 2, 1, 1], 5, 3.0);
    let c = op(&mut g, "Conv", "conv", &[x, w]);
    let s = op(&mut g, "Sigmoid", "sig", &[c]);
    let t = op(&mut g, "Tanh", "tanh", &[c]);
    g.set_outputs(vec![s, t]).unwrap();
    let m = model(g, 13);
    let samples = seeded(&[("x", &[1, 2, 4, 4])]);
    // QNN encodings: sigmoid scale 1/2^bits with offset 0; tanh covers [-1, 1] with the zero
    // point in the middle of the unsigned range.
    let cases = [
        (Precision::A8W8, DType::U8, (1.0 / 256.0, 0), (1.0 / 128.0, 128)),
        (Precision::A16W8, DType::U16, (1.0 / 65536.0, 0), (1.0 / 32768.0, 32768)),
    ];
    for (precision, dtype, sigmoid, tanh) in cases {
        let (q, report) = run(&m, &htp(precision, "v75", None), &samples);
        for (value, want) in [("sig_out", sigmoid), ("tanh_out", tanh)] {
            let (s, z) = dq_params(&q, q_of_output(&q, value.trim_end_matches("_out")));
            assert_eq!(z.dtype(), dtype, "{precision} {value}");
            assert_eq!((s.as_slice::<f32>().unwrap()[0], z.to_i64_vec().unwrap()[0]), want, "{precision} {value}");
            assert!(report.activations.iter().any(|a| a.value == value && a.fixed), "{precision} {value} is reported fixed");
        }
    }
}

#[test]
fn block_wise_weights_are_int4_with_block_size() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 128]);
    let w = weight(&mut g, "w", &[128, 8], 7, 1.0);
    let y = op(&mut g, "MatMul", "mm", &[x, w]);
    let xc = input(&mut g, "xc", &[1, 96, 2, 2]);
    let wc = weight(&mut g, "wc", &[4, 96, 1, 1], 8, 1.0);
    let yc = op(&mut g, "Conv", "conv", &[xc, wc]);
    let wd = weight(&mut g, "wd", &[96, 1, 1, 1], 10, 1.0);
    let yd = g.new_value("dw_out", None).unwrap();
    g.add_node(Node::new("Conv", "dw").with_inputs([xc, wd]).with_outputs([yd]).with_attr("group", Attr::Int(96))).unwrap();
    g.set_outputs(vec![y, yc, yd]).unwrap();
    let m = model(g, 17);
    let wdata = init(&m, w).as_slice::<f32>().unwrap().to_vec();
    let samples = seeded(&[("x", &[1, 128]), ("xc", &[1, 96, 2, 2])]);
    for block in [64, 32] {
        let options = HtpOptions { precision: Precision::A16W4Block, precision_options: PrecisionOptions { block_size: block, ..Default::default() }, soc: Some("v73".into()) };
        let (q, report) = run(&m, &HtpQuantizer::new(&options, None).unwrap(), &samples);
        assert_eq!(report.opset.1, 21, "block-wise and 4-bit Q/DQ need opset 21");
        // MatMul [K=128, N=8]: blocks along K (axis 0).
        let dq = dq_of_input(&q, "mm", 1);
        assert_eq!((dq.attr_int("axis"), dq.attr_int("block_size")), (Some(0), Some(block as i64)));
        let data = init(&q, dq.input(0).unwrap());
        assert_eq!(data.dtype(), DType::I4);
        assert!(data.packed_ints().unwrap().iter().all(|v| (-7..=7).contains(v)), "narrow int4 range");
        let scales = dq_params(&q, dq).0;
        assert_eq!(scales.shape(), &[128 / block, 8]);
        let s = scales.as_slice::<f32>().unwrap();
        for blk in 0..128 / block {
            for n in 0..8 {
                let amax = (blk * block..(blk + 1) * block).fold(0f32, |m, k| m.max(wdata[k * 8 + n].abs()));
                assert_eq!(s[blk * 8 + n], amax / 7.0, "block {blk}, column {n}");
            }
        }
        // Conv [M=4, C=96, 1, 1]: blocks along the input channels (axis 1), the last one partial.
        let dq = dq_of_input(&q, "conv", 1);
        assert_eq!((dq.attr_int("axis"), dq.attr_int("block_size")), (Some(1), Some(block as i64)));
        assert_eq!(dq_params(&q, dq).0.shape(), &[4, 96usize.div_ceil(block), 1, 1]);
        // A depthwise Conv's single input channel fits in one block: int4 per output channel.
        let dq = dq_of_input(&q, "dw", 1);
        assert_eq!((dq.attr_int("axis"), dq.attr_int("block_size")), (Some(0), None));
        assert_eq!(init(&q, dq.input(0).unwrap()).dtype(), DType::I4);
        // Activations are 16-bit.
        assert_eq!(dq_params(&q, dq_of_input(&q, "mm", 0)).1.dtype(), DType::U16);
    }
    // 16a4w: int4 per output channel, no blocks.
    let (q, _) = run(&m, &htp(Precision::A16W4, "v75", None), &samples);
    let dq = dq_of_input(&q, "mm", 1);
    assert_eq!((dq.attr_int("axis"), dq.attr_int("block_size")), (Some(1), None));
    assert_eq!(init(&q, dq.input(0).unwrap()).dtype(), DType::I4);
}

/// conv0 -> relu0 -> conv1 -> relu1 -> conv2, with an override on conv1.
fn conv_chain() -> (Model, Seeded) {
    let mut g = Graph::new("g");
    let mut x = input(&mut g, "x", &[1, 3, 6, 6]);
    for i in 0..3 {
        let w = weight(&mut g, &format!("w{i}"), &[3, 3, 1, 1], 20 + i as u64, 0.8);
        x = op(&mut g, "Conv", &format!("conv{i}"), &[x, w]);
        if i < 2 {
            x = op(&mut g, "Relu", &format!("relu{i}"), &[x]);
        }
    }
    g.set_outputs(vec![x]).unwrap();
    (model(g, 13), seeded(&[("x", &[1, 3, 6, 6])]))
}

#[test]
fn an_override_makes_one_conv_16_bit() {
    let (m, samples) = conv_chain();
    let config = "[[name]]\nname = \"conv1\"\nprecision = \"16a8w\"\n";
    let (q, report) = run(&m, &htp(Precision::A8W8, "v75", Some(config)), &samples);
    let act = |node: &str| dq_params(&q, dq_of_input(&q, node, 0)).1.dtype();
    assert_eq!(act("conv0"), DType::U8);
    assert_eq!(act("conv1"), DType::U16, "the override");
    assert_eq!(act("conv2"), DType::U8);
    // conv0 writes 8 bits, converted to 16 for conv1 (QNN's Convert): DQ u16 <- Q u16 <- DQ u8.
    let producer_op = |v: ValueId| q.graph.producer(v).map(|(n, _)| q.graph.node(n).unwrap());
    let q16 = producer_op(dq_of_input(&q, "conv1", 0).input(0).unwrap()).unwrap();
    assert_eq!(producer_op(q16.input(0).unwrap()).map(|n| n.op_type.as_str()), Some("DequantizeLinear"), "conv1's 16-bit input is requantized from conv0's 8-bit output");
    for conv in ["conv0", "conv1", "conv2"] {
        assert_eq!(init(&q, dq_of_input(&q, conv, 1).input(0).unwrap()).dtype(), DType::I8, "{conv}: 8-bit weights");
    }
    let rule = |name: &str| report.nodes.iter().find(|n| n.name == name).and_then(|n| n.rule.clone()).unwrap();
    assert!(rule("conv1").contains("[16a8w]") && rule("conv0").contains("[8a8w]"), "{} / {}", rule("conv1"), rule("conv0"));
    // An op-order entry keeps the third Conv float, with the reason.
    let config = "[[op_order]]\nop = \"Conv\"\nindex = 2\nprecision = \"float\"\n";
    let (q, report) = run(&m, &htp(Precision::A8W8, "v75", Some(config)), &samples);
    let conv2 = report.nodes.iter().find(|n| n.name == "conv2").unwrap();
    assert!(!conv2.quantized && conv2.reason.as_deref().is_some_and(|r| r.contains("op_order")), "{conv2:?}");
    assert_eq!(q.graph.producer(node_named(&q, "conv2").input(1).unwrap()), None, "conv2's weight stays a float initializer");
}

#[test]
fn relu_fuses_into_its_conv_and_rules_can_be_replaced() {
    let (m, samples) = conv_chain();
    let (q, _) = run(&m, &htp(Precision::A8W8, "v75", None), &samples);
    let producer = |q: &Model, node: &str| q.graph.node(q.graph.producer(node_named(q, node).input(0).unwrap()).unwrap().0).unwrap().op_type.clone();
    assert_eq!(producer(&q, "relu0"), "Conv", "no Q/DQ inside Conv+Relu");
    assert_eq!(producer(&q, "conv1"), "DequantizeLinear");
    // A later registry entry replaces Relu's rule: it no longer fuses.
    let mut unfused = htp(Precision::A8W8, "v75", None);
    unfused.registry.register("Relu", rules::SINGLE);
    let (q, _) = run(&m, &unfused, &samples);
    assert_eq!(producer(&q, "relu0"), "DequantizeLinear");
    // A [rules] line in the config does the same for Resize: shared in/out instead of its own observer.
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 2, 4, 4]);
    let w = weight(&mut g, "w", &[2, 2, 1, 1], 9, 0.5);
    let c = op(&mut g, "Conv", "conv", &[x, w]);
    let scales = g.add_initializer("scales", Tensor::from_vec(&[4], vec![1f32, 1.0, 2.0, 2.0]).unwrap()).unwrap();
    let roi = g.add_initializer("roi", Tensor::from_vec(&[0], Vec::<f32>::new()).unwrap()).unwrap();
    let r = op(&mut g, "Resize", "resize", &[c, roi, scales]);
    g.set_outputs(vec![r]).unwrap();
    let m = model(g, 13);
    let samples = seeded(&[("x", &[1, 2, 4, 4])]);
    let group = |report: &Report, v: &str| report.activations.iter().find(|a| a.value == v).map(|a| a.group);
    let (_, own) = run(&m, &htp(Precision::A8W8, "v75", None), &samples);
    assert_ne!(group(&own, "conv_out"), group(&own, "resize_out"));
    let (_, shared) = run(&m, &htp(Precision::A8W8, "v75", Some("[rules]\nResize = \"shared\"\n")), &samples);
    assert_eq!(group(&shared, "conv_out"), group(&shared, "resize_out"));
    let options = HtpOptions { precision: Precision::A8W8, precision_options: PrecisionOptions::default(), soc: None };
    let e = HtpQuantizer::new(&options, Some(&HtpConfig::from_toml("[rules]\nResize = \"magic\"\n").unwrap())).unwrap_err().to_string();
    assert!(e.contains("magic") && e.contains("shared"), "{e}");
}

/// A graph with one Conv and one Gemm, both with constant weights spanning two blocks of 64
/// input channels.
fn weighted_graph() -> (Graph, Vec<NodeId>) {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 128, 2, 2]);
    let w = weight(&mut g, "w", &[32, 128, 1, 1], 1, 0.5);
    let c = op(&mut g, "Conv", "conv", &[x, w]);
    let f = op(&mut g, "Flatten", "flat", &[c]);
    let w2 = weight(&mut g, "w2", &[128, 4], 2, 0.5);
    let y = op(&mut g, "Gemm", "gemm", &[f, w2]);
    g.set_outputs(vec![y]).unwrap();
    let ids = ["conv", "gemm"].iter().map(|n| g.nodes().find(|(_, x)| x.name == *n).unwrap().0).collect();
    (g, ids)
}

fn violations(q: &HtpQuantizer, g: &Graph) -> Vec<qforge_quant::quantizer::Violation> {
    q.validate(g, &q.annotate(g))
}

#[test]
fn every_generation_accepts_exactly_its_precisions() {
    let (g, weighted) = weighted_graph();
    let table = SocTable::builtin();
    for gen in &table.generation {
        for p in Precision::ALL {
            let v = violations(&htp(p, &gen.name, None), &g);
            let nodes: Vec<NodeId> = v.iter().map(|v| v.node).collect();
            if gen.precisions.contains(&p) {
                assert!(v.is_empty(), "{p} on {}: {v:?}", gen.name);
            } else {
                assert_eq!(nodes, weighted, "{p} on {}: one violation per weighted node", gen.name);
                let oldest = table.generation.iter().find(|o| o.precisions.contains(&p)).unwrap();
                assert!(v.iter().all(|v| v.rule.contains(p.name()) && v.fix.contains(&format!("--soc {}", oldest.name))), "{v:?}");
            }
        }
    }
    // The facts the table encodes: block-wise 4-bit needs v69, 16a16w needs v73.
    let fix = |p, soc| violations(&htp(p, soc, None), &g).first().map(|v| v.fix.clone());
    assert_eq!(fix(Precision::A16W4Block, "v68").as_deref(), Some("use --precision 16a4w or --soc v69"));
    assert_eq!(fix(Precision::A16W16, "v69").as_deref(), Some("use --precision 16a8w or --soc v73"));
    assert_eq!(fix(Precision::A16W16, "SM8450"), fix(Precision::A16W16, "v69"), "a chip names its generation");
    for (p, soc) in [(Precision::A8W8, "v68"), (Precision::A16W8, "v68"), (Precision::A16W4Block, "v69"), (Precision::A16W16, "v73")] {
        assert_eq!(fix(p, soc), None, "{p} on {soc}");
    }
}

/// A graph that triggers an op constraint of the table when its activations are 16-bit, with
/// the node it must be reported on.
fn constraint_graph(op_type: &str) -> (Graph, NodeId) {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 4, 8]);
    let w = weight(&mut g, "w", &[8, 8], 3, 0.5);
    let h = op(&mut g, "MatMul", "proj", &[x, w]);
    let y = match op_type {
        "LayerNormalization" => {
            let gamma = weight(&mut g, "gamma", &[8], 4, 1.0);
            let beta = weight(&mut g, "beta", &[8], 5, 0.1);
            op(&mut g, "LayerNormalization", "target", &[h, gamma, beta])
        }
        "MatMul" => {
            let t = g.new_value("t", None).unwrap();
            g.add_node(Node::new("Transpose", "tr").with_inputs([x]).with_outputs([t]).with_attr("perm", Attr::Ints(vec![0, 2, 1]))).unwrap();
            op(&mut g, "MatMul", "target", &[h, t])
        }
        other => panic!("the table constrains {other}: add a graph for it here"),
    };
    g.set_outputs(vec![y]).unwrap();
    let id = g.nodes().find(|(_, n)| n.name == "target").unwrap().0;
    (g, id)
}

#[test]
fn every_op_constraint_is_reported_on_its_node_and_only_there() {
    let table = SocTable::builtin();
    assert!(!table.op_constraint.is_empty());
    for c in &table.op_constraint {
        for op in &c.ops {
            let (g, target) = constraint_graph(op);
            let since = table.generation.iter().position(|x| x.name == c.since).unwrap();
            for (i, gen) in table.generation.iter().enumerate() {
                let v = violations(&htp(Precision::A16W8, &gen.name, None), &g);
                if i < since {
                    assert_eq!(v.iter().map(|v| v.node).collect::<Vec<_>>(), vec![target], "{op} on {}: {v:?}", gen.name);
                    assert!(v[0].rule.contains(&c.since) && v[0].fix.contains(&format!("--soc {}", c.since)), "{v:?}");
                } else {
                    assert!(v.is_empty(), "{op} on {}: {v:?}", gen.name);
                }
                assert!(violations(&htp(Precision::A8W8, &gen.name, None), &g).is_empty(), "{op} with 8-bit activations on {}", gen.name);
            }
        }
    }
    // On v68, with 16-bit activations: the LayerNormalization and the MatMul of two activations
    // are refused, the MatMul with a constant weight is not.
    for op in ["LayerNormalization", "MatMul"] {
        let (g, target) = constraint_graph(op);
        let v = violations(&htp(Precision::A16W8, "v68", None), &g);
        assert_eq!(v.iter().map(|v| v.node).collect::<Vec<_>>(), vec![target], "{op}");
    }
}

#[test]
fn strict_fails_on_violations_and_the_report_lists_them() {
    let (g, _) = weighted_graph();
    let m = model(g, 13);
    let samples = seeded(&[("x", &[1, 128, 2, 2])]);
    let q = htp(Precision::A16W4Block, "v68", None);
    let (_, report) = run(&m, &q, &samples);
    let nodes: Vec<(&str, &str)> = report.violations.iter().map(|v| (v.node.as_str(), v.op.as_str())).collect();
    assert_eq!(nodes, vec![("conv", "Conv"), ("gemm", "Gemm")]);
    let e = quantize(&m, &q, &samples, &QuantizeOptions { strict: true, ..Default::default() }, &mut |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("2 node(s)") && e.contains("'conv'") && e.contains("'gemm'") && e.contains("--soc v69"), "{e}");
}

#[test]
fn float_nodes_are_reported_with_reasons() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 2, 4, 4]);
    let w = weight(&mut g, "w", &[2, 2, 1, 1], 9, 0.5);
    let c = op(&mut g, "Conv", "conv", &[x, w]);
    let e = op(&mut g, "Einsum", "custom", &[c]);
    let s = op(&mut g, "Shape", "shape", &[e]);
    let moved = op(&mut g, "Identity", "moved", &[e]);
    let kept = op(&mut g, "Identity", "kept", &[c]);
    let requested = op(&mut g, "Sigmoid", "requested", &[c]);
    g.set_outputs(vec![e, s, moved, kept, requested]).unwrap();
    let q = htp(Precision::A8W8, "v75", Some("[[name]]\nname = \"requested\"\nprecision = \"float\"\n"));
    let a = q.annotate(&g);
    let reasons: HashMap<String, String> = a.float.iter().map(|f| (g.node(f.node).unwrap().name.clone(), f.reason.clone())).collect();
    assert!(reasons["requested"].contains("an override keeps it in float (name)"), "{reasons:?}");
    assert!(reasons["custom"].contains("no rule for Einsum"), "{reasons:?}");
    assert!(reasons["shape"].contains("no rule for Shape"), "{reasons:?}");
    assert!(reasons["moved"].contains("no encoding to share"), "data movement after a float node: {reasons:?}");
    assert!(!reasons.contains_key("kept"), "data movement after a quantized node is quantized: {reasons:?}");
    assert_eq!(a.nodes.len() + a.float.len(), g.node_count(), "every node is annotated or listed in float");
}

/// ONNX Runtime loads and runs every precision, also written below opset 21 (16- and 4-bit
/// Q/DQ in the com.microsoft domain; block-wise weights are refused there), with its QDQ
/// fusions on, and off so Q/DQ run as written. With fusions off, every quantized tensor is
/// exposed and compared with qforge's own execution of the same QDQ model, in topological
/// order: the first one that differs differs by one integer step in at most 1 % of its
/// elements. Q/DQ kernels are bit-exact with ORT, and a float accumulation one ulp apart can
/// move a value across one rounding boundary. That step then propagates, and a later
/// requantization to a finer scale widens it, so the final outputs are only held within eight
/// steps of the 8-bit output grid (8/256) for 8-bit activations and 1e-3 for 16-bit.
fn check_against_ort(name: &str, m: &Model, samples: &dyn SampleSource, feed: &[(String, Tensor)], block_size: usize, tmp: &Path) {
    for (p, max_opset) in Precision::ALL.into_iter().flat_map(|p| [(p, None), (p, Some(20))]) {
        let options = HtpOptions { precision: p, precision_options: PrecisionOptions { block_size, ..Default::default() }, soc: None };
        let opts = QuantizeOptions { max_opset, ..Default::default() };
        let result = quantize(m, &HtpQuantizer::new(&options, None).unwrap(), samples, &opts, &mut |_, _| {});
        if max_opset.is_some() && p.is_blockwise() {
            let e = result.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("above --max-opset 20"), "{name} {p}: block-wise weights cannot stay below opset 21: {e}");
            continue;
        }
        let (q, _) = result.unwrap();
        if max_opset.is_some() {
            assert!(q.opset("").unwrap() <= 20, "{name} {p}: opset {:?}", q.opset(""));
            let contrib = q.graph.nodes().filter(|(_, n)| n.domain == "com.microsoft").count();
            assert_eq!(contrib > 0, p != Precision::A8W8, "{name} {p}: {contrib} com.microsoft Q/DQ");
        }
        let p = format!("{p}{}", max_opset.map(|v| format!(" (opset <= {v})")).unwrap_or_default());
        let blocked = q.graph.nodes().filter(|(_, n)| n.attr_int("block_size").is_some()).count();
        assert_eq!(blocked > 0, options.precision.is_blockwise(), "{name} {p}: {blocked} block-wise DequantizeLinear");
        let path = tmp.join(format!("{name}_{p}.onnx"));
        qforge_onnx::save(&q, &path).unwrap();
        let fused = ort_run_with(&path, feed, 1, true);
        assert!(fused.iter().all(|(_, t)| t.to_f64_vec().unwrap().iter().all(|x| x.is_finite())), "{name} {p}: ORT with its QDQ fusions on runs it");
        let mut exposed = q.clone();
        let outputs = exposed.graph.outputs().len();
        let g = &exposed.graph;
        let quantized: Vec<ValueId> = g.topo_order().unwrap().into_iter().map(|id| g.node(id).unwrap()).filter(|n| n.op_type == "QuantizeLinear").filter_map(|n| n.output(0)).collect();
        let all: Vec<ValueId> = exposed.graph.outputs().iter().copied().chain(quantized.iter().copied().filter(|v| !q.graph.is_output(*v))).collect();
        exposed.graph.set_outputs(all).unwrap();
        let exposed_path = tmp.join(format!("{name}_{p}_exposed.onnx"));
        qforge_onnx::save(&exposed, &exposed_path).unwrap();
        let ours = qforge_runtime::Session::new(&exposed).unwrap().run(feed.to_vec()).unwrap();
        let theirs = ort_run_with(&exposed_path, feed, 1, false);
        let first_difference = ours[outputs..].iter().zip(&theirs[outputs..]).find(|((_, a), (_, b))| a != b);
        if let Some(((value, a), (_, b))) = first_difference {
            let (a, b) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
            let differing = a.iter().zip(&b).filter(|(x, y)| x != y).count();
            let steps = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
            println!("{name:<10} {p:<12} first quantized tensor to differ: '{value}', {differing} of {} values by up to {steps} step(s)", a.len());
            assert!(steps <= 1.0 && differing * 100 <= a.len(), "{name} {p}: '{value}' is the first quantized tensor to differ, {differing} of {} values by up to {steps} steps", a.len());
        }
        let atol = if options.precision.activation() == qforge_quant::QType::U8 { 8.0 / 256.0 } else { 1e-3 };
        for ((out, a), (_, b)) in ours[..outputs].iter().zip(&theirs[..outputs]) {
            let (worst, ok) = compare(a, b, 0.0, atol);
            println!("{name:<10} {p:<12} '{out}': qforge vs ORT max |diff| {worst:.2e} (tolerance {atol:.1e})");
            assert!(ok, "{name} {p} '{out}': max |diff| {worst}");
        }
    }
}

#[test]
fn every_precision_runs_in_ort_and_matches_qforge_on_tiny_cnn() {
    let m = qforge_onnx::load(&repo().join("examples/tiny_cnn.onnx")).unwrap();
    let stacked = qforge_data::read_npz(&repo().join("examples/tiny_cnn_calib.npz")).unwrap();
    let (name, all) = &stacked[0];
    let per = all.len() / all.shape()[0];
    let shape = &all.shape()[1..];
    let data = all.as_slice::<f32>().unwrap();
    let rows: Vec<_> = (0..all.shape()[0]).map(|i| vec![(name.clone(), Tensor::from_vec(shape, data[i * per..(i + 1) * per].to_vec()).unwrap())]).collect();
    let feed = vec![(name.clone(), Tensor::from_vec(shape, noise(99, per, -1.0, 1.0)).unwrap())];
    let tmp = TempDir::new("htp-tiny");
    check_against_ort("tiny_cnn", &m, &rows, &feed, 4, tmp.path());
}

#[test]
fn every_precision_runs_in_ort_and_matches_qforge_on_ocr_cls() {
    let m = qforge_testkit::real_models().into_iter().find(|m| m.name == "ocr_cls").expect("ocr_cls is fetched by scripts/setup.sh");
    let mut model = qforge_onnx::load(&m.path).unwrap();
    qforge_onnx::fold_constant_nodes(&mut model);
    let samples: Vec<_> = (0..4).map(|s| make_inputs(&model.graph, &m, 20 + s)).collect();
    let feed = make_inputs(&model.graph, &m, 7);
    let tmp = TempDir::new("htp-cls");
    check_against_ort("ocr_cls", &model, &samples, &feed, 64, tmp.path());
}

/// A value read inside an If body from the main graph is quantized in both graphs, and the
/// Q/DQ names of the body do not shadow the main graph's: ONNX's checker and ORT accept it.
#[test]
fn values_read_from_an_enclosing_graph_are_quantized_inside_if_bodies() {
    let branch = |name: &str, seed: u64| {
        let mut b = Graph::new(name);
        let x = b.add_outer("x").unwrap();
        let w = weight(&mut b, &format!("{name}_w"), &[2, 3, 1, 1], seed, 0.5);
        let c = op(&mut b, "Conv", &format!("{name}_conv"), &[x, w]);
        b.set_outputs(vec![c]).unwrap();
        b
    };
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 3, 4, 4]);
    let cond = g.add_initializer("cond", Tensor::from_bools(&[], &[true]).unwrap()).unwrap();
    let y = g.new_value("y", Some(ValueType::tensor_of(DType::F32, &[1, 2, 4, 4]))).unwrap();
    g.add_node(Node::new("If", "if").with_inputs([cond]).with_outputs([y])
        .with_attr("then_branch", Attr::Graph(Box::new(branch("then", 11))))
        .with_attr("else_branch", Attr::Graph(Box::new(branch("else", 12))))).unwrap();
    let wm = weight(&mut g, "main_w", &[2, 3, 1, 1], 13, 0.5);
    let main_out = op(&mut g, "Conv", "main_conv", &[x, wm]);
    g.set_outputs(vec![y, main_out]).unwrap();
    let samples = seeded(&[("x", &[1, 3, 4, 4])]);
    let (q, report) = run(&model(g, 13), &htp(Precision::A8W8, "v75", None), &samples);
    for graph in ["g", "then"] {
        assert!(report.activations.iter().any(|a| a.graph == graph && a.value == "x"), "x quantized in graph '{graph}'");
    }
    let tmp = TempDir::new("htp-if");
    let path = tmp.path().join("if.onnx");
    qforge_onnx::save(&q, &path).unwrap();
    let check = qforge_testkit::oracle("onnx_check.py", &[path.as_os_str()]);
    assert!(check.status.success(), "onnx.checker: {}", String::from_utf8_lossy(&check.stdout));
    let feed = samples[0].clone();
    let ours = qforge_runtime::Session::new(&q).unwrap().run(feed.clone()).unwrap();
    let theirs = ort_run_qdq(&path, &feed, 1);
    let step = report.activations.iter().map(|a| a.scale).fold(0f32, f32::max);
    for ((name, a), (_, b)) in ours.iter().zip(&theirs) {
        let (worst, ok) = compare(a, b, 0.0, step as f64);
        assert!(ok, "'{name}': qforge and ORT differ by {worst}");
    }
}

/// A detection head's output: box coordinates of about a hundred (a Conv with large weights)
/// concatenated with class scores in [0, 1] (a Sigmoid), then flattened.
fn box_and_score_head() -> (Model, Seeded) {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 4, 6, 6]);
    let w_box = weight(&mut g, "w_box", &[4, 4, 1, 1], 11, 60.0);
    let w_cls = weight(&mut g, "w_cls", &[4, 4, 1, 1], 12, 2.0);
    let boxes = op(&mut g, "Conv", "conv_box", &[x, w_box]);
    let logits = op(&mut g, "Conv", "conv_cls", &[x, w_cls]);
    let scores = op(&mut g, "Sigmoid", "sig", &[logits]);
    let cat = g.new_value("cat_out", None).unwrap();
    g.add_node(Node::new("Concat", "cat").with_inputs([boxes, scores]).with_outputs([cat]).with_attr("axis", Attr::Int(1))).unwrap();
    let shape = g.add_initializer("flat_shape", Tensor::from_vec(&[3], vec![1i64, 8, 36]).unwrap()).unwrap();
    let flat = op(&mut g, "Reshape", "flat", &[cat, shape]);
    g.set_outputs(vec![flat]).unwrap();
    (model(g, 13), seeded(&[("x", &[1, 4, 6, 6])]))
}

/// The largest |quantized - float| over the class scores (channels 4..8) of the head's output,
/// the quantized model run by ONNX Runtime.
fn score_error(float: &Model, q: &Model, samples: &Seeded, tmp: &Path) -> f32 {
    let path = tmp.join("head.onnx");
    qforge_onnx::save(q, &path).unwrap();
    let mut worst = 0f32;
    for i in 0..samples.len() {
        let want = float_outputs(float, samples, i);
        let got = ort_run_qdq(&path, &samples[i], 1);
        let (w, o) = (want[0].1.as_slice::<f32>().unwrap(), got[0].1.as_slice::<f32>().unwrap());
        for k in 4 * 36..8 * 36 {
            worst = worst.max((w[k] - o[k]).abs());
        }
    }
    worst
}

#[test]
fn a_concat_input_left_with_few_levels_widens_the_concat_and_its_readers_to_16_bits() {
    let (m, samples) = box_and_score_head();
    let tmp = TempDir::new("htp_widen");
    let (q, report) = run(&m, &htp(Precision::A8W8, "v75", None), &samples);
    let mut widened: Vec<_> = report.widened.iter().map(|r| (r.node.as_str(), r.op.as_str(), r.from, r.to, r.concat.as_str(), r.value.as_str())).collect();
    widened.sort();
    use qforge_quant::QType::{U16, U8};
    assert_eq!(widened, [("cat", "Concat", U8, U16, "cat", "sig_out"), ("flat", "Reshape", U8, U16, "cat", "sig_out")]);
    assert!(report.widened.iter().all(|r| r.levels < 16), "{:?}", report.widened);
    assert!(report.narrow_inputs.is_empty(), "{:?}", report.narrow_inputs);
    assert_eq!(dq_params(&q, q_of_output(&q, "cat")).1.dtype(), DType::U16);
    // The box Conv's own output stays 8-bit and is requantized to 16 bits for the Concat:
    // conv_box -> Q/DQ u8 -> Q/DQ u16 -> cat, as the target converts it.
    let mut chain = vec![];
    let mut v = node_named(&q, "cat").input(0).unwrap();
    while let Some((p, _)) = q.graph.producer(v) {
        let n = q.graph.node(p).unwrap();
        if n.op_type == "QuantizeLinear" {
            chain.push(init(&q, n.input(2).unwrap()).dtype());
        }
        if n.op_type == "Conv" {
            break;
        }
        v = n.input(0).unwrap();
    }
    assert_eq!(chain, [DType::U16, DType::U8]);
    // The scores keep the Sigmoid's 8-bit grid (1/512 off at most), half a 16-bit step of the
    // output and the 8-bit rounding of the logits before it: about 0.01 together.
    let wide = score_error(&m, &q, &samples, tmp.path());
    println!("scores: max |error| {wide:.4} with the widened Concat");
    assert!(wide < 0.02, "scores off by {wide} with a 16-bit Concat");

    // A config entry naming the Concat's precision keeps it: no widening, the narrow input is
    // reported, and the scores fall on the 8-bit grid of the box coordinates.
    let config = "[[op_type]]\nop = \"Concat\"\nprecision = \"8a8w\"\n";
    let (q, report) = run(&m, &htp(Precision::A8W8, "v75", Some(config)), &samples);
    assert!(report.widened.is_empty(), "{:?}", report.widened);
    assert!(report.narrow_inputs.iter().any(|r| r.node == "cat" && r.value == "sig_out"), "{:?}", report.narrow_inputs);
    assert_eq!(dq_params(&q, q_of_output(&q, "cat")).1.dtype(), DType::U8);
    let narrow = score_error(&m, &q, &samples, tmp.path());
    println!("scores: max |error| {narrow:.4} with the Concat kept at 8 bits");
    assert!(narrow > 0.1, "scores off by only {narrow} on the 8-bit grid of the boxes");

    // 16-bit activations everywhere: nothing to widen.
    let (_, report) = run(&m, &htp(Precision::A16W8, "v75", None), &samples);
    assert!(report.widened.is_empty() && report.narrow_inputs.is_empty(), "{:?} {:?}", report.widened, report.narrow_inputs);
}

/// Paddle's decoder loop: the step counter is an int64 carried as `Cast(Cast(counter) + 1.0)`
/// to int64, and each step writes `2 x row[counter]` of the input into row `counter` of a
/// zero-initialized accumulator (ScatterElements).
fn float_counted_loop(steps: usize, width: usize) -> (Model, Seeded) {
    let dims = [1, steps as i64, width as i64];
    let mut body = Graph::new("body");
    body.add_input("i", Some(ValueType::tensor_of(DType::I64, &[]))).unwrap();
    let cond = body.add_input("cond", Some(ValueType::tensor_of(DType::Bool, &[]))).unwrap();
    let counter = body.add_input("counter", Some(ValueType::tensor_of(DType::I64, &[1]))).unwrap();
    let acc = body.add_input("acc", Some(ValueType::tensor_of(DType::F32, &dims))).unwrap();
    let x = body.add_outer("x").unwrap();
    let one = body.add_initializer("one", Tensor::from_vec(&[1], vec![1f32]).unwrap()).unwrap();
    let two = body.add_initializer("two", Tensor::scalar(2f32)).unwrap();
    let axis = body.add_initializer("axis", Tensor::from_vec(&[1], vec![1i64]).unwrap()).unwrap();
    let index_shape = body.add_initializer("index_shape", Tensor::from_vec(&[3], vec![1i64, 1, 1]).unwrap()).unwrap();
    let row_shape = body.add_initializer("row_shape", Tensor::from_vec(&[3], vec![1i64, 1, width as i64]).unwrap()).unwrap();
    let cast = |b: &mut Graph, name: &str, v: ValueId, to: DType| {
        let out = b.new_value(format!("{name}_out"), None).unwrap();
        b.add_node(Node::new("Cast", name).with_inputs([v]).with_outputs([out]).with_attr("to", Attr::Int(to.onnx_code() as i64))).unwrap();
        out
    };
    let as_float = cast(&mut body, "counter_as_float", counter, DType::F32);
    let incremented = op(&mut body, "Add", "increment", &[as_float, one]);
    let next = cast(&mut body, "next_counter", incremented, DType::I64);
    let row = op(&mut body, "Slice", "row", &[x, counter, next, axis]);
    let doubled = op(&mut body, "Mul", "double", &[row, two]);
    let index = op(&mut body, "Reshape", "index", &[counter, index_shape]);
    let indices = op(&mut body, "Expand", "indices", &[index, row_shape]);
    let written = body.new_value("written", None).unwrap();
    body.add_node(Node::new("ScatterElements", "write_row").with_inputs([acc, indices, doubled]).with_outputs([written]).with_attr("axis", Attr::Int(1))).unwrap();
    let cond_out = op(&mut body, "Identity", "keep_going", &[cond]);
    body.set_outputs(vec![cond_out, next, written]).unwrap();

    let mut g = Graph::new("g");
    input(&mut g, "x", &[1, steps, width]);
    let trips = g.add_initializer("trips", Tensor::scalar(steps as i64)).unwrap();
    let go = g.add_initializer("go", Tensor::from_bools(&[], &[true]).unwrap()).unwrap();
    let start = g.add_initializer("start", Tensor::from_vec(&[1], vec![0i64]).unwrap()).unwrap();
    let zeros = g.add_initializer("zeros", Tensor::from_vec(&[1, steps, width], vec![0f32; steps * width]).unwrap()).unwrap();
    let (last, y) = (g.new_value("last", None).unwrap(), g.new_value("y", None).unwrap());
    g.add_node(Node::new("Loop", "decode").with_inputs([trips, go, start, zeros]).with_outputs([last, y]).with_attr("body", Attr::Graph(Box::new(body)))).unwrap();
    g.set_outputs(vec![y]).unwrap();
    (model(g, 13), seeded(&[("x", &[1, steps, width])]))
}

/// Float values only ever converted back to integers (a loop counter incremented in float)
/// stay float under every quantizer: at 8 bits a counter up to 16 steps 0.063, so step 11
/// would dequantize to 10.98 and truncate to row 10. Every row lands where the float model
/// writes it, in qforge's runtime and in ONNX Runtime.
#[test]
fn a_loop_counter_incremented_in_float_is_never_quantized() {
    let (steps, width) = (16, 4);
    let (m, samples) = float_counted_loop(steps, width);
    let tmp = TempDir::new("htp-counter");
    let ort = BackendConfig::load("ort").unwrap();
    let ort = ConfigQuantizer { mapping: default_mapping(&ort, RangeName::Minmax, true), backend: ort };
    for (backend, q) in [("htp", &htp(Precision::A8W8, "v75", None) as &dyn Quantizer), ("ort", &ort)] {
        let (q, report) = quantize(&m, q, &samples, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
        let add = report.nodes.iter().find(|n| n.name == "increment").unwrap();
        let reason = add.reason.clone().unwrap_or_default();
        assert!(!add.quantized && reason.contains("index arithmetic"), "{backend}: the counter's Add is float as index arithmetic: '{reason}'");
        assert!(report.activations.iter().all(|a| a.value != "counter_as_float_out" && a.value != "increment_out"), "{backend}: the counter is not quantized");
        let path = tmp.path().join(format!("{backend}.onnx"));
        qforge_onnx::save(&q, &path).unwrap();
        for feed in &samples {
            let want = qforge_runtime::Session::new(&m).unwrap().run(feed.clone()).unwrap().remove(0).1;
            let ours = qforge_runtime::Session::new(&q).unwrap().run(feed.clone()).unwrap().remove(0).1;
            let theirs = ort_run_qdq(&path, feed, 1).remove(0).1;
            // Each row is 2 x its input row, quantized: within a few 8-bit steps of [-2, 2].
            for (who, got) in [("qforge", &ours), ("ORT", &theirs)] {
                let (worst, ok) = compare(&want, got, 0.0, 4.0 * 4.0 / 255.0);
                assert!(ok, "{backend} in {who}: rows off by {worst}");
            }
        }
    }
}

