//! Shape and type inference with symbolic dimensions.
//!
//! [`infer_graph`] walks a graph in topological order and computes each node output's element
//! type and shape from its inputs, attributes and constant inputs. Besides shapes it tracks
//! the *values* of small integer tensors symbolically (`Shape` -> `Gather` -> `Concat` ->
//! `Reshape` chains, as PyTorch and Paddle exports compute shapes), so data-dependent shapes
//! resolve where ONNX's own inference stops. Dimensions are `Known`, a named `Sym` (kept
//! through ops that pass it on unchanged), or `Unknown` (a symbol that arithmetic changed).
//! Unknown ops produce unknown types and are listed in the report; nothing fails.
//!
//! Declared types are merged, never lost: an inferred dimension fills an unknown declared one,
//! and a contradiction is reported with the node, not applied.

mod rules;

use std::collections::HashMap;

use crate::{Dim, Graph, Model, NodeId, OpsetImport, Shape, Tensor, ValueId, ValueKind, ValueType};

/// What inference did and where it stopped.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InferReport {
    /// Node outputs whose type was filled in or refined.
    pub inferred: usize,
    /// Ops with no inference rule: (node name, op type).
    pub unknown_ops: Vec<(String, String)>,
    /// Declared types that contradict inference: (value, declared, inferred).
    pub conflicts: Vec<(String, String, String)>,
}

/// A value as inference sees it: its type and, for small integer tensors, its elements.
#[derive(Debug, Clone, Default)]
pub(crate) struct Known {
    pub ty: Option<ValueType>,
    /// Elements of a rank-0 or rank-1 integer tensor, as dimensions (for shape arithmetic).
    pub value: Option<Vec<Dim>>,
    /// Full constant data, when the value is a constant.
    pub constant: Option<Tensor>,
}

/// Infers types in a model's main graph (and its subgraphs).
pub fn infer_model(model: &mut Model) -> InferReport {
    let opsets = model.opset_imports.clone();
    infer_graph(&mut model.graph, &opsets)
}

/// Infers types in a graph and its subgraphs; see the module docs.
pub fn infer_graph(g: &mut Graph, opsets: &[OpsetImport]) -> InferReport {
    let mut report = InferReport::default();
    infer_scoped(g, opsets, &HashMap::new(), &mut report);
    report
}

fn opset(opsets: &[OpsetImport], domain: &str) -> i64 {
    let norm = |d: &str| if d == "ai.onnx" { String::new() } else { d.to_string() };
    opsets.iter().find(|o| norm(&o.domain) == norm(domain)).map(|o| o.version).unwrap_or(21)
}

fn infer_scoped(g: &mut Graph, opsets: &[OpsetImport], outer: &HashMap<String, Known>, report: &mut InferReport) {
    let Ok(order) = g.topo_order() else { return };
    let mut known: HashMap<ValueId, Known> = HashMap::new();
    for (id, v) in g.values() {
        let mut k = Known { ty: v.ty.clone(), ..Default::default() };
        if v.kind() == ValueKind::Outer {
            k = outer.get(&v.name).cloned().unwrap_or_default();
        }
        if let (Some(t), ValueKind::Initializer) = (v.initializer(), v.kind()) {
            k.value = rules::int_dims(t);
            k.constant = Some(t.clone());
        }
        known.insert(id, k);
    }
    for id in order {
        let node = g.node(id).expect("topological order lists live nodes").clone();
        let ins: Vec<Known> = node.inputs.iter().map(|v| v.and_then(|v| known.get(&v).cloned()).unwrap_or_default()).collect();
        let op_version = opset(opsets, &node.domain);
        let outs = match rules::infer(&node, &ins, op_version) {
            Some(o) => o,
            None => {
                report.unknown_ops.push((node.display_name(id), node.qualified_op()));
                vec![Known::default(); node.outputs.len()]
            }
        };
        // Subgraphs see this graph's types by name.
        if node.subgraphs().next().is_some() {
            let scope: HashMap<String, Known> = outer.clone().into_iter()
                .chain(g.values().map(|(vid, v)| (v.name.clone(), known.get(&vid).cloned().unwrap_or_default())))
                .collect();
            infer_subgraphs(g, id, opsets, &scope, report);
        }
        for (v, k) in node.outputs.iter().zip(outs) {
            let Some(v) = v else { continue };
            let merged = merge(g, *v, k.ty.clone(), &node.display_name(id), report);
            known.insert(*v, Known { ty: merged, value: k.value, constant: k.constant });
        }
    }
}

fn infer_subgraphs(g: &mut Graph, id: NodeId, opsets: &[OpsetImport], scope: &HashMap<String, Known>, report: &mut InferReport) {
    if let Ok(attrs) = g.node_attrs_mut(id) {
        for a in attrs.iter_mut() {
            for sub in a.value.graphs_mut() {
                infer_scoped(sub, opsets, scope, report);
            }
        }
    }
}

/// Merges an inferred type into a value's declared one and returns the result.
fn merge(g: &mut Graph, v: ValueId, inferred: Option<ValueType>, node: &str, report: &mut InferReport) -> Option<ValueType> {
    let value = g.value_mut(v).ok()?;
    let Some(inferred) = inferred else { return value.ty.clone() };
    let merged = match &value.ty {
        None => Some(inferred.clone()),
        Some(declared) => match merge_types(declared, &inferred) {
            Some(m) => Some(m),
            None => {
                report.conflicts.push((value.name.clone(), declared.to_string(), format!("{inferred} (at node '{node}')")));
                return value.ty.clone();
            }
        },
    };
    if merged != value.ty {
        report.inferred += 1;
        value.ty = merged.clone();
    }
    merged
}

/// The more specific of two compatible types; `None` when they contradict.
fn merge_types(a: &ValueType, b: &ValueType) -> Option<ValueType> {
    match (a, b) {
        (ValueType::Tensor { elem: ea, shape: sa }, ValueType::Tensor { elem: eb, shape: sb }) => {
            let elem = match (ea, eb) {
                (Some(x), Some(y)) if x != y => return None,
                (Some(x), _) | (None, Some(x)) => Some(*x),
                _ => None,
            };
            let shape = match (sa, sb) {
                (Some(x), Some(y)) if x.len() != y.len() => return None,
                (Some(x), Some(y)) => Some(x.iter().zip(y).map(|(p, q)| merge_dim(p, q)).collect::<Option<Shape>>()?),
                (Some(x), None) | (None, Some(x)) => Some(x.clone()),
                _ => None,
            };
            Some(ValueType::Tensor { elem, shape })
        }
        _ => Some(a.clone()),
    }
}

fn merge_dim(a: &Dim, b: &Dim) -> Option<Dim> {
    match (a, b) {
        (Dim::Known(x), Dim::Known(y)) if x != y && *x >= 0 && *y >= 0 => None,
        (Dim::Known(x), _) if *x >= 0 => Some(Dim::Known(*x)),
        (_, Dim::Known(y)) if *y >= 0 => Some(Dim::Known(*y)),
        (Dim::Sym(s), _) | (_, Dim::Sym(s)) => Some(Dim::Sym(s.clone())),
        _ => Some(a.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Node, Tensor};

    fn op(g: &mut Graph, op: &str, inputs: &[ValueId]) -> ValueId {
        let name = g.unique_name(&op.to_lowercase());
        let out = g.new_value(name.clone(), None).unwrap();
        g.add_node(Node::new(op, name).with_inputs(inputs.iter().copied()).with_outputs([out])).unwrap();
        out
    }

    #[test]
    fn symbolic_shape_chain_resolves_reshape() {
        // x: [N, 3, 4]; y = Reshape(x, Concat(Gather(Shape(x), 0), [12])) -> [N, 12].
        let mut g = Graph::new("g");
        let x = g.add_input("x", Some(ValueType::tensor(DType::F32, vec![Dim::Sym("N".into()), Dim::Known(3), Dim::Known(4)]))).unwrap();
        let zero = g.add_initializer("zero", Tensor::from_vec(&[1], vec![0i64]).unwrap()).unwrap();
        let twelve = g.add_initializer("twelve", Tensor::from_vec(&[1], vec![12i64]).unwrap()).unwrap();
        let s = op(&mut g, "Shape", &[x]);
        let n = op(&mut g, "Gather", &[s, zero]);
        let name = g.unique_name("concat");
        let target = g.new_value(name.clone(), None).unwrap();
        g.add_node(Node::new("Concat", name).with_inputs([n, twelve]).with_outputs([target]).with_attr("axis", crate::Attr::Int(0))).unwrap();
        let y = op(&mut g, "Reshape", &[x, target]);
        let b = g.add_input("b", Some(ValueType::tensor_of(DType::F32, &[12]))).unwrap();
        let z = op(&mut g, "Add", &[y, b]);
        g.set_outputs(vec![z]).unwrap();
        let report = infer_graph(&mut g, &[OpsetImport { domain: String::new(), version: 17 }]);
        assert!(report.unknown_ops.is_empty() && report.conflicts.is_empty(), "{report:?}");
        let want = ValueType::tensor(DType::F32, vec![Dim::Sym("N".into()), Dim::Known(12)]);
        assert_eq!(g.value(y).unwrap().ty, Some(want.clone()));
        assert_eq!(g.value(z).unwrap().ty, Some(want));
    }

    #[test]
    fn one_hot_inserts_depth_at_axis_and_scatter_keeps_data_type() {
        let mut g = Graph::new("g");
        let i = g.add_input("i", Some(ValueType::tensor(DType::I32, vec![Dim::Sym("N".into()), Dim::Known(3)]))).unwrap();
        let depth = g.add_initializer("depth", Tensor::scalar(5i64)).unwrap();
        let values = g.add_initializer("values", Tensor::from_vec(&[2], vec![0f32, 1.0]).unwrap()).unwrap();
        let name = g.unique_name("onehot");
        let y = g.new_value(name.clone(), None).unwrap();
        g.add_node(Node::new("OneHot", name).with_inputs([i, depth, values]).with_outputs([y]).with_attr("axis", crate::Attr::Int(-2))).unwrap();
        let idx = g.add_input("idx", Some(ValueType::tensor_of(DType::I64, &[1, 5, 3]))).unwrap();
        let z = op(&mut g, "ScatterElements", &[y, idx, y]);
        g.set_outputs(vec![z]).unwrap();
        let report = infer_graph(&mut g, &[OpsetImport { domain: String::new(), version: 18 }]);
        assert!(report.unknown_ops.is_empty() && report.conflicts.is_empty(), "{report:?}");
        let want = ValueType::tensor(DType::F32, vec![Dim::Sym("N".into()), Dim::Known(5), Dim::Known(3)]);
        assert_eq!(g.value(y).unwrap().ty, Some(want.clone()));
        assert_eq!(g.value(z).unwrap().ty, Some(want));
    }

    /// Index outputs of selection ops are int64 (never taken for float activations), and
    /// shapes follow from a constant `k` and the axis.
    #[test]
    fn selection_ops_give_int64_indices() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", Some(ValueType::tensor(DType::F32, vec![Dim::Sym("N".into()), Dim::Known(10)]))).unwrap();
        let k = g.add_initializer("k", Tensor::from_vec(&[1], vec![3i64]).unwrap()).unwrap();
        let (values, indices) = (g.new_value("values", None).unwrap(), g.new_value("indices", None).unwrap());
        g.add_node(Node::new("TopK", "topk").with_inputs([x, k]).with_outputs([values, indices])).unwrap();
        let nz = op(&mut g, "NonZero", &[x]);
        let outs: Vec<ValueId> = ["y", "first", "inverse", "counts"].iter().map(|n| g.new_value(*n, None).unwrap()).collect();
        g.add_node(Node::new("Unique", "unique").with_inputs([x]).with_outputs(outs.iter().copied()).with_attr("axis", crate::Attr::Int(-1))).unwrap();
        g.set_outputs(vec![values, indices, nz, outs[0], outs[2]]).unwrap();
        let report = infer_graph(&mut g, &[OpsetImport { domain: String::new(), version: 17 }]);
        assert!(report.unknown_ops.is_empty() && report.conflicts.is_empty(), "{report:?}");
        let top = vec![Dim::Sym("N".into()), Dim::Known(3)];
        assert_eq!(g.value(values).unwrap().ty, Some(ValueType::tensor(DType::F32, top.clone())));
        assert_eq!(g.value(indices).unwrap().ty, Some(ValueType::tensor(DType::I64, top)));
        assert_eq!(g.value(nz).unwrap().ty, Some(ValueType::tensor(DType::I64, vec![Dim::Known(2), Dim::Unknown])));
        assert_eq!(g.value(outs[0]).unwrap().ty, Some(ValueType::tensor(DType::F32, vec![Dim::Sym("N".into()), Dim::Unknown])));
        assert_eq!(g.value(outs[2]).unwrap().ty, Some(ValueType::tensor(DType::I64, vec![Dim::Known(10)])));
    }

    #[test]
    fn axes_of_scalars_leave_shapes_unknown() {
        // Concat, Gather and Split take an axis that a scalar does not have.
        let mut g = Graph::new("g");
        let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[]))).unwrap();
        let i = g.add_initializer("i", Tensor::from_vec(&[], vec![0i64]).unwrap()).unwrap();
        let mut outs = vec![];
        for (op, inputs) in [("Concat", vec![x, x]), ("Gather", vec![x, i]), ("Split", vec![x])] {
            let y = g.new_value(format!("{op}_out"), None).unwrap();
            g.add_node(Node::new(op, op).with_inputs(inputs).with_outputs([y]).with_attr("axis", crate::Attr::Int(0))).unwrap();
            outs.push(y);
        }
        g.set_outputs(outs.clone()).unwrap();
        infer_graph(&mut g, &[]);
        for y in outs {
            assert_eq!(g.value(y).unwrap().ty.as_ref().and_then(|t| t.shape()), None, "{}", g.value_name(y));
        }
    }

    #[test]
    fn contradictions_are_reported_not_applied() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[2, 3]))).unwrap();
        let y = op(&mut g, "Relu", &[x]);
        g.value_mut(y).unwrap().ty = Some(ValueType::tensor_of(DType::F32, &[5]));
        g.set_outputs(vec![y]).unwrap();
        let report = infer_graph(&mut g, &[]);
        assert_eq!(report.conflicts.len(), 1);
        assert_eq!(g.value(y).unwrap().ty, Some(ValueType::tensor_of(DType::F32, &[5])));
        let u = op(&mut g, "NoSuchOp", &[x]);
        let report = infer_graph(&mut g, &[]);
        assert_eq!(report.unknown_ops.len(), 1);
        assert!(g.value(u).unwrap().ty.is_none());
    }

    #[test]
    fn windows_over_three_spatial_axes_give_their_output_sizes() {
        use crate::Attr;
        let mut g = Graph::new("g");
        let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[2, 4, 9, 8, 7]))).unwrap();
        let w = g.add_input("w", Some(ValueType::tensor_of(DType::F32, &[6, 2, 3, 2, 3]))).unwrap();
        let wt = g.add_input("wt", Some(ValueType::tensor_of(DType::F32, &[4, 3, 3, 3, 3]))).unwrap();
        let ints = |v: &[i64]| Attr::Ints(v.to_vec());
        let mut node = |op: &str, inputs: &[ValueId], attrs: Vec<(&str, Attr)>| {
            let name = g.unique_name(&op.to_lowercase());
            let out = g.new_value(name.clone(), None).unwrap();
            let n = attrs.into_iter().fold(Node::new(op, name).with_inputs(inputs.iter().copied()).with_outputs([out]), |n, (k, v)| n.with_attr(k, v));
            g.add_node(n).unwrap();
            out
        };
        let conv = node("Conv", &[x, w], vec![("group", Attr::Int(2)), ("strides", ints(&[2, 1, 3])), ("dilations", ints(&[1, 2, 1])), ("pads", ints(&[1, 0, 1, 1, 2, 0]))]);
        let pool = node("MaxPool", &[x], vec![("kernel_shape", ints(&[2, 3, 2])), ("strides", ints(&[2, 2, 2])), ("dilations", ints(&[2, 1, 1])), ("ceil_mode", Attr::Int(1))]);
        let deconv = node("ConvTranspose", &[x, wt], vec![("strides", ints(&[2, 2, 2])), ("output_padding", ints(&[1, 0, 0])), ("pads", ints(&[1, 1, 0, 1, 1, 0]))]);
        g.set_outputs(vec![conv, pool, deconv]).unwrap();
        let report = infer_graph(&mut g, &[OpsetImport { domain: String::new(), version: 22 }]);
        assert!(report.unknown_ops.is_empty() && report.conflicts.is_empty(), "{report:?}");
        assert_eq!(g.value(conv).unwrap().ty, Some(ValueType::tensor_of(DType::F32, &[2, 6, 5, 8, 2])));
        assert_eq!(g.value(pool).unwrap().ty, Some(ValueType::tensor_of(DType::F32, &[2, 4, 4, 4, 4])));
        assert_eq!(g.value(deconv).unwrap().ty, Some(ValueType::tensor_of(DType::F32, &[2, 3, 18, 15, 15])));
    }

    /// ONNX Runtime's transformer ops of `com.microsoft` get their output shapes; an op of
    /// that domain named like an ONNX op with another contract is not read as the ONNX op,
    /// and one without a rule stays unknown.
    #[test]
    fn com_microsoft_transformer_ops_have_their_own_rules() {
        use crate::{Attr, MS_DOMAIN};
        let mut g = Graph::new("g");
        let n = Dim::Sym("N".into());
        let x = g.add_input("x", Some(ValueType::tensor(DType::F32, vec![n.clone(), Dim::Known(7), Dim::Known(16)]))).unwrap();
        let w = g.add_initializer("w", Tensor::zeros(DType::F32, &[16, 48]).unwrap()).unwrap();
        let b = g.add_initializer("b", Tensor::zeros(DType::F32, &[48]).unwrap()).unwrap();
        let ms = |g: &mut Graph, op: &str, inputs: Vec<Option<ValueId>>, outputs: usize, attrs: Vec<(&str, Attr)>| -> Vec<ValueId> {
            let name = g.unique_name(&op.to_lowercase());
            let outs: Vec<ValueId> = (0..outputs).map(|i| g.new_value(format!("{name}_{i}"), None).unwrap()).collect();
            let mut node = Node::new(op, name).with_outputs(outs.iter().copied());
            node.inputs = inputs;
            node.domain = MS_DOMAIN.into();
            for (k, v) in attrs {
                node = node.with_attr(k, v);
            }
            g.add_node(node).unwrap();
            outs
        };
        let attn = ms(&mut g, "Attention", vec![Some(x), Some(w), Some(b)], 1, vec![("num_heads", Attr::Int(4))]);
        let gelu = ms(&mut g, "FastGelu", vec![Some(attn[0])], 1, vec![]);
        let gamma = g.add_initializer("gamma", Tensor::zeros(DType::F32, &[16]).unwrap()).unwrap();
        let sln = ms(&mut g, "SkipLayerNormalization", vec![Some(gelu[0]), Some(x), Some(gamma)], 4, vec![]);
        let wt = g.add_initializer("wt", Tensor::zeros(DType::F32, &[5, 16]).unwrap()).unwrap();
        let mm = ms(&mut g, "FusedMatMul", vec![Some(sln[0]), Some(wt)], 1, vec![("transB", Attr::Int(1))]);
        let ids = g.add_input("ids", Some(ValueType::tensor(DType::I32, vec![n.clone(), Dim::Known(7)]))).unwrap();
        let table = g.add_initializer("table", Tensor::zeros(DType::F32, &[30, 16]).unwrap()).unwrap();
        let eln = ms(&mut g, "EmbedLayerNormalization", vec![Some(ids), None, Some(table), Some(table), None, Some(gamma), Some(gamma)], 3, vec![]);
        let unknown = ms(&mut g, "GroupQueryAttention", vec![Some(x), Some(x), Some(x)], 1, vec![]);
        g.set_outputs(vec![mm[0], sln[1], sln[3], eln[0], eln[1], unknown[0]]).unwrap();
        let opsets = [OpsetImport { domain: String::new(), version: 17 }, OpsetImport { domain: MS_DOMAIN.into(), version: 1 }];
        let report = infer_graph(&mut g, &opsets);
        assert_eq!(report.unknown_ops.len(), 1, "{report:?}");
        let f32_of = |dims: Vec<Dim>| Some(ValueType::tensor(DType::F32, dims));
        assert_eq!(g.value(attn[0]).unwrap().ty, f32_of(vec![n.clone(), Dim::Known(7), Dim::Known(16)]));
        assert_eq!(g.value(sln[1]).unwrap().ty, f32_of(vec![n.clone(), Dim::Known(7), Dim::Known(1)]));
        assert_eq!(g.value(sln[3]).unwrap().ty, f32_of(vec![n.clone(), Dim::Known(7), Dim::Known(16)]));
        assert_eq!(g.value(mm[0]).unwrap().ty, f32_of(vec![n.clone(), Dim::Known(7), Dim::Known(5)]));
        assert_eq!(g.value(eln[0]).unwrap().ty, f32_of(vec![n.clone(), Dim::Known(7), Dim::Known(16)]));
        assert_eq!(g.value(eln[1]).unwrap().ty, Some(ValueType::tensor(DType::I32, vec![n])));
        assert_eq!(g.value(unknown[0]).unwrap().ty, None);
    }

    #[test]
    fn sequence_ops_carry_element_types_and_shapes() {
        // x: [N, 6] -> SplitToSequence(axis 1, keepdims 0) -> seq<float[N]>; SequenceAt -> float[N];
        // ConcatFromSequence(axis 1, new_axis 1) -> float[N, ?]; SequenceLength -> int64 scalar.
        let mut g = Graph::new("g");
        let x = g.add_input("x", Some(ValueType::tensor(DType::F32, vec![Dim::Sym("N".into()), Dim::Known(6)]))).unwrap();
        let pos = g.add_initializer("pos", Tensor::scalar(0i64)).unwrap();
        let seq = g.new_value("seq", None).unwrap();
        g.add_node(Node::new("SplitToSequence", "split").with_inputs([x]).with_outputs([seq]).with_attr("axis", crate::Attr::Int(1)).with_attr("keepdims", crate::Attr::Int(0))).unwrap();
        let at = op(&mut g, "SequenceAt", &[seq, pos]);
        let len = op(&mut g, "SequenceLength", &[seq]);
        let cat = g.new_value("cat", None).unwrap();
        g.add_node(Node::new("ConcatFromSequence", "cat").with_inputs([seq]).with_outputs([cat]).with_attr("axis", crate::Attr::Int(1)).with_attr("new_axis", crate::Attr::Int(1))).unwrap();
        let opt = op(&mut g, "Optional", &[at]);
        let got = op(&mut g, "OptionalGetElement", &[opt]);
        g.set_outputs(vec![at, len, cat, got]).unwrap();
        let report = infer_graph(&mut g, &[OpsetImport { domain: String::new(), version: 18 }]);
        assert!(report.unknown_ops.is_empty() && report.conflicts.is_empty(), "{report:?}");
        let n = || ValueType::tensor(DType::F32, vec![Dim::Sym("N".into())]);
        assert_eq!(g.value(seq).unwrap().ty, Some(ValueType::Sequence(Some(Box::new(n())))));
        assert_eq!(g.value(at).unwrap().ty, Some(n()));
        assert_eq!(g.value(len).unwrap().ty, Some(ValueType::tensor_of(DType::I64, &[])));
        assert_eq!(g.value(cat).unwrap().ty, Some(ValueType::tensor(DType::F32, vec![Dim::Sym("N".into()), Dim::Unknown])));
        assert_eq!(g.value(opt).unwrap().ty, Some(ValueType::Optional(Some(Box::new(n())))));
        assert_eq!(g.value(got).unwrap().ty, Some(n()));
    }
}
