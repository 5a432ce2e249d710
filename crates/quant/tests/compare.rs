//! `compare` against an independent reference: the same figures computed in numpy from ONNX
//! Runtime runs of the float model and of the QDQ model (intermediates exposed as graph
//! outputs with the `onnx` package, Q/DQ found by graph structure in Python), weights
//! dequantized and BatchNormalization folded in numpy; a model compared with itself; an If
//! body compared like the same layers in the main graph; a model quantized by ONNX Runtime's
//! quantizer; and the errors.

use std::path::Path;

use qforge_ir::{Attr, Graph, Model, Node, OpsetImport, Tensor, ValueId};
use qforge_quant::backend::BackendConfig;
use qforge_quant::compare::{compare, CompareError, Comparison, Metrics};
use qforge_quant::pipeline::{quantize, QuantizeOptions, SampleSource};
use qforge_quant::qconfig::{QConfigMapping, RangeName};
use qforge_quant::quantizer::{default_qconfig, ConfigQuantizer};
use qforge_testkit::{oracle, python, TempDir};

/// qforge's runtime and ONNX Runtime sum convolutions in different orders: their float values
/// differ by a few ulps, and an element that close to a QuantizeLinear rounding boundary lands
/// one quantization step apart. On these few thousand elements that moves the figures by about
/// 1e-5 relative; the tolerances leave a margin of 30 or more.
const SQNR_TOLERANCE_DB: f64 = 1e-3;
/// Same cause, for cosine similarity.
const COSINE_TOLERANCE: f64 = 1e-8;
/// Same cause, relative to the MSE.
const MSE_RELATIVE_TOLERANCE: f64 = 1e-4;
/// Weights need no runtime: both sides dequantize in float32 exactly as ONNX specifies and sum
/// in float64, so only summation order differs.
const WEIGHT_SQNR_TOLERANCE_DB: f64 = 1e-6;

fn noise(seed: u64, n: usize) -> Vec<f32> {
    qforge_testkit::noise(seed, n, -0.5, 0.5)
}

/// Calibration feeds held in memory.
type Samples = Vec<Vec<(String, Tensor)>>;

fn seeded_samples(input: &str, shape: &[usize], count: usize) -> Samples {
    let n = shape.iter().product();
    (0..count).map(|i| vec![(input.to_string(), Tensor::from_vec(shape, noise(100 + i as u64, n).iter().map(|v| v * 4.0).collect::<Vec<f32>>()).unwrap())]).collect()
}

fn model(g: Graph) -> Model {
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() }
}

fn op(g: &mut Graph, op: &str, name: &str, inputs: &[ValueId]) -> ValueId {
    let out = g.new_value(format!("{name}_out"), None).unwrap();
    g.add_node(Node::new(op, name).with_inputs(inputs.iter().copied()).with_outputs([out])).unwrap();
    out
}

fn weight(g: &mut Graph, name: &str, shape: &[usize], seed: u64) -> ValueId {
    g.add_initializer(name, Tensor::from_vec(shape, noise(seed, shape.iter().product())).unwrap()).unwrap()
}

fn input(g: &mut Graph, name: &str, shape: &[i64]) -> ValueId {
    g.add_input(name, Some(qforge_ir::ValueType::tensor_of(qforge_ir::DType::F32, shape))).unwrap()
}

fn quantized(m: &Model, samples: &dyn SampleSource) -> Model {
    let backend = BackendConfig::load("ort").unwrap();
    let mapping = QConfigMapping::global(default_qconfig(&backend, RangeName::Minmax, true));
    quantize(m, &ConfigQuantizer { backend, mapping }, samples, &QuantizeOptions::default(), &mut |_, _| {}).unwrap().0
}

fn run_compare(float: &Model, quant: &Model, samples: &dyn SampleSource) -> Comparison {
    compare(float, quant, samples, 1, &mut |_, _| {}).unwrap()
}

/// `x -> Conv -> BatchNormalization -> Relu -> Conv -> Add(relu, conv) -> Conv -> output`.
fn conv_bn_residual() -> Model {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 3, 10, 10]);
    let w1 = weight(&mut g, "w1", &[6, 3, 3, 3], 1);
    let b1 = weight(&mut g, "b1", &[6], 2);
    let c1 = op(&mut g, "Conv", "conv1", &[x, w1, b1]);
    let bn: Vec<ValueId> = ["bn_scale", "bn_shift", "bn_mean", "bn_var"].iter().enumerate()
        .map(|(i, n)| g.add_initializer(*n, Tensor::from_vec(&[6], noise(20 + i as u64, 6).iter().map(|v| v + 1.0).collect::<Vec<f32>>()).unwrap()).unwrap()).collect();
    let y = op(&mut g, "BatchNormalization", "bn1", &[c1, bn[0], bn[1], bn[2], bn[3]]);
    let r = op(&mut g, "Relu", "relu1", &[y]);
    let w2 = weight(&mut g, "w2", &[6, 6, 1, 1], 3);
    let c2 = op(&mut g, "Conv", "conv2", &[r, w2]);
    let add = op(&mut g, "Add", "add", &[r, c2]);
    let w3 = weight(&mut g, "w3", &[2, 6, 1, 1], 4);
    let c3 = op(&mut g, "Conv", "conv3", &[add, w3]);
    g.set_outputs(vec![c3]).unwrap();
    model(g)
}

/// The numpy side: runs both models in ONNX Runtime (optimizations off, intermediates exposed
/// as outputs) and prints the figures of each named tensor and of each named node's weight.
const NUMPY_REFERENCE: &str = r#"
import json, sys
import numpy as np, onnx, onnxruntime as ort
from onnx import numpy_helper

float_path, quant_path, sample_dir, count, names, weight_nodes = sys.argv[1:7]
names, weight_nodes, count = names.split(","), [w for w in weight_nodes.split(",") if w], int(count)
fm, qm = onnx.load(float_path), onnx.load(quant_path)

def fake_quantized(g, name):
    for q in g.node:
        if q.op_type == "QuantizeLinear" and q.input[0] == name:
            for d in g.node:
                if d.op_type == "DequantizeLinear" and d.input[0] == q.output[0]:
                    return d.output[0]
    return name

def session(m, tensors):
    present = {o.name for o in m.graph.output}
    for t in tensors:
        if t not in present:
            m.graph.output.append(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])

quant_names = [fake_quantized(qm.graph, n) for n in names]
fs, qs = session(fm, names), session(qm, quant_names)
sums = {n: np.zeros(5) for n in names}
for i in range(count):
    feed = {"x": np.load(f"{sample_dir}/{i}.npy")}
    fo = dict(zip(names, fs.run(names, feed)))
    qo = dict(zip(names, qs.run(quant_names, feed)))
    for n in names:
        x, y = fo[n].astype(np.float64).ravel(), qo[n].astype(np.float64).ravel()
        sums[n] += [x.size, (x * x).sum(), (y * y).sum(), (x * y).sum(), ((x - y) ** 2).sum()]

def figures(count, xx, yy, xy, ee):
    return {"sqnr_db": 10 * np.log10(xx / ee), "mse": ee / count, "cosine": xy / np.sqrt(xx * yy), "count": int(count)}

result = {"activations": {n: figures(*sums[n]) for n in names}, "quant_names": dict(zip(names, quant_names)), "weights": {}}

# The quantized model as ONNX Runtime deploys it: default graph optimizations, which fuse the
# QDQ units into integer kernels; its first graph output against the float model's.
deployed = ort.InferenceSession(quant_path, providers=["CPUExecutionProvider"])
out = qm.graph.output[0].name
acc = np.zeros(5)
for i in range(count):
    feed = {"x": np.load(f"{sample_dir}/{i}.npy")}
    x = fs.run([out], feed)[0].astype(np.float64).ravel()
    y = deployed.run([out], feed)[0].astype(np.float64).ravel()
    acc += [x.size, (x * x).sum(), (y * y).sum(), (x * y).sum(), ((x - y) ** 2).sum()]
result["deployed"] = {out: figures(*acc)}

finits = {t.name: numpy_helper.to_array(t) for t in fm.graph.initializer}
qinits = {t.name: numpy_helper.to_array(t) for t in qm.graph.initializer}
for node_name in weight_nodes:
    qnode = next(n for n in qm.graph.node if n.name == node_name)
    dq = next(n for n in qm.graph.node if n.output[0] == qnode.input[1])
    q, scale, zp = (qinits[v] for v in dq.input[:3])
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    shape = [1] * q.ndim
    shape[axis] = -1
    y = (q.astype(np.int32) - zp.astype(np.int32).reshape(shape)).astype(np.float32) * scale.astype(np.float32).reshape(shape)
    fnode = next(n for n in fm.graph.node if n.name == node_name)
    w = finits[fnode.input[1]]
    bn = next((n for n in fm.graph.node if n.op_type == "BatchNormalization" and n.input[0] == fnode.output[0]), None)
    if bn is not None:
        eps = np.float32(next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5))
        s = finits[bn.input[1]] / np.sqrt(finits[bn.input[4]] + eps)
        w = w * s.reshape([-1] + [1] * (w.ndim - 1))
    x = np.moveaxis(w.astype(np.float64), axis, 0).reshape(w.shape[axis], -1)
    y = np.moveaxis(y.astype(np.float64), axis, 0).reshape(w.shape[axis], -1)
    per = [float(10 * np.log10((a * a).sum() / ((a - b) ** 2).sum())) for a, b in zip(x, y)]
    result["weights"][node_name] = {"sqnr_db": float(10 * np.log10((x * x).sum() / ((x - y) ** 2).sum())), "channels": per}
print(json.dumps(result))
"#;

fn numpy_reference(dir: &Path, float: &Path, quant: &Path, samples: &Samples, names: &[&str], weight_nodes: &[&str]) -> serde_json::Value {
    let data = dir.join("samples");
    std::fs::create_dir_all(&data).unwrap();
    for (i, s) in samples.iter().enumerate() {
        qforge_data::write_npy(&data.join(format!("{i}.npy")), &s[0].1).unwrap();
    }
    let script = dir.join("reference.py");
    std::fs::write(&script, NUMPY_REFERENCE).unwrap();
    let out = std::process::Command::new(python()).arg(&script).arg(float).arg(quant).arg(&data)
        .arg(samples.len().to_string()).arg(names.join(",")).arg(weight_nodes.join(",")).output().unwrap();
    assert!(out.status.success(), "numpy reference failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn activation<'a>(c: &'a Comparison, graph: &str, name: &str) -> &'a Metrics {
    &c.activations.iter().find(|t| t.graph == graph && t.name == name).unwrap_or_else(|| panic!("{graph}:{name} not compared; have {:?}", c.activations.iter().map(|t| &t.name).collect::<Vec<_>>())).metrics
}

#[test]
fn figures_match_numpy_on_onnx_runtime_runs() {
    let float = conv_bn_residual();
    let samples = seeded_samples("x", &[1, 3, 10, 10], 4);
    let quant = quantized(&float, &samples);
    let c = run_compare(&float, &quant, &samples);

    let tmp = TempDir::new("compare");
    let (fpath, qpath) = (tmp.path().join("float.onnx"), tmp.path().join("quant.onnx"));
    qforge_onnx::save(&float, &fpath).unwrap();
    qforge_onnx::save(&quant, &qpath).unwrap();
    let names = ["x", "bn1_out", "relu1_out", "conv2_out", "add_out", "conv3_out"];
    let weight_nodes = ["conv1", "conv2", "conv3"];
    let reference = numpy_reference(tmp.path(), &fpath, &qpath, &samples, &names, &weight_nodes);

    let fake_quantized = c.activations.iter().filter(|t| t.fake_quantized).count();
    assert!(fake_quantized >= 3, "Q/DQ values compared: {fake_quantized}");
    for name in names {
        let ours = activation(&c, "", name);
        let theirs = &reference["activations"][name];
        let compared_with = c.activations.iter().find(|t| t.name == name).unwrap().compared_with.as_str();
        assert_eq!(compared_with, reference["quant_names"][name].as_str().unwrap(), "{name}: counterpart");
        let (sqnr, cosine, mse) = (theirs["sqnr_db"].as_f64().unwrap(), theirs["cosine"].as_f64().unwrap(), theirs["mse"].as_f64().unwrap());
        println!("{name:<10} vs {compared_with:<34} SQNR {:.4} dB (numpy {:+.1e}), cosine {:.8} ({:+.1e}), MSE {:.4e} (relative {:+.1e})",
            ours.sqnr_db, sqnr - ours.sqnr_db, ours.cosine, cosine - ours.cosine, ours.mse, (mse - ours.mse) / mse);
        assert_eq!(ours.count, theirs["count"].as_u64().unwrap(), "{name}: elements");
        assert!(sqnr.is_finite() && sqnr < 60.0, "{name}: the test needs real quantization error, numpy gives {sqnr} dB");
        assert!((ours.sqnr_db - sqnr).abs() <= SQNR_TOLERANCE_DB, "{name}: SQNR {} vs numpy {sqnr}", ours.sqnr_db);
        assert!((ours.cosine - cosine).abs() <= COSINE_TOLERANCE, "{name}: cosine {} vs numpy {cosine}", ours.cosine);
        assert!((ours.mse - mse).abs() <= MSE_RELATIVE_TOLERANCE * mse, "{name}: MSE {} vs numpy {mse}", ours.mse);
    }
    let output = &c.outputs.iter().find(|t| t.name == "conv3_out").expect("graph output compared").metrics;
    assert!((output.sqnr_db - reference["activations"]["conv3_out"]["sqnr_db"].as_f64().unwrap()).abs() <= SQNR_TOLERANCE_DB);

    for node in weight_nodes {
        let w = c.weights.iter().find(|w| w.consumer == node && w.op == "Conv" && w.metrics.count > 6).unwrap_or_else(|| panic!("weight of {node} not compared"));
        let theirs = &reference["weights"][node];
        let channels: Vec<f64> = theirs["channels"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        println!("{node} weight {}: SQNR {:.6} / numpy {:.6} dB, channels {:?}", w.name, w.metrics.sqnr_db, theirs["sqnr_db"], w.channel_sqnr_db);
        assert_eq!(w.axis, Some(0), "{node}: per output channel");
        assert!((w.metrics.sqnr_db - theirs["sqnr_db"].as_f64().unwrap()).abs() <= WEIGHT_SQNR_TOLERANCE_DB, "{node}");
        assert_eq!(w.channel_sqnr_db.len(), channels.len(), "{node}: channels");
        for (k, (a, b)) in w.channel_sqnr_db.iter().zip(&channels).enumerate() {
            assert!((a - b).abs() <= WEIGHT_SQNR_TOLERANCE_DB, "{node} channel {k}: {a} vs numpy {b}");
        }
        let mut sorted = channels.clone();
        sorted.sort_by(f64::total_cmp);
        assert!((w.min_channel_sqnr_db.unwrap() - sorted[0]).abs() <= WEIGHT_SQNR_TOLERANCE_DB, "{node}: min channel");
    }
    let folded = c.weights.iter().find(|w| w.consumer == "conv1" && w.op == "Conv" && w.metrics.count > 6).unwrap();
    assert_ne!(folded.name, "w1", "conv1's weight is compared with the BatchNormalization-folded float weight");
}

/// `x -> Add(3) -> Clip(0, 6) -> MatMul (float) -> y`, and its QDQ form with the qparams rapidocr's text-line
/// classifier got for its first hardswish gate (input scale 0.05416667, zero point 114; 3 as
/// u8 255 with scale 3/255; the Add's output at scale 6/255, zero point 0). An `x` that
/// quantizes to the zero point lands on 3 = 127.5 output steps: a tie, which the QDQ graph's
/// float arithmetic rounds to even (128) and ONNX Runtime's integer Add kernel, folding the
/// zero point into a float offset, rounds to 127. Both are half a step from 3; the MatMul mixes
/// them with the other values' errors, so the output SQNR tells them apart.
fn gate_models() -> (Model, Model) {
    let build = |quantized: bool| {
        let mut g = Graph::new("g");
        let x = input(&mut g, "x", &[1, 64]);
        let constant = |g: &mut Graph, name: &str, t: Tensor| g.add_initializer(name, t).unwrap();
        let (zero, six) = (constant(&mut g, "zero", Tensor::scalar(0f32)), constant(&mut g, "six", Tensor::scalar(6f32)));
        let fake_quantized = |g: &mut Graph, v: ValueId, name: &str, scale: f32, zero_point: u8| {
            let (s, z) = (constant(g, &format!("{name}_scale"), Tensor::scalar(scale)), constant(g, &format!("{name}_zero_point"), Tensor::scalar(zero_point)));
            let q = op(g, "QuantizeLinear", &format!("{name}_q"), &[v, s, z]);
            op(g, "DequantizeLinear", &format!("{name}_dq"), &[q, s, z])
        };
        let (x, three) = if quantized {
            let q3 = constant(&mut g, "three_q", Tensor::scalar(255u8));
            let (s, z) = (constant(&mut g, "three_scale", Tensor::scalar(3.0f32 / 255.0)), constant(&mut g, "three_zero_point", Tensor::scalar(0u8)));
            (fake_quantized(&mut g, x, "x", 0.054_166_67, 114), op(&mut g, "DequantizeLinear", "three_dq", &[q3, s, z]))
        } else {
            (x, constant(&mut g, "three", Tensor::scalar(3f32)))
        };
        let mut shifted = op(&mut g, "Add", "add", &[x, three]);
        if quantized {
            shifted = fake_quantized(&mut g, shifted, "add_out", 6.0 / 255.0, 0);
        }
        let gate = op(&mut g, "Clip", "clip", &[shifted, zero, six]);
        let w = weight(&mut g, "w", &[64, 8], 70);
        let y = op(&mut g, "MatMul", "mix", &[gate, w]);
        g.set_outputs(vec![y]).unwrap();
        model(g)
    };
    (build(false), build(true))
}

#[test]
fn outputs_as_deployed_are_onnx_runtime_s_where_integer_kernels_round_differently() {
    let (float, quant) = gate_models();
    // Every fourth value quantizes to the zero point.
    let samples: Samples = (0..4).map(|i| {
        let v: Vec<f32> = noise(200 + i, 64).iter().enumerate().map(|(k, v)| if k % 4 == 0 { 0.0 } else { v * 12.0 }).collect();
        vec![("x".to_string(), Tensor::from_vec(&[1, 64], v).unwrap())]
    }).collect();
    let c = run_compare(&float, &quant, &samples);
    let tmp = TempDir::new("compare_deployed");
    let (fpath, qpath) = (tmp.path().join("float.onnx"), tmp.path().join("quant.onnx"));
    qforge_onnx::save(&float, &fpath).unwrap();
    qforge_onnx::save(&quant, &qpath).unwrap();
    let reference = numpy_reference(tmp.path(), &fpath, &qpath, &samples, &["mix_out"], &[]);
    let written = c.outputs[0].metrics.sqnr_db;
    let deployed = c.outputs_as_run.as_ref().expect("the QDQ units lower")[0].metrics.sqnr_db;
    let (ort_written, ort_deployed) = (reference["activations"]["mix_out"]["sqnr_db"].as_f64().unwrap(), reference["deployed"]["mix_out"]["sqnr_db"].as_f64().unwrap());
    println!("as written {written:.4} dB (ONNX Runtime without optimizations {ort_written:.4}), as deployed {deployed:.4} dB (ONNX Runtime {ort_deployed:.4})");
    assert!((written - ort_written).abs() <= SQNR_TOLERANCE_DB, "as written {written} dB, ONNX Runtime {ort_written} dB");
    assert!((deployed - ort_deployed).abs() <= SQNR_TOLERANCE_DB, "as deployed {deployed} dB, ONNX Runtime {ort_deployed} dB");
    assert!((written - deployed).abs() > 10.0 * SQNR_TOLERANCE_DB, "the tie must round differently in ONNX Runtime's integer Add for this test to tell the two apart");
}

#[test]
fn a_model_compared_with_itself_has_no_error() {
    let mut g = Graph::new("g");
    let x = input(&mut g, "x", &[1, 3, 6, 6]);
    let w = weight(&mut g, "w", &[4, 3, 3, 3], 7);
    let c = op(&mut g, "Conv", "conv", &[x, w]);
    let r = op(&mut g, "Relu", "relu", &[c]);
    let s = op(&mut g, "Sigmoid", "sig", &[r]);
    g.set_outputs(vec![s]).unwrap();
    let m = model(g);
    let samples = seeded_samples("x", &[1, 3, 6, 6], 3);
    let cmp = run_compare(&m, &m, &samples);
    assert_eq!(cmp.activations.len(), 4, "x, conv, relu, sig");
    for t in cmp.activations.iter().chain(&cmp.outputs) {
        assert_eq!(t.metrics.sqnr_db, f64::INFINITY, "{}", t.name);
        assert_eq!((t.metrics.cosine, t.metrics.mse, t.metrics.max_abs_error), (1.0, 0.0, 0.0), "{}", t.name);
        assert!(!t.fake_quantized);
    }
    let per_sample = 3 * 6 * 6;
    assert_eq!(activation(&cmp, "", "x").count, 3 * per_sample as u64);
    assert!(cmp.weights.is_empty() && cmp.unmatched.is_empty());
}

/// The layers of an If branch give the figures the same layers give in the main graph: values
/// inside subgraphs are seen, paired and accumulated like any other.
#[test]
fn if_body_values_compare_like_main_graph_values() {
    fn layers(g: &mut Graph, x: ValueId) -> ValueId {
        let w = weight(g, "then_w", &[4, 3, 1, 1], 11);
        let c = op(g, "Conv", "then_conv", &[x, w]);
        op(g, "Relu", "then_relu", &[c])
    }
    let mut flat = Graph::new("g");
    let x = input(&mut flat, "x", &[1, 3, 5, 5]);
    let out = layers(&mut flat, x);
    flat.set_outputs(vec![out]).unwrap();

    let mut branch = Graph::new("then");
    let bx = branch.add_outer("x").unwrap();
    let bout = layers(&mut branch, bx);
    branch.set_outputs(vec![bout]).unwrap();
    let mut other = Graph::new("else");
    let ox = other.add_outer("x").unwrap();
    let o = op(&mut other, "Relu", "else_relu", &[ox]);
    other.set_outputs(vec![o]).unwrap();
    let mut g = Graph::new("g");
    input(&mut g, "x", &[1, 3, 5, 5]);
    let cond = g.add_initializer("cond", Tensor::from_bools(&[], &[true]).unwrap()).unwrap();
    let y = g.new_value("y", None).unwrap();
    g.add_node(Node::new("If", "if").with_inputs([cond]).with_outputs([y])
        .with_attr("then_branch", Attr::Graph(Box::new(branch)))
        .with_attr("else_branch", Attr::Graph(Box::new(other)))).unwrap();
    g.set_outputs(vec![y]).unwrap();

    let samples = seeded_samples("x", &[1, 3, 5, 5], 3);
    let (flat, with_if) = (model(flat), model(g));
    let flat_cmp = run_compare(&flat, &quantized(&flat, &samples), &samples);
    let if_cmp = run_compare(&with_if, &quantized(&with_if, &samples), &samples);
    for name in ["then_conv_out", "then_relu_out"] {
        let (a, b) = (activation(&flat_cmp, "", name), activation(&if_cmp, "if/then_branch", name));
        println!("{name}: main graph {:.6} dB, If body {:.6} dB", a.sqnr_db, b.sqnr_db);
        assert!(a.sqnr_db.is_finite() && a.count == b.count);
        assert!((a.sqnr_db - b.sqnr_db).abs() <= 1e-9 && (a.mse - b.mse).abs() <= 1e-9 * a.mse, "{name}");
    }
    assert!(if_cmp.activations.iter().all(|t| !t.name.starts_with("else")), "the else branch never ran");
    let w = if_cmp.weights.iter().find(|w| w.name == "then_w").expect("weight inside the branch");
    assert_eq!(w.graph, "if/then_branch");
}

#[test]
fn errors_name_what_is_wrong() {
    let float = conv_bn_residual();
    let samples = seeded_samples("x", &[1, 3, 10, 10], 2);
    let quant = quantized(&float, &samples);

    let mut renamed = quant.clone();
    let x = renamed.graph.value_by_name("x").unwrap();
    renamed.graph.rename_value(x, "image").unwrap();
    let e = compare(&float, &renamed, &samples, 1, &mut |_, _| {}).unwrap_err();
    assert!(matches!(e, CompareError::InputsDiffer { .. }), "{e}");
    assert!(e.to_string().contains("'x'") && e.to_string().contains("'image'"), "{e}");

    let mut unrelated = Graph::new("g");
    let ux = input(&mut unrelated, "x", &[1, 3, 10, 10]);
    let neg = op(&mut unrelated, "Neg", "other", &[ux]);
    unrelated.set_outputs(vec![neg]).unwrap();
    let e = compare(&float, &model(unrelated), &samples, 1, &mut |_, _| {}).unwrap_err();
    assert!(matches!(e, CompareError::NoMatches), "{e}");

    let mut bad = seeded_samples("x", &[1, 3, 10, 10], 2);
    bad[1][0].1.as_slice_mut::<f32>().unwrap()[5] = f32::NAN;
    let e = compare(&float, &quant, &bad, 1, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("'#1'") && e.to_string().contains("'x'") && e.to_string().contains("NaN"), "{e}");

    let e = compare(&float, &quant, &Samples::new(), 1, &mut |_, _| {}).unwrap_err();
    assert!(matches!(e, CompareError::NoSamples), "{e}");
}

/// A model quantized by ONNX Runtime's quantizer (its names: `X_QuantizeLinear_Output`,
/// `W_quantized`, a quantized graph output renamed to `Y_QuantizeLinear_Input`): every value it
/// quantized is compared with its fake-quantized value, the graph output too, and every weight
/// with its float initializer.
#[test]
fn onnx_runtime_quantized_models_are_understood() {
    let repo = qforge_testkit::repo();
    let (float_path, calib) = (repo.join("examples/tiny_cnn.onnx"), repo.join("examples/tiny_cnn_calib.npz"));
    let tmp = TempDir::new("compare-ort");
    let ort_path = tmp.path().join("ort.onnx");
    let out = oracle("ort_quantize.py", &[float_path.as_os_str(), calib.as_os_str(), ort_path.as_os_str()]);
    assert!(out.status.success(), "ONNX Runtime's quantizer failed: {}", String::from_utf8_lossy(&out.stderr));
    let (float, quant) = (qforge_onnx::load(&float_path).unwrap(), qforge_onnx::load(&ort_path).unwrap());
    let stacked = qforge_data::read_npz(&calib).unwrap();
    let x = &stacked[0].1;
    let per = x.len() / x.shape()[0];
    let samples: Samples = (0..x.shape()[0]).map(|i| {
        vec![("x".to_string(), Tensor::from_vec(&x.shape()[1..], x.as_slice::<f32>().unwrap()[i * per..(i + 1) * per].to_vec()).unwrap())]
    }).collect();
    let c = run_compare(&float, &quant, &samples);

    let g = &quant.graph;
    let mut quantized_values = 0;
    for (_, q) in g.nodes().filter(|(_, n)| n.op_type == "QuantizeLinear") {
        let name = g.value_name(q.input(0).unwrap());
        let Some(t) = c.activations.iter().find(|t| t.name == name) else { continue };
        quantized_values += 1;
        let (dq, _) = g.consumers(q.output(0).unwrap())[0];
        assert_eq!(t.compared_with, g.value_name(g.node(dq).unwrap().output(0).unwrap()), "{name}");
        assert!(t.fake_quantized && t.metrics.sqnr_db.is_finite(), "{name}");
    }
    assert!(quantized_values >= 6, "activations quantized by ORT and compared: {quantized_values}");
    assert!(g.value_by_name("probs_QuantizeLinear_Input").is_some(), "ORT renames the quantized graph output");
    let probs = c.activations.iter().find(|t| t.name == "probs").unwrap();
    assert!(probs.fake_quantized && probs.compared_with == "probs");
    let mut weights: Vec<&str> = c.weights.iter().map(|w| w.name.as_str()).collect();
    weights.sort();
    assert_eq!(weights, ["c1.b", "c1.w", "c2.b", "c2.w", "fc.b", "fc.w"]);
    assert!(c.unmatched_weights.is_empty(), "{:?}", c.unmatched_weights);
}
