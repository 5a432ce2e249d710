use std::collections::HashMap;

use qforge_ir::{Graph, IrResult, Node, NodeId, Patch, ValueId, ValueKind};
use qforge_runtime::NONDETERMINISTIC;

use super::{loop_body, loop_body_mut, loops};

/// Moves the nodes of every Loop body (at any depth, innermost first) that compute the same
/// value from constants at every iteration out of the loop, into the graph that holds the Loop,
/// where `fold_constants` then folds them.
///
/// A node moves when it is of the default domain, holds no subgraph, is not random
/// ([`NONDETERMINISTIC`]), and each of its inputs is a constant of the holding graph that the
/// body reads by name, a constant of the body, or the output of a node moved before it, at
/// least one of them not a body constant (constant subexpressions of the body are
/// `fold_constants`' work there). A `Transpose` of a weight read from the main graph is the
/// common case: moved and folded, it is a constant the body reads as a weight. The body then
/// reads the node's outputs by name; the body constants a moved node reads are copied into
/// the holding graph. A node whose output is a body output, or whose output name the holding
/// graph already has, stays.
///
/// Nodes computing from activations of enclosing graphs stay too: moved, a value that float
/// data movement computes from a dequantized one and that the body reads by name is what ONNX
/// Runtime's `QDQPropagationTransformer` propagates Q/DQ onto, and it aborts on a subgraph's
/// implicit input (see `uncarry_loop_invariants`). Returns the number of nodes moved.
pub fn hoist_loop_invariants(g: &mut Graph) -> IrResult<usize> {
    let mut moved = super::rewrite_subgraphs(g, "hoist_loop_invariants", &hoist_loop_invariants)?;
    let mut here = 0;
    for id in loops(g) {
        here += hoist(g, id)?;
    }
    if here > 0 {
        g.sort_nodes()?;
    }
    moved += here;
    Ok(moved)
}

/// Whether `n` may run once before its loop instead of at every iteration, given that its
/// inputs do not change.
fn movable(n: &Node) -> bool {
    n.is_default_domain() && n.subgraphs().next().is_none() && !NONDETERMINISTIC.contains(&n.op_type.as_str()) && n.op_type != "Constant"
}

/// Moves the loop invariants of Loop `id`'s body into `g`, before the Loop.
fn hoist(g: &mut Graph, id: NodeId) -> IrResult<usize> {
    let mut node = g.node(id)?.clone();
    let Some(body) = loop_body(&node) else { return Ok(0) };
    // Per invariant body value: whether it depends on a constant of `g` (true) or is a
    // constant of the body (false).
    let mut invariant: HashMap<ValueId, bool> = HashMap::new();
    for (v, val) in body.values() {
        match val.kind() {
            ValueKind::Outer if g.value_by_name(&val.name).is_some_and(|x| g.constant_data(x).is_some()) => {
                invariant.insert(v, true);
            }
            ValueKind::Initializer if val.is_constant() => {
                invariant.insert(v, false);
            }
            _ => {}
        }
    }
    let mut moved = vec![];
    for nid in body.topo_order()? {
        let n = body.node(nid)?;
        if n.constant_tensor().is_some() {
            invariant.extend(n.outputs.iter().flatten().map(|v| (*v, false)));
            continue;
        }
        let inputs: Option<Vec<bool>> = n.inputs.iter().flatten().map(|v| invariant.get(v).copied()).collect();
        let stays_inside = |v: &ValueId| {
            let name = body.value_name(*v);
            body.is_output(*v) || name.is_empty() || g.value_by_name(&name).is_some()
        };
        if !movable(n) || !inputs.is_some_and(|i| i.contains(&true)) || n.outputs.iter().flatten().any(stays_inside) {
            continue;
        }
        invariant.extend(n.outputs.iter().flatten().map(|v| (*v, true)));
        moved.push(nid);
    }
    if moved.is_empty() {
        return Ok(0);
    }

    let mut patch = Patch::new(g, "hoist_loop_invariants");
    patch.reserve(moved.iter().flat_map(|nid| body.node(*nid).expect("topo order").outputs.iter().flatten().map(|v| body.value_name(*v))));
    // Body value -> the value of `g` that holds it.
    let mut in_g: HashMap<ValueId, ValueId> = HashMap::new();
    for nid in &moved {
        let mut copy = body.node(*nid)?.clone();
        for input in copy.inputs.iter_mut().flatten() {
            let v = *input;
            let held = match in_g.get(&v) {
                Some(h) => *h,
                None => {
                    let val = body.value(v)?;
                    let h = match val.kind() {
                        ValueKind::Outer => g.value_by_name(&val.name).expect("checked invariant"),
                        _ => {
                            let data = body.constant_data(v).expect("a constant input");
                            let name = patch.unique_name(g, &format!("{}.{}", body.name, val.name));
                            patch.new_initializer(name, data)
                        }
                    };
                    in_g.insert(v, h);
                    h
                }
            };
            *input = held;
        }
        for output in copy.outputs.iter_mut().flatten() {
            let val = body.value(*output)?;
            let h = patch.new_value(val.name.clone(), val.ty.clone());
            in_g.insert(*output, h);
            *output = h;
        }
        patch.add_node(copy);
    }
    let body = loop_body_mut(&mut node).expect("checked above");
    for nid in &moved {
        body.detach_node_to_outer(*nid)?;
    }
    body.remove_dead_nodes();
    patch.remove_node(id);
    patch.add_node(node);
    g.apply(patch)?;
    Ok(moved.len())
}

#[cfg(test)]
mod tests {
    use qforge_ir::{Attr, DType, Tensor, ValueType};

    use super::*;

    /// A Loop computing `s = s * Tanh((Transpose(w) + 0.5) + x)`, where the constant `w` and the
    /// activation `x` come from the main graph: `Transpose(w)` and the Add of the body constant
    /// 0.5 are invariant constants; the Add reading `x`, and what follows, stay.
    fn invariant_loop() -> Graph {
        let f32_ty = |shape: &[i64]| Some(ValueType::tensor_of(DType::F32, shape));
        let mut body = Graph::new("body");
        body.add_input("i", Some(ValueType::tensor_of(DType::I64, &[]))).unwrap();
        let cond = body.add_input("cond", Some(ValueType::tensor_of(DType::Bool, &[]))).unwrap();
        let s = body.add_input("s_in", f32_ty(&[2, 2])).unwrap();
        let (x, w) = (body.add_outer("x").unwrap(), body.add_outer("w").unwrap());
        let half = body.add_initializer("half", Tensor::scalar(0.5f32)).unwrap();
        let vals: Vec<ValueId> = ["wt", "wb", "sum", "t", "s_out", "cond_out"].iter().map(|n| body.new_value(*n, None).unwrap()).collect();
        let [wt, wb, sum, t, s_out, cond_out] = vals[..] else { unreachable!() };
        body.add_node(Node::new("Transpose", "tr").with_inputs([w]).with_outputs([wt])).unwrap();
        body.add_node(Node::new("Add", "shift").with_inputs([wt, half]).with_outputs([wb])).unwrap();
        body.add_node(Node::new("Add", "add_x").with_inputs([wb, x]).with_outputs([sum])).unwrap();
        body.add_node(Node::new("Tanh", "tanh").with_inputs([sum]).with_outputs([t])).unwrap();
        body.add_node(Node::new("Mul", "step").with_inputs([t, s]).with_outputs([s_out])).unwrap();
        body.add_node(Node::new("Identity", "c").with_inputs([cond]).with_outputs([cond_out])).unwrap();
        body.set_outputs(vec![cond_out, s_out]).unwrap();

        let mut g = Graph::new("main");
        let x = g.add_input("x", f32_ty(&[2, 2])).unwrap();
        g.add_initializer("w", Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap()).unwrap();
        let trips = g.add_initializer("trips", Tensor::scalar(3i64)).unwrap();
        let out = g.new_value("s_final", None).unwrap();
        let mut lp = Node::new("Loop", "loop").with_inputs([trips, trips, x]).with_outputs([out]).with_attr("body", Attr::Graph(Box::new(body)));
        lp.inputs[1] = None;
        g.add_node(lp).unwrap();
        g.set_outputs(vec![out]).unwrap();
        g.check().unwrap();
        g
    }

    #[test]
    fn invariants_of_constants_move_before_the_loop_and_the_body_reads_their_outputs() {
        let mut g = invariant_loop();
        assert_eq!(hoist_loop_invariants(&mut g).unwrap(), 2);
        g.check().unwrap();
        let order: Vec<String> = g.topo_order().unwrap().into_iter().map(|id| g.node(id).unwrap().name.clone()).collect();
        assert_eq!(order, ["tr", "shift", "loop"]);
        let lp = g.nodes().map(|(_, n)| n).find(|n| n.op_type == "Loop").unwrap();
        let body = loop_body(lp).unwrap();
        let mut names: Vec<&str> = body.nodes().map(|(_, n)| n.name.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["add_x", "c", "step", "tanh"], "nodes reading the activation x or the carried s stay");
        assert_eq!(body.value(body.value_by_name("wb").unwrap()).unwrap().kind(), ValueKind::Outer);
        assert!(body.value_by_name("half").is_none(), "the constant moved with its reader");
        let captured: Vec<String> = lp.captures().iter().map(|v| g.value_name(*v)).collect();
        assert_eq!(captured, ["wb", "x"]);
        let copied = g.nodes().map(|(_, n)| n).find(|n| n.name == "shift").unwrap();
        assert_eq!(g.value_name(copied.input(1).unwrap()), "body.half");
    }

    #[test]
    fn a_node_reading_a_carried_value_stays() {
        let mut g = invariant_loop();
        hoist_loop_invariants(&mut g).unwrap();
        let lp = g.nodes().map(|(_, n)| n).find(|n| n.op_type == "Loop").unwrap();
        let body = loop_body(lp).unwrap();
        let step = body.nodes().map(|(_, n)| n).find(|n| n.name == "step").unwrap();
        assert_eq!(body.value_name(step.input(1).unwrap()), "s_in");
    }
}
