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
    r.err().expect("the run must fail").to_string()
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
