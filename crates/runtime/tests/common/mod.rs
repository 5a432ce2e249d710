//! Shared helpers of the single-op kernel tests: run one node, build inputs, expect an error.

#![allow(dead_code)]

use qforge_ir::{Attr, Graph, Model, Node, OpsetImport, Tensor, MS_DOMAIN};
use qforge_runtime::Session;

/// Runs one `op` node at `opset` on `inputs` (named `in0`, `in1`, ...; `None` leaves an
/// optional input out) with `outputs` outputs.
pub fn run(op: &str, opset: i64, attrs: &[(&str, Attr)], inputs: Vec<Option<Tensor>>, outputs: usize) -> Result<Vec<Tensor>, String> {
    run_in("", &[OpsetImport { domain: String::new(), version: opset }], op, attrs, inputs, outputs)
}

/// [`run`] for an op of ONNX Runtime's `com.microsoft` domain (version 1, beside the default
/// domain at opset 17).
pub fn run_ms(op: &str, attrs: &[(&str, Attr)], inputs: Vec<Option<Tensor>>, outputs: usize) -> Result<Vec<Tensor>, String> {
    let opsets = [OpsetImport { domain: String::new(), version: 17 }, OpsetImport { domain: MS_DOMAIN.into(), version: 1 }];
    run_in(MS_DOMAIN, &opsets, op, attrs, inputs, outputs)
}

/// [`run`] with the node in `domain` and the model importing `opsets`.
fn run_in(domain: &str, opsets: &[OpsetImport], op: &str, attrs: &[(&str, Attr)], inputs: Vec<Option<Tensor>>, outputs: usize) -> Result<Vec<Tensor>, String> {
    let mut g = Graph::new("g");
    let mut ids = vec![];
    let mut feed = vec![];
    for (i, t) in inputs.into_iter().enumerate() {
        match t {
            Some(t) => {
                let name = format!("in{i}");
                ids.push(Some(g.add_input(&name, None).unwrap()));
                feed.push((name, t));
            }
            None => ids.push(None),
        }
    }
    let outs: Vec<_> = (0..outputs).map(|i| g.new_value(format!("out{i}"), None).unwrap()).collect();
    let mut node = Node::new(op, "node").with_outputs(outs.iter().copied());
    node.domain = domain.to_string();
    node.inputs = ids;
    for (name, value) in attrs {
        node = node.with_attr(name, value.clone());
    }
    g.add_node(node).unwrap();
    g.set_outputs(outs).unwrap();
    let model = Model { ir_version: 8, opset_imports: opsets.to_vec(), graph: g, ..Default::default() };
    let session = Session::new(&model).map_err(|e| e.to_string())?;
    session.run(feed).map(|v| v.into_iter().map(|(_, t)| t).collect()).map_err(|e| e.to_string())
}

pub fn f32s(shape: &[usize], v: Vec<f32>) -> Option<Tensor> {
    Some(Tensor::from_vec(shape, v).unwrap())
}

pub fn i64s(shape: &[usize], v: Vec<i64>) -> Option<Tensor> {
    Some(Tensor::from_vec(shape, v).unwrap())
}

pub fn expect_err(r: Result<Vec<Tensor>, String>, words: &[&str]) {
    let e = r.expect_err("the run must fail");
    assert!(words.iter().all(|w| e.contains(w)), "{e}");
}
