use std::collections::BTreeMap;

use qforge_ir::{Attr, DType, Graph, IrResult, Patch, Tensor, ValueId, ValueKind};

use crate::quantizer::weight_axes;

/// Gives each subgraph of `g`'s nodes (If branches, Loop and Scan bodies) its own copy of the
/// float constants it reads from `g` as the weight (input 1 of an op with a weight layout,
/// [`weight_axes`]: Conv, ConvTranspose, Gemm, MatMul) and bias (input 2, with that weight).
/// Quantization stores a weight as integers only when it is a constant of the weight's own graph; a weight captured from the enclosing graph would otherwise stay float. The copy
/// is an initializer of the subgraph named `<subgraph>.<weight>` (made unique); other readers
/// of the captured value keep reading it, and `g`'s initializer is removed once nothing reads
/// it. The node owning a changed subgraph is rebuilt in place (same inputs and outputs) so its
/// captures are recomputed. Reaches the direct subgraphs of `g`'s nodes; a weight read two
/// levels down stays as it is. Returns the number of copies made.
pub fn localize_captured_weights(g: &mut Graph) -> IrResult<usize> {
    let owners: Vec<_> = g.nodes()
        .filter(|(_, n)| n.attrs.iter().any(|a| matches!(a.value, Attr::Graph(_))))
        .map(|(id, _)| id)
        .collect();
    let mut copies = 0;
    for id in owners {
        let mut node = g.node(id)?.clone();
        let mut changed = false;
        for attr in &mut node.attrs {
            let Attr::Graph(sub) = &mut attr.value else { continue };
            // Captured constant -> its data and the (node, input) edges reading it as a weight or bias.
            let mut captured: BTreeMap<String, (&Tensor, Vec<_>)> = BTreeMap::new();
            let captured_const = |v: ValueId| -> Option<(String, &Tensor)> {
                let val = sub.value(v).ok().filter(|val| val.kind() == ValueKind::Outer)?;
                let t = g.value(g.value_by_name(&val.name)?).ok().filter(|o| o.is_constant())?.initializer()?;
                (t.dtype() == DType::F32).then(|| (val.name.clone(), t))
            };
            for (sid, sn) in sub.nodes() {
                if !sn.domain.is_empty() && sn.domain != "ai.onnx" {
                    continue;
                }
                let Some((name, w)) = sn.input(1).and_then(captured_const) else { continue };
                if weight_axes(sn, w.shape().len()).0.is_none() {
                    continue;
                }
                captured.entry(name).or_insert((w, vec![])).1.push((sid, 1));
                if let Some((bias, b)) = sn.input(2).and_then(captured_const) {
                    captured.entry(bias).or_insert((b, vec![])).1.push((sid, 2));
                }
            }
            if captured.is_empty() {
                continue;
            }
            let mut patch = Patch::new(sub, "localize_captured_weights");
            for (name, (tensor, edges)) in &captured {
                let local = patch.unique_name(sub, &format!("{}.{name}", sub.name));
                let local = patch.new_initializer(local, (*tensor).clone());
                for &(sid, i) in edges {
                    patch.redirect_input(sid, i, local);
                }
                copies += 1;
            }
            sub.apply(patch)?;
            sub.remove_dead_nodes();
            changed = true;
        }
        if changed {
            let mut patch = Patch::new(g, "localize_captured_weights");
            patch.remove_node(id);
            patch.add_node(node);
            g.apply(patch)?;
        }
    }
    if copies > 0 {
        g.remove_dead_nodes();
    }
    Ok(copies)
}
