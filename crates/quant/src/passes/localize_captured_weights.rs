use std::collections::BTreeMap;

use qforge_ir::{Attr, DType, Graph, IrResult, Patch, ValueKind};

/// The inputs of a node that quantization stores as constants (weight, bias), by op type.
fn weight_inputs(op: &str) -> &'static [usize] {
    match op {
        "Conv" | "ConvTranspose" | "Gemm" => &[1, 2],
        "MatMul" => &[1],
        _ => &[],
    }
}

/// Gives each subgraph of `g`'s nodes (If branches, Loop and Scan bodies) its own copy of the
/// float constants it reads from `g` as the weight or bias of a Conv, ConvTranspose, Gemm or
/// MatMul. Quantization stores a weight as integers only when it is a constant of the weight's
/// own graph; a weight captured from the enclosing graph would otherwise stay float. The copy
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
            // Captured constant -> the (node, input) edges that read it as a weight or bias.
            let mut captured: BTreeMap<String, Vec<_>> = BTreeMap::new();
            for (sid, sn) in sub.nodes() {
                if !sn.domain.is_empty() && sn.domain != "ai.onnx" {
                    continue;
                }
                for &i in weight_inputs(&sn.op_type) {
                    let Some(v) = sn.input(i) else { continue };
                    let val = sub.value(v)?;
                    if val.kind() != ValueKind::Outer {
                        continue;
                    }
                    let outer = g.value_by_name(&val.name).and_then(|o| g.value(o).ok());
                    if outer.is_some_and(|o| o.is_constant() && o.initializer().is_some_and(|t| t.dtype() == DType::F32)) {
                        captured.entry(val.name.clone()).or_default().push((sid, i));
                    }
                }
            }
            if captured.is_empty() {
                continue;
            }
            let mut patch = Patch::new(sub, "localize_captured_weights");
            for (name, edges) in &captured {
                let tensor = g.value(g.value_by_name(name).expect("found above"))?.initializer().expect("constant").clone();
                let local = patch.unique_name(sub, &format!("{}.{name}", sub.name));
                let local = patch.new_initializer(local, tensor);
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
