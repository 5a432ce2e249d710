use qforge_ir::{Graph, IrResult, NodeId, Patch, ValueId, CAPTURE_USE};

use super::{loop_body, loop_body_mut, loops};

/// Turns the loop-carried variables of every Loop (at any depth) that hold a constant of the
/// enclosing graph and that the body passes on unchanged into constants the body reads from
/// the enclosing graph.
///
/// A variable passes through when the body's output for it is its body input, through any
/// chain of `Identity`, `Squeeze` undoing an `Unsqueeze` on the same axes, and `Add`/`Sub` of
/// zeros or `Mul`/`Div` by ones that do not broadcast the value to another shape (see
/// [`identity_source`]). Paddle2ONNX carries every weight a decoder reads through its Loop
/// that way. Such a variable holds its initial value at every iteration and after the loop,
/// so the Loop loses its input, body input, body output and output; the body reads the
/// constant by name instead, and readers of the Loop output read the constant. Weights then
/// are constants the body reads, which `localize_captured_weights` makes its own, and what the
/// body computes from them alone becomes a loop invariant for `hoist_loop_invariants`.
///
/// Activations passed on unchanged (a decoder's feature map) stay carried: read by name, a
/// value that float data movement computes from a dequantized one is what ONNX Runtime's
/// `QDQPropagationTransformer` propagates Q/DQ onto, and it aborts on a subgraph's implicit
/// input (an `stl_vector.h` assertion at session creation, ONNX Runtime 1.31). A variable is also
/// kept when its Loop output is a graph output or is read by a nested graph, when a nested
/// graph reads its body input, or when the body already has a value named like the constant.
/// Returns the number of variables removed.
pub fn uncarry_loop_invariants(g: &mut Graph) -> IrResult<usize> {
    let mut removed = super::rewrite_subgraphs(g, "uncarry_loop_invariants", &uncarry_loop_invariants)?;
    for id in loops(g) {
        removed += uncarry(g, id)?;
    }
    Ok(removed)
}

/// Removes the carried variables of Loop `id` of `g` that pass through its body.
fn uncarry(g: &mut Graph, id: NodeId) -> IrResult<usize> {
    let mut node = g.node(id)?.clone();
    let Some(body) = loop_body(&node) else { return Ok(0) };
    let carried = body.inputs().len().saturating_sub(2);
    if node.inputs.len() != 2 + carried || body.outputs().len() < 1 + carried {
        return Ok(0);
    }
    let read_by_nested_graph = |graph: &Graph, v: ValueId| graph.value(v).is_ok_and(|val| val.uses().iter().any(|u| u.1 == CAPTURE_USE));
    let dropped: Vec<(usize, ValueId, String)> = (0..carried).filter_map(|k| {
        let (b, o) = (body.inputs()[2 + k], body.outputs()[1 + k]);
        let init = node.inputs[2 + k]?;
        let name = g.value_name(init);
        let out = node.outputs.get(k).copied().flatten();
        let keep = g.constant_data(init).is_none()
            || !passes_through(body, o, b)
            || read_by_nested_graph(body, b)
            || body.value_by_name(&name).is_some_and(|x| x != b)
            || out.is_some_and(|out| g.is_output(out) || read_by_nested_graph(g, out));
        (!keep).then_some((k, init, name))
    }).collect();
    if dropped.is_empty() {
        return Ok(0);
    }
    let is_dropped = |k: usize| dropped.iter().any(|d| d.0 == k);
    let body = loop_body_mut(&mut node).expect("checked above");
    let outputs = body.outputs().to_vec();
    let inputs = body.inputs().to_vec();
    for (k, _, name) in &dropped {
        body.input_to_outer(inputs[2 + k], name)?;
    }
    body.set_outputs(outputs.iter().enumerate().filter(|&(i, _)| i == 0 || i > carried || !is_dropped(i - 1)).map(|(_, v)| *v).collect())?;
    body.remove_dead_nodes();
    let mut patch = Patch::new(g, "uncarry_loop_invariants");
    for (k, init, _) in &dropped {
        if let Some(Some(out)) = node.outputs.get(*k) {
            patch.replace_uses(*out, *init);
        }
    }
    node.inputs = node.inputs.iter().enumerate().filter(|&(i, _)| i < 2 || !is_dropped(i - 2)).map(|(_, v)| *v).collect();
    node.outputs = node.outputs.iter().enumerate().filter(|&(i, _)| i >= carried || !is_dropped(i)).map(|(_, v)| *v).collect();
    patch.remove_node(id);
    patch.add_node(node);
    g.apply(patch)?;
    Ok(dropped.len())
}

/// Whether `v` is `to` or equals it through [`identity_source`] steps.
fn passes_through(g: &Graph, mut v: ValueId, to: ValueId) -> bool {
    while v != to {
        match identity_source(g, v) {
            Some(s) => v = s,
            None => return false,
        }
    }
    true
}

/// The value that `v` equals element for element, with the same shape, when its producer is
/// an identity on it:
///
/// ```text
/// Identity(x)                                   = x
/// x + 0 = 0 + x = x - 0 = x * 1 = 1 * x = x / 1 = x    (the constant has only 1-sized dims
///                                                      and no more dims than x)
/// Squeeze(... Unsqueeze(x, axes) ..., axes)     = x    (identities between them)
/// ```
///
/// `x + 0` turns `-0.0` into `+0.0`, which no quantized value tells apart.
fn identity_source(g: &Graph, v: ValueId) -> Option<ValueId> {
    let (id, 0) = g.producer(v)? else { return None };
    let n = g.node(id).ok().filter(|n| n.is_default_domain())?;
    let (a, b) = (n.input(0), n.input(1));
    match n.op_type.as_str() {
        "Identity" => a,
        "Add" => neutral_operand(g, a?, b?, 0.0).or_else(|| neutral_operand(g, b?, a?, 0.0)),
        "Mul" => neutral_operand(g, a?, b?, 1.0).or_else(|| neutral_operand(g, b?, a?, 1.0)),
        "Sub" => neutral_operand(g, a?, b?, 0.0),
        "Div" => neutral_operand(g, a?, b?, 1.0),
        "Squeeze" => {
            let mut x = a?;
            while let Some(s) = identity_source(g, x) {
                x = s;
            }
            let (u, 0) = g.producer(x)? else { return None };
            let un = g.node(u).ok().filter(|un| un.op_type == "Unsqueeze" && un.is_default_domain())?;
            let same = axes(g, un).zip(axes(g, n)).is_some_and(|(p, q)| p == q);
            same.then(|| un.input(0)).flatten()
        }
        _ => None,
    }
}

/// `x`, when `c` is a constant of `neutral`s that broadcasting against `x` leaves `x`'s shape.
fn neutral_operand(g: &Graph, x: ValueId, c: ValueId, neutral: f64) -> Option<ValueId> {
    let t = g.constant_data(c)?;
    let broadcast_free = t.shape().iter().all(|&d| d == 1) && t.rank() <= min_rank(g, x);
    (broadcast_free && t.to_f64_vec().ok()?.iter().all(|&e| e == neutral)).then_some(x)
}

/// A lower bound on the rank of `x`: its declared rank, or the number of axes an `Unsqueeze`
/// producing it adds.
fn min_rank(g: &Graph, x: ValueId) -> usize {
    if let Some(shape) = g.value(x).ok().and_then(|v| v.ty.as_ref()).and_then(|t| t.shape()) {
        return shape.len();
    }
    let unsqueezed = g.producer(x).and_then(|(id, _)| g.node(id).ok()).filter(|n| n.op_type == "Unsqueeze" && n.is_default_domain());
    unsqueezed.and_then(|n| axes(g, n)).map_or(0, |a| a.len())
}

/// The sorted `axes` of a Squeeze or Unsqueeze: its attribute (before opset 13) or constant
/// second input. `None` when it has neither.
fn axes(g: &Graph, n: &qforge_ir::Node) -> Option<Vec<i64>> {
    let mut axes = match n.attr_ints("axes") {
        Some(a) => a.to_vec(),
        None => g.constant_data(n.input(1)?)?.to_i64_vec().ok()?,
    };
    axes.sort_unstable();
    Some(axes)
}

#[cfg(test)]
mod tests {
    use qforge_ir::{Attr, DType, Node, Tensor, ValueType};

    use super::*;

    /// A Loop whose body carries `w` on through `Squeeze(Unsqueeze(w) + 0)` (Paddle2ONNX's way)
    /// and an accumulator `acc = acc + MatMul(x, w)` that changes at each iteration; `out_w`
    /// and `out_acc` are the Loop's outputs, read by a `Relu` each.
    fn carried_weight_loop(zero: f32) -> Graph {
        let f32_ty = |shape: &[i64]| Some(ValueType::tensor_of(DType::F32, shape));
        let mut body = Graph::new("body");
        let _iter = body.add_input("i", Some(ValueType::tensor_of(DType::I64, &[]))).unwrap();
        let cond = body.add_input("cond", Some(ValueType::tensor_of(DType::Bool, &[]))).unwrap();
        let w = body.add_input("w_in", f32_ty(&[2, 2])).unwrap();
        let acc = body.add_input("acc_in", f32_ty(&[1, 2])).unwrap();
        let x = body.add_outer("x").unwrap();
        let axes = body.add_initializer("axes", Tensor::from_slice(&[1], &[0i64]).unwrap()).unwrap();
        let zeros = body.add_initializer("zero", Tensor::from_slice(&[1], &[zero]).unwrap()).unwrap();
        let values: Vec<ValueId> = ["u", "u0", "w_out", "xw", "acc_out", "cond_out"].iter().map(|n| body.new_value(*n, None).unwrap()).collect();
        let [u, u0, w_out, xw, acc_out, cond_out] = values[..] else { unreachable!() };
        body.add_node(Node::new("Unsqueeze", "unsq").with_inputs([w, axes]).with_outputs([u])).unwrap();
        body.add_node(Node::new("Add", "add0").with_inputs([u, zeros]).with_outputs([u0])).unwrap();
        body.add_node(Node::new("Squeeze", "sq").with_inputs([u0, axes]).with_outputs([w_out])).unwrap();
        body.add_node(Node::new("MatMul", "mm").with_inputs([x, w]).with_outputs([xw])).unwrap();
        body.add_node(Node::new("Add", "acc").with_inputs([acc, xw]).with_outputs([acc_out])).unwrap();
        body.add_node(Node::new("Identity", "c").with_inputs([cond]).with_outputs([cond_out])).unwrap();
        body.set_outputs(vec![cond_out, w_out, acc_out]).unwrap();

        let mut g = Graph::new("main");
        let x = g.add_input("x", f32_ty(&[1, 2])).unwrap();
        let trips = g.add_initializer("trips", Tensor::scalar(3i64)).unwrap();
        let w0 = g.add_initializer("w", Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap()).unwrap();
        let acc0 = g.add_initializer("acc0", Tensor::zeros(DType::F32, &[1, 2]).unwrap()).unwrap();
        let outs: Vec<ValueId> = ["out_w", "out_acc", "relu_w", "relu_acc"].iter().map(|n| g.new_value(*n, None).unwrap()).collect();
        let _ = x;
        let mut lp = Node::new("Loop", "loop").with_inputs([trips, trips, w0, acc0]).with_outputs([outs[0], outs[1]]).with_attr("body", Attr::Graph(Box::new(body)));
        lp.inputs[1] = None;
        g.add_node(lp).unwrap();
        g.add_node(Node::new("Relu", "rw").with_inputs([outs[0]]).with_outputs([outs[2]])).unwrap();
        g.add_node(Node::new("Relu", "racc").with_inputs([outs[1]]).with_outputs([outs[3]])).unwrap();
        g.set_outputs(vec![outs[2], outs[3]]).unwrap();
        g.check().unwrap();
        g
    }

    fn the_loop(g: &Graph) -> &Node {
        g.nodes().map(|(_, n)| n).find(|n| n.op_type == "Loop").unwrap()
    }

    #[test]
    fn a_weight_passed_on_through_unsqueeze_add_zero_squeeze_is_read_from_the_enclosing_graph() {
        let mut g = carried_weight_loop(0.0);
        assert_eq!(uncarry_loop_invariants(&mut g).unwrap(), 1);
        g.check().unwrap();
        let lp = the_loop(&g);
        let names = |vs: &[Option<ValueId>]| vs.iter().map(|v| v.map(|v| g.value_name(v))).collect::<Vec<_>>();
        assert_eq!(names(&lp.inputs), [Some("trips".to_string()), None, Some("acc0".to_string())]);
        assert_eq!(names(&lp.outputs), [Some("out_acc".to_string())]);
        let body = loop_body(lp).unwrap();
        assert_eq!(body.inputs().len(), 3);
        assert_eq!(body.outputs().len(), 2);
        let mm = body.nodes().map(|(_, n)| n).find(|n| n.op_type == "MatMul").unwrap();
        assert_eq!(body.value_name(mm.input(1).unwrap()), "w");
        assert!(body.nodes().all(|(_, n)| !matches!(n.op_type.as_str(), "Unsqueeze" | "Squeeze")), "the pass-through chain is dead");
        let relu_w = g.nodes().map(|(_, n)| n).find(|n| n.name == "rw").unwrap();
        assert_eq!(g.value_name(relu_w.input(0).unwrap()), "w", "the Loop's final w is its initial one");
        assert!(lp.captures().iter().any(|v| g.value_name(*v) == "w"));
    }

    #[test]
    fn adding_a_nonzero_constant_keeps_the_variable_carried() {
        let mut g = carried_weight_loop(0.5);
        assert_eq!(uncarry_loop_invariants(&mut g).unwrap(), 0);
        assert_eq!(the_loop(&g).inputs.len(), 4);
    }
}
