use qforge_ir::{DType, Graph, IrResult, Node, NodeId, Patch, Tensor, ValueId};

/// The values of a constant float32 initializer, with its shape.
fn const_f32(g: &Graph, v: ValueId) -> Option<(Vec<f32>, Vec<usize>)> {
    let val = g.value(v).ok()?;
    let t = val.initializer().filter(|_| val.is_constant())?;
    (t.dtype() == DType::F32).then(|| (t.as_slice::<f32>().unwrap().to_vec(), t.shape().to_vec()))
}

/// The constant factor of a `Mul` (either input) or the divisor of a `Div` (input 1) when it
/// is a float32 constant, as `(other input, input index of the constant, factor, shape)`;
/// a divisor is returned as its reciprocal and must be finite and non-zero everywhere.
fn constant_factor(g: &Graph, n: &Node) -> Option<(ValueId, usize, Vec<f32>, Vec<usize>)> {
    if !n.domain.is_empty() || n.inputs.len() != 2 {
        return None;
    }
    let [a, b] = [n.input(0)?, n.input(1)?];
    match n.op_type.as_str() {
        "Div" => {
            let (c, shape) = const_f32(g, b)?;
            c.iter().all(|v| v.is_normal()).then(|| (a, 1, c.iter().map(|v| 1.0 / v).collect(), shape))
        }
        "Mul" => match (const_f32(g, a), const_f32(g, b)) {
            (None, Some((c, shape))) => Some((a, 1, c, shape)),
            (Some((c, shape)), None) => Some((b, 0, c, shape)),
            _ => None,
        },
        _ => None,
    }
}

/// Makes scaling by constants uniform and short, so integer backends see one quantizable
/// `Mul` where the model wrote several steps: `Div(x, c)` becomes `Mul(x, 1 / c)` (every
/// value of `c` finite and non-zero), and `Mul(Mul(x, a), b)` with single-element constants
/// `a`, `b` becomes `Mul(x, a * b)` when the inner product has no other reader and is not a
/// graph output. Each rewritten node writes the original output value, so tensor names stay.
/// Returns the number of rewritten nodes.
pub fn fold_constant_scales(g: &mut Graph) -> IrResult<usize> {
    let mut rewritten = 0;
    let order = g.topo_order()?;
    for id in order {
        let Ok(node) = g.node(id) else { continue };
        let node = node.clone();
        let Some((x, _, factor, shape)) = constant_factor(g, &node) else { continue };
        let out = node.output(0).expect("Mul and Div have an output");
        let inner = g.producer(x).and_then(|(p, _)| {
            let pn = g.node(p).ok()?;
            let (px, _, pf, _) = (pn.op_type == "Mul").then(|| constant_factor(g, pn)).flatten()?;
            (pf.len() == 1 && factor.len() == 1 && g.consumers(x).len() == 1 && !g.is_output(x)).then_some((p, px, pf[0]))
        });
        if node.op_type == "Mul" && inner.is_none() {
            continue;
        }
        let mut patch = Patch::new(g, "fold_constant_scales");
        let (input, factor, remove): (ValueId, Vec<f32>, Vec<NodeId>) = match inner {
            Some((p, px, pf)) => (px, vec![factor[0] * pf], vec![id, p]),
            None => (x, factor, vec![id]),
        };
        let base = if node.name.is_empty() { "scale".to_string() } else { node.name.clone() };
        let cname = patch.unique_name(g, &format!("{base}.factor"));
        let c = patch.new_initializer(cname, Tensor::from_vec(if inner.is_some() { &[] } else { &shape }, factor)?);
        let mut mul = Node::new("Mul", node.name.clone());
        mul.inputs = vec![Some(input), Some(c)];
        mul.outputs = vec![Some(out)];
        mul.doc_string = node.doc_string.clone();
        patch.add_node(mul);
        remove.into_iter().for_each(|n| patch.remove_node(n));
        g.apply(patch)?;
        rewritten += 1;
    }
    if rewritten > 0 {
        g.remove_dead_nodes();
    }
    Ok(rewritten)
}
