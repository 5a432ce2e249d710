//! Loop feeds its body the iteration number and condition in the shape the body declares, and
//! a value the body refuses names the Loop node.

use qforge_ir::{Attr, DType, Graph, Model, Node, OpsetImport, Tensor, ValueType};
use qforge_runtime::Session;

/// `acc = acc0; for i in 0..3 { acc = acc + i }`, the body's iteration number, condition and
/// accumulator declared with `shape` (`[]` as ONNX specifies, `[1]` as Paddle exports).
fn sum_of_counters(shape: &[usize]) -> Session {
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let mut body = Graph::new("body");
    let i = body.add_input("i", Some(ValueType::tensor_of(DType::I64, &dims))).unwrap();
    let cond = body.add_input("cond", Some(ValueType::tensor_of(DType::Bool, &dims))).unwrap();
    let acc = body.add_input("acc", Some(ValueType::tensor_of(DType::I64, &dims))).unwrap();
    let cond_out = body.new_value("cond_out", None).unwrap();
    let acc_out = body.new_value("acc_out", None).unwrap();
    body.add_node(Node::new("Identity", "keep_going").with_inputs([cond]).with_outputs([cond_out])).unwrap();
    body.add_node(Node::new("Add", "add_counter").with_inputs([acc, i]).with_outputs([acc_out])).unwrap();
    body.set_outputs(vec![cond_out, acc_out]).unwrap();

    let mut g = Graph::new("g");
    let m = g.add_initializer("m", Tensor::scalar(3i64)).unwrap();
    let c = g.add_initializer("c", Tensor::from_bools(&[], &[true]).unwrap()).unwrap();
    let acc0 = g.add_input("acc0", None).unwrap();
    let y = g.new_value("y", None).unwrap();
    g.add_node(Node::new("Loop", "loop").with_inputs([m, c, acc0]).with_outputs([y]).with_attr("body", Attr::Graph(Box::new(body)))).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let model = Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() };
    Session::new(&model).unwrap()
}

#[test]
fn loop_counters_take_the_rank_the_body_declares() {
    for shape in [&[][..], &[1]] {
        let acc0 = Tensor::from_vec(shape, vec![10i64]).unwrap();
        let out = sum_of_counters(shape).run(vec![("acc0".into(), acc0)]).unwrap_or_else(|e| panic!("{shape:?}: {e}"));
        assert_eq!(out[0].1.shape(), shape);
        assert_eq!(out[0].1.as_slice::<i64>().unwrap(), &[13]);
    }
}

#[test]
fn a_value_the_body_refuses_is_an_error_of_the_loop_node() {
    let e = sum_of_counters(&[1]).run(vec![("acc0".into(), Tensor::scalar(10i64))]).expect_err("acc is declared [1]").to_string();
    assert!(e.contains("'loop'") && e.contains("subgraph 'body': input 'acc'") && e.contains("rank 1"), "{e}");
}
