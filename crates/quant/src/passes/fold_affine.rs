use qforge_ir::{Attr, DType, Graph, IrResult, Node, NodeId, Patch, Tensor, ValueId};

/// Constant data of a value, as f32, when it is a constant float32 initializer.
pub(super) fn const_f32(g: &Graph, v: Option<ValueId>) -> Option<(Vec<f32>, Vec<usize>)> {
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

/// A per-output-channel affine map `y = scale[c] * x + shift[c]`.
struct ChannelAffine {
    scale: Vec<f32>,
    shift: Vec<f32>,
}

/// Values of a constant of `shape` that broadcasts against an output `[N, C, ...]` (rank
/// `out_rank`, channel axis 1) along the channel axis only: one value per channel, or one for
/// all. `None` when it varies along another axis or would change the output's shape.
fn per_channel(data: &[f32], shape: &[usize], channels: usize, out_rank: usize) -> Option<Vec<f32>> {
    if shape.len() > out_rank {
        return None;
    }
    let channel_axis = (shape.len() + 1).checked_sub(out_rank);
    let mut varies = false;
    for (i, &d) in shape.iter().enumerate() {
        if d != 1 {
            if channel_axis != Some(i) || d != channels {
                return None;
            }
            varies = true;
        }
    }
    Some(if varies { data.to_vec() } else { vec![data[0]; channels] })
}

/// The affine map a node applies to input `x` (its input 0 for BatchNormalization), when it
/// is per output channel of a producer with `channels` channels and output rank `out_rank`.
fn affine_of(g: &Graph, n: &Node, x: ValueId, channels: usize, out_rank: usize) -> Option<ChannelAffine> {
    let ones = || vec![1.0; channels];
    let zeros = || vec![0.0; channels];
    if n.op_type == "BatchNormalization" {
        if n.attr_int("training_mode").unwrap_or(0) != 0 || n.outputs.iter().skip(1).any(|o| o.is_some()) || n.input(0) != Some(x) {
            return None;
        }
        let p: Vec<Vec<f32>> = (1..5).map(|i| const_f32(g, n.input(i)).map(|p| p.0)).collect::<Option<_>>()?;
        if p.iter().any(|v| v.len() != channels) {
            return None;
        }
        let eps = n.attr_float("epsilon").unwrap_or(1e-5);
        let scale: Vec<f32> = (0..channels).map(|c| p[0][c] / (p[3][c] + eps).sqrt()).collect();
        let shift = (0..channels).map(|c| p[1][c] - p[2][c] * scale[c]).collect();
        return Some(ChannelAffine { scale, shift });
    }
    let [a, b] = [n.input(0)?, n.input(1)?];
    let (x_first, other) = if a == x { (true, b) } else if b == x { (false, a) } else { return None };
    if a == b {
        return None;
    }
    let (data, shape) = const_f32(g, Some(other))?;
    let c = per_channel(&data, &shape, channels, out_rank)?;
    Some(match (n.op_type.as_str(), x_first) {
        ("Mul", _) => ChannelAffine { scale: c, shift: zeros() },
        ("Add", _) => ChannelAffine { scale: ones(), shift: c },
        ("Sub", true) => ChannelAffine { scale: ones(), shift: c.iter().map(|v| -v).collect() },
        ("Sub", false) => ChannelAffine { scale: vec![-1.0; channels], shift: c },
        ("Div", true) if c.iter().all(|v| v.is_normal()) => ChannelAffine { scale: c.iter().map(|v| 1.0 / v).collect(), shift: zeros() },
        _ => return None,
    })
}

/// Folds a per-output-channel affine map `y = s[c] * x + t[c]` that follows a Conv,
/// ConvTranspose or Gemm into its weights and bias: inference-mode `BatchNormalization`
/// (`s = scale / sqrt(var + eps)`, `t = B - mean * s`) and `Mul`, `Add`, `Sub` or `Div` by a
/// constant that is a scalar or one value per output channel. Output channel `c` of the weight
/// is multiplied by `s[c]` and the bias becomes `bias * s + t`. Only folds when the producer's
/// output has no other reader and is not a graph output, and weight, bias and the map's
/// parameters are constant float32 tensors; repeats until nothing more folds, so chains such
/// as `Conv -> Mul -> Add` fold whole. The folded node writes the map's output value, so
/// the tensor keeps its name. Returns the number of folded nodes.
pub fn fold_affine(g: &mut Graph) -> IrResult<usize> {
    let mut folded = 0;
    loop {
        let candidates: Vec<NodeId> = g.nodes()
            .filter(|(_, n)| n.domain.is_empty() && matches!(n.op_type.as_str(), "BatchNormalization" | "Mul" | "Add" | "Sub" | "Div"))
            .map(|(id, _)| id)
            .collect();
        let before = folded;
        for id in candidates {
            if fold_one(g, id)? {
                folded += 1;
            }
        }
        if folded == before {
            break;
        }
    }
    if folded > 0 {
        g.remove_dead_nodes();
    }
    Ok(folded)
}

/// Folds node `id` into its weighted producer if it is a foldable affine map.
fn fold_one(g: &mut Graph, id: NodeId) -> IrResult<bool> {
    let Ok(node) = g.node(id) else { return Ok(false) };
    let node = node.clone();
    let Some(x) = node.inputs.iter().flatten().copied().find(|&v| matches!(g.producer(v), Some((p, 0)) if g.node(p).is_ok_and(|n| channel_layout(n).is_some()))) else {
        return Ok(false);
    };
    let (prod_id, _) = g.producer(x).expect("found above");
    let prod = g.node(prod_id)?.clone();
    let (axis, groups) = channel_layout(&prod).expect("found above");
    if g.consumers(x).len() != 1 || g.is_output(x) {
        return Ok(false);
    }
    let Some((w, wshape)) = const_f32(g, prod.input(1)) else { return Ok(false) };
    let channels = wshape.get(axis).copied().unwrap_or(0) * groups;
    let out_rank = if prod.op_type == "Gemm" { 2 } else { wshape.len() };
    if channels == 0 {
        return Ok(false);
    }
    let Some(map) = affine_of(g, &node, x, channels, out_rank) else { return Ok(false) };
    let bias = match prod.input(2) {
        Some(b) => match const_f32(g, Some(b)) {
            Some((b, _)) if b.len() == channels => b,
            _ => return Ok(false),
        },
        None => vec![0.0; channels],
    };
    let outer: usize = wshape[..axis].iter().product();
    let per_group = wshape[axis];
    let inner: usize = wshape[axis + 1..].iter().product();
    let mut w2 = w;
    for o in 0..outer {
        let group = if groups > 1 { o / (outer / groups) } else { 0 };
        for k in 0..per_group {
            let c = group * per_group + k;
            let start = (o * per_group + k) * inner;
            w2[start..start + inner].iter_mut().for_each(|v| *v *= map.scale[c]);
        }
    }
    let b2: Vec<f32> = (0..channels).map(|c| bias[c] * map.scale[c] + map.shift[c]).collect();
    let mut patch = Patch::new(g, "fold_affine");
    let base = if prod.name.is_empty() { "folded".to_string() } else { prod.name.clone() };
    let wname = patch.unique_name(g, &format!("{base}.weight_folded"));
    let bname = patch.unique_name(g, &format!("{base}.bias_folded"));
    let w_new = patch.new_initializer(wname, Tensor::from_vec(&wshape, w2)?);
    let b_new = patch.new_initializer(bname, Tensor::from_vec(&[channels], b2)?);
    let mut folded_node = Node::new(prod.op_type.clone(), prod.name.clone());
    folded_node.inputs = vec![prod.input(0), Some(w_new), Some(b_new)];
    folded_node.outputs = vec![node.output(0)];
    folded_node.attrs = prod.attrs.iter().filter(|a| !(prod.op_type == "Gemm" && matches!(a.value, Attr::Float(_)) && a.name == "beta")).cloned().collect();
    folded_node.doc_string = prod.doc_string.clone();
    patch.add_node(folded_node);
    patch.remove_node(id);
    patch.remove_node(prod_id);
    g.apply(patch)?;
    Ok(true)
}
