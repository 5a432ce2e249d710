//! Execution plans: a graph compiled once into kernels over value slots.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use qforge_ir::{Dim, Graph, NodeId, OpsetImport, Tensor, ValueId, ValueKind, ValueType};

use crate::hooks::{Hooks, NodeEvent, ValueEvent};
use crate::{HookSink, Kernel, NodeInfo, Registry, RunCtx, RuntimeError, RuntimeResult, Value};

/// Ops whose outputs vary from run to run; never folded into constants.
pub const NONDETERMINISTIC: &[&str] = &["RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"];

/// One kernel call of a plan.
pub(crate) struct Step {
    pub(crate) node: NodeId,
    pub(crate) label: String,
    pub(crate) op: String,
    /// Shared with the fused copy of the plan (see `fuse.rs`).
    pub(crate) kernel: Arc<dyn Kernel>,
    pub(crate) inputs: Vec<Option<usize>>,
    pub(crate) outputs: Vec<Option<usize>>,
    /// Slots of the enclosing-graph values the node's subgraphs read.
    pub(crate) captures: Vec<usize>,
    /// Slots whose last reader is this step.
    pub(crate) free: Vec<usize>,
}

/// Whether planning computes nodes whose inputs are all constants once (folding them into
/// constants) or runs them on every run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Folding {
    /// Fold them when planning (kernels may then pre-pack the folded constants).
    #[default]
    Constants,
    /// Run them on every run, so hooks see, replace or supply their outputs (e.g. a
    /// dequantized weight). Applies to the planned graph; If/Loop bodies still fold.
    Off,
}

/// Which steps a run executes.
#[derive(Clone, Copy)]
enum Schedule<'a> {
    /// Every step; each value is freed after its last reader unless `keep` holds its slot.
    All { keep: Option<&'a [bool]> },
    /// The steps of the `dirty` nodes and every step reading a value an executed step
    /// produced, and the steps that produce what those read and the table lacks (values a
    /// kept run dropped; see [`Plan::rerun_steps`]); the other values stay as they are. A
    /// recomputed value is freed after its last reader.
    From { dirty: &'a HashSet<NodeId> },
}

/// The wall time of one executed node.
#[derive(Debug, Clone)]
pub struct StepTime {
    pub node: String,
    pub op: String,
    pub seconds: f64,
}

/// A graph input as the plan sees it.
#[derive(Clone)]
pub(crate) struct PlannedInput {
    pub name: String,
    pub slot: usize,
    pub ty: Option<ValueType>,
    pub default: Option<Tensor>,
}

/// A graph compiled for execution: constants folded, kernels built, liveness computed.
pub struct Plan {
    pub(crate) graph: String,
    pub(crate) slots: usize,
    pub(crate) constants: Vec<(usize, Tensor)>,
    pub(crate) inputs: Vec<PlannedInput>,
    pub(crate) outers: Vec<(String, usize)>,
    pub(crate) steps: Vec<Step>,
    pub(crate) outputs: Vec<(String, usize)>,
    pub(crate) by_name: HashMap<String, usize>,
    pub(crate) names: Vec<String>,
    pub(crate) value_ids: Vec<ValueId>,
}

/// The version of `domain` the model imports (`""` and `"ai.onnx"` are one domain); the
/// runtime's default when it imports none.
pub fn opset_of(opsets: &[OpsetImport], domain: &str) -> i64 {
    let norm = |d: &str| if d == "ai.onnx" { String::new() } else { d.to_string() };
    opsets.iter().find(|o| norm(&o.domain) == norm(domain)).map(|o| o.version)
        .unwrap_or(if domain.is_empty() || domain == "ai.onnx" { 21 } else { 1 })
}

impl Plan {
    /// Plans a graph: topological order, constant folding of initializer-only
    /// subexpressions, one kernel per remaining node, and the last reader of every value.
    /// `outer_consts` are the constants of enclosing graphs by name: a subgraph that reads
    /// them gets them folded too.
    pub fn build(g: &Graph, opsets: &[OpsetImport], registry: &Registry, outer_consts: &HashMap<String, Tensor>) -> RuntimeResult<Plan> {
        Self::build_with(g, opsets, registry, outer_consts, Folding::Constants)
    }

    /// [`Plan::build`] with a choice of [`Folding`].
    pub fn build_with(g: &Graph, opsets: &[OpsetImport], registry: &Registry, outer_consts: &HashMap<String, Tensor>, folding: Folding) -> RuntimeResult<Plan> {
        let order = g.topo_order()?;
        let slots = g.values().map(|(id, _)| id.0 as usize + 1).max().unwrap_or(0);
        let mut consts: HashMap<usize, Tensor> = HashMap::new();
        for (id, v) in g.values() {
            let data = match v.kind() {
                ValueKind::Initializer => v.initializer().cloned(),
                ValueKind::Outer => outer_consts.get(&v.name).cloned(),
                _ => None,
            };
            if let Some(t) = data {
                consts.insert(id.0 as usize, t);
            }
        }
        let mut steps = vec![];
        for id in order {
            let node = g.node(id)?;
            let label = node.display_name(id);
            let opset = opset_of(opsets, &node.domain);
            let build = registry.lookup(&node.domain, &node.op_type, opset)
                .ok_or_else(|| RuntimeError::Unsupported { node: label.clone(), op: node.qualified_op(), opset })?;
            // Constants visible to the node's subgraphs, by name.
            let scope_consts: HashMap<String, Tensor> = if node.subgraphs().next().is_some() {
                let mut m = outer_consts.clone();
                m.extend(consts.iter().map(|(&slot, t)| (g.value_name(ValueId(slot as u32)), t.clone())));
                m
            } else {
                HashMap::new()
            };
            let info = NodeInfo {
                node,
                id,
                graph: g,
                opset,
                opsets,
                scope_consts: &scope_consts,
                const_inputs: node.inputs.iter().map(|v| v.and_then(|v| consts.get(&(v.0 as usize)))).collect(),
                input_types: node.inputs.iter().map(|v| v.and_then(|v| g.value(v).ok()).and_then(|v| v.ty.as_ref())).collect(),
            };
            let kernel = build(&info).map_err(|e| locate(e, &label, &node.op_type))?;
            let foldable = folding == Folding::Constants
                && node.captures().is_empty()
                && node.subgraphs().next().is_none()
                && !NONDETERMINISTIC.contains(&node.op_type.as_str())
                && node.inputs.iter().flatten().all(|v| consts.contains_key(&(v.0 as usize)));
            if foldable {
                let ins: Vec<Option<&Tensor>> = node.inputs.iter().map(|v| v.map(|v| &consts[&(v.0 as usize)])).collect();
                let no_scope = |_: &str| None;
                let ctx = RunCtx { scope: &no_scope, hooks: None };
                // Constants are tensors: an op of values folds when all it yields is tensors.
                let outs = match kernel.values() {
                    None => Some(kernel.run(&ins, &ctx).map_err(|e| locate(e, &label, &node.op_type))?),
                    Some(vk) => {
                        let values: Vec<Option<Value>> = ins.iter().map(|t| t.map(|t| Value::Tensor(t.clone()))).collect();
                        let refs: Vec<Option<&Value>> = values.iter().map(Option::as_ref).collect();
                        let outs = vk.run_values(&refs, &ctx).map_err(|e| locate(e, &label, &node.op_type))?;
                        outs.into_iter().map(|v| v.into_tensor().ok()).collect::<Option<Vec<Tensor>>>()
                    }
                };
                if let Some(outs) = outs {
                    for (v, t) in node.outputs.iter().zip(outs) {
                        if let Some(v) = v {
                            consts.insert(v.0 as usize, t);
                        }
                    }
                    continue;
                }
            }
            steps.push(Step {
                node: id,
                label,
                op: node.op_type.clone(),
                kernel: Arc::from(kernel),
                inputs: node.inputs.iter().map(|v| v.map(|v| v.0 as usize)).collect(),
                outputs: node.outputs.iter().map(|v| v.map(|v| v.0 as usize)).collect(),
                captures: node.captures().iter().map(|v| v.0 as usize).collect(),
                free: vec![],
            });
        }
        let outputs: Vec<(String, usize)> = g.outputs().iter().map(|v| (g.value_name(*v), v.0 as usize)).collect();
        let keep: std::collections::HashSet<usize> = outputs.iter().map(|o| o.1).collect();
        assign_frees(&mut steps, &keep);
        // Only constants that the steps or outputs read are kept.
        let needed: std::collections::HashSet<usize> = steps.iter()
            .flat_map(|s| s.inputs.iter().flatten().copied().collect::<Vec<_>>())
            .chain(keep.iter().copied())
            .chain(steps.iter().flat_map(|s| s.captures.iter().copied()))
            .collect();
        let mut constants: Vec<(usize, Tensor)> = consts.into_iter().filter(|(k, _)| needed.contains(k)).collect();
        constants.sort_by_key(|c| c.0);
        let inputs = g.inputs().iter().map(|v| {
            let val = g.value(*v).expect("input exists");
            PlannedInput { name: val.name.clone(), slot: v.0 as usize, ty: val.ty.clone(), default: val.initializer().cloned() }
        }).collect();
        let outers = g.values().filter(|(_, v)| v.kind() == ValueKind::Outer && !outer_consts.contains_key(&v.name)).map(|(id, v)| (v.name.clone(), id.0 as usize)).collect();
        let mut value_ids = vec![ValueId(u32::MAX); slots];
        let mut names = vec![String::new(); slots];
        let mut by_name = HashMap::new();
        for (id, v) in g.values() {
            value_ids[id.0 as usize] = id;
            names[id.0 as usize] = v.name.clone();
            by_name.insert(v.name.clone(), id.0 as usize);
        }
        Ok(Plan { graph: g.name.clone(), slots, constants, inputs, outers, steps, outputs, by_name, names, value_ids })
    }

    /// Runs the plan. `feeds[i]` is graph input `i` (`None`: use its default initializer).
    /// `scope` resolves values of enclosing graphs. `hooks` sees every produced tensor.
    pub fn run(&self, feeds: Vec<Option<Value>>, scope: &dyn Fn(&str) -> Option<Value>, hooks: Option<&mut dyn Hooks>) -> RuntimeResult<Vec<Value>> {
        self.run_profiled(feeds, scope, hooks, None)
    }

    /// [`Plan::run`], also recording each step's wall time in `profile` when given.
    pub fn run_profiled(&self, feeds: Vec<Option<Value>>, scope: &dyn Fn(&str) -> Option<Value>, hooks: Option<&mut dyn Hooks>, profile: Option<&mut Vec<StepTime>>) -> RuntimeResult<Vec<Value>> {
        match hooks {
            Some(h) => {
                let lock = std::sync::Mutex::new(h);
                self.run_in(feeds, scope, Some(HookSink { hooks: &lock, path: &[] }), profile)
            }
            None => self.run_in(feeds, scope, None, profile),
        }
    }

    /// Runs the plan as a subgraph reached through `hooks.path` (or the main graph).
    pub(crate) fn run_in(&self, feeds: Vec<Option<Value>>, scope: &dyn Fn(&str) -> Option<Value>, hooks: Option<HookSink>, profile: Option<&mut Vec<StepTime>>) -> RuntimeResult<Vec<Value>> {
        let mut table = self.start(feeds, scope, hooks)?;
        self.execute(&mut table, scope, hooks, profile, Schedule::All { keep: None })?;
        self.collect_outputs(&table)
    }

    /// Runs the plan as a main graph and keeps its values: the outputs and the value table
    /// (indexed by value id) for [`Plan::run_from`]. Values that steps produce and `dropped`
    /// holds are freed after their last reader as in a plain run; [`Plan::run_from`]
    /// recomputes those it needs.
    pub(crate) fn run_keeping(&self, feeds: Vec<Option<Value>>, hooks: &mut dyn Hooks, dropped: &HashSet<ValueId>) -> RuntimeResult<(Vec<Value>, Vec<Option<Value>>)> {
        let no_scope = |_: &str| None;
        let lock = std::sync::Mutex::new(hooks);
        let sink = Some(HookSink { hooks: &lock, path: &[] });
        let mut keep = vec![true; self.slots];
        for &s in self.steps.iter().flat_map(|step| step.outputs.iter().flatten()) {
            keep[s] = !dropped.contains(&self.value_ids[s]);
        }
        let mut table = self.start(feeds, &no_scope, sink)?;
        self.execute(&mut table, &no_scope, sink, None, Schedule::All { keep: Some(&keep) })?;
        Ok((self.collect_outputs(&table)?, table))
    }

    /// Re-runs part of a main-graph run from its value table `base` (of [`Plan::run_keeping`]):
    /// the steps of the `dirty` nodes, every step downstream of them, and the steps that
    /// recompute what those read and `base` dropped; the other values are `base`'s. `hooks`
    /// sees (and may supply or replace) only what is re-run.
    pub(crate) fn run_from(&self, base: &[Option<Value>], dirty: &HashSet<NodeId>, hooks: &mut dyn Hooks) -> RuntimeResult<Vec<Value>> {
        if base.len() != self.slots {
            return Err(RuntimeError::Kernel(format!("the values given hold {} slots, graph '{}' has {}: they come from another session", base.len(), self.graph, self.slots)));
        }
        let no_scope = |_: &str| None;
        let lock = std::sync::Mutex::new(hooks);
        let mut table = base.to_vec();
        self.execute(&mut table, &no_scope, Some(HookSink { hooks: &lock, path: &[] }), None, Schedule::From { dirty })?;
        self.collect_outputs(&table)
    }

    /// The value table before the first step: constants, fed inputs (reported to the hooks)
    /// and values of enclosing graphs.
    fn start(&self, mut feeds: Vec<Option<Value>>, scope: &dyn Fn(&str) -> Option<Value>, hooks: Option<HookSink>) -> RuntimeResult<Vec<Option<Value>>> {
        let mut table: Vec<Option<Value>> = vec![None; self.slots];
        for (slot, t) in &self.constants {
            table[*slot] = Some(Value::Tensor(t.clone()));
        }
        for (i, input) in self.inputs.iter().enumerate() {
            let v = feeds.get_mut(i).and_then(|f| f.take()).or_else(|| input.default.clone().map(Value::Tensor))
                .ok_or_else(|| RuntimeError::Input { input: input.name.clone(), reason: "is required but was not given".into() })?;
            check_input(input, &v)?;
            table[input.slot] = Some(self.report(hooks, None, i, input.slot, v));
        }
        for (name, slot) in &self.outers {
            table[*slot] = Some(scope(name).ok_or_else(|| RuntimeError::Kernel(format!("graph '{}' reads '{name}' from an enclosing graph, which does not define it", self.graph)))?);
        }
        Ok(table)
    }

    /// Reports a produced tensor to the hooks; returns it or its replacement. Sequences and
    /// optionals are not reported.
    fn report(&self, hooks: Option<HookSink>, node: Option<NodeId>, output: usize, slot: usize, v: Value) -> Value {
        let (Some(sink), Value::Tensor(t)) = (hooks, &v) else { return v };
        let ev = ValueEvent { node, output, value: self.value_ids[slot], name: &self.names[slot], path: sink.path };
        sink.hooks.report(&ev, t).map_or(v, Value::Tensor)
    }

    /// Runs the steps `schedule` selects over `table`.
    fn execute(&self, table: &mut [Option<Value>], scope: &dyn Fn(&str) -> Option<Value>, hooks: Option<HookSink>, mut profile: Option<&mut Vec<StepTime>>, schedule: Schedule) -> RuntimeResult<()> {
        let (mut produced, rerun) = match schedule {
            Schedule::From { dirty } => (vec![false; self.slots], self.rerun_steps(table, dirty)),
            Schedule::All { .. } => (vec![], vec![]),
        };
        for (i, step) in self.steps.iter().enumerate() {
            if matches!(schedule, Schedule::From { .. }) && !rerun[i] {
                continue;
            }
            let started = profile.is_some().then(std::time::Instant::now);
            let supplied = hooks.and_then(|sink| sink.hooks.supply(&NodeEvent { node: step.node, path: sink.path }));
            let computed = match supplied {
                Some(outs) if outs.len() != step.outputs.len() => {
                    return Err(RuntimeError::Node { node: step.label.clone(), op: step.op.clone(), reason: format!("the hooks supplied {} outputs, the node declares {}", outs.len(), step.outputs.len()) });
                }
                Some(outs) => Computed::Supplied(outs),
                None => self.compute(step, table, scope, hooks)?,
            };
            let mut store = |k: usize, v: Option<Value>| {
                let Some(Some(slot)) = step.outputs.get(k).copied() else { return };
                table[slot] = v.map(|v| self.report(hooks, Some(step.node), k, slot, v));
                if let Some(p) = produced.get_mut(slot) {
                    *p = true;
                }
            };
            match computed {
                Computed::Tensors(outs) => outs.into_iter().enumerate().for_each(|(k, t)| store(k, Some(Value::Tensor(t)))),
                Computed::Values(outs) => outs.into_iter().enumerate().for_each(|(k, v)| store(k, Some(v))),
                Computed::Supplied(outs) => outs.into_iter().enumerate().for_each(|(k, t)| store(k, t.map(Value::Tensor))),
            }
            match schedule {
                Schedule::All { keep: None } => step.free.iter().for_each(|&s| table[s] = None),
                Schedule::All { keep: Some(keep) } => step.free.iter().filter(|&&s| !keep[s]).for_each(|&s| table[s] = None),
                Schedule::From { .. } => step.free.iter().filter(|&&s| produced[s]).for_each(|&s| table[s] = None),
            }
            if let (Some(p), Some(t0)) = (profile.as_deref_mut(), started) {
                p.push(StepTime { node: step.label.clone(), op: step.op.clone(), seconds: t0.elapsed().as_secs_f64() });
            }
        }
        Ok(())
    }

    /// The steps [`Schedule::From`] runs over `table`: those of the `dirty` nodes and every
    /// step reading a value one of them changes; then, walking back, every step producing a
    /// value that a running step reads and `table` lacks, which recomputes what a kept run
    /// dropped as it was (the steps upstream of every change).
    fn rerun_steps(&self, table: &[Option<Value>], dirty: &HashSet<NodeId>) -> Vec<bool> {
        let mut run = vec![false; self.steps.len()];
        let mut changed = vec![false; self.slots];
        for (i, step) in self.steps.iter().enumerate() {
            if dirty.contains(&step.node) || step.inputs.iter().flatten().chain(&step.captures).any(|&s| changed[s]) {
                run[i] = true;
                step.outputs.iter().flatten().for_each(|&s| changed[s] = true);
            }
        }
        let mut missing = vec![false; self.slots];
        for (i, step) in self.steps.iter().enumerate().rev() {
            run[i] |= step.outputs.iter().flatten().any(|&s| missing[s]);
            if run[i] {
                for &s in step.inputs.iter().flatten().chain(&step.captures) {
                    missing[s] |= !changed[s] && table[s].is_none();
                }
            }
        }
        run
    }

    /// Runs one step's kernel on the values in `table`: a [`Kernel`] on tensors (refusing other
    /// values), a [`crate::ValueKernel`] on any values.
    fn compute(&self, step: &Step, table: &[Option<Value>], scope: &dyn Fn(&str) -> Option<Value>, hooks: Option<HookSink>) -> RuntimeResult<Computed> {
        let node_error = |reason: String| RuntimeError::Node { node: step.label.clone(), op: step.op.clone(), reason };
        if let Some(missing) = step.inputs.iter().position(|s| s.is_some_and(|s| table[s].is_none())) {
            return Err(node_error(format!("input {missing} has no value")));
        }
        let lookup = |name: &str| match self.by_name.get(name) {
            Some(&s) => table[s].clone().or_else(|| scope(name)),
            None => scope(name),
        };
        let ctx = RunCtx { scope: &lookup, hooks };
        let declared = step.outputs.iter().rposition(|o| o.is_some()).map_or(0, |p| p + 1);
        Ok(match step.kernel.values() {
            None => {
                let mut ins: Vec<Option<&Tensor>> = Vec::with_capacity(step.inputs.len());
                for (i, s) in step.inputs.iter().enumerate() {
                    ins.push(match s.and_then(|s| table[s].as_ref()) {
                        None => None,
                        Some(Value::Tensor(t)) => Some(t),
                        Some(v) => return Err(node_error(format!("input {i} is {v}; the op takes tensors"))),
                    });
                }
                let outs = step.kernel.run(&ins, &ctx).map_err(|e| locate(e, &step.label, &step.op))?;
                if outs.len() < declared {
                    return Err(node_error(format!("the kernel returned {} outputs, the node declares {}", outs.len(), step.outputs.len())));
                }
                Computed::Tensors(outs)
            }
            Some(vk) => {
                let ins: Vec<Option<&Value>> = step.inputs.iter().map(|s| s.and_then(|s| table[s].as_ref())).collect();
                let outs = vk.run_values(&ins, &ctx).map_err(|e| locate(e, &step.label, &step.op))?;
                if outs.len() < declared {
                    return Err(node_error(format!("the kernel returned {} outputs, the node declares {}", outs.len(), step.outputs.len())));
                }
                Computed::Values(outs)
            }
        })
    }

    fn collect_outputs(&self, table: &[Option<Value>]) -> RuntimeResult<Vec<Value>> {
        self.outputs.iter().map(|(name, slot)| {
            table[*slot].clone().ok_or_else(|| RuntimeError::Kernel(format!("graph '{}' output '{name}' was not computed", self.graph)))
        }).collect()
    }
}

/// The outputs of one step: its kernel's, or those the hooks supplied.
enum Computed {
    Tensors(Vec<Tensor>),
    Values(Vec<Value>),
    Supplied(Vec<Option<Tensor>>),
}

/// Sets each step's `free` list: the values whose last reader it is, except those in `keep`.
pub(crate) fn assign_frees(steps: &mut [Step], keep: &HashSet<usize>) {
    let mut last_use: HashMap<usize, usize> = HashMap::new();
    for (i, s) in steps.iter().enumerate() {
        for v in s.inputs.iter().flatten().chain(&s.captures).copied() {
            last_use.insert(v, i);
        }
    }
    for s in steps.iter_mut() {
        s.free.clear();
    }
    for (v, i) in last_use {
        if !keep.contains(&v) {
            steps[i].free.push(v);
        }
    }
}

/// Adds the node to a kernel error.
fn locate(e: RuntimeError, label: &str, op: &str) -> RuntimeError {
    match e {
        RuntimeError::Kernel(reason) => RuntimeError::Node { node: label.to_string(), op: op.to_string(), reason },
        RuntimeError::Ir(e) => RuntimeError::Node { node: label.to_string(), op: op.to_string(), reason: e.to_string() },
        e => e,
    }
}

/// Checks a fed value against the input's declared type: the kind of value (a tensor, a
/// sequence; an optional input also takes a tensor or a sequence, as an optional holding it),
/// and a tensor's element type, rank and fixed dimensions.
fn check_input(input: &PlannedInput, v: &Value) -> RuntimeResult<()> {
    let err = |reason: String| RuntimeError::Input { input: input.name.clone(), reason };
    let kind_fits = match (&input.ty, v) {
        (Some(ValueType::Tensor { .. }), v) => matches!(v, Value::Tensor(_)),
        (Some(ValueType::Sequence(_)), v) => matches!(v, Value::Sequence(_)),
        _ => true,
    };
    if !kind_fits {
        return Err(err(format!("must be {}, got {v}", input.ty.as_ref().map(|t| t.to_string()).unwrap_or_default())));
    }
    let (Some(ValueType::Tensor { elem, shape }), Value::Tensor(t)) = (&input.ty, v) else { return Ok(()) };
    if let Some(e) = elem {
        if *e != t.dtype() {
            return Err(err(format!("must be {e}, got {}", t.dtype())));
        }
    }
    if let Some(shape) = shape {
        if shape.len() != t.rank() {
            return Err(err(format!("must have rank {} ({}), got shape {:?}", shape.len(), fmt_shape(shape), t.shape())));
        }
        for (i, (d, &n)) in shape.iter().zip(t.shape()).enumerate() {
            if let Dim::Known(k) = d {
                if *k >= 0 && *k as usize != n {
                    return Err(err(format!("dimension {i} must be {k} ({}), got shape {:?}", fmt_shape(shape), t.shape())));
                }
            }
        }
    }
    Ok(())
}

fn fmt_shape(s: &[Dim]) -> String {
    format!("[{}]", s.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
}
