//! Node annotations: the output of a quantizer's `annotate` step.

use std::collections::BTreeMap;

use qforge_ir::{Graph, Node, NodeId, ValueType};

use crate::spec::{Edge, Spec};

/// What one node's inputs and outputs are quantized to. A `None` entry (or a missing one)
/// keeps that edge in float.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeAnnotation {
    pub inputs: Vec<Option<Spec>>,
    pub outputs: Vec<Option<Spec>>,
    /// The rule or pattern that produced the annotation, for the report.
    pub rule: String,
    /// Nodes quantized together as one unit (a fused pattern), root first.
    pub group: Vec<NodeId>,
    /// The unit has a quantized weight (its integer kernel pays off on its own).
    pub weighted: bool,
    /// The target can run the unit with a float output
    /// ([`crate::backend::BackendPatternConfig::float_output`]).
    pub float_output: bool,
}

impl NodeAnnotation {
    pub fn input(&self, i: usize) -> Option<&Spec> {
        self.inputs.get(i).and_then(|s| s.as_ref())
    }
    pub fn output(&self, i: usize) -> Option<&Spec> {
        self.outputs.get(i).and_then(|s| s.as_ref())
    }
    /// Sets the spec of input `i`, growing the list as needed.
    pub fn set_input(&mut self, i: usize, spec: Spec) {
        if self.inputs.len() <= i {
            self.inputs.resize(i + 1, None);
        }
        self.inputs[i] = Some(spec);
    }
    pub fn set_output(&mut self, i: usize, spec: Spec) {
        if self.outputs.len() <= i {
            self.outputs.resize(i + 1, None);
        }
        self.outputs[i] = Some(spec);
    }
}

/// Why a node stays in float.
#[derive(Debug, Clone, PartialEq)]
pub struct FloatReason {
    pub node: NodeId,
    pub kind: FloatKind,
    pub reason: String,
}

/// The kinds of reasons a node stays in float.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FloatKind {
    /// The user's configuration asks for float.
    Requested,
    /// The target has no quantized form of the op.
    NotSupported,
    /// The target supports the op, but not with the requested qconfig (`--strict` fails).
    ConfigRejected,
    /// Quantizing it alone would only add error (e.g. data movement between float ops).
    NoBenefit,
    /// The accuracy budget returned one of its quantized inputs, outputs or weights to float
    /// (an integer kernel needs all of them).
    AccuracyBudget,
}

/// Annotations of a whole graph, plus the nodes deliberately left in float with reasons.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Annotations {
    pub nodes: BTreeMap<NodeId, NodeAnnotation>,
    pub float: Vec<FloatReason>,
}

impl Annotations {
    pub fn get(&self, n: NodeId) -> Option<&NodeAnnotation> {
        self.nodes.get(&n)
    }
    pub fn is_annotated(&self, n: NodeId) -> bool {
        self.nodes.contains_key(&n)
    }
    /// The spec of an edge, if annotated.
    pub fn spec(&self, e: Edge) -> Option<&Spec> {
        match e {
            Edge::Input { node, index } => self.nodes.get(&node)?.input(index),
            Edge::Output { node, index } => self.nodes.get(&node)?.output(index),
        }
    }
    /// Records that `node` stays in float, unless a reason was already given.
    pub fn keep_float(&mut self, node: NodeId, kind: FloatKind, reason: impl Into<String>) {
        if !self.float.iter().any(|f| f.node == node) {
            self.float.push(FloatReason { node, kind, reason: reason.into() });
        }
    }

    /// Keeps in float, with the reason (replacing any other), every node that reads or
    /// produces a sequence or an optional: by its inputs' and outputs' declared or inferred
    /// types, or by its op (the runtime's [`qforge_runtime::kernels::sequence::OPS`]). Such
    /// values are not tensors and are never activations. A unit holding such a node stays float whole. Tensors next to them (a Conv
    /// output split into a sequence, a tensor taken out of one) quantize as usual.
    pub fn keep_non_tensors_float(&mut self, g: &Graph) {
        for (id, node) in g.nodes() {
            let Some(why) = non_tensor_reason(g, node) else { continue };
            let group = self.nodes.remove(&id).map(|a| a.group).unwrap_or_default();
            for n in group.into_iter().filter(|&n| n != id) {
                if self.nodes.remove(&n).is_some() {
                    self.float.retain(|f| f.node != n);
                    let reason = format!("it is quantized as one unit with '{}', which {why}", node.display_name(id));
                    self.float.push(FloatReason { node: n, kind: FloatKind::NotSupported, reason });
                }
            }
            self.float.retain(|f| f.node != id);
            self.float.push(FloatReason { node: id, kind: FloatKind::NotSupported, reason: why });
        }
    }
}

/// Why `node` cannot be quantized when it reads or produces a sequence or an optional.
fn non_tensor_reason(g: &Graph, node: &Node) -> Option<String> {
    const NEVER: &str = "sequences and optionals are not tensors and are never quantized";
    let typed = |v: qforge_ir::ValueId| g.value(v).ok().and_then(|x| x.ty.as_ref()).filter(|t| matches!(t, ValueType::Sequence(_) | ValueType::Optional(_))).map(|t| (g.value_name(v), t.clone()));
    let read = node.inputs.iter().flatten().find_map(|&v| typed(v)).map(|x| ("reads", x));
    match read.or_else(|| node.outputs.iter().flatten().find_map(|&v| typed(v)).map(|x| ("produces", x))) {
        Some((verb, (name, ty))) => Some(format!("it {verb} '{name}' ({ty}): {NEVER}")),
        None if node.domain.is_empty() && qforge_runtime::kernels::sequence::OPS.iter().any(|(op, ..)| *op == node.op_type) => Some(format!("{} works on sequences or optionals: {NEVER}", node.op_type)),
        None => None,
    }
}
