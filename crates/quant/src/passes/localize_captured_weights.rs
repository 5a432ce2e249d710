use std::collections::BTreeMap;

use qforge_ir::{Attr, DType, Graph, IrResult, Patch, Tensor, ValueKind};

use crate::quantizer::weight_axes;

/// Gives every subgraph below `g` (If branches, Loop and Scan bodies, at any depth) its own
/// copy of the float constants it reads from an enclosing graph as the weight (input 1 of an
/// op with a weight layout, [`weight_axes`]: Conv, ConvTranspose, Gemm, MatMul) and bias
/// (input 2, with that weight; for a MatMul, the constant an `Add` adds to its output).
/// Quantization stores a weight as integers only when it is a constant of the weight's own
/// graph; a weight captured from an enclosing graph would otherwise stay float. A captured name is resolved the way ONNX scopes it: through every
/// graph between the reader and the graph that defines it, and only a float32 constant
/// there is copied. The copy is an initializer of the reading subgraph named
/// `<subgraph>.<weight>` (made unique); other readers of the captured value keep reading it,
/// and `g`'s initializer is removed once nothing reads it. Each node owning a changed
/// subgraph is rebuilt in place (same inputs and outputs), so its captures are recomputed.
/// Returns the number of copies made.
pub fn localize_captured_weights(g: &mut Graph) -> IrResult<usize> {
    let copies = localize_below(g, &|_| None)?;
    if copies > 0 {
        g.remove_dead_nodes();
    }
    Ok(copies)
}

/// The float32 constant that `name`, as read inside a subgraph of `g`, refers to: `g`'s own
/// constant of that name, or, when `g` captures the name too, what `outer` resolves it to.
fn resolve_in(g: &Graph, name: &str, outer: &dyn Fn(&str) -> Option<Tensor>) -> Option<Tensor> {
    let val = g.value(g.value_by_name(name)?).ok()?;
    if val.kind() == ValueKind::Outer {
        return outer(name);
    }
    let t = val.initializer().filter(|_| val.is_constant())?;
    (t.dtype() == DType::F32).then(|| t.clone())
}

/// Localizes captured weights in the subgraphs of `g`'s nodes and, recursively, below them.
/// `outer` resolves the names `g` itself captures.
fn localize_below(g: &mut Graph, outer: &dyn Fn(&str) -> Option<Tensor>) -> IrResult<usize> {
    let owners: Vec<_> = g.nodes()
        .filter(|(_, n)| n.attrs.iter().any(|a| matches!(a.value, Attr::Graph(_))))
        .map(|(id, _)| id)
        .collect();
    let mut copies = 0;
    for id in owners {
        let mut node = g.node(id)?.clone();
        let mut changed = 0;
        for attr in &mut node.attrs {
            let Attr::Graph(sub) = &mut attr.value else { continue };
            changed += localize_in(sub, &|name| resolve_in(g, name, outer))?;
        }
        if changed > 0 {
            let mut patch = Patch::new(g, "localize_captured_weights");
            patch.remove_node(id);
            patch.add_node(node);
            g.apply(patch)?;
            copies += changed;
        }
    }
    Ok(copies)
}

/// Copies into `sub` the weights and biases its own nodes read from enclosing graphs
/// (`resolve` maps a captured name to its constant), then does the same below `sub`.
fn localize_in(sub: &mut Graph, resolve: &dyn Fn(&str) -> Option<Tensor>) -> IrResult<usize> {
    // Captured constant -> its data and the (node, input) edges reading it as a weight or bias.
    let mut captured: BTreeMap<String, (Tensor, Vec<_>)> = BTreeMap::new();
    let captured_const = |v| -> Option<(String, Tensor)> {
        let val = sub.value(v).ok().filter(|val| val.kind() == ValueKind::Outer)?;
        Some((val.name.clone(), resolve(&val.name)?))
    };
    for (sid, sn) in sub.nodes() {
        if !sn.domain.is_empty() && sn.domain != "ai.onnx" {
            continue;
        }
        let Some((name, w)) = sn.input(1).and_then(captured_const) else { continue };
        if weight_axes(sn, w.shape().len()) == (None, None) {
            continue;
        }
        captured.entry(name).or_insert((w, vec![])).1.push((sid, 1));
        if let Some((bias, b)) = sn.input(2).and_then(captured_const) {
            captured.entry(bias).or_insert((b, vec![])).1.push((sid, 2));
        }
        if sn.op_type == "MatMul" {
            // The bias `Add(MatMul(x, W), b)` adds, which `matmul_add_to_gemm` then fuses.
            for &(reader, _) in sn.output(0).map(|y| sub.consumers(y)).unwrap_or_default() {
                let Ok(add) = sub.node(reader) else { continue };
                if add.op_type != "Add" || !add.is_default_domain() {
                    continue;
                }
                let other = (0..2).find(|&i| add.input(i) != sn.output(0));
                if let Some((i, (bias, b))) = other.and_then(|i| Some((i, add.input(i).and_then(captured_const)?))) {
                    captured.entry(bias).or_insert((b, vec![])).1.push((reader, i));
                }
            }
        }
    }
    let mut copies = 0;
    if !captured.is_empty() {
        let mut patch = Patch::new(sub, "localize_captured_weights");
        for (name, (tensor, edges)) in captured {
            let local = patch.unique_name(sub, &format!("{}.{name}", sub.name));
            let local = patch.new_initializer(local, tensor);
            for (sid, i) in edges {
                patch.redirect_input(sid, i, local);
            }
            copies += 1;
        }
        sub.apply(patch)?;
    }
    copies += localize_below(sub, resolve)?;
    if copies > 0 {
        // After the nested graphs, so captures they no longer need go too.
        sub.remove_dead_nodes();
    }
    Ok(copies)
}
