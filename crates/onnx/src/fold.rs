//! `Constant` nodes to initializers.

use qforge_ir::{Graph, Model, Patch, ValueKind, CAPTURE_USE};

/// Replaces `Constant` nodes (default domain, any opset) with initializers of the same name,
/// in the main graph and every subgraph. Constants that are graph outputs, are read by a
/// subgraph by name, or use a sparse value stay nodes. Returns how many were folded.
pub fn fold_constant_nodes(model: &mut Model) -> usize {
    fold_graph(&mut model.graph)
}

fn fold_graph(g: &mut Graph) -> usize {
    let mut folded = 0;
    let ids: Vec<_> = g.nodes().map(|(id, _)| id).collect();
    for id in ids {
        let Ok(n) = g.node(id) else { continue };
        let (Some(t), Some(out)) = (n.constant_tensor(), n.output(0)) else { continue };
        let v = g.value(out).expect("node output exists");
        if g.is_output(out) || v.uses().iter().any(|u| u.1 == CAPTURE_USE) || v.kind() != ValueKind::NodeOutput {
            continue;
        }
        let name = v.name.clone();
        let (doc, meta, in_vi) = (v.doc_string.clone(), v.metadata_props.clone(), v.in_value_info);
        let mut p = Patch::new(g, "fold_constant_nodes");
        let tmp = p.unique_name(g, &format!("{name}__folded"));
        let c = p.new_initializer(tmp, t);
        p.replace_uses(out, c);
        p.remove_node(id);
        if g.apply(p).is_err() || g.rename_value(c, name).is_err() {
            continue;
        }
        let v = g.value_mut(c).expect("new initializer exists");
        v.doc_string = doc;
        v.metadata_props = meta;
        v.in_value_info = in_vi;
        folded += 1;
    }
    let ids: Vec<_> = g.nodes().map(|(id, _)| id).collect();
    for id in ids {
        if let Ok(attrs) = g.node_attrs_mut(id) {
            for a in attrs.iter_mut() {
                for sub in a.value.graphs_mut() {
                    folded += fold_graph(sub);
                }
            }
        }
    }
    folded
}
