use qforge_ir::{Attr, DType, Graph, IrResult, Node, OpsetImport, Patch, Tensor, ValueKind, ValueType, CAPTURE_USE};

/// What [`upcast_half`] changed (the report's `upcast`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Upcast {
    /// The ONNX names of the half-precision types the model computed in (`float16`,
    /// `bfloat16`).
    pub from: Vec<String>,
    /// Values (in every graph) whose type became float32.
    pub values: usize,
    /// Initializers and tensor attributes stored as float32.
    pub constants: usize,
    /// Cast, EyeLike, Random* and window nodes whose float16/bfloat16 target became float32.
    pub targets: usize,
    /// Casts from float32 to float32 left by the widening (the half-precision model's casts
    /// around ops it kept in float32), removed.
    pub casts_removed: usize,
    /// Graph inputs and outputs that keep their half-precision type, converted at the boundary.
    pub boundary: Vec<String>,
}

/// Dtype attributes that name the element type a node creates, by op type.
const DTYPE_ATTRS: &[(&str, &str)] = &[
    ("Cast", "to"),
    ("EyeLike", "dtype"),
    ("RandomNormal", "dtype"),
    ("RandomUniform", "dtype"),
    ("RandomNormalLike", "dtype"),
    ("RandomUniformLike", "dtype"),
    ("Bernoulli", "dtype"),
    ("HannWindow", "output_datatype"),
    ("HammingWindow", "output_datatype"),
    ("BlackmanWindow", "output_datatype"),
    ("MelWeightMatrix", "output_datatype"),
];

fn is_half(d: DType) -> bool {
    matches!(d, DType::F16 | DType::BF16)
}

/// Makes a model that computes in float16 or bfloat16 compute in float32, with the same
/// interface: every half-precision value of `g` and of its subgraphs becomes float32 (value
/// types, initializers, Constant and ConstantOfShape tensors, and the target type of Cast,
/// EyeLike, Random*, Bernoulli, the window ops and MelWeightMatrix). A half-precision graph
/// input is cast to float32 where it enters; a half-precision graph output is cast back from
/// float32 where it leaves. Widening is exact, so the float32 model computes what the
/// half-precision one approximates. Quantization works on float32 values; without this a
/// float16 model keeps every node in float. The casts that then convert float32 to float32
/// (a half-precision model casts around the ops it keeps in float32) are removed, with types
/// inferred under `opsets` to find them. `None` when `g` has no half-precision value.
///
/// Fails, leaving `g` unchanged, when a half-precision graph input is also read by a subgraph
/// by name (its float32 copy could not take over that read).
pub fn upcast_half(g: &mut Graph, opsets: &[OpsetImport]) -> IrResult<Option<Upcast>> {
    let mut from: Vec<DType> = g.graphs().iter().flat_map(|(path, sub)| half_types(sub, path.is_empty())).collect();
    from.sort_by_key(|d| d.onnx_code());
    from.dedup();
    if from.is_empty() {
        return Ok(None);
    }
    let mut up = Upcast { from: from.iter().map(|d| d.to_string()).collect(), ..Default::default() };
    let mut patch = Patch::new(g, "upcast_half");
    patch.reserve(g.nodes().map(|(_, n)| n.name.clone()));
    let mut kept = vec![];
    for &v in g.inputs() {
        let Some(half) = elem(g.value(v)?.ty.as_ref()).filter(|&d| is_half(d)) else { continue };
        let name = g.value_name(v);
        let wide_name = patch.unique_name(g, &format!("{name}_float32"));
        let wide = patch.new_value(wide_name, None);
        let cast_name = patch.unique_name(g, &format!("{name}_to_float32"));
        patch.add_node(cast(&cast_name, v, wide, DType::F32));
        patch.replace_uses(v, wide);
        kept.push((name, half));
    }
    for &v in g.outputs() {
        let Some(half) = elem(g.value(v)?.ty.as_ref()).filter(|&d| is_half(d)) else { continue };
        let name = g.value_name(v);
        let half_name = if half == DType::F16 { "float16" } else { "bfloat16" };
        let narrow_name = patch.unique_name(g, &format!("{name}_{half_name}"));
        let narrow = patch.new_value(narrow_name, g.value(v)?.ty.clone());
        let cast_name = patch.unique_name(g, &format!("{name}_to_{half_name}"));
        patch.add_node(cast(&cast_name, v, narrow, half));
        patch.replace_uses(v, narrow);
        kept.push((name, half));
    }
    g.apply(patch)?;
    up.boundary = kept.iter().map(|(n, _)| n.clone()).collect();
    // The boundary values and Casts keep their half-precision type; everything else widens.
    let boundary_values: Vec<_> = kept.iter().filter_map(|(n, _)| g.value_by_name(n)).collect();
    let boundary_casts: Vec<_> = g.outputs().iter().filter(|v| boundary_values.contains(v)).filter_map(|&v| g.producer(v).map(|(n, _)| n)).collect();
    widen(g, &boundary_values, &boundary_casts, &mut up)?;
    qforge_ir::infer::infer_graph(g, opsets);
    let paths: Vec<_> = g.graphs().into_iter().map(|(p, _)| p).collect();
    for p in paths {
        let sub = g.graph_at_mut(&p).expect("a path from graphs()");
        up.casts_removed += drop_identity_casts(sub)?;
    }
    Ok(Some(up))
}

/// Removes the Casts of `g` from float32 to float32 whose readers can read their input
/// instead: not a graph output fed by anything but a node, not read by a subgraph by name.
fn drop_identity_casts(g: &mut Graph) -> IrResult<usize> {
    let f32_code = DType::F32.onnx_code() as i64;
    let mut patch = Patch::new(g, "upcast_half");
    let mut removed = 0;
    for (id, n) in g.nodes() {
        let (Some(from), Some(to)) = (n.input(0), n.output(0)) else { continue };
        if n.op_type != "Cast" || n.attr_int("to") != Some(f32_code) || elem(g.value(from)?.ty.as_ref()) != Some(DType::F32) {
            continue;
        }
        let captured = |v| g.consumers(v).iter().any(|&(_, i)| i == CAPTURE_USE);
        let output_from_non_node = g.is_output(to) && (g.value(from)?.kind() != ValueKind::NodeOutput || g.is_output(from));
        if captured(to) || output_from_non_node {
            continue;
        }
        patch.replace_uses(to, from);
        patch.remove_node(id);
        removed += 1;
    }
    g.apply(patch)?;
    Ok(removed)
}

fn elem(ty: Option<&ValueType>) -> Option<DType> {
    ty.and_then(|t| t.elem())
}

fn cast(name: &str, from: qforge_ir::ValueId, to_value: qforge_ir::ValueId, to: DType) -> Node {
    Node::new("Cast", name).with_inputs([from]).with_outputs([to_value]).with_attr("to", Attr::Int(to.onnx_code() as i64))
}

/// The half-precision types `g` itself (not its subgraphs) computes in: that its values
/// declare, its initializers store or its nodes create. At the `main` graph's boundary, a
/// half-precision input that only Casts to float32 read and a half-precision output that a
/// Cast writes are an interface, not computation (what [`upcast_half`] leaves).
fn half_types(g: &Graph, main: bool) -> Vec<DType> {
    let interface = |id: qforge_ir::ValueId| {
        let cast_to_f32 = |n: &Node| n.op_type == "Cast" && n.attr_int("to") == Some(DType::F32.onnx_code() as i64);
        let read_by_casts = g.inputs().contains(&id) && g.consumers(id).iter().all(|&(c, _)| g.node(c).is_ok_and(cast_to_f32));
        let cast_out = g.is_output(id) && g.producer(id).is_some_and(|(p, _)| g.node(p).is_ok_and(|n| n.op_type == "Cast"));
        main && (read_by_casts || cast_out)
    };
    let values = g.values().filter(|(id, _)| !interface(*id)).filter_map(|(_, v)| v.initializer().map(|t| t.dtype()).or(elem(v.ty.as_ref())));
    let created = g.nodes().flat_map(|(_, n)| {
        let writes_interface = n.outputs.iter().flatten().any(|&v| interface(v));
        let target = DTYPE_ATTRS.iter().filter(|(op, _)| *op == n.op_type && !writes_interface).filter_map(|(_, a)| n.attr_int(a)).filter_map(|c| DType::from_onnx(c as i32));
        let tensors = n.attrs.iter().filter_map(|a| match &a.value { Attr::Tensor(t) => Some(t.dtype()), _ => None });
        target.chain(tensors).collect::<Vec<_>>()
    });
    values.chain(created).filter(|&d| is_half(d)).collect()
}

/// Widens every half-precision value, constant and creation target of `g` and its subgraphs to
/// float32, except the main graph's boundary values and the Casts producing them.
fn widen(g: &mut Graph, keep_values: &[qforge_ir::ValueId], keep_casts: &[qforge_ir::NodeId], up: &mut Upcast) -> IrResult<()> {
    let ids: Vec<_> = g.values().map(|(id, _)| id).filter(|id| !keep_values.contains(id)).collect();
    for id in ids {
        if let Some(t) = g.value(id)?.initializer().filter(|t| is_half(t.dtype())) {
            let wide = to_f32(t)?;
            g.set_initializer(id, wide)?;
            up.constants += 1;
        }
        let v = g.value_mut(id)?;
        if let Some(ty) = v.ty.as_mut() {
            if widen_type(ty) {
                up.values += 1;
            }
        }
    }
    let nodes: Vec<_> = g.nodes().map(|(id, n)| (id, n.op_type.clone())).filter(|(id, _)| !keep_casts.contains(id)).collect();
    for (id, op) in nodes {
        for a in g.node_attrs_mut(id)?.iter_mut() {
            match &mut a.value {
                Attr::Int(code) if DTYPE_ATTRS.contains(&(op.as_str(), a.name.as_str())) => {
                    if DType::from_onnx(*code as i32).is_some_and(is_half) {
                        *code = DType::F32.onnx_code() as i64;
                        up.targets += 1;
                    }
                }
                Attr::Tensor(t) if is_half(t.dtype()) => {
                    *t = to_f32(t)?;
                    up.constants += 1;
                }
                other => {
                    for sub in other.graphs_mut() {
                        widen(sub, &[], &[], up)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Makes the element types of `ty` (nested in sequences, optionals and maps) float32 where
/// they were half precision; whether anything changed.
fn widen_type(ty: &mut ValueType) -> bool {
    match ty {
        ValueType::Tensor { elem, .. } | ValueType::SparseTensor { elem, .. } => match elem {
            Some(d) if is_half(*d) => {
                *d = DType::F32;
                true
            }
            _ => false,
        },
        ValueType::Sequence(Some(t)) | ValueType::Optional(Some(t)) | ValueType::Map { value: Some(t), .. } => widen_type(t),
        _ => false,
    }
}

fn to_f32(t: &Tensor) -> IrResult<Tensor> {
    let values: Vec<f32> = t.to_f64_vec()?.into_iter().map(|v| v as f32).collect();
    Tensor::from_vec(t.shape(), values)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `y = Relu(Conv(x, w)) + c` in float16, `c` from a Constant node, with a float16
    /// ConstantOfShape and a Cast back to float16 in the middle.
    fn half_graph(half: DType) -> Graph {
        let t = |shape: &[usize], v: Vec<f32>| match half {
            DType::F16 => Tensor::from_vec(shape, v.into_iter().map(half::f16::from_f32).collect()).unwrap(),
            _ => Tensor::from_vec(shape, v.into_iter().map(half::bf16::from_f32).collect()).unwrap(),
        };
        let mut g = Graph::new("g");
        let x = g.add_input("x", Some(ValueType::tensor_of(half, &[1, 2, 3, 3]))).unwrap();
        let w = g.add_initializer("w", t(&[2, 2, 1, 1], vec![0.5, -1.0, 2.0, 0.25])).unwrap();
        let conv = g.new_value("conv", Some(ValueType::tensor_of(half, &[1, 2, 3, 3]))).unwrap();
        g.add_node(Node::new("Conv", "conv").with_inputs([x, w]).with_outputs([conv])).unwrap();
        let relu = g.new_value("relu", None).unwrap();
        g.add_node(Node::new("Relu", "relu").with_inputs([conv]).with_outputs([relu])).unwrap();
        let again = g.new_value("again", None).unwrap();
        g.add_node(cast("again", relu, again, half)).unwrap();
        let c = g.new_value("c", None).unwrap();
        g.add_node(Node::new("Constant", "c").with_outputs([c]).with_attr("value", Attr::Tensor(t(&[1], vec![0.5])))).unwrap();
        let y = g.new_value("y", Some(ValueType::tensor_of(half, &[1, 2, 3, 3]))).unwrap();
        g.add_node(Node::new("Add", "add").with_inputs([again, c]).with_outputs([y])).unwrap();
        g.set_outputs(vec![y]).unwrap();
        g
    }

    #[test]
    fn half_models_compute_in_float32_behind_their_half_interface() {
        for half in [DType::F16, DType::BF16] {
            let mut g = half_graph(half);
            let up = upcast_half(&mut g, &[]).unwrap().expect("the graph computes in half precision");
            g.check().unwrap();
            assert_eq!(up.from, [half.to_string()]);
            assert_eq!(up.boundary, ["x", "y"]);
            assert_eq!((up.constants, up.targets, up.casts_removed), (2, 1, 1), "w and the Constant; the Cast in the middle, then gone");
            let ty = |name: &str| g.value(g.value_by_name(name).unwrap()).unwrap().ty.as_ref().and_then(|t| t.elem());
            assert_eq!((ty("x"), ty("y")), (Some(half), Some(half)), "the interface keeps its types");
            assert_eq!(ty("conv"), Some(DType::F32));
            assert_eq!(g.value(g.value_by_name("w").unwrap()).unwrap().initializer().unwrap().dtype(), DType::F32);
            let casts: Vec<_> = g.nodes().filter(|(_, n)| n.op_type == "Cast").map(|(_, n)| (g.value_name(n.input(0).unwrap()), n.attr_int("to").unwrap())).collect();
            let code = |d: DType| d.onnx_code() as i64;
            assert!(casts.contains(&("x".to_string(), code(DType::F32))), "{casts:?}");
            assert!(!casts.iter().any(|(from, _)| from == "relu"), "float32 to float32: removed: {casts:?}");
            assert_eq!(g.node(g.consumers(g.value_by_name("relu").unwrap())[0].0).unwrap().op_type, "Add");
            assert_eq!(casts.iter().filter(|(_, to)| *to == code(half)).count(), 1, "only the output's Cast narrows: {casts:?}");
            assert_eq!(upcast_half(&mut g, &[]).unwrap(), None, "only the interface stays half");
        }
    }

    #[test]
    fn float32_graphs_are_left_alone() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", Some(ValueType::tensor_of(DType::F32, &[2]))).unwrap();
        let y = g.new_value("y", None).unwrap();
        g.add_node(Node::new("Relu", "relu").with_inputs([x]).with_outputs([y])).unwrap();
        g.set_outputs(vec![y]).unwrap();
        let before = g.clone();
        assert_eq!(upcast_half(&mut g, &[]).unwrap(), None);
        assert_eq!(g, before);
    }
}
