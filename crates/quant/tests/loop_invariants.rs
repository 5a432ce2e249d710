//! A Paddle2ONNX-style decoder Loop: the weights and the feature map it reads are loop-carried
//! variables the body passes on unchanged (directly, through Identity, and through
//! `Squeeze(Unsqueeze(w) + 0)`). Fusion reads the weights from the main graph instead, moves
//! `Transpose(w_out)` out of the loop, where it folds, and quantizes the body's weights as
//! weights; the feature map stays carried. ONNX Runtime (the oracle) computes the same outputs
//! on the fused float model as on the original, and close ones on the quantized model.

use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor, ValueId, ValueType};
use qforge_quant::backend::BackendConfig;
use qforge_quant::pipeline::{fuse, quantize, QuantizeOptions};
use qforge_quant::qconfig::RangeName;
use qforge_quant::quantizer::{default_mapping, ConfigQuantizer};
use qforge_testkit::{compare, noise, ort_run, seeded_feeds, TempDir};

const STEPS: i64 = 5;

fn op(g: &mut Graph, op: &str, name: &str, inputs: &[ValueId]) -> ValueId {
    let out = g.new_value(name, None).unwrap();
    g.add_node(Node::new(op, name).with_inputs(inputs.iter().copied()).with_outputs([out])).unwrap();
    out
}

fn constant(g: &mut Graph, name: &str, shape: &[usize], seed: u64, bound: f32) -> ValueId {
    g.add_initializer(name, Tensor::from_vec(shape, noise(seed, shape.iter().product(), -bound, bound)).unwrap()).unwrap()
}

/// `feats [1, 16, 8] = Transpose(Reshape(Conv(x)))`; a Loop of [`STEPS`] iterations carries
/// `h [1, 8]` and passes on `feats`, `w_att [8, 8]`, `w_out [8, 8]` and `b_out [8]`:
///
/// ```text
/// e     = Tanh(MatMul(feats, w_att) + Unsqueeze(h, 1))      # [1, 16, 8]
/// h'    = Tanh(MatMul(ReduceMean(e, [1]), Transpose(w_out)) + b_out)   # [1, 8], scanned too
/// ```
fn decoder() -> Model {
    let f32_ty = |shape: &[i64]| Some(ValueType::tensor_of(DType::F32, shape));
    let mut g = Graph::new("decoder");
    let x = g.add_input("x", f32_ty(&[1, 3, 4, 4])).unwrap();
    let cw = constant(&mut g, "conv_w", &[8, 3, 3, 3], 1, 0.3);
    let c = g.new_value("conv", None).unwrap();
    g.add_node(Node::new("Conv", "conv").with_inputs([x, cw]).with_outputs([c]).with_attr("pads", Attr::Ints(vec![1; 4]))).unwrap();
    let shape = g.add_initializer("flat", Tensor::from_vec(&[3], vec![1i64, 8, 16]).unwrap()).unwrap();
    let flat = op(&mut g, "Reshape", "flatten", &[c, shape]);
    let feats = g.new_value("feats", None).unwrap();
    g.add_node(Node::new("Transpose", "to_rows").with_inputs([flat]).with_outputs([feats]).with_attr("perm", Attr::Ints(vec![0, 2, 1]))).unwrap();
    let w_att = constant(&mut g, "w_att", &[8, 8], 2, 0.5);
    let w_out = constant(&mut g, "w_out", &[8, 8], 3, 0.5);
    let b_out = constant(&mut g, "b_out", &[8], 4, 0.2);
    let h0 = g.add_initializer("h0", Tensor::zeros(DType::F32, &[1, 8]).unwrap()).unwrap();
    let trips = g.add_initializer("trips", Tensor::scalar(STEPS)).unwrap();

    let mut b = Graph::new("step");
    b.add_input("i", Some(ValueType::tensor_of(DType::I64, &[]))).unwrap();
    let cond = b.add_input("cond", Some(ValueType::tensor_of(DType::Bool, &[]))).unwrap();
    let h = b.add_input("h_in", f32_ty(&[1, 8])).unwrap();
    let feats_in = b.add_input("feats_in", f32_ty(&[1, 16, 8])).unwrap();
    let w_att_in = b.add_input("w_att_in", f32_ty(&[8, 8])).unwrap();
    let w_out_in = b.add_input("w_out_in", f32_ty(&[8, 8])).unwrap();
    let b_out_in = b.add_input("b_out_in", f32_ty(&[8])).unwrap();
    let axis1 = b.add_initializer("axis1", Tensor::from_vec(&[1], vec![1i64]).unwrap()).unwrap();
    let axis0 = b.add_initializer("axis0", Tensor::from_vec(&[1], vec![0i64]).unwrap()).unwrap();
    let zero = b.add_initializer("zero", Tensor::from_vec(&[1], vec![0f32]).unwrap()).unwrap();
    let proj = op(&mut b, "MatMul", "proj", &[feats_in, w_att_in]);
    let h_row = op(&mut b, "Unsqueeze", "h_row", &[h, axis1]);
    let pre = op(&mut b, "Add", "att_pre", &[proj, h_row]);
    let e = op(&mut b, "Tanh", "att", &[pre]);
    let mean = b.new_value("pooled", None).unwrap();
    b.add_node(Node::new("ReduceMean", "pool").with_inputs([e]).with_outputs([mean]).with_attr("axes", Attr::Ints(vec![1])).with_attr("keepdims", Attr::Int(0))).unwrap();
    let w_out_t = b.new_value("w_out_t", None).unwrap();
    b.add_node(Node::new("Transpose", "w_out_t").with_inputs([w_out_in]).with_outputs([w_out_t]).with_attr("perm", Attr::Ints(vec![1, 0]))).unwrap();
    let mm = op(&mut b, "MatMul", "out_mm", &[mean, w_out_t]);
    let biased = op(&mut b, "Add", "out_bias", &[mm, b_out_in]);
    let h_new = op(&mut b, "Tanh", "h_new", &[biased]);
    let h_scan = op(&mut b, "Identity", "h_scan", &[h_new]);
    let cond_out = op(&mut b, "Identity", "go_on", &[cond]);
    let feats_out = op(&mut b, "Identity", "feats_out", &[feats_in]);
    let lifted = op(&mut b, "Unsqueeze", "w_att_lift", &[w_att_in, axis0]);
    let plus0 = op(&mut b, "Add", "w_att_plus0", &[lifted, zero]);
    let w_att_out = op(&mut b, "Squeeze", "w_att_out", &[plus0, axis0]);
    b.set_outputs(vec![cond_out, h_new, feats_out, w_att_out, w_out_in, b_out_in, h_scan]).unwrap();

    let outs: Vec<ValueId> = ["h_final", "feats_final", "w_att_final", "w_out_final", "b_out_final", "hs"].iter().map(|n| g.new_value(*n, None).unwrap()).collect();
    let mut lp = Node::new("Loop", "decode").with_inputs([trips, trips, h0, feats, w_att, w_out, b_out]).with_outputs(outs.iter().copied()).with_attr("body", Attr::Graph(Box::new(b)));
    lp.inputs[1] = None;
    g.add_node(lp).unwrap();
    // A reader of a passed-on Loop output, which must read the initial value afterwards.
    let feats_mean = g.new_value("feats_mean", None).unwrap();
    g.add_node(Node::new("ReduceMean", "feats_pool").with_inputs([outs[1]]).with_outputs([feats_mean]).with_attr("axes", Attr::Ints(vec![1])).with_attr("keepdims", Attr::Int(0))).unwrap();
    g.set_outputs(vec![outs[0], outs[5], feats_mean]).unwrap();
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() }
}

/// ONNX Runtime's outputs of [`decoder`] and of `other` on three seeded inputs, as
/// `(output name, decoder's, other's)`.
fn ort_outputs_beside_decoder(other: &Model) -> Vec<(String, Tensor, Tensor)> {
    let tmp = TempDir::new("loopinv");
    let (orig, path) = (tmp.path().join("orig.onnx"), tmp.path().join("other.onnx"));
    qforge_onnx::save(&decoder(), &orig).unwrap();
    qforge_onnx::save(other, &path).unwrap();
    let mut pairs = vec![];
    for feed in seeded_feeds(&[("x", &[1, 3, 4, 4])], 3) {
        for ((name, a), (_, b)) in ort_run(&orig, &feed, 1).into_iter().zip(ort_run(&path, &feed, 1)) {
            pairs.push((name, a, b));
        }
    }
    pairs
}

fn the_loop(m: &Model) -> &Node {
    m.graph.nodes().map(|(_, n)| n).find(|n| n.op_type == "Loop").expect("a Loop")
}

#[test]
fn fusion_reads_passed_on_weights_from_the_main_graph_and_moves_their_transpose_out() {
    let mut fused = decoder();
    let f = fuse(&mut fused).unwrap();
    // Uncarried: the three weights. Moved: Transpose(w_out), which the main graph then folds.
    assert_eq!((f.loop_carried_uncarried, f.loop_invariants_hoisted), (3, 1));
    let lp = the_loop(&fused);
    let g = &fused.graph;
    let inputs: Vec<String> = lp.inputs.iter().flatten().map(|v| g.value_name(*v)).collect();
    assert_eq!(inputs, ["trips", "h0", "feats"], "the feature map, an activation, stays carried");
    assert_eq!(lp.outputs.len(), 3, "h, the feature map and the scan output stay");
    let body = lp.subgraphs().next().unwrap().1;
    assert!(body.nodes().any(|(_, n)| n.name == "proj"), "the projection reads the carried feature map");
    let out_mm = body.nodes().map(|(_, n)| n).find(|n| n.op_type == "Gemm" || n.name == "out_mm").unwrap();
    let w = body.value(out_mm.input(1).unwrap()).unwrap();
    assert!(w.is_constant(), "Transpose(w_out) is a constant of the body");
    let orig = decoder();
    let w_out = orig.graph.value(orig.graph.value_by_name("w_out").unwrap()).unwrap().initializer().unwrap().as_slice::<f32>().unwrap().to_vec();
    let folded = w.initializer().unwrap().as_slice::<f32>().unwrap();
    assert!((0..8).all(|i| (0..8).all(|j| folded[j * 8 + i] == w_out[i * 8 + j])), "the body's constant is w_out transposed");

    // ONNX Runtime computes the same outputs on the fused float model as on the original.
    for (name, a, b) in ort_outputs_beside_decoder(&fused) {
        let (worst, ok) = compare(&a, &b, 1e-5, 1e-6);
        assert!(ok, "{name}: max |diff| {worst}");
    }
}

#[test]
fn the_loop_quantizes_its_weights_as_weights_and_runs_close_to_float_in_onnx_runtime() {
    let backend = BackendConfig::load("ort").unwrap();
    let mapping = default_mapping(&backend, RangeName::Minmax, true);
    let q = ConfigQuantizer { backend, mapping };
    let samples = seeded_feeds(&[("x", &[1, 3, 4, 4])], 8);
    let (m, report) = quantize(&decoder(), &q, &samples, &QuantizeOptions::default(), &mut |_, _| {}).unwrap();
    assert_eq!((report.loop_carried_uncarried, report.loop_invariants_hoisted), (3, 1));
    assert!(report.summary().contains("3 loop-carried constant(s) passed on unchanged"), "{}", report.summary());
    let stored: Vec<&str> = report.constants.iter().map(|c| c.value.as_str()).collect();
    for w in ["w_att", "w_out_t"] {
        assert!(stored.iter().any(|s| s.ends_with(w)), "{w} is stored quantized: {stored:?}");
    }

    // 8-bit activations and weights through a Conv, two MatMuls and three Tanh per step, over
    // five steps: a few steps of 1/255 of each output's range; a lost or stale weight would
    // be off by a good part of it.
    for (name, a, b) in ort_outputs_beside_decoder(&m) {
        let (a, b) = (a.as_slice::<f32>().unwrap(), b.as_slice::<f32>().unwrap());
        let range = a.iter().fold(f32::MIN, |m, &v| m.max(v)) - a.iter().fold(f32::MAX, |m, &v| m.min(v));
        let worst = a.iter().zip(b).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
        println!("{name}: max |quantized - float| {worst:.4} over a range of {range:.3}");
        assert!(worst <= 0.05 * range.max(1e-3), "{name}: max |diff| {worst} over a range of {range}");
    }
}
