//! `qforge quantize` on a model with sequence ops between convolutions: Conv -> SplitToSequence
//! -> SequenceAt / ConcatFromSequence -> Conv, and a Loop that builds a sequence with
//! SequenceInsert and reads a tensor of the outer graph. The Convs quantize, the nodes of
//! sequences stay float with their reason, and ONNX Runtime (the oracle) runs the quantized
//! model close to the float one. A sequence graph output is written by `qforge run` and
//! compared by `qforge compare` item by item.

mod common;

use common::{qforge, text};
use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor, ValueId, ValueType};
use qforge_testkit::{noise, ort_run, TempDir};

fn conv(g: &mut Graph, name: &str, x: ValueId, cin: usize, cout: usize, k: usize, seed: u64) -> ValueId {
    let fan_in = (cin * k * k) as f32;
    let bound = 1.0 / fan_in.sqrt();
    let w = g.add_initializer(format!("{name}_w"), Tensor::from_vec(&[cout, cin, k, k], noise(seed, cout * cin * k * k, -bound, bound)).unwrap()).unwrap();
    let b = g.add_initializer(format!("{name}_b"), Tensor::from_vec(&[cout], noise(seed + 1, cout, -0.1, 0.1)).unwrap()).unwrap();
    let y = g.new_value(name, None).unwrap();
    let pad = (k / 2) as i64;
    g.add_node(Node::new("Conv", name).with_inputs([x, w, b]).with_outputs([y]).with_attr("pads", Attr::Ints(vec![pad; 4]))).unwrap();
    y
}

fn node(g: &mut Graph, op: &str, name: &str, inputs: &[ValueId]) -> ValueId {
    let y = g.new_value(name, None).unwrap();
    g.add_node(Node::new(op, name).with_inputs(inputs.iter().copied()).with_outputs([y])).unwrap();
    y
}

/// x [1, 3, 16, 16] -> conv1 -> relu -> SplitToSequence into two [1, 4, 16, 16] halves;
/// `y = conv2(ConcatFromSequence(loop)) + conv3(ConcatFromSequence(halves))`, where the Loop
/// inserts `first + i` for i in 0..3 into an empty sequence; `z = conv4(SequenceAt(halves, -1))`.
fn model() -> Model {
    let seq_f32 = || ValueType::Sequence(Some(Box::new(ValueType::Tensor { elem: Some(DType::F32), shape: None })));
    let mut g = Graph::new("sequences");
    let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[1, 3, 16, 16]))).unwrap();
    let c1 = conv(&mut g, "conv1", x, 3, 8, 3, 1);
    let r1 = node(&mut g, "Relu", "relu1", &[c1]);
    let split = g.add_initializer("split", Tensor::from_vec(&[2], vec![4i64, 4]).unwrap()).unwrap();
    let halves = g.new_value("halves", None).unwrap();
    g.add_node(Node::new("SplitToSequence", "split_channels").with_inputs([r1, split]).with_outputs([halves]).with_attr("axis", Attr::Int(1))).unwrap();
    let zero = g.add_initializer("zero", Tensor::scalar(0i64)).unwrap();
    let last = g.add_initializer("last", Tensor::scalar(-1i64)).unwrap();
    // Read by the Loop body, by name.
    node(&mut g, "SequenceAt", "first_half", &[halves, zero]);
    let second = node(&mut g, "SequenceAt", "second_half", &[halves, last]);

    let mut body = Graph::new("build");
    let i = body.add_input("i", Some(ValueType::tensor_of(DType::I64, &[]))).unwrap();
    let cond = body.add_input("cond", Some(ValueType::tensor_of(DType::Bool, &[]))).unwrap();
    let acc = body.add_input("acc", Some(seq_f32())).unwrap();
    let outer_first = body.add_outer("first_half").unwrap();
    let cond_out = body.new_value("cond_out", Some(ValueType::tensor_of(DType::Bool, &[]))).unwrap();
    body.add_node(Node::new("Identity", "keep_going").with_inputs([cond]).with_outputs([cond_out])).unwrap();
    let fi = body.new_value("fi", None).unwrap();
    body.add_node(Node::new("Cast", "to_float").with_inputs([i]).with_outputs([fi]).with_attr("to", Attr::Int(1))).unwrap();
    let shifted = node(&mut body, "Add", "shifted", &[outer_first, fi]);
    let acc_out = body.new_value("acc_out", Some(seq_f32())).unwrap();
    body.add_node(Node::new("SequenceInsert", "append").with_inputs([acc, shifted]).with_outputs([acc_out])).unwrap();
    body.set_outputs(vec![cond_out, acc_out]).unwrap();

    let empty = g.new_value("empty", None).unwrap();
    g.add_node(Node::new("SequenceEmpty", "start").with_outputs([empty])).unwrap();
    let trips = g.add_initializer("trips", Tensor::scalar(3i64)).unwrap();
    let go = g.add_initializer("go", Tensor::from_bools(&[], &[true]).unwrap()).unwrap();
    let built = g.new_value("built", None).unwrap();
    g.add_node(Node::new("Loop", "build_loop").with_inputs([trips, go, empty]).with_outputs([built]).with_attr("body", Attr::Graph(Box::new(body)))).unwrap();
    let stacked = g.new_value("stacked", None).unwrap();
    g.add_node(Node::new("ConcatFromSequence", "join_loop").with_inputs([built]).with_outputs([stacked]).with_attr("axis", Attr::Int(1))).unwrap();
    let rejoined = g.new_value("rejoined", None).unwrap();
    g.add_node(Node::new("ConcatFromSequence", "join_halves").with_inputs([halves]).with_outputs([rejoined]).with_attr("axis", Attr::Int(1))).unwrap();
    let c2 = conv(&mut g, "conv2", stacked, 12, 6, 3, 3);
    let c3 = conv(&mut g, "conv3", rejoined, 8, 6, 1, 5);
    let y = node(&mut g, "Add", "y", &[c2, c3]);
    let z = conv(&mut g, "conv4", second, 4, 6, 3, 7);
    g.set_outputs(vec![y, z]).unwrap();
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 17 }], graph: g, ..Default::default() }
}

fn input(seed: u64) -> Tensor {
    Tensor::from_vec(&[1, 3, 16, 16], noise(seed, 3 * 16 * 16, -1.0, 1.0)).unwrap()
}

/// `count` sample folders `<dir>/calib/<s>/x.npy` of seeded inputs; returns the `calib` path.
fn calibration(dir: &std::path::Path, count: u64) -> std::path::PathBuf {
    let calib = dir.join("calib");
    for s in 0..count {
        let d = calib.join(format!("{s:03}"));
        std::fs::create_dir_all(&d).unwrap();
        qforge_data::write_npy(&d.join("x.npy"), &input(100 + s)).unwrap();
    }
    calib
}

#[test]
fn convs_around_sequence_ops_quantize_and_sequence_nodes_stay_float() {
    let tmp = TempDir::new("seqq");
    let float_path = tmp.path().join("float.onnx");
    qforge_onnx::save(&model(), &float_path).unwrap();
    let calib = calibration(tmp.path(), 8);
    let out = tmp.path().join("q.onnx");
    let report = tmp.path().join("report.json");
    let o = qforge(&["quantize".as_ref(), float_path.as_os_str(), "-o".as_ref(), out.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str(), "--report".as_ref(), report.as_os_str()]);
    assert!(o.status.success(), "{}", text(&o.stderr));

    // The report: every Conv quantized; every node of sequences float, with the reason.
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let nodes = r["nodes"].as_array().unwrap();
    let find = |name: &str| nodes.iter().find(|n| n["name"] == name).unwrap_or_else(|| panic!("'{name}' missing from the report"));
    for c in ["conv1", "conv2", "conv3", "conv4"] {
        assert_eq!(find(c)["quantized"], true, "{}", find(c));
    }
    for s in ["split_channels", "first_half", "second_half", "start", "build_loop", "join_loop", "join_halves", "append"] {
        let n = find(s);
        assert_eq!(n["quantized"], false, "{n}");
        assert!(n["reason"].as_str().unwrap().contains("sequences and optionals are not tensors and are never quantized"), "{n}");
    }

    // The file: each Conv reads its activation and weight through DequantizeLinear.
    let q = qforge_onnx::load(&out).unwrap();
    let g = &q.graph;
    for (id, n) in g.nodes().filter(|(_, n)| n.op_type == "Conv") {
        for k in 0..2 {
            let v = n.input(k).unwrap();
            let producer = g.value(v).unwrap().producer().map(|(p, _)| g.node(p).unwrap().op_type.clone());
            assert_eq!(producer.as_deref(), Some("DequantizeLinear"), "input {k} of {}", n.display_name(id));
        }
    }
    assert!(!g.nodes().any(|(_, n)| n.op_type == "QuantizeLinear" && n.input(0).is_some_and(|v| ["halves", "built", "empty"].contains(&g.value_name(v).as_str()))));

    // ONNX Runtime runs both; the quantized outputs stay within 2% of each output's range of
    // the float ones (8-bit activations give steps of about 0.4% of a range, and three
    // quantized Convs lie on the longest path, so errors of a few steps are expected; they
    // measure 0.4-0.7%. A misplaced or missing sequence element would be off by a good part
    // of the range).
    for seed in [1, 2, 3] {
        let feed = vec![("x".to_string(), input(seed))];
        let (f, qo) = (ort_run(&float_path, &feed, 1), ort_run(&out, &feed, 1));
        for ((name, a), (_, b)) in f.iter().zip(&qo) {
            let (a, b) = (a.as_slice::<f32>().unwrap(), b.as_slice::<f32>().unwrap());
            let range = a.iter().fold(f32::MIN, |m, &v| m.max(v)) - a.iter().fold(f32::MAX, |m, &v| m.min(v));
            let worst = a.iter().zip(b).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            println!("{name}: max |quantized - float| {worst:.4} over a range of {range:.3} ({:.2}%)", 100.0 * worst / range);
            assert!(worst <= 0.02 * range, "{name}: max |diff| {worst} over a range of {range}");
        }
    }
    // qforge's runtime agrees with ONNX Runtime on the float model.
    let float = qforge_onnx::load(&float_path).unwrap();
    let session = qforge_runtime::Session::new(&float).unwrap();
    let feed = vec![("x".to_string(), input(1))];
    for ((name, a), (_, b)) in session.run(feed.clone()).unwrap().iter().zip(ort_run(&float_path, &feed, 1)) {
        let (worst, ok) = qforge_testkit::compare(a, &b, 1e-4, 1e-5);
        assert!(ok, "{name}: max |diff| {worst}");
    }
}

/// [`model`] with the sequence `halves` as a third graph output.
fn model_with_sequence_output() -> Model {
    let mut m = model();
    let halves = m.graph.value_by_name("halves").unwrap();
    let mut outputs = m.graph.outputs().to_vec();
    outputs.push(halves);
    m.graph.set_outputs(outputs).unwrap();
    m
}

/// A graph output that is a sequence: `qforge run` writes its items as `halves[0]` and
/// `halves[1]`, equal to what ONNX Runtime returns for it, and `qforge compare` compares it item
/// by item between the float and the quantized model.
#[test]
fn sequence_outputs_are_written_and_compared_item_by_item() {
    let tmp = TempDir::new("seqout");
    let float_path = tmp.path().join("float.onnx");
    qforge_onnx::save(&model_with_sequence_output(), &float_path).unwrap();
    let calib = calibration(tmp.path(), 4);
    let quantized = tmp.path().join("q.onnx");
    let o = qforge(&["quantize".as_ref(), float_path.as_os_str(), "-o".as_ref(), quantized.as_os_str(), "--calibration-data".as_ref(), calib.as_os_str()]);
    assert!(o.status.success(), "{}", text(&o.stderr));

    let out = tmp.path().join("out.npz");
    let x = calib.join("000").join("x.npy");
    let o = qforge(&["run".as_ref(), float_path.as_os_str(), "-o".as_ref(), out.as_os_str(), "--input".as_ref(), format!("x={}", x.display()).as_ref()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("halves: a sequence of 2 float tensors, written as halves[0] .. halves[1]"), "{}", text(&o.stderr));
    let ours = qforge_data::read_npz(&out).unwrap();
    let theirs = ort_run(&float_path, &[("x".to_string(), input(100))], 1);
    let names = |v: &[(String, Tensor)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&ours), ["y", "conv4", "halves[0]", "halves[1]"]);
    assert_eq!(names(&ours), names(&theirs), "ONNX Runtime's outputs, sequence items by the same names");
    for ((name, a), (_, b)) in ours.iter().zip(&theirs) {
        assert_eq!(a.shape(), b.shape(), "{name}");
        let (worst, ok) = qforge_testkit::compare(a, b, 1e-4, 1e-5);
        assert!(ok, "{name}: max |diff| {worst}");
    }

    let o = qforge(&["compare".as_ref(), float_path.as_os_str(), quantized.as_os_str(), "--data".as_ref(), calib.as_os_str(), "--json".as_ref()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let c: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let halves = c["outputs"].as_array().unwrap().iter().find(|t| t["name"] == "halves").unwrap_or_else(|| panic!("no 'halves' among {}", c["outputs"]));
    assert_eq!(halves["count"], 4 * 2 * 4 * 16 * 16, "two [1, 4, 16, 16] items on each of 4 samples: {halves}");
    assert_eq!(halves["unpaired"], 0, "{halves}");
    let sqnr = halves["sqnr_db"].as_f64().unwrap();
    assert!(sqnr > 25.0, "the ReLU output split in halves is one quantized Conv away from float: {sqnr} dB");
}
