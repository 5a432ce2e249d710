//! Control flow: If, Loop and Scan run their subgraphs, planned once, in the caller's scope.
//! If and Loop carry any values (tensors, sequences, optionals); Scan carries tensors.

use qforge_ir::{Attr, DType, NodeId, Tensor};

use super::shape::{strided_copy, strides, transpose_tensor};
use super::util::{axis, ints, opt_input, opt_tensor_input, tensor_input};
use crate::plan::Plan;
use crate::{kernel_error, value_kernel, HookSink, Kernel, NodeInfo, Registry, RunCtx, RuntimeError, RuntimeResult, Value, ValueKernel, LATEST};

/// Registers If, Loop and Scan.
pub fn register(r: &mut Registry) {
    r.add("", "If", 1, LATEST, if_);
    r.add("", "Loop", 1, LATEST, loop_);
    r.add("", "Scan", 8, 8, scan);
    r.add("", "Scan", 9, LATEST, scan);
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
pub(crate) fn run_subgraph(plan: &Plan, feeds: Vec<Option<Value>>, ctx: &RunCtx, node: NodeId, attr: &'static str) -> RuntimeResult<Vec<Value>> {
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

impl ValueKernel for If {
    fn run_values(&self, ins: &[Option<&Value>], ctx: &RunCtx) -> RuntimeResult<Vec<Value>> {
        let (branch, attr) = if scalar_bool(tensor_input(ins, 0, "the condition")?, "the condition")? { (&self.then, "then_branch") } else { (&self.otherwise, "else_branch") };
        run_subgraph(branch, vec![], ctx, self.id, attr)
    }
}

fn if_(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    value_kernel(If { id: info.id, then: subgraph(info, "then_branch")?, otherwise: subgraph(info, "else_branch")? })
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

/// Loop: runs the body while the condition holds and fewer than `M` iterations ran. Loop-carried
/// values may be tensors, sequences or optionals; scan outputs (the body's outputs after them)
/// must be tensors and are stacked along a new leading axis.
impl ValueKernel for Loop {
    fn run_values(&self, ins: &[Option<&Value>], ctx: &RunCtx) -> RuntimeResult<Vec<Value>> {
        let max = opt_tensor_input(ins, 0, "M")?.map(|t| t.to_i64_vec().map_err(|e| kernel_error(e.to_string())).map(|v| v.first().copied().unwrap_or(0))).transpose()?;
        let mut cond = opt_tensor_input(ins, 1, "cond")?.map(|t| scalar_bool(t, "cond")).transpose()?.unwrap_or(true);
        let mut carried: Vec<Value> = ins.iter().skip(2).map(|t| t.cloned().ok_or_else(|| kernel_error("loop-carried values must be given"))).collect::<RuntimeResult<_>>()?;
        let n = carried.len();
        let mut scans: Vec<Vec<Tensor>> = vec![];
        let mut i = 0i64;
        while cond && max.is_none_or(|m| i < m) {
            let [ref iter_shape, ref cond_shape] = self.counter_shapes;
            let mut feeds = vec![Some(Value::Tensor(Tensor::from_vec(iter_shape, vec![i]).unwrap())), Some(Value::Tensor(Tensor::from_bools(cond_shape, &[cond]).unwrap()))];
            feeds.extend(carried.drain(..).map(Some));
            let mut outs = run_subgraph(&self.body, feeds, ctx, self.id, "body")?;
            if outs.len() < 1 + n {
                return Err(kernel_error(format!("the loop body returned {} outputs, expected at least {}", outs.len(), 1 + n)));
            }
            let extra = outs.split_off(1 + n);
            carried = outs.split_off(1);
            cond = match &outs[0] {
                Value::Tensor(t) => scalar_bool(t, "the body's condition output")?,
                v => return Err(kernel_error(format!("the body's condition output is {v}, not a tensor"))),
            };
            if scans.is_empty() {
                scans = vec![vec![]; extra.len()];
            }
            for (k, v) in extra.into_iter().enumerate() {
                scans[k].push(v.into_tensor().map_err(|v| kernel_error(format!("scan output {k} of the loop body is {v}; scan outputs must be tensors")))?);
            }
            i += 1;
            if i > 1 << 31 {
                return Err(kernel_error("the loop ran more than 2^31 iterations"));
            }
        }
        let n_scan = self.body.outputs.len().saturating_sub(1 + n);
        let mut out = carried;
        for k in 0..n_scan {
            out.push(Value::Tensor(match scans.get(k) {
                Some(parts) if !parts.is_empty() => stack(parts)?,
                _ => Tensor::zeros(qforge_ir::DType::F32, &[0]).unwrap(),
            }));
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
    value_kernel(Loop { id: info.id, body, counter_shapes })
}

/// A scan input as iterated: the tensor, its sequence axis and direction.
struct ScanInput {
    tensor: Tensor,
    axis: usize,
    reverse: bool,
}

impl ScanInput {
    /// The element at step `t` of `len` steps: the slice at position `t` along the sequence
    /// axis (from the end when reversed), without that axis.
    fn element(&self, t: usize, len: usize) -> RuntimeResult<Tensor> {
        let s = self.tensor.shape();
        let pos = if self.reverse { len - 1 - t } else { t };
        let st = strides(s);
        let shape: Vec<usize> = s.iter().enumerate().filter(|&(d, _)| d != self.axis).map(|(_, &n)| n).collect();
        let steps: Vec<isize> = st.iter().enumerate().filter(|&(d, _)| d != self.axis).map(|(_, &k)| k as isize).collect();
        strided_copy(&self.tensor, &shape, pos * st[self.axis], &steps)
    }
}

struct Scan {
    id: NodeId,
    body: Plan,
    num_scan_inputs: usize,
    input_axes: Vec<i64>,
    input_reverse: Vec<bool>,
    output_axes: Vec<i64>,
    output_reverse: Vec<bool>,
    /// Opset 8: an optional `sequence_lens` input first, batch axis 0 and sequence axis 1.
    batched: bool,
    /// Element type and shape of each body output, where the body declares them fully (for
    /// scan outputs of scans of zero steps).
    declared_elements: Vec<Option<(DType, Vec<usize>)>>,
}

impl Scan {
    /// Runs the body `len` times from `states` over `inputs`; returns the final states and
    /// each scan output's per-step values in step order.
    fn iterate(&self, mut states: Vec<Tensor>, inputs: &[ScanInput], len: usize, ctx: &RunCtx) -> RuntimeResult<(Vec<Tensor>, Vec<Vec<Tensor>>)> {
        let n = states.len();
        let k = self.body.outputs.len().checked_sub(n).ok_or_else(|| kernel_error(format!("the scan body has {} outputs, fewer than the {n} state variables", self.body.outputs.len())))?;
        let mut steps: Vec<Vec<Tensor>> = vec![Vec::with_capacity(len); k];
        for t in 0..len {
            let mut feeds: Vec<Option<Value>> = states.drain(..).map(|s| Some(Value::Tensor(s))).collect();
            for si in inputs {
                feeds.push(Some(Value::Tensor(si.element(t, len)?)));
            }
            let mut outs = run_subgraph(&self.body, feeds, ctx, self.id, "body")?.into_iter()
                .map(|v| v.into_tensor().map_err(|v| kernel_error(format!("the scan body returned {v}; Scan carries tensors"))))
                .collect::<RuntimeResult<Vec<Tensor>>>()?;
            if outs.len() != n + k {
                return Err(kernel_error(format!("the scan body returned {} outputs, expected {}", outs.len(), n + k)));
            }
            for (acc, v) in steps.iter_mut().zip(outs.drain(n..)) {
                acc.push(v);
            }
            states = outs;
        }
        Ok((states, steps))
    }

    /// The per-step value of scan output `k` (after `n` states) for a scan of zero steps: a
    /// zero tensor of its declared type.
    fn empty_element(&self, n: usize, k: usize) -> RuntimeResult<Tensor> {
        match self.declared_elements.get(n + k).and_then(|d| d.as_ref()) {
            Some((dtype, shape)) => Tensor::zeros(*dtype, shape).map_err(|e| kernel_error(e.to_string())),
            None => Err(kernel_error(format!("scan output {k} has no steps and the body does not declare its shape"))),
        }
    }

    /// The scan inputs after `states` leading inputs, with their axes and directions, and the
    /// common sequence length.
    fn scan_inputs(&self, given: &[Tensor], default_axis: i64) -> RuntimeResult<(Vec<ScanInput>, usize)> {
        let mut inputs = vec![];
        let mut len = None;
        for (i, t) in given.iter().enumerate() {
            let requested = self.input_axes.get(i).copied().unwrap_or(default_axis);
            let ax = axis(requested, t.rank()).map_err(|_| kernel_error(format!("scan input {i} of shape {:?} has no axis {requested}", t.shape())))?;
            if t.rank() == 0 {
                return Err(kernel_error(format!("scan input {i} is a scalar; it needs a sequence axis")));
            }
            let l = t.shape()[ax];
            if *len.get_or_insert(l) != l {
                return Err(kernel_error(format!("scan input {i} has sequence length {l} (shape {:?}), unlike the {} of the first", t.shape(), len.unwrap_or(0))));
            }
            inputs.push(ScanInput { tensor: t.clone(), axis: ax, reverse: self.input_reverse.get(i).copied().unwrap_or(false) });
        }
        Ok((inputs, len.unwrap_or(0)))
    }

    /// Scan output `k` (after `n` states) from its per-step values: stacked in step order (or
    /// reversed) along its output axis.
    fn scan_output(&self, n: usize, k: usize, mut values: Vec<Tensor>) -> RuntimeResult<Tensor> {
        if self.output_reverse.get(k).copied().unwrap_or(false) {
            values.reverse();
        }
        let stacked = if values.is_empty() {
            let e = self.empty_element(n, k)?;
            let mut shape = vec![0];
            shape.extend_from_slice(e.shape());
            Tensor::zeros(e.dtype(), &shape).map_err(|e| kernel_error(e.to_string()))?
        } else {
            stack(&values)?
        };
        let r = stacked.rank();
        let requested = self.output_axes.get(k).copied().unwrap_or(0);
        let ax = axis(requested, r).map_err(|_| kernel_error(format!("scan output axis {requested} is out of range for scan output {k} of rank {r}")))?;
        if ax == 0 {
            return Ok(stacked);
        }
        let perm: Vec<usize> = (1..=ax).chain([0]).chain(ax + 1..r).collect();
        transpose_tensor(&stacked, &perm)
    }
}

impl Kernel for Scan {
    fn run(&self, ins: &[Option<&Tensor>], ctx: &RunCtx) -> RuntimeResult<Vec<Tensor>> {
        let first = usize::from(self.batched);
        let given: Vec<Tensor> = ins.iter().skip(first).enumerate()
            .map(|(i, t)| t.cloned().ok_or_else(|| kernel_error(format!("state and scan input {i} must be given"))))
            .collect::<RuntimeResult<_>>()?;
        let n = given.len().checked_sub(self.num_scan_inputs).ok_or_else(|| kernel_error(format!("Scan has {} state and scan inputs, fewer than num_scan_inputs {}", given.len(), self.num_scan_inputs)))?;
        if !self.batched {
            let (inputs, len) = self.scan_inputs(&given[n..], 0)?;
            let (mut states, steps) = self.iterate(given[..n].to_vec(), &inputs, len, ctx)?;
            for (k, values) in steps.into_iter().enumerate() {
                states.push(self.scan_output(n, k, values)?);
            }
            return Ok(states);
        }
        self.run_batched(opt_input(ins, 0), &given, n, ctx)
    }
}

impl Scan {
    /// Opset 8: every state and scan input has a leading batch axis; each batch element is
    /// scanned along axis 1 for its `sequence_lens` entry (default: the whole axis), and
    /// shorter scan outputs are padded with zeros to the longest.
    fn run_batched(&self, lens: Option<&Tensor>, given: &[Tensor], n: usize, ctx: &RunCtx) -> RuntimeResult<Vec<Tensor>> {
        let batch = given.first().and_then(|t| t.shape().first().copied()).ok_or_else(|| kernel_error("Scan-8 inputs need a leading batch axis"))?;
        if let Some(t) = given.iter().find(|t| t.shape().first() != Some(&batch)) {
            return Err(kernel_error(format!("every Scan-8 input needs batch size {batch}, got shape {:?}", t.shape())));
        }
        let (_, max_len) = self.scan_inputs(&given[n..], 1)?;
        let lens: Vec<usize> = match lens.filter(|t| !t.is_empty()) {
            Some(t) => {
                let v = ints(t, "sequence_lens")?;
                if v.len() != batch {
                    return Err(kernel_error(format!("sequence_lens has {} entries for a batch of {batch}", v.len())));
                }
                v.iter().map(|&l| usize::try_from(l).ok().filter(|&l| l <= max_len).ok_or_else(|| kernel_error(format!("sequence length {l} is outside [0, {max_len}]")))).collect::<RuntimeResult<_>>()?
            }
            None => vec![max_len; batch],
        };
        let mut final_states: Vec<Vec<Tensor>> = vec![vec![]; n];
        let mut outputs: Vec<Vec<Tensor>> = vec![];
        for (b, &len) in lens.iter().enumerate() {
            let row = |t: &Tensor| ScanInput { tensor: t.clone(), axis: 0, reverse: false }.element(b, batch);
            let states: Vec<Tensor> = given[..n].iter().map(row).collect::<RuntimeResult<_>>()?;
            let per_batch: Vec<Tensor> = given[n..].iter().map(row).collect::<RuntimeResult<_>>()?;
            let inputs: Vec<ScanInput> = per_batch.into_iter().enumerate()
                .map(|(i, tensor)| ScanInput { tensor, axis: 0, reverse: self.input_reverse.get(i).copied().unwrap_or(false) })
                .collect();
            let (states, steps) = self.iterate(states, &inputs, len, ctx)?;
            for (acc, s) in final_states.iter_mut().zip(states) {
                acc.push(s);
            }
            if outputs.is_empty() {
                outputs = vec![vec![]; steps.len()];
            }
            for (k, mut values) in steps.into_iter().enumerate() {
                let element = match values.first() {
                    Some(v) => Tensor::zeros(v.dtype(), v.shape()).map_err(|e| kernel_error(e.to_string()))?,
                    None => self.empty_element(n, k)?,
                };
                values.resize(max_len, element);
                outputs[k].push(self.scan_output(n, k, values)?);
            }
        }
        if batch == 0 {
            return Err(kernel_error("Scan-8 with a batch of zero is not supported"));
        }
        final_states.into_iter().chain(outputs).map(|parts| stack(&parts)).collect()
    }
}

/// Scan (opset 8: optional `sequence_lens` first, batch axis 0, sequence axis 1, scan input
/// `directions`; opset 9+: `scan_input_axes`/`scan_input_directions`,
/// `scan_output_axes`/`scan_output_directions`). The inputs are N initial states followed by
/// `num_scan_inputs` scan inputs; the body maps (states, one element of each scan input) to
/// (next states, one element of each scan output) once per position of the sequence axis.
/// The outputs are the final states, then each scan output: its per-step values stacked
/// along its output axis.
fn scan(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let body = subgraph(info, "body")?;
    let num_scan_inputs = info.node.attr_int("num_scan_inputs").ok_or_else(|| info.error("attribute 'num_scan_inputs' is required"))?;
    let num_scan_inputs = usize::try_from(num_scan_inputs).ok().filter(|&m| m >= 1).ok_or_else(|| info.error(format!("num_scan_inputs must be positive, got {num_scan_inputs}")))?;
    let batched = info.opset < 9;
    let flags = |name: &str| -> RuntimeResult<Vec<bool>> {
        let v = info.attr_ints(name).unwrap_or_default();
        match v.iter().find(|&&d| d != 0 && d != 1) {
            Some(d) => Err(info.error(format!("'{name}' entries must be 0 (forward) or 1 (reverse), got {d}"))),
            None => Ok(v.iter().map(|&d| d == 1).collect()),
        }
    };
    let input_reverse = flags(if batched { "directions" } else { "scan_input_directions" })?;
    let output_reverse = flags("scan_output_directions")?;
    let declared_elements = match info.node.attr("body") {
        Some(Attr::Graph(g)) => g.outputs().iter().map(|&v| {
            let ty = g.value(v).ok()?.ty.as_ref()?;
            let shape = ty.shape()?.iter().map(|d| d.known().and_then(|k| usize::try_from(k).ok())).collect::<Option<Vec<usize>>>()?;
            Some((ty.elem()?, shape))
        }).collect::<Vec<_>>(),
        _ => vec![],
    };
    Ok(Box::new(Scan {
        id: info.id,
        num_scan_inputs,
        input_axes: info.attr_ints("scan_input_axes").unwrap_or_default(),
        input_reverse,
        output_axes: info.attr_ints("scan_output_axes").unwrap_or_default(),
        output_reverse,
        batched,
        declared_elements,
        body,
    }))
}
