//! Graph passes, one file each. Every pass returns what it changed and leaves a graph that
//! passes `Graph::check`. Constant folding and the lowering to integer operators live in the
//! runtime, whose sessions apply them to QDQ models, and are re-exported here.

mod constant_input_defaults;
mod fold_affine;
mod fold_constant_scales;
mod hoist_loop_invariants;
mod localize_captured_weights;
mod matmul_add_to_gemm;
mod uncarry_loop_invariants;
mod upcast_half;
mod upgrade_opset;

pub use constant_input_defaults::constant_input_defaults;
pub use fold_affine::fold_affine;
pub use fold_constant_scales::fold_constant_scales;
pub use hoist_loop_invariants::hoist_loop_invariants;
pub use localize_captured_weights::localize_captured_weights;
pub use matmul_add_to_gemm::matmul_add_to_gemm;
pub use qforge_runtime::{fold_constants, lower_qoperator, LowerError, LowerLog, Lowered, NotLowered};
pub use uncarry_loop_invariants::uncarry_loop_invariants;
pub use upcast_half::{upcast_half, Upcast};
pub use upgrade_opset::{upgrade_opset, Rewrite, UpgradeError, MAX_OPSET};

use qforge_ir::{Attr, Graph, IrResult, Node, NodeId, Patch};

/// The Loop nodes of `g` (default domain).
fn loops(g: &Graph) -> Vec<NodeId> {
    g.nodes().filter(|(_, n)| n.op_type == "Loop" && n.is_default_domain()).map(|(id, _)| id).collect()
}

/// The body of a Loop node.
fn loop_body(n: &Node) -> Option<&Graph> {
    n.attrs.iter().find(|a| a.name == "body").and_then(|a| match &a.value {
        Attr::Graph(g) => Some(&**g),
        _ => None,
    })
}

/// The body of a Loop node, to edit.
fn loop_body_mut(n: &mut Node) -> Option<&mut Graph> {
    n.attrs.iter_mut().find(|a| a.name == "body").and_then(|a| match &mut a.value {
        Attr::Graph(g) => Some(&mut **g),
        _ => None,
    })
}

/// Applies `pass` to every subgraph of `g`'s nodes and rebuilds each node whose subgraphs it
/// changed in place (same inputs and outputs), so that its captures are recomputed. Returns
/// the sum of `pass`'s counts.
fn rewrite_subgraphs(g: &mut Graph, origin: &str, pass: &dyn Fn(&mut Graph) -> IrResult<usize>) -> IrResult<usize> {
    let owners: Vec<_> = g.nodes().filter(|(_, n)| n.subgraphs().next().is_some()).map(|(id, _)| id).collect();
    let mut total = 0;
    for id in owners {
        let mut node = g.node(id)?.clone();
        let mut changed = 0;
        for sub in node.attrs.iter_mut().flat_map(|a| a.value.graphs_mut()) {
            changed += pass(sub)?;
        }
        if changed > 0 {
            let mut patch = Patch::new(g, origin);
            patch.remove_node(id);
            patch.add_node(node);
            g.apply(patch)?;
            total += changed;
        }
    }
    Ok(total)
}
