//! OneHot, ScatterElements, ScatterND and GatherND cases the ONNX node tests do not cover:
//! opset 9's negative indices, float indices, integer and string data, negative index tuples,
//! and errors that name the node.

use qforge_ir::{Attr, Graph, Model, Node, OpsetImport, Tensor};
use qforge_runtime::Session;

/// A model of one default-domain node over the given inputs, at `opset`.
fn one_node(op: &str, opset: i64, inputs: &[&str], attrs: Vec<(&str, Attr)>) -> Session {
    let mut g = Graph::new("g");
    let ins: Vec<_> = inputs.iter().map(|n| g.add_input(*n, None).unwrap()).collect();
    let y = g.new_value("y", None).unwrap();
    let mut node = Node::new(op, "the_node").with_inputs(ins).with_outputs([y]);
    for (k, v) in attrs {
        node = node.with_attr(k, v);
    }
    g.add_node(node).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let model = Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: opset }], graph: g, ..Default::default() };
    Session::new(&model).unwrap()
}

fn run(s: &Session, feeds: Vec<(&str, Tensor)>) -> Result<Tensor, String> {
    let feeds = feeds.into_iter().map(|(n, t)| (n.to_string(), t)).collect();
    s.run(feeds).map(|mut o| o.remove(0).1).map_err(|e| e.to_string())
}

fn t<T: qforge_ir::Elem>(shape: &[usize], v: Vec<T>) -> Tensor {
    Tensor::from_vec(shape, v).unwrap()
}

#[test]
fn one_hot_wraps_negative_indices_from_opset_11_only() {
    let feeds = || vec![("i", t(&[3], vec![-1i64, 0, 3])), ("d", Tensor::scalar(3i64)), ("v", t(&[2], vec![0i32, 1]))];
    let y = run(&one_node("OneHot", 11, &["i", "d", "v"], vec![]), feeds()).unwrap();
    assert_eq!(y.shape(), &[3, 3]);
    assert_eq!(y.as_slice::<i32>().unwrap(), &[0, 0, 1, 1, 0, 0, 0, 0, 0]);
    let y = run(&one_node("OneHot", 9, &["i", "d", "v"], vec![]), feeds()).unwrap();
    assert_eq!(y.as_slice::<i32>().unwrap(), &[0, 0, 0, 1, 0, 0, 0, 0, 0]);
}

#[test]
fn one_hot_truncates_float_indices_and_depth_and_inserts_axis_0() {
    let s = one_node("OneHot", 11, &["i", "d", "v"], vec![("axis", Attr::Int(0))]);
    let y = run(&s, vec![("i", t(&[2], vec![1.7f32, -0.5])), ("d", t(&[1], vec![2.9f64])), ("v", t(&[2], vec![-1.0f32, 5.0]))]).unwrap();
    assert_eq!(y.shape(), &[2, 2]);
    assert_eq!(y.as_slice::<f32>().unwrap(), &[-1.0, 5.0, 5.0, -1.0]);
}

#[test]
fn one_hot_errors_name_the_node() {
    let s = one_node("OneHot", 11, &["i", "d", "v"], vec![]);
    let e = run(&s, vec![("i", t(&[1], vec![0i64])), ("d", t(&[2], vec![2i64, 3])), ("v", t(&[2], vec![0f32, 1.0]))]).unwrap_err();
    assert!(e.contains("'the_node'") && e.contains("depth"), "{e}");
    let e = run(&s, vec![("i", t(&[1], vec![0i64])), ("d", Tensor::scalar(2i64)), ("v", t(&[3], vec![0f32, 1.0, 2.0]))]).unwrap_err();
    assert!(e.contains("'the_node'") && e.contains("two elements"), "{e}");
}

#[test]
fn scatter_elements_reduces_integers_in_update_order() {
    let data = || t(&[1, 3], vec![100u8, 2, 3]);
    let idx = || t(&[1, 4], vec![0i32, 0, -1, 2]);
    let upd = || t(&[1, 4], vec![100u8, 70, 4, 5]);
    for (reduction, want) in [("add", [14u8, 2, 12]), ("mul", [96, 2, 60]), ("max", [100, 2, 5]), ("min", [70, 2, 3]), ("none", [70, 2, 5])] {
        let s = one_node("ScatterElements", 18, &["x", "i", "u"], vec![("axis", Attr::Int(-1)), ("reduction", Attr::String(reduction.into()))]);
        let y = run(&s, vec![("x", data()), ("i", idx()), ("u", upd())]).unwrap();
        assert_eq!(y.as_slice::<u8>().unwrap(), &want, "{reduction}");
    }
}

#[test]
fn scatter_writes_strings_and_old_scatter_is_an_alias() {
    let strings = |v: &[&str]| Tensor::from_strings(&[v.len()], v.iter().map(|s| s.as_bytes().to_vec()).collect()).unwrap();
    let s = one_node("ScatterElements", 13, &["x", "i", "u"], vec![]);
    let y = run(&s, vec![("x", strings(&["a", "b", "c"])), ("i", t(&[1], vec![1i64])), ("u", strings(&["z"]))]).unwrap();
    assert_eq!(y.strings().unwrap(), &[b"a".to_vec(), b"z".to_vec(), b"c".to_vec()]);
    let s = one_node("Scatter", 10, &["x", "i", "u"], vec![]);
    let y = run(&s, vec![("x", t(&[3], vec![0f32; 3])), ("i", t(&[2], vec![2i64, 0])), ("u", t(&[2], vec![1f32, 2.0]))]).unwrap();
    assert_eq!(y.as_slice::<f32>().unwrap(), &[2.0, 0.0, 1.0]);
}

#[test]
fn scatter_elements_errors_name_the_node() {
    let s = one_node("ScatterElements", 18, &["x", "i", "u"], vec![]);
    let e = run(&s, vec![("x", t(&[2, 2], vec![0f32; 4])), ("i", t(&[1, 1], vec![2i64])), ("u", t(&[1, 1], vec![1f32]))]).unwrap_err();
    assert!(e.contains("'the_node'") && e.contains("out of range"), "{e}");
    let e = run(&s, vec![("x", t(&[2, 2], vec![0f32; 4])), ("i", t(&[1, 3], vec![0i64; 3])), ("u", t(&[1, 3], vec![1f32; 3]))]).unwrap_err();
    assert!(e.contains("'the_node'") && e.contains("exceed"), "{e}");
    let e = run(&s, vec![("x", t(&[2], vec![0f32; 2])), ("i", t(&[1], vec![0i64])), ("u", t(&[1], vec![1i64]))]).unwrap_err();
    assert!(e.contains("'the_node'") && e.contains("type"), "{e}");
    let bools = |v: &[bool]| Tensor::from_bools(&[v.len()], v).unwrap();
    let s = one_node("ScatterElements", 18, &["x", "i", "u"], vec![("reduction", Attr::String("add".into()))]);
    let e = run(&s, vec![("x", bools(&[true, false])), ("i", t(&[1], vec![0i64])), ("u", bools(&[true]))]).unwrap_err();
    assert!(e.contains("'the_node'") && e.contains("does not support bool"), "{e}");

    let mut g = Graph::new("g");
    let ins: Vec<_> = ["x", "i", "u"].iter().map(|n| g.add_input(*n, None).unwrap()).collect();
    let y = g.new_value("y", None).unwrap();
    g.add_node(Node::new("ScatterElements", "bad_reduction").with_inputs(ins).with_outputs([y]).with_attr("reduction", Attr::String("sum".into()))).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let model = Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 18 }], graph: g, ..Default::default() };
    let e = Session::new(&model).err().expect("an unknown reduction is refused").to_string();
    assert!(e.contains("'bad_reduction'") && e.contains("sum"), "{e}");
}

#[test]
fn scatter_nd_errors_name_the_node() {
    let s = one_node("ScatterND", 18, &["x", "i", "u"], vec![]);
    let x = || t(&[2, 3], vec![0f32; 6]);
    let e = run(&s, vec![("x", x()), ("i", t(&[1, 3], vec![0i64; 3])), ("u", t(&[1], vec![1f32]))]).unwrap_err();
    assert!(e.contains("'the_node'") && e.contains("must end in a dimension of 1 to 2"), "{e}");
    let e = run(&s, vec![("x", x()), ("i", t(&[1, 1], vec![-3i64])), ("u", t(&[1, 3], vec![1f32; 3]))]).unwrap_err();
    assert!(e.contains("'the_node'") && e.contains("out of range"), "{e}");
    let e = run(&s, vec![("x", x()), ("i", t(&[1, 1], vec![1i64])), ("u", t(&[1, 2], vec![1f32; 2]))]).unwrap_err();
    assert!(e.contains("'the_node'") && e.contains("do not match [1, 3]"), "{e}");
    // A negative index counts from the end: row -1 is row 1.
    let y = run(&s, vec![("x", x()), ("i", t(&[1, 1], vec![-1i64])), ("u", t(&[1, 3], vec![1f32, 2.0, 3.0]))]).unwrap();
    assert_eq!(y.as_slice::<f32>().unwrap(), [0.0, 0.0, 0.0, 1.0, 2.0, 3.0]);
}

#[test]
fn gather_nd_selects_slices_per_batch_and_names_the_node_on_errors() {
    let s = one_node("GatherND", 13, &["x", "i"], vec![("batch_dims", Attr::Int(1))]);
    let x = || t(&[2, 2, 2], (0..8).map(|v| v as f32).collect());
    // Batch 0 takes its row 1, batch 1 its row -2 (row 0).
    let y = run(&s, vec![("x", x()), ("i", t(&[2, 1], vec![1i64, -2]))]).unwrap();
    assert_eq!((y.shape(), y.as_slice::<f32>().unwrap()), (&[2usize, 2][..], &[2.0f32, 3.0, 4.0, 5.0][..]));
    let e = run(&s, vec![("x", x()), ("i", t(&[2, 1], vec![2i64, 0]))]).unwrap_err();
    assert!(e.contains("'the_node'") && e.contains("out of range"), "{e}");
    let e = run(&s, vec![("x", x()), ("i", t(&[3, 1], vec![0i64; 3]))]).unwrap_err();
    assert!(e.contains("'the_node'") && e.contains("do not fit"), "{e}");
}
