//! Wrong inputs and unsupported ops give errors that name the input or node, never panics.

mod common;

use common::{expect_err, f32s, i64s, run};
use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor, ValueType};
use qforge_runtime::{RuntimeError, Session};
use qforge_testkit::repo;

fn tiny() -> Session {
    let model = qforge_onnx::load(&repo().join("examples/tiny_cnn.onnx")).unwrap();
    Session::new(&model).unwrap()
}

fn err(r: Result<Vec<(String, Tensor)>, RuntimeError>) -> String {
    r.expect_err("the run must fail").to_string()
}

#[test]
fn wrong_inputs_are_named() {
    let s = tiny();
    let good = Tensor::zeros(DType::F32, &[1, 3, 32, 32]).unwrap();
    assert!(s.run(vec![("x".into(), good.clone())]).is_ok());
    let e = err(s.run(vec![("y".into(), good.clone())]));
    assert!(e.contains("input 'y'") && e.contains("'x'"), "{e}");
    let e = err(s.run(vec![]));
    assert!(e.contains("input 'x'") && e.contains("required"), "{e}");
    let e = err(s.run(vec![("x".into(), Tensor::zeros(DType::F64, &[1, 3, 32, 32]).unwrap())]));
    assert!(e.contains("input 'x'") && e.contains("float"), "{e}");
    let e = err(s.run(vec![("x".into(), Tensor::zeros(DType::F32, &[3, 32, 32]).unwrap())]));
    assert!(e.contains("input 'x'") && e.contains("rank 4"), "{e}");
    let e = err(s.run(vec![("x".into(), Tensor::zeros(DType::F32, &[1, 4, 32, 32]).unwrap())]));
    assert!(e.contains("dimension 1 must be 3"), "{e}");
    let e = err(s.run(vec![("x".into(), good.clone()), ("x".into(), good)]));
    assert!(e.contains("more than once"), "{e}");
    // A dynamic batch of a different size still runs.
    assert!(s.run(vec![("x".into(), Tensor::zeros(DType::F32, &[2, 3, 32, 32]).unwrap())]).is_ok());
}

#[test]
fn unsupported_ops_and_bad_shapes_name_the_node() {
    let mut g = Graph::new("g");
    let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[2]))).unwrap();
    let y = g.new_value("y", None).unwrap();
    g.add_node(Node::new("NotAnOp", "mystery").with_inputs([x]).with_outputs([y])).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let model = Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 17 }], graph: g, ..Default::default() };
    let e = Session::new(&model).err().unwrap().to_string();
    assert!(e.contains("'mystery'") && e.contains("NotAnOp") && e.contains("not supported"), "{e}");

    let mut g = Graph::new("g");
    let a = g.add_input("a", None).unwrap();
    let b = g.add_input("b", None).unwrap();
    let c = g.new_value("c", None).unwrap();
    g.add_node(Node::new("MatMul", "mm").with_inputs([a, b]).with_outputs([c])).unwrap();
    g.set_outputs(vec![c]).unwrap();
    let model = Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 17 }], graph: g, ..Default::default() };
    let s = Session::new(&model).unwrap();
    let e = err(s.run(vec![("a".into(), Tensor::zeros(DType::F32, &[2, 3]).unwrap()), ("b".into(), Tensor::zeros(DType::F32, &[4, 5]).unwrap())]));
    assert!(e.contains("'mm'") && e.contains("do not align"), "{e}");
}

#[test]
fn a_conv_kernel_of_size_zero_is_an_error_naming_the_node() {
    let mut g = Graph::new("g");
    let x = g.add_input("x", None).unwrap();
    let w = g.add_input("w", None).unwrap();
    let y = g.new_value("y", None).unwrap();
    g.add_node(Node::new("Conv", "empty_kernel").with_inputs([x, w]).with_outputs([y])).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let model = Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 17 }], graph: g, ..Default::default() };
    let s = Session::new(&model).unwrap();
    let feed = vec![("x".into(), Tensor::zeros(DType::F32, &[1, 1, 4, 4]).unwrap()), ("w".into(), Tensor::zeros(DType::F32, &[1, 1, 0, 3]).unwrap())];
    let e = err(s.run(feed));
    assert!(e.contains("'empty_kernel'") && e.contains("kernel size 0"), "{e}");
}

#[test]
fn ops_along_an_axis_refuse_scalars() {
    let scalar = || f32s(&[], vec![1.5]);
    for (op, inputs) in [
        ("ArgMax", vec![scalar()]),
        ("ArgMin", vec![scalar()]),
        ("Softmax", vec![scalar()]),
        ("LogSoftmax", vec![scalar()]),
        ("Hardmax", vec![scalar()]),
        ("LpNormalization", vec![scalar()]),
        ("Split", vec![scalar()]),
        ("Concat", vec![scalar(), scalar()]),
        ("Gather", vec![scalar(), i64s(&[], vec![0])]),
        ("CumSum", vec![scalar(), i64s(&[], vec![0])]),
    ] {
        let attrs: &[(&str, Attr)] = if op == "CumSum" { &[] } else { &[("axis", Attr::Int(0))] };
        expect_err(run(op, 13, attrs, inputs, 1), &["axis 0", "rank 0"]);
    }
}

fn opset17(g: Graph) -> Model {
    Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 17 }], graph: g, ..Default::default() }
}

#[test]
fn sequence_and_optional_misuse_names_the_node() {
    // x [2, 3] and y [2, 4] in a sequence; SequenceAt at `pos`, ConcatFromSequence on `axis`.
    let build = |axis: i64| {
        let mut g = Graph::new("g");
        let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[2, 3]))).unwrap();
        let y = g.add_input("y", Some(ValueType::tensor_of(DType::F32, &[2, 4]))).unwrap();
        let pos = g.add_input("pos", Some(ValueType::tensor_of(DType::I64, &[]))).unwrap();
        let seq = g.new_value("seq", None).unwrap();
        let at = g.new_value("at", None).unwrap();
        let joined = g.new_value("joined", None).unwrap();
        g.add_node(Node::new("SequenceConstruct", "build").with_inputs([x, y]).with_outputs([seq])).unwrap();
        g.add_node(Node::new("SequenceAt", "pick").with_inputs([seq, pos]).with_outputs([at])).unwrap();
        g.add_node(Node::new("ConcatFromSequence", "join").with_inputs([seq]).with_outputs([joined]).with_attr("axis", Attr::Int(axis))).unwrap();
        g.set_outputs(vec![at, joined]).unwrap();
        Session::new(&opset17(g)).unwrap()
    };
    let feeds = |pos: i64| vec![
        ("x".to_string(), Tensor::zeros(DType::F32, &[2, 3]).unwrap()),
        ("y".to_string(), Tensor::from_vec(&[2, 4], (0..8).map(|v| v as f32).collect()).unwrap()),
        ("pos".to_string(), Tensor::scalar(pos)),
    ];
    let s = build(1);
    let out = s.run(feeds(-1)).unwrap();
    assert_eq!(out[0].1.as_slice::<f32>().unwrap(), (0..8).map(|v| v as f32).collect::<Vec<_>>().as_slice());
    assert_eq!(out[1].1.shape(), &[2, 7]);
    for pos in [2, -3] {
        let e = err(s.run(feeds(pos)));
        assert!(e.contains("'pick'") && e.contains(&format!("position {pos} is out of range for a sequence of 2 tensors")), "{e}");
    }
    let e = err(build(0).run(feeds(0)));
    assert!(e.contains("'join'") && e.contains("cannot concatenate float [2, 3] with float [2, 4] on axis 0"), "{e}");

    // An empty optional read with OptionalGetElement.
    let mut g = Graph::new("g");
    let none = g.new_value("none", None).unwrap();
    let got = g.new_value("got", None).unwrap();
    let ty = ValueType::tensor_of(DType::F32, &[2]);
    g.add_node(Node::new("Optional", "nothing").with_outputs([none]).with_attr("type", Attr::Type(ty))).unwrap();
    g.add_node(Node::new("OptionalGetElement", "get").with_inputs([none]).with_outputs([got])).unwrap();
    g.set_outputs(vec![got]).unwrap();
    let e = err(Session::new(&opset17(g)).unwrap().run(vec![]));
    assert!(e.contains("'get'") && e.contains("the optional input is empty"), "{e}");

    // A sequence where a tensor op expects a tensor, and a sequence as a graph output of `run`.
    let mut g = Graph::new("g");
    let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[2]))).unwrap();
    let seq = g.new_value("seq", None).unwrap();
    let r = g.new_value("r", None).unwrap();
    g.add_node(Node::new("SequenceConstruct", "build").with_inputs([x]).with_outputs([seq])).unwrap();
    g.add_node(Node::new("Relu", "relu").with_inputs([seq]).with_outputs([r])).unwrap();
    g.set_outputs(vec![r, seq]).unwrap();
    let s = Session::new(&opset17(g)).unwrap();
    let e = err(s.run(vec![("x".into(), Tensor::zeros(DType::F32, &[2]).unwrap())]));
    assert!(e.contains("'relu'") && e.contains("input 0 is a sequence of 1 float tensors; the op takes tensors"), "{e}");
}

#[test]
fn run_refuses_sequence_outputs_and_run_values_returns_them() {
    let mut g = Graph::new("g");
    let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[4]))).unwrap();
    let seq = g.new_value("pieces", None).unwrap();
    g.add_node(Node::new("SplitToSequence", "split").with_inputs([x]).with_outputs([seq])).unwrap();
    g.set_outputs(vec![seq]).unwrap();
    let s = Session::new(&opset17(g)).unwrap();
    let x = Tensor::from_vec(&[4], vec![1f32, 2., 3., 4.]).unwrap();
    let e = err(s.run(vec![("x".into(), x.clone())]));
    assert!(e.contains("output 'pieces' is a sequence of 4 float tensors"), "{e}");
    let out = s.run_values(vec![("x".into(), x.into())]).unwrap();
    let qforge_runtime::Value::Sequence(seq) = &out[0].1 else { panic!("{:?}", out[0].1) };
    assert_eq!(seq.items.iter().map(|t| t.as_slice::<f32>().unwrap().to_vec()).collect::<Vec<_>>(), vec![vec![1.], vec![2.], vec![3.], vec![4.]]);
}
