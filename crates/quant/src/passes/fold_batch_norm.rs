use qforge_ir::{Attr, DType, Graph, IrResult, Node, NodeId, Patch, Tensor, ValueId};

/// Constant data of a value, as f32, when it is a constant float32 initializer.
fn const_f32(g: &Graph, v: Option<ValueId>) -> Option<(Vec<f32>, Vec<usize>)> {
    let val = g.value(v?).ok()?;
    if !val.is_constant() {
        return None;
    }
    let t = val.initializer()?;
    (t.dtype() == DType::F32).then(|| (t.as_slice::<f32>().unwrap().to_vec(), t.shape().to_vec()))
}

/// Where the output channels of a weighted op's weight lie: `(axis, groups)`. Conv weights are
/// `[M, C/g, k...]` (axis 0); ConvTranspose weights `[C, M/g, k...]` (axis 1, per group);
/// Gemm weights `[N, K]` with transB, else `[K, N]`.
fn channel_layout(n: &Node) -> Option<(usize, usize)> {
    match n.op_type.as_str() {
        "Conv" => Some((0, 1)),
        "ConvTranspose" => Some((1, n.attr_int("group").unwrap_or(1).max(1) as usize)),
        "Gemm" if n.attr_float("alpha").unwrap_or(1.0) == 1.0 && n.attr_float("beta").unwrap_or(1.0) == 1.0 => {
            Some((if n.attr_int("transB").unwrap_or(0) != 0 { 0 } else { 1 }, 1))
        }
        _ => None,
    }
}

/// Folds inference-mode `BatchNormalization` into the Conv, ConvTranspose or Gemm that feeds
/// it: with `a = scale / sqrt(var + eps)`, output channel `c` of the weight is multiplied by
/// `a[c]` and the bias becomes `(bias - mean) * a + B`. Only folds when the producer's output
/// has no other reader, and weights, bias and BN parameters are constant float32 tensors.
/// Returns the number of folded nodes.
pub fn fold_batch_norm(g: &mut Graph) -> IrResult<usize> {
    let candidates: Vec<NodeId> = g.nodes().filter(|(_, n)| n.op_type == "BatchNormalization" && n.domain.is_empty()).map(|(id, _)| id).collect();
    let mut folded = 0;
    for bn_id in candidates {
        let bn = g.node(bn_id)?.clone();
        if bn.attr_int("training_mode").unwrap_or(0) != 0 || bn.outputs.iter().skip(1).any(|o| o.is_some()) {
            continue;
        }
        let Some(x) = bn.input(0) else { continue };
        let Some((prod_id, 0)) = g.producer(x) else { continue };
        let prod = g.node(prod_id)?.clone();
        let Some((axis, groups)) = channel_layout(&prod) else { continue };
        if g.consumers(x).len() != 1 || g.is_output(x) {
            continue;
        }
        let Some((w, wshape)) = const_f32(g, prod.input(1)) else { continue };
        let params: Option<Vec<Vec<f32>>> = (1..5).map(|i| const_f32(g, bn.input(i)).map(|p| p.0)).collect();
        let Some(p) = params else { continue };
        let (scale, beta, mean, var) = (&p[0], &p[1], &p[2], &p[3]);
        let eps = bn.attr_float("epsilon").unwrap_or(1e-5);
        let channels = wshape.get(axis).copied().unwrap_or(0) * groups;
        if channels == 0 || p.iter().any(|v| v.len() != channels) {
            continue;
        }
        let bias = match prod.input(2) {
            Some(b) => match const_f32(g, Some(b)) {
                Some((b, _)) if b.len() == channels => b,
                _ => continue,
            },
            None => vec![0.0; channels],
        };
        let a: Vec<f32> = (0..channels).map(|c| scale[c] / (var[c] + eps).sqrt()).collect();
        // Scale the weight along its output-channel axis.
        let outer: usize = wshape[..axis].iter().product();
        let per_group = wshape[axis];
        let inner: usize = wshape[axis + 1..].iter().product();
        let mut w2 = w;
        for o in 0..outer {
            let group = if groups > 1 { o / (outer / groups) } else { 0 };
            for k in 0..per_group {
                let c = group * per_group + k;
                let start = (o * per_group + k) * inner;
                w2[start..start + inner].iter_mut().for_each(|v| *v *= a[c]);
            }
        }
        let b2: Vec<f32> = (0..channels).map(|c| (bias[c] - mean[c]) * a[c] + beta[c]).collect();
        let mut patch = Patch::new(g, "fold_batch_norm");
        let base = if prod.name.is_empty() { "folded".to_string() } else { prod.name.clone() };
        let wname = patch.unique_name(g, &format!("{base}.weight_bn"));
        let bname = patch.unique_name(g, &format!("{base}.bias_bn"));
        let w_new = patch.new_initializer(wname, Tensor::from_vec(&wshape, w2)?);
        let b_new = patch.new_initializer(bname, Tensor::from_vec(&[channels], b2)?);
        let out_name = patch.unique_name(g, &format!("{base}_bn_out"));
        let out = patch.new_value(out_name, None);
        let mut node = Node::new(prod.op_type.clone(), prod.name.clone());
        node.inputs = vec![prod.input(0), Some(w_new), Some(b_new)];
        node.outputs = vec![Some(out)];
        node.attrs = prod.attrs.iter().filter(|a| !(prod.op_type == "Gemm" && matches!(a.value, Attr::Float(_)) && (a.name == "beta"))).cloned().collect();
        node.doc_string = prod.doc_string.clone();
        patch.add_node(node);
        let bn_out = bn.output(0).expect("checked above");
        patch.replace_uses(bn_out, out);
        patch.remove_node(bn_id);
        patch.remove_node(prod_id);
        g.apply(patch)?;
        folded += 1;
    }
    if folded > 0 {
        g.remove_dead_nodes();
    }
    Ok(folded)
}
