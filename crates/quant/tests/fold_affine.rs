//! Folding per-channel affine maps (BatchNormalization, constant Mul/Add/Sub/Div) into the
//! preceding Conv/ConvTranspose/Gemm keeps the model's outputs, checked with ONNX Runtime on the
//! original (with ORT's own fusions off, so every node runs as written) and the folded model
//! (rtol 1e-4, atol 1e-5): on real models, and on a small graph with every foldable form and
//! the forms that must not fold.

use qforge_ir::{DType, Graph, Model, Node, OpsetImport, Tensor, ValueId, ValueType};
use qforge_quant::passes::fold_affine;
use qforge_testkit::{compare, make_inputs, ort_run_with, real_models, TempDir};

const AFFINE: [&str; 5] = ["BatchNormalization", "Mul", "Add", "Sub", "Div"];

fn count(g: &Graph, ops: &[&str]) -> usize {
    g.nodes().filter(|(_, n)| ops.contains(&n.op_type.as_str())).count()
}

/// Runs `original` and `folded` in ORT (fusions off) on `inputs` and asserts equal outputs.
fn assert_same_outputs(tag: &str, original: &std::path::Path, folded: &Model, inputs: &[(String, Tensor)], tmp: &TempDir) {
    let path = tmp.path().join(format!("{tag}.folded.onnx"));
    qforge_onnx::save(folded, &path).unwrap();
    let (a, b) = (ort_run_with(original, inputs, 1, false), ort_run_with(&path, inputs, 1, false));
    assert_eq!(a.len(), b.len());
    for ((name, x), (name_b, y)) in a.iter().zip(&b) {
        assert_eq!(name, name_b, "{tag}: output names changed");
        let (worst, ok) = compare(y, x, 1e-4, 1e-5);
        println!("{tag:<12} '{name}' max |diff| {worst:.2e}");
        assert!(ok, "{tag} output '{name}': max |diff| {worst}");
    }
}

#[test]
fn folded_real_models_match_the_originals() {
    let tmp = TempDir::new("foldaffine");
    let mut total = 0;
    for m in real_models().into_iter().filter(|m| ["ocr_cls", "ocr_det", "orientation"].contains(&m.name.as_str())) {
        let original = qforge_onnx::load(&m.path).unwrap();
        let mut model = original.clone();
        qforge_onnx::fold_constant_nodes(&mut model);
        let before = count(&model.graph, &AFFINE);
        let folded = fold_affine(&mut model.graph).unwrap();
        model.graph.check().unwrap();
        assert!(folded > 0, "{}: nothing folded", m.name);
        assert_eq!(count(&model.graph, &AFFINE), before - folded, "{}", m.name);
        println!("{:<12} folded {folded} of {before} BatchNormalization/Mul/Add/Sub/Div", m.name);
        assert_same_outputs(&m.name, &m.path, &model, &make_inputs(&original.graph, &m, 3), &tmp);
        total += folded;
    }
    assert!(total >= 40, "only {total} nodes folded");
}

fn constant(g: &mut Graph, name: &str, shape: &[usize], values: impl Fn(usize) -> f32) -> ValueId {
    let n = shape.iter().product();
    g.add_initializer(name, Tensor::from_vec(shape, (0..n).map(values).collect::<Vec<f32>>()).unwrap()).unwrap()
}

fn op(g: &mut Graph, op: &str, name: &str, inputs: &[ValueId]) -> ValueId {
    let out = g.new_value(format!("{name}_out"), None).unwrap();
    g.add_node(Node::new(op, name).with_inputs(inputs.iter().copied()).with_outputs([out])).unwrap();
    out
}

/// Conv -> Mul(scalar) -> Add([1,C,1,1]) -> Sub(x - [C,1,1]) -> Div(x / scalar) -> Sub(c - x)
/// folds whole; Conv -> Mul by a spatial constant, and a Conv output read twice, do not fold;
/// Gemm -> Mul([N]) folds.
#[test]
fn every_foldable_form_folds_and_the_others_do_not() {
    let mut g = Graph::new("affine");
    let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[1, 3, 6, 6]))).unwrap();
    let w = constant(&mut g, "w", &[4, 3, 3, 3], |i| ((i * 37 % 17) as f32 - 8.0) / 20.0);
    let b = constant(&mut g, "b", &[4], |i| i as f32 * 0.1 - 0.2);
    let c1 = op(&mut g, "Conv", "conv1", &[x, w, b]);
    let s = constant(&mut g, "s", &[], |_| 1.7);
    let m1 = op(&mut g, "Mul", "mul1", &[s, c1]);
    let t = constant(&mut g, "t", &[1, 4, 1, 1], |i| i as f32 - 1.5);
    let a1 = op(&mut g, "Add", "add1", &[m1, t]);
    let u = constant(&mut g, "u", &[4, 1, 1], |i| 0.3 * i as f32);
    let s1 = op(&mut g, "Sub", "sub1", &[a1, u]);
    let d = constant(&mut g, "d", &[1], |_| 6.0);
    let d1 = op(&mut g, "Div", "div1", &[s1, d]);
    let e = constant(&mut g, "e", &[4, 1, 1], |i| 0.5 - 0.25 * i as f32);
    let y1 = op(&mut g, "Sub", "sub2", &[e, d1]);
    // Not foldable: a constant varying along a spatial axis; a Conv output read twice.
    let w2 = constant(&mut g, "w2", &[4, 3, 1, 1], |i| (i as f32 - 6.0) / 7.0);
    let c2 = op(&mut g, "Conv", "conv2", &[x, w2]);
    let spatial = constant(&mut g, "spatial", &[1, 1, 1, 6], |i| 1.0 + i as f32);
    let y2 = op(&mut g, "Mul", "mul_spatial", &[c2, spatial]);
    let c3 = op(&mut g, "Conv", "conv3", &[x, w2]);
    let k = constant(&mut g, "k", &[], |_| 2.0);
    let m3 = op(&mut g, "Mul", "mul_shared", &[c3, k]);
    let y3 = op(&mut g, "Add", "add_shared", &[m3, c3]);
    // Gemm -> Mul per output feature.
    let f = g.add_input("f", Some(ValueType::tensor_of(DType::F32, &[2, 5]))).unwrap();
    let gw = constant(&mut g, "gw", &[5, 3], |i| (i as f32 - 7.0) / 9.0);
    let gm = op(&mut g, "Gemm", "gemm", &[f, gw]);
    let gs = constant(&mut g, "gs", &[3], |i| 0.5 + i as f32);
    let y4 = op(&mut g, "Mul", "gemm_scale", &[gm, gs]);
    g.set_outputs(vec![y1, y2, y3, y4]).unwrap();
    let model = Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() };
    let tmp = TempDir::new("foldaffine_small");
    let original = tmp.path().join("small.onnx");
    qforge_onnx::save(&model, &original).unwrap();

    let mut folded = model.clone();
    let n = fold_affine(&mut folded.graph).unwrap();
    folded.graph.check().unwrap();
    assert_eq!(n, 6, "mul1, add1, sub1, div1, sub2 and gemm_scale fold");
    let remaining: Vec<String> = folded.graph.nodes().filter(|(_, n)| AFFINE.contains(&n.op_type.as_str())).map(|(_, n)| n.name.clone()).collect();
    assert_eq!(remaining.len(), 3, "{remaining:?}");
    for name in ["mul_spatial", "mul_shared", "add_shared"] {
        assert!(remaining.iter().any(|r| r == name), "{name} must stay: {remaining:?}");
    }
    let inputs = vec![
        ("x".to_string(), Tensor::from_vec(&[1, 3, 6, 6], (0..108).map(|i| ((i * 29 % 31) as f32 - 15.0) / 10.0).collect::<Vec<f32>>()).unwrap()),
        ("f".to_string(), Tensor::from_vec(&[2, 5], (0..10).map(|i| i as f32 / 3.0 - 1.0).collect::<Vec<f32>>()).unwrap()),
    ];
    assert_same_outputs("small", &original, &folded, &inputs, &tmp);
}
