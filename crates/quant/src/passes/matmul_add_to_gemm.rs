use qforge_ir::{Graph, IrResult, Node, NodeId, Patch, Tensor, ValueId};

use super::fold_affine::const_f32;

/// Rewrites `Add(MatMul(A, B), c)` as `Gemm(A, B, c)` where `A` is a float activation of rank
/// 2 (by its inferred or declared type), `B` a constant float32 `[K, N]`, `c` a constant float32
/// of one value per output column or one for all (`[N]`, `[1, N]`, `[1]`, scalar; either Add
/// operand), and the MatMul's output is read by that Add only. ONNX Runtime's MatMulAddFusion
/// does the same, and its quantizer's pre-processing applies it. The result computes the same
/// expression; integer targets then quantize the bias to int32 at the weight's scale instead of
/// adding a requantized constant, and the Gemm may keep a float output where only float nodes
/// read it (a classifier's logits). Returns the number of rewrites; the graph passes
/// `Graph::check` afterwards.
pub fn matmul_add_to_gemm(g: &mut Graph) -> IrResult<usize> {
    let candidates: Vec<NodeId> = g.nodes().filter(|(_, n)| n.domain.is_empty() && n.op_type == "MatMul").map(|(id, _)| id).collect();
    let mut rewritten = 0;
    for id in candidates {
        if let Some((add, bias)) = fusible(g, id) {
            rewrite(g, id, add, bias)?;
            rewritten += 1;
        }
    }
    if rewritten > 0 {
        g.remove_dead_nodes();
    }
    Ok(rewritten)
}

/// The Add that reads MatMul `id` and its bias as `N` values, when the pair can become a Gemm.
fn fusible(g: &Graph, id: NodeId) -> Option<(NodeId, Vec<f32>)> {
    let mm = g.node(id).ok()?;
    let (a, y) = (mm.input(0)?, mm.output(0)?);
    let rank = g.value(a).ok()?.ty.as_ref()?.shape()?.len();
    let (_, wshape) = const_f32(g, mm.input(1))?;
    if rank != 2 || wshape.len() != 2 || g.value(a).ok()?.is_constant() || g.is_output(y) {
        return None;
    }
    let [(add_id, _)] = g.consumers(y)[..] else { return None };
    let add = g.node(add_id).ok()?;
    if !add.domain.is_empty() || add.op_type != "Add" || add.inputs.len() != 2 {
        return None;
    }
    let other = add.inputs.iter().flatten().copied().find(|&v| v != y)?;
    let (c, cshape) = const_f32(g, Some(other))?;
    let n = wshape[1];
    let per_column = match cshape[..] {
        [] | [1] | [1, 1] => vec![c[0]; n],
        [m] | [1, m] if m == n => c,
        _ => return None,
    };
    Some((add_id, per_column))
}

fn rewrite(g: &mut Graph, id: NodeId, add: NodeId, bias: Vec<f32>) -> IrResult<()> {
    let mm = g.node(id)?.clone();
    let out: Option<ValueId> = g.node(add)?.output(0);
    let mut patch = Patch::new(g, "matmul_add_to_gemm");
    let base = if mm.name.is_empty() { "gemm".to_string() } else { mm.name.clone() };
    let cname = patch.unique_name(g, &format!("{base}.bias"));
    let c = patch.new_initializer(cname, Tensor::from_vec(&[bias.len()], bias)?);
    let mut gemm = Node::new("Gemm", mm.name.clone());
    gemm.inputs = vec![mm.input(0), mm.input(1), Some(c)];
    gemm.outputs = vec![out];
    gemm.doc_string = mm.doc_string.clone();
    patch.add_node(gemm);
    patch.remove_node(add);
    patch.remove_node(id);
    g.apply(patch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use qforge_ir::{DType, ValueType};

    fn graph(a_shape: &[i64], bias_shape: &[usize], bias_first: bool) -> (Graph, ValueId, ValueId) {
        let mut g = Graph::new("g");
        let a = g.add_input("a", Some(ValueType::tensor_of(DType::F32, a_shape))).unwrap();
        let w = g.add_initializer("w", Tensor::from_vec(&[3, 2], vec![1f32, 2., 3., 4., 5., 6.]).unwrap()).unwrap();
        let n: usize = bias_shape.iter().product();
        let c = g.add_initializer("c", Tensor::from_vec(bias_shape, (0..n).map(|i| 10.0 + i as f32).collect()).unwrap()).unwrap();
        let y = g.new_value("y", None).unwrap();
        let z = g.new_value("z", None).unwrap();
        g.add_node(Node::new("MatMul", "mm").with_inputs([a, w]).with_outputs([y])).unwrap();
        let add_inputs = if bias_first { [c, y] } else { [y, c] };
        g.add_node(Node::new("Add", "add").with_inputs(add_inputs).with_outputs([z])).unwrap();
        g.set_outputs(vec![z]).unwrap();
        (g, a, z)
    }

    #[test]
    fn a_matmul_with_a_per_column_bias_becomes_one_gemm() {
        for (shape, first) in [(&[2][..], false), (&[1, 2][..], true), (&[][..], false)] {
            let (mut g, a, z) = graph(&[4, 3], shape, first);
            assert_eq!(matmul_add_to_gemm(&mut g).unwrap(), 1);
            g.check().unwrap();
            let nodes: Vec<&Node> = g.nodes().map(|(_, n)| n).collect();
            assert_eq!(nodes.len(), 1);
            let gemm = nodes[0];
            assert_eq!((gemm.op_type.as_str(), gemm.name.as_str()), ("Gemm", "mm"));
            assert_eq!((gemm.input(0), gemm.output(0)), (Some(a), Some(z)));
            let (c, cshape) = const_f32(&g, gemm.input(2)).unwrap();
            assert_eq!(cshape, [2]);
            assert_eq!(c, if shape.is_empty() { vec![10.0, 10.0] } else { vec![10.0, 11.0] });
        }
    }

    #[test]
    fn other_ranks_biases_and_readers_stay_as_they_are() {
        // A of rank 3 (Gemm takes 2-D inputs only) and a bias that varies along rows.
        for (a_shape, bias) in [(&[1, 4, 3][..], &[2][..]), (&[4, 3][..], &[4, 2][..])] {
            let (mut g, ..) = graph(a_shape, bias, false);
            assert_eq!(matmul_add_to_gemm(&mut g).unwrap(), 0);
        }
        // The MatMul's output is also a graph output.
        let (mut g, _, z) = graph(&[4, 3], &[2], false);
        let y = g.producer(z).and_then(|(add, _)| g.node(add).unwrap().input(0)).unwrap();
        g.set_outputs(vec![z, y]).unwrap();
        assert_eq!(matmul_add_to_gemm(&mut g).unwrap(), 0);
    }
}
