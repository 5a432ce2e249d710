//! `upgrade_opset` keeps the function a model computes, with ONNX Runtime as the oracle (graph
//! optimizations off, so every node runs as written) and ONNX's full checker as the judge of
//! the upgraded files: every real model, the light model zoo and the committed models are
//! upgraded to 13 (when below) and 21, and tiny hand-built graphs cover each rewrite rule,
//! subgraphs, and the failures that must leave the model unchanged.

use std::path::{Path, PathBuf};

use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor, ValueId, ValueType};
use qforge_quant::passes::{upgrade_opset, Rewrite, UpgradeError};
use qforge_testkit::{committed_models, compare, light_models, make_inputs, oracle, ort_run_with, real_models, RealModel, TempDir};

type Inputs = Vec<(String, Tensor)>;

/// ONNX's checker with `full_check` on every file.
fn onnx_check(paths: &[PathBuf]) {
    let args: Vec<&std::ffi::OsStr> = paths.iter().map(|p| p.as_os_str()).collect();
    let out = oracle("onnx_check.py", &args);
    assert!(out.status.success(), "onnx checker: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

/// Largest |difference| between the outputs of two models in ONNX Runtime on the same inputs;
/// fails above 1e-6 (equal infinities and NaN against NaN count as equal) or when the
/// outputs' names, types or shapes differ.
fn max_diff(reference: &[(String, Tensor)], model: &Path, inputs: &Inputs, what: &str) -> f64 {
    let got = ort_run_with(model, inputs, 1, false);
    assert_eq!(got.iter().map(|o| &o.0).collect::<Vec<_>>(), reference.iter().map(|o| &o.0).collect::<Vec<_>>(), "{what}: output names");
    let mut worst = 0f64;
    for ((name, y), (_, x)) in got.iter().zip(reference) {
        assert_eq!((y.dtype(), y.shape()), (x.dtype(), x.shape()), "{what}: output '{name}'");
        let (p, q) = (y.to_f64_vec().unwrap(), x.to_f64_vec().unwrap());
        let d = p.iter().zip(&q).map(|(a, b)| if a == b || (a.is_nan() && b.is_nan()) { 0.0 } else { (a - b).abs() }).fold(0f64, |m, d| if d.is_nan() || m.is_nan() { f64::NAN } else { m.max(d) });
        assert!(d <= 1e-6, "{what}: output '{name}' differs by {d:e}");
        worst = worst.max(d);
    }
    worst
}

/// Calls `f` on every default-domain node of a graph and of its subgraphs.
fn walk(g: &Graph, f: &mut dyn FnMut(&Graph, &Node)) {
    for (_, n) in g.nodes() {
        if n.domain.is_empty() || n.domain == "ai.onnx" {
            f(g, n);
        }
        for (_, s) in n.subgraphs() {
            walk(s, f);
        }
    }
}

/// Attributes that became inputs, with the opset of the change.
const MOVED: &[(&str, &str, i64)] = &[
    ("BatchNormalization", "spatial", 9), ("Slice", "starts", 10), ("Slice", "ends", 10), ("TopK", "k", 10),
    ("Pad", "pads", 11), ("Clip", "min", 11), ("Clip", "max", 11), ("Dropout", "ratio", 12),
    ("Split", "split", 13), ("Squeeze", "axes", 13), ("Unsqueeze", "axes", 13), ("ReduceSum", "axes", 13),
    ("ReduceMean", "axes", 18), ("ReduceMax", "axes", 18), ("ReduceMin", "axes", 18), ("ReduceProd", "axes", 18),
    ("ReduceL1", "axes", 18), ("ReduceL2", "axes", 18), ("ReduceLogSum", "axes", 18), ("ReduceLogSumExp", "axes", 18),
    ("ReduceSumSquare", "axes", 18),
];
const SOFTMAX: [&str; 3] = ["Softmax", "LogSoftmax", "Hardmax"];

/// Nodes the upgrade from `from` to `to` must rewrite: those carrying a moved attribute, the
/// Softmax family across 13, Upsample across 10 and Scatter across 11.
fn due(g: &Graph, from: i64, to: i64) -> usize {
    let crosses = |v: i64| from < v && v <= to;
    let mut n = 0;
    walk(g, &mut |_, node| {
        let op = node.op_type.as_str();
        let moved = MOVED.iter().any(|(o, a, v)| *o == op && crosses(*v) && node.attr(a).is_some());
        let other = (SOFTMAX.contains(&op) && crosses(13)) || (op == "Upsample" && crosses(10)) || (op == "Scatter" && crosses(11));
        n += (moved || other) as usize;
    });
    n
}

/// Asserts an upgraded graph has no attribute or op that the target opset no longer has, and
/// that the Softmax family states its axis.
fn assert_current(g: &Graph, to: i64, what: &str) {
    walk(g, &mut |_, n| {
        let op = n.op_type.as_str();
        for (o, a, v) in MOVED {
            assert!(!(*o == op && *v <= to && n.attr(a).is_some()), "{what}: node '{}' ({op}) still has '{a}'", n.name);
        }
        assert!(!(op == "Upsample" && to >= 10 || op == "Scatter" && to >= 11), "{what}: node '{}' is still {op}", n.name);
        assert!(!(SOFTMAX.contains(&op) && n.attr_int("axis").is_none()), "{what}: node '{}' ({op}) has no explicit axis", n.name);
    });
}

fn count(g: &Graph, op: &str) -> usize {
    let mut n = 0;
    walk(g, &mut |_, node| n += (node.op_type == op) as usize);
    n
}

/// Upgrades each model to 13 (when below) and 21 and checks the upgraded files with ONNX's
/// checker and ONNX Runtime; returns the largest output difference.
fn upgrade_models(models: Vec<RealModel>, tag: &str) -> f64 {
    let tmp = TempDir::new(tag);
    let mut worst = 0f64;
    for m in models {
        let original = qforge_onnx::load(&m.path).unwrap();
        let from = original.opset("").unwrap();
        let inputs = make_inputs(&original.graph, &m, 7);
        let mut files = vec![];
        for to in [13, 21].into_iter().filter(|t| *t > from) {
            let mut model = original.clone();
            let rewrites = upgrade_opset(&mut model, to).unwrap_or_else(|e| panic!("{}: {e}", m.name));
            let what = format!("{} {from}->{to}", m.name);
            assert_eq!(model.opset(""), Some(to), "{what}");
            model.graph.check().unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_current(&model.graph, to, &what);
            assert_eq!(rewrites.len(), due(&original.graph, from, to), "{what}: rewrites {rewrites:#?}");
            let path = tmp.path().join(format!("{}_op{to}.onnx", m.name));
            qforge_onnx::save(&model, &path).unwrap();
            files.push((to, path, rewrites));
        }
        onnx_check(&files.iter().map(|f| f.1.clone()).collect::<Vec<_>>());
        let reference = ort_run_with(&m.path, &inputs, 1, false);
        for (to, path, rewrites) in &files {
            let d = max_diff(&reference, path, &inputs, &format!("{} {from}->{to}", m.name));
            println!("{:<28} opset {from:>2} -> {to}: {:>3} nodes rewritten, max |diff| {d:.1e}", m.name, rewrites.len());
            worst = worst.max(d);
        }
    }
    println!("max |diff| over all models: {worst:e}");
    worst
}

#[test]
fn real_and_committed_models_upgrade_exactly() {
    upgrade_models(real_models().into_iter().chain(committed_models()).collect(), "upgrade-real");
}

#[test]
fn light_zoo_models_upgrade_exactly() {
    upgrade_models(light_models(), "upgrade-light");
}

// ---- tiny hand-built graphs -------------------------------------------------------------

fn f32_type(dims: &[i64]) -> Option<ValueType> {
    Some(ValueType::tensor_of(DType::F32, dims))
}

/// Deterministic data in [-2, 2), with exact ties (multiples of 1/8) so Hardmax and TopK see
/// repeated values.
fn data(shape: &[usize], seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n as u32).map(|i| ((i.wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(40503)) >> 7) % 32) as f32 / 8.0 - 2.0).collect();
    Tensor::from_vec(shape, v).unwrap()
}

struct Tiny {
    g: Graph,
    outputs: Vec<ValueId>,
}

impl Tiny {
    fn new() -> Tiny {
        Tiny { g: Graph::new("tiny"), outputs: vec![] }
    }
    fn input(&mut self, name: &str, dims: &[i64]) -> ValueId {
        self.g.add_input(name, f32_type(dims)).unwrap()
    }
    fn init(&mut self, name: &str, t: Tensor) -> ValueId {
        self.g.add_initializer(name, t).unwrap()
    }
    /// Adds `op` with `n_out` outputs named after the node; returns them.
    fn op(&mut self, op: &str, name: &str, inputs: &[ValueId], n_out: usize, attrs: Vec<(&str, Attr)>) -> Vec<ValueId> {
        let outs: Vec<ValueId> = (0..n_out).map(|i| self.g.new_value(format!("{name}_out{i}"), None).unwrap()).collect();
        let mut node = Node::new(op, name).with_inputs(inputs.iter().copied()).with_outputs(outs.iter().copied());
        for (k, a) in attrs {
            node = node.with_attr(k, a);
        }
        self.g.add_node(node).unwrap();
        outs
    }
    /// Adds `op` with one output that becomes a graph output.
    fn out(&mut self, op: &str, name: &str, inputs: &[ValueId], attrs: Vec<(&str, Attr)>) -> ValueId {
        let v = self.op(op, name, inputs, 1, attrs)[0];
        self.output(v);
        v
    }
    /// Makes `v` a graph output; its type is inferred when the model is built.
    fn output(&mut self, v: ValueId) {
        self.outputs.push(v);
    }
    /// Makes `v` a graph output of a declared type.
    fn output_typed(&mut self, v: ValueId, elem: DType, dims: &[i64]) {
        self.g.value_mut(v).unwrap().ty = Some(ValueType::tensor_of(elem, dims));
        self.outputs.push(v);
    }
    fn model(mut self, opset: i64) -> Model {
        self.g.set_outputs(self.outputs.clone()).unwrap();
        let ir_version = if opset < 15 { 7 } else { 8 };
        let mut m = Model { ir_version, opset_imports: vec![OpsetImport { domain: String::new(), version: opset }], producer_name: "qforge-test".into(), graph: self.g, ..Default::default() };
        qforge_ir::infer::infer_model(&mut m);
        for &v in m.graph.outputs() {
            assert!(m.graph.value(v).unwrap().ty.as_ref().is_some_and(|t| t.shape().is_some()), "output type of '{}' not inferred", m.graph.value_name(v));
        }
        m
    }
}

fn ints(v: &[i64]) -> Attr {
    Attr::Ints(v.to_vec())
}

fn s(v: &str) -> Attr {
    Attr::String(v.as_bytes().to_vec())
}

fn by_name<'a>(g: &'a Graph, name: &str) -> &'a Node {
    g.nodes().map(|(_, n)| n).find(|n| n.name == name).unwrap_or_else(|| panic!("no node '{name}'"))
}

/// Constant int64 data of a node input.
fn const_input(g: &Graph, n: &Node, i: usize) -> Vec<i64> {
    g.value(n.input(i).unwrap()).unwrap().initializer().unwrap().to_i64_vec().unwrap()
}

/// Upgrades `original` to each target, checks each file with ONNX's checker and compares its
/// ONNX Runtime outputs with the original's on `inputs`; returns the upgraded models with their
/// rewrites and the largest difference.
fn upgrade_tiny(tag: &str, original: &Model, targets: &[i64], inputs: &[Inputs]) -> (Vec<(Model, Vec<Rewrite>)>, f64) {
    let tmp = TempDir::new(tag);
    let a = tmp.path().join("original.onnx");
    qforge_onnx::save(original, &a).unwrap();
    let mut done = vec![];
    let mut files = vec![];
    for &to in targets {
        let mut m = original.clone();
        let rewrites = upgrade_opset(&mut m, to).unwrap_or_else(|e| panic!("{tag} -> {to}: {e}"));
        assert_eq!(m.opset(""), Some(to));
        m.graph.check().unwrap();
        assert_current(&m.graph, to, &format!("{tag} -> {to}"));
        let b = tmp.path().join(format!("op{to}.onnx"));
        qforge_onnx::save(&m, &b).unwrap();
        files.push(b);
        done.push((m, rewrites));
    }
    onnx_check(&files);
    let mut worst = 0f64;
    for ins in inputs {
        let reference = ort_run_with(&a, ins, 1, false);
        for (to, b) in targets.iter().zip(&files) {
            worst = worst.max(max_diff(&reference, b, ins, &format!("{tag} -> {to}")));
        }
    }
    println!("{tag}: max |diff| {worst:e}");
    (done, worst)
}

#[test]
fn softmax_family_along_a_middle_axis_is_wrapped() {
    let mut t = Tiny::new();
    let x = t.input("x", &[2, 3, 4, 5]);
    t.out("Softmax", "softmax_axis1", &[x], vec![("axis", Attr::Int(1))]);
    t.out("LogSoftmax", "logsoftmax_axis1", &[x], vec![("axis", Attr::Int(1))]);
    t.out("Hardmax", "hardmax_axis2", &[x], vec![("axis", Attr::Int(2))]);
    t.out("Softmax", "softmax_default", &[x], vec![]);
    t.out("Softmax", "softmax_axis3", &[x], vec![("axis", Attr::Int(3))]);
    t.out("LogSoftmax", "logsoftmax_minus1", &[x], vec![("axis", Attr::Int(-1))]);
    let original = t.model(11);
    let inputs = vec![vec![("x".to_string(), data(&[2, 3, 4, 5], 1))]];
    let (done, worst) = upgrade_tiny("softmax", &original, &[13, 21], &inputs);
    assert_eq!(worst, 0.0, "the wrapped ops compute bit-identical results");
    for (m, rewrites) in &done {
        assert_eq!(rewrites.len(), 6);
        assert_eq!((count(&m.graph, "Flatten"), count(&m.graph, "Shape"), count(&m.graph, "Reshape")), (4, 4, 4));
        for name in ["softmax_axis3", "logsoftmax_minus1"] {
            assert_eq!(by_name(&m.graph, name).input(0), m.graph.value_by_name("x"), "{name} is not wrapped");
        }
        assert_eq!(by_name(&m.graph, "softmax_axis1").attr_int("axis"), Some(-1));
        assert_eq!(by_name(&m.graph, "softmax_default").attr_int("axis"), Some(-1));
    }
    // Only relabelling the opset changes the result: the rewrite is what keeps it.
    let tmp = TempDir::new("softmax-naive");
    let mut naive = original.clone();
    naive.opset_imports[0].version = 13;
    let (a, b) = (tmp.path().join("a.onnx"), tmp.path().join("b.onnx"));
    qforge_onnx::save(&original, &a).unwrap();
    qforge_onnx::save(&naive, &b).unwrap();
    let (x, y) = (ort_run_with(&a, &inputs[0], 1, false), ort_run_with(&b, &inputs[0], 1, false));
    assert!(compare(&y[0].1, &x[0].1, 0.0, 1e-3).0 > 1e-3, "Softmax-11 and Softmax-13 along axis 1 should differ");
}

#[test]
fn split_sizes_become_an_input_and_num_outputs_is_set_at_18() {
    let mut t = Tiny::new();
    let x = t.input("x", &[2, 6, 3]);
    for v in t.op("Split", "split_sizes", &[x], 3, vec![("axis", Attr::Int(1)), ("split", ints(&[1, 2, 3]))]) {
        t.output(v);
    }
    for v in t.op("Split", "split_equal", &[x], 3, vec![("axis", Attr::Int(2))]) {
        t.output(v);
    }
    let original = t.model(11);
    let (done, worst) = upgrade_tiny("split", &original, &[13, 21], &[vec![("x".into(), data(&[2, 6, 3], 2))]]);
    assert_eq!(worst, 0.0);
    for ((m, rewrites), to) in done.iter().zip([13, 21]) {
        let n = by_name(&m.graph, "split_sizes");
        assert_eq!(const_input(&m.graph, n, 1), vec![1, 2, 3]);
        assert_eq!(by_name(&m.graph, "split_equal").attr_int("num_outputs"), (to >= 18).then_some(3));
        assert_eq!(rewrites.len(), if to >= 18 { 2 } else { 1 });
    }
}

#[test]
fn squeeze_and_unsqueeze_axes_become_inputs() {
    let mut t = Tiny::new();
    let x = t.input("x", &[3, 1, 4, 1]);
    let sq = t.op("Squeeze", "squeeze_axis1", &[x], 1, vec![("axes", ints(&[1]))])[0];
    t.out("Unsqueeze", "unsqueeze", &[sq], vec![("axes", ints(&[0, 3]))]);
    t.out("Squeeze", "squeeze_all", &[x], vec![]);
    let original = t.model(11);
    let (done, worst) = upgrade_tiny("squeeze", &original, &[13, 21], &[vec![("x".into(), data(&[3, 1, 4, 1], 3))]]);
    assert_eq!(worst, 0.0);
    for (m, rewrites) in &done {
        assert_eq!(rewrites.len(), 2, "{rewrites:?}");
        assert_eq!(const_input(&m.graph, by_name(&m.graph, "squeeze_axis1"), 1), vec![1]);
        assert_eq!(const_input(&m.graph, by_name(&m.graph, "unsqueeze"), 1), vec![0, 3]);
        assert_eq!(by_name(&m.graph, "squeeze_all").inputs.len(), 1);
    }
}

#[test]
fn reduce_axes_become_inputs_at_18() {
    let mut t = Tiny::new();
    let x = t.input("x", &[2, 3, 4]);
    t.out("ReduceMean", "mean_axis1", &[x], vec![("axes", ints(&[1])), ("keepdims", Attr::Int(0))]);
    t.out("ReduceMean", "mean_last", &[x], vec![("axes", ints(&[-1]))]);
    t.out("ReduceMean", "mean_all", &[x], vec![("keepdims", Attr::Int(0))]);
    t.out("ReduceMax", "max", &[x], vec![("axes", ints(&[0, 2]))]);
    t.out("ReduceL2", "l2", &[x], vec![("axes", ints(&[2]))]);
    t.out("ReduceLogSumExp", "lse", &[x], vec![("axes", ints(&[1]))]);
    t.out("ReduceSumSquare", "sumsq", &[x], vec![("axes", ints(&[0]))]);
    let original = t.model(17);
    let (done, worst) = upgrade_tiny("reduce", &original, &[18, 21], &[vec![("x".into(), data(&[2, 3, 4], 4))]]);
    assert_eq!(worst, 0.0);
    for (m, rewrites) in &done {
        assert_eq!(rewrites.len(), 6, "{rewrites:?}");
        assert_eq!(const_input(&m.graph, by_name(&m.graph, "mean_axis1"), 1), vec![1]);
        assert_eq!(const_input(&m.graph, by_name(&m.graph, "max"), 1), vec![0, 2]);
        assert_eq!(by_name(&m.graph, "mean_all").inputs.len(), 1);
    }
    let mut same = original.clone();
    assert_eq!(upgrade_opset(&mut same, 17).unwrap(), vec![], "a target at the current opset is a no-op");
    assert_eq!(same, original);
}

#[test]
fn opset_9_ops_upgrade_to_10_11_13_and_21() {
    let mut t = Tiny::new();
    let x = t.input("x", &[1, 2, 3, 4]);
    let scales = t.init("scales", Tensor::from_vec(&[4], vec![1f32, 1.0, 2.0, 3.0]).unwrap());
    t.out("Upsample", "upsample_nearest", &[x, scales], vec![("mode", s("nearest"))]);
    t.out("Upsample", "upsample_linear", &[x, scales], vec![("mode", s("linear"))]);
    t.out("Slice", "slice", &[x], vec![("starts", ints(&[1, -3])), ("ends", ints(&[2, 1000])), ("axes", ints(&[1, 3]))]);
    let topk = t.op("TopK", "topk", &[x], 2, vec![("k", Attr::Int(2))]);
    t.output_typed(topk[0], DType::F32, &[1, 2, 3, 2]);
    t.output_typed(topk[1], DType::I64, &[1, 2, 3, 2]);
    let dropped = t.op("Dropout", "dropout", &[x], 1, vec![("ratio", Attr::Float(0.3))])[0];
    t.out("Clip", "clip_both", &[dropped], vec![("min", Attr::Float(-0.5)), ("max", Attr::Float(0.75))]);
    t.out("Clip", "clip_max", &[x], vec![("max", Attr::Float(0.25))]);
    t.out("Pad", "pad_value", &[x], vec![("pads", ints(&[0, 0, 1, 2, 0, 1, 0, 1])), ("value", Attr::Float(1.5))]);
    t.out("Pad", "pad_reflect", &[x], vec![("pads", ints(&[0, 0, 1, 1, 0, 0, 2, 1])), ("mode", s("reflect"))]);
    t.out("ReduceSum", "sum", &[x], vec![("axes", ints(&[1]))]);
    let idx = t.init("idx", Tensor::from_vec(&[1, 2, 1, 2], vec![2i64, 0, 1, 3]).unwrap());
    let upd = t.init("upd", Tensor::from_vec(&[1, 2, 1, 2], vec![9f32, 8.0, 7.0, 6.0]).unwrap());
    let scattered = t.op("Scatter", "scatter", &[x, idx, upd], 1, vec![("axis", Attr::Int(3))])[0];
    t.output_typed(scattered, DType::F32, &[1, 2, 3, 4]);
    t.out("Unsqueeze", "unsqueeze", &[x], vec![("axes", ints(&[0]))]);
    let original = t.model(9);
    let mut inf = data(&[1, 2, 3, 4], 5).into_vec::<f32>().unwrap();
    inf[5] = f32::INFINITY;
    inf[6] = f32::NEG_INFINITY;
    let inputs = vec![vec![("x".into(), data(&[1, 2, 3, 4], 5))], vec![("x".into(), Tensor::from_vec(&[1, 2, 3, 4], inf).unwrap())]];
    let (done, worst) = upgrade_tiny("opset9", &original, &[10, 11, 13, 21], &inputs);
    assert_eq!(worst, 0.0);
    for ((m, rewrites), to) in done.iter().zip([10, 11, 13, 21]) {
        assert_eq!(rewrites.len(), due(&original.graph, 9, to), "{to}: {rewrites:#?}");
        let up = by_name(&m.graph, "upsample_nearest");
        assert_eq!(up.op_type, "Resize");
        assert_eq!(up.attr_str("nearest_mode"), (to >= 11).then_some("floor"));
        assert_eq!(up.inputs.iter().filter(|i| i.is_some()).count(), if to == 11 { 3 } else { 2 });
        assert_eq!(const_input(&m.graph, by_name(&m.graph, "slice"), 3), vec![1, 3]);
        assert_eq!(const_input(&m.graph, by_name(&m.graph, "topk"), 1), vec![2]);
        assert_eq!(by_name(&m.graph, "clip_max").inputs.len(), if to >= 11 { 3 } else { 1 }, "an absent min becomes the old default");
    }
}

#[test]
fn resize_10_rounding_is_made_explicit() {
    let mut t = Tiny::new();
    let x = t.input("x", &[1, 1, 4, 6]);
    let up = t.init("up", Tensor::from_vec(&[4], vec![1f32, 1.0, 1.5, 2.5]).unwrap());
    let down = t.init("down", Tensor::from_vec(&[4], vec![1f32, 1.0, 0.5, 0.7]).unwrap());
    t.out("Resize", "nearest_up", &[x, up], vec![("mode", s("nearest"))]);
    t.out("Resize", "nearest_down", &[x, down], vec![("mode", s("nearest"))]);
    t.out("Resize", "linear_up", &[x, up], vec![("mode", s("linear"))]);
    let original = t.model(10);
    let (done, worst) = upgrade_tiny("resize10", &original, &[11, 13, 21], &[vec![("x".into(), data(&[1, 1, 4, 6], 6))]]);
    assert_eq!(worst, 0.0);
    for (m, _) in &done {
        assert_eq!(by_name(&m.graph, "nearest_up").attr_str("nearest_mode"), Some("floor"));
        assert_eq!(by_name(&m.graph, "nearest_down").attr_str("nearest_mode"), Some("ceil"));
        assert_eq!(by_name(&m.graph, "linear_up").attr_str("coordinate_transformation_mode"), Some("asymmetric"));
    }
}

#[test]
fn subgraph_bodies_are_upgraded_with_their_own_constants() {
    let branch = |name: &str, op: &str| {
        let mut g = Graph::new(name);
        let x = g.add_outer("x").unwrap();
        let y = g.new_value(format!("{name}_y"), None).unwrap();
        g.add_node(Node::new(op, format!("{name}_{op}")).with_inputs([x]).with_outputs([y]).with_attr("axis", Attr::Int(1))).unwrap();
        let z = g.new_value(format!("{name}_z"), f32_type(&[1, 2, 3, 4])).unwrap();
        g.add_node(Node::new("Unsqueeze", format!("{name}_unsqueeze")).with_inputs([y]).with_outputs([z]).with_attr("axes", ints(&[0]))).unwrap();
        g.set_outputs(vec![z]).unwrap();
        g
    };
    let mut t = Tiny::new();
    let _ = t.input("x", &[2, 3, 4]);
    let cond = t.g.add_input("cond", Some(ValueType::tensor_of(DType::Bool, &[]))).unwrap();
    let out = t.g.new_value("y", f32_type(&[1, 2, 3, 4])).unwrap();
    t.g.add_node(Node::new("If", "if").with_inputs([cond]).with_outputs([out])
        .with_attr("then_branch", Attr::Graph(Box::new(branch("then", "Softmax"))))
        .with_attr("else_branch", Attr::Graph(Box::new(branch("else", "LogSoftmax"))))).unwrap();
    t.outputs.push(out);
    let original = t.model(11);
    let feed = |c: bool| vec![("x".to_string(), data(&[2, 3, 4], 7)), ("cond".to_string(), Tensor::from_bools(&[], &[c]).unwrap())];
    let (done, worst) = upgrade_tiny("subgraph", &original, &[13, 21], &[feed(true), feed(false)]);
    assert_eq!(worst, 0.0);
    for (m, rewrites) in &done {
        assert_eq!(rewrites.len(), 4, "{rewrites:#?}");
        assert!(rewrites.iter().all(|r| r.graph == "then" || r.graph == "else"));
        let if_node = by_name(&m.graph, "if");
        for (_, sub) in if_node.subgraphs() {
            assert_eq!(count(sub, "Flatten"), 1, "{}", sub.name);
            assert_eq!(sub.initializers().count(), 1, "{}: the axes constant lives in the subgraph", sub.name);
        }
        assert_eq!(m.graph.initializers().count(), 0);
    }
}

#[test]
fn inexpressible_upgrades_fail_naming_the_node_and_change_nothing() {
    let fails = |m: &Model, to: i64| {
        let mut copy = m.clone();
        let e = upgrade_opset(&mut copy, to).unwrap_err();
        assert_eq!(&copy, m, "a failed upgrade leaves the model unchanged");
        e
    };
    let node_of = |e: UpgradeError| match e {
        UpgradeError::Node { node, reason, .. } => (node, reason),
        e => panic!("expected a node error, got {e}"),
    };

    let mut t = Tiny::new();
    let x = t.input("x", &[1, 2, 3]);
    let p: Vec<ValueId> = (0..4).map(|i| t.init(&format!("p{i}"), Tensor::from_vec(&[2, 3], vec![1f32; 6]).unwrap())).collect();
    t.out("Relu", "relu", &[x], vec![]);
    t.out("BatchNormalization", "bn", &[x, p[0], p[1], p[2], p[3]], vec![("spatial", Attr::Int(0))]);
    let (node, reason) = node_of(fails(&t.model(7), 13));
    assert_eq!(node, "bn");
    assert!(reason.contains("spatial"), "{reason}");

    let mut t = Tiny::new();
    let x = t.input("x", &[1, 1, 4, 4]);
    let mixed = t.init("mixed", Tensor::from_vec(&[4], vec![1f32, 1.0, 2.0, 0.5]).unwrap());
    t.out("Softmax", "softmax", &[x], vec![]);
    t.out("Resize", "resize_mixed", &[x, mixed], vec![]);
    let m = t.model(10);
    assert_eq!(node_of(fails(&m, 21)).0, "resize_mixed");
    assert!(matches!(fails(&m, 22), UpgradeError::Model { .. }));

    let mut t = Tiny::new();
    let x = t.input("x", &[2, 2]);
    let outs = t.op("Dropout", "dropout", &[x], 2, vec![]);
    t.output(outs[0]);
    t.output(outs[1]);
    assert_eq!(node_of(fails(&t.model(9), 13)).0, "dropout");
}
