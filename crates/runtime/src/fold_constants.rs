//! Constant folding of a graph with the runtime's own kernels.

use std::collections::HashMap;

use qforge_ir::{Graph, Node, OpsetImport, Tensor};
use crate::{opset_of, NodeInfo, Registry, RunCtx, NONDETERMINISTIC};

/// Replaces every node whose inputs are all constant initializers by initializers holding its
/// outputs (same values and names, so subgraphs reading them by name read the constants),
/// computed with the qforge runtime's kernels, so weights built from constants
/// (`Reshape(W)`, `Transpose(W)`, `ConstantOfShape`) are quantized as weights. Nodes with
/// subgraphs, random ops, nodes producing graph outputs, ops the runtime cannot run and nodes
/// for which `keep` holds are kept. Returns the number of folded nodes.
pub fn fold_constants(g: &mut Graph, opsets: &[OpsetImport], keep: impl Fn(&Node) -> bool) -> Result<usize, String> {
    let order = g.topo_order().map_err(|e| e.to_string())?;
    let no_scope: HashMap<String, Tensor> = HashMap::new();
    let mut folded = 0;
    for id in order {
        let node = g.node(id).map_err(|e| e.to_string())?.clone();
        let constant = |v: &qforge_ir::ValueId| g.value(*v).is_ok_and(|x| x.is_constant());
        if keep(&node) || node.subgraphs().next().is_some() || !node.captures().is_empty() || NONDETERMINISTIC.contains(&node.op_type.as_str())
            || !node.inputs.iter().flatten().all(constant)
            || node.outputs.iter().flatten().any(|v| g.is_output(*v))
        {
            continue;
        }
        let domain_version = opset_of(opsets, &node.domain);
        let Some(build) = Registry::builtin().lookup(&node.domain, &node.op_type, domain_version) else { continue };
        let ins: Vec<Option<&Tensor>> = node.inputs.iter().map(|v| v.and_then(|v| g.value(v).ok()).and_then(|x| x.initializer())).collect();
        let info = NodeInfo {
            node: &node,
            id,
            graph: g,
            opset: domain_version,
            opsets,
            scope_consts: &no_scope,
            const_inputs: ins.clone(),
            input_types: node.inputs.iter().map(|v| v.and_then(|v| g.value(v).ok()).and_then(|x| x.ty.as_ref())).collect(),
        };
        let Ok(kernel) = build(&info) else { continue };
        let Ok(outs) = kernel.run(&ins, &RunCtx { scope: &|_| None, hooks: None }) else { continue };
        if outs.len() < node.outputs.len() {
            continue;
        }
        g.replace_node_by_constants(id, outs).map_err(|e| e.to_string())?;
        folded += 1;
    }
    Ok(folded)
}
