//! Control flow: If and Loop run their subgraphs, planned once, in the caller's scope.

use qforge_ir::{Attr, NodeId, Tensor};

use super::util::{input, opt_input};
use crate::plan::Plan;
use crate::{kernel_error, HookSink, Kernel, NodeInfo, Registry, RunCtx, RuntimeError, RuntimeResult, LATEST};

/// Registers If and Loop.
pub fn register(r: &mut Registry) {
    r.add("", "If", 1, LATEST, if_);
    r.add("", "Loop", 1, LATEST, loop_);
}

fn subgraph(info: &NodeInfo, name: &str) -> RuntimeResult<Plan> {
    match info.node.attr(name) {
        Some(Attr::Graph(g)) => Plan::build(g, info.opsets, Registry::builtin(), info.scope_consts).map_err(|e| info.error(format!("subgraph '{name}': {e}"))),
        _ => Err(info.error(format!("attribute '{name}' must be a graph"))),
    }
}

fn scalar_bool(t: &Tensor, what: &str) -> RuntimeResult<bool> {
    let v = t.to_f64_vec().map_err(|e| kernel_error(e.to_string()))?;
    match v.as_slice() {
        [b] => Ok(*b != 0.0),
        _ => Err(kernel_error(format!("{what} must hold one value, got shape {:?}", t.shape()))),
    }
}

/// Runs a subgraph of node `node` (held in attribute `attr`), extending the hooks' path. A
/// feed the subgraph's declared inputs refuse is the node's error, not the model's input's.
fn run_subgraph(plan: &Plan, feeds: Vec<Option<Tensor>>, ctx: &RunCtx, node: NodeId, attr: &'static str) -> RuntimeResult<Vec<Tensor>> {
    let result = match ctx.hooks {
        Some(sink) => {
            let path: Vec<(NodeId, &'static str)> = sink.path.iter().copied().chain([(node, attr)]).collect();
            plan.run_in(feeds, ctx.scope, Some(HookSink { hooks: sink.hooks, path: &path }), None)
        }
        None => plan.run_in(feeds, ctx.scope, None, None),
    };
    result.map_err(|e| match e {
        RuntimeError::Input { input, reason } => kernel_error(format!("subgraph '{attr}': input '{input}' {reason}")),
        e => e,
    })
}

struct If {
    id: NodeId,
    then: Plan,
    otherwise: Plan,
}

impl Kernel for If {
    fn run(&self, ins: &[Option<&Tensor>], ctx: &RunCtx) -> RuntimeResult<Vec<Tensor>> {
        let (branch, attr) = if scalar_bool(input(ins, 0)?, "the condition")? { (&self.then, "then_branch") } else { (&self.otherwise, "else_branch") };
        run_subgraph(branch, vec![], ctx, self.id, attr)
    }
}

fn if_(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    Ok(Box::new(If { id: info.id, then: subgraph(info, "then_branch")?, otherwise: subgraph(info, "else_branch")? }))
}

struct Loop {
    id: NodeId,
    body: Plan,
    /// Shapes of the iteration number and condition fed to the body: `[1]` where the body
    /// declares that input with rank 1 (Paddle exports do; ONNX Runtime feeds them so), else
    /// scalars.
    counter_shapes: [Vec<usize>; 2],
}

/// Stacks equally shaped tensors along a new leading axis.
fn stack(parts: &[Tensor]) -> RuntimeResult<Tensor> {
    let first = &parts[0];
    let mut shape = vec![parts.len()];
    shape.extend_from_slice(first.shape());
    let mut raw = vec![];
    for p in parts {
        if p.shape() != first.shape() || p.dtype() != first.dtype() {
            return Err(kernel_error(format!("scan outputs change shape across iterations ({:?} vs {:?})", first.shape(), p.shape())));
        }
        raw.extend_from_slice(p.raw_bytes().ok_or_else(|| kernel_error("string scan outputs are not supported"))?);
    }
    Tensor::from_raw(first.dtype(), &shape, &raw).map_err(|e| kernel_error(e.to_string()))
}

impl Kernel for Loop {
    fn run(&self, ins: &[Option<&Tensor>], ctx: &RunCtx) -> RuntimeResult<Vec<Tensor>> {
        let max = opt_input(ins, 0).map(|t| t.to_i64_vec().map_err(|e| kernel_error(e.to_string())).map(|v| v.first().copied().unwrap_or(0))).transpose()?;
        let mut cond = opt_input(ins, 1).map(|t| scalar_bool(t, "cond")).transpose()?.unwrap_or(true);
        let mut carried: Vec<Tensor> = ins.iter().skip(2).map(|t| t.cloned().ok_or_else(|| kernel_error("loop-carried values must be given"))).collect::<RuntimeResult<_>>()?;
        let n = carried.len();
        let mut scans: Vec<Vec<Tensor>> = vec![];
        let mut i = 0i64;
        while cond && max.is_none_or(|m| i < m) {
            let [ref iter_shape, ref cond_shape] = self.counter_shapes;
            let mut feeds = vec![Some(Tensor::from_vec(iter_shape, vec![i]).unwrap()), Some(Tensor::from_bools(cond_shape, &[cond]).unwrap())];
            feeds.extend(carried.iter().cloned().map(Some));
            let outs = run_subgraph(&self.body, feeds, ctx, self.id, "body")?;
            if outs.len() < 1 + n {
                return Err(kernel_error(format!("the loop body returned {} outputs, expected at least {}", outs.len(), 1 + n)));
            }
            cond = scalar_bool(&outs[0], "the body's condition output")?;
            carried = outs[1..1 + n].to_vec();
            let extra = &outs[1 + n..];
            if scans.is_empty() {
                scans = vec![vec![]; extra.len()];
            }
            for (k, t) in extra.iter().enumerate() {
                scans[k].push(t.clone());
            }
            i += 1;
            if i > 1 << 31 {
                return Err(kernel_error("the loop ran more than 2^31 iterations"));
            }
        }
        let n_scan = self.body.outputs.len().saturating_sub(1 + n);
        let mut out = carried;
        for k in 0..n_scan {
            out.push(match scans.get(k) {
                Some(parts) if !parts.is_empty() => stack(parts)?,
                _ => Tensor::zeros(qforge_ir::DType::F32, &[0]).unwrap(),
            });
        }
        Ok(out)
    }
}

fn loop_(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let body = subgraph(info, "body")?;
    let shape = |k: usize| match body.inputs.get(k).and_then(|p| p.ty.as_ref()).and_then(|t| t.shape()) {
        Some(s) if s.len() == 1 => vec![1],
        _ => vec![],
    };
    let counter_shapes = [shape(0), shape(1)];
    Ok(Box::new(Loop { id: info.id, body, counter_shapes }))
}
