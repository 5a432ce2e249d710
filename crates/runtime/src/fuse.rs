//! Fusion of f32 elementwise chains, for runs without hooks and runs whose hooks watch only
//! some values.
//!
//! [`Plan::fused`] derives from a planned graph a second plan in which chains of elementwise
//! steps (Add/Sub/Mul/Div with constants or with each other, Relu, Clip, Sigmoid, Tanh,
//! Erf, HardSigmoid, HardSwish, LeakyRelu, inference BatchNormalization) run as one step: as the
//! epilogue of the Conv that produces their input, applied to each output block while it is
//! in cache, or as one fused elementwise pass. The values inside a fused group are never
//! materialized, so a fused plan serves runs without hooks (sessions build one) and runs whose
//! hooks watch only values it keeps ([`crate::Session::watching`]); runs with other hooks use
//! the original plan and see every value.
//!
//! Per-output-channel affine ops right after a Conv (BatchNormalization, Mul/Add/Sub/Div by
//! a per-channel or scalar constant) are folded into its weight and bias, as ONNX Runtime
//! does, which changes results by rounding only; every other fused op computes its exact f32
//! expression in the original order. A fused step falls back to the original kernels, one
//! by one, whenever its fast path does not apply to a run (an input that is not f32, shapes
//! that broadcast differently than the fast path supports).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use qforge_ir::{DType, Graph, OpsetImport, Tensor};

use crate::kernels::conv::{build_conv, Conv};
use crate::kernels::fused::{Binary, Inst, Operand, Param, ParamShape, Program, Scratch, Unary, MAX_OPERANDS};
use crate::kernels::util::{assume_init, min_items, threads, uninit, ELEMENT_WORK};
use crate::plan::{assign_frees, opset_of, Plan, Step};
use crate::{kernel_error, Kernel, NodeInfo, RunCtx, RuntimeResult};

/// Steps scanned past a group's last member for more members.
const WINDOW: usize = 48;
/// Most external inputs a fused group reads besides its primary input.
const MAX_EXTRAS: usize = 3;

/// An argument of an elementwise step: a value computed at run time, or a constant.
#[derive(Clone)]
enum Arg {
    Dyn(usize),
    Const(Param),
}

/// An elementwise step the fuser understands.
#[derive(Clone)]
enum Ew {
    Unary(Unary, usize),
    Binary(Binary, Arg, Arg),
    /// `x * a[c] + b[c]` per channel of axis 1 (inference BatchNormalization).
    Affine { x: usize, a: Vec<f32>, b: Vec<f32> },
}

impl Ew {
    /// The run-time values the step reads, in operand order.
    fn dynamic(&self) -> Vec<usize> {
        match self {
            Ew::Unary(_, x) | Ew::Affine { x, .. } => vec![*x],
            Ew::Binary(_, a, b) => [a, b].into_iter().filter_map(|a| match a { Arg::Dyn(s) => Some(*s), Arg::Const(_) => None }).collect(),
        }
    }
}

/// A set of steps that runs as one.
struct Group {
    /// The anchoring Conv step, if the group is its epilogue.
    conv: Option<usize>,
    /// Elementwise member steps, in plan order; the last one produces the output.
    members: Vec<usize>,
    /// Values the group reads from outside: the primary input first.
    externals: Vec<usize>,
}

impl Plan {
    /// A copy of this plan with elementwise chains fused (see the module documentation) that
    /// still materializes the graph outputs and the values of the `kept` slots; `None` when
    /// nothing fuses. Kernels of unfused steps are shared with this plan.
    pub(crate) fn fused(&self, g: &Graph, opsets: &[OpsetImport], kept: &HashSet<usize>) -> Option<Plan> {
        let consts: HashMap<usize, &Tensor> = self.constants.iter().map(|(s, t)| (*s, t)).collect();
        let keep: HashSet<usize> = self.outputs.iter().map(|o| o.1).collect();
        let boundaries: HashSet<usize> = keep.iter().chain(kept).copied().collect();
        let mut readers: Vec<Vec<usize>> = vec![vec![]; self.slots];
        for (i, s) in self.steps.iter().enumerate() {
            for v in s.inputs.iter().flatten().chain(&s.captures).copied() {
                if !consts.contains_key(&v) && readers[v].last() != Some(&i) {
                    readers[v].push(i);
                }
            }
        }
        let ew: Vec<Option<Ew>> = self.steps.iter().map(|s| classify(s, g, opsets, &consts)).collect();
        let ctx = Fuser { plan: self, readers: &readers, keep: &boundaries, ew: &ew, consts: &consts };
        let mut assigned = vec![false; self.steps.len()];
        let mut groups: Vec<Group> = vec![];
        for i in 0..self.steps.len() {
            if assigned[i] {
                continue;
            }
            let group = if ctx.is_conv_anchor(i, g) {
                ctx.grow(i, None, &assigned)
            } else if ew[i].is_some() {
                ctx.grow(i, Some(i), &assigned).filter(|gr| gr.members.len() >= 2)
            } else {
                None
            };
            if let Some(gr) = group {
                for &m in gr.conv.iter().chain(&gr.members) {
                    assigned[m] = true;
                }
                groups.push(gr);
            }
        }
        if groups.is_empty() {
            return None;
        }
        // Each group runs at the position of its last member.
        let mut at_last: HashMap<usize, usize> = HashMap::new();
        for (k, gr) in groups.iter().enumerate() {
            at_last.insert(*gr.members.last().unwrap(), k);
        }
        let mut steps = vec![];
        for (i, s) in self.steps.iter().enumerate() {
            if let Some(&k) = at_last.get(&i) {
                steps.push(ctx.fused_step(&groups[k], g, opsets)?);
            } else if !assigned[i] {
                steps.push(Step {
                    node: s.node,
                    label: s.label.clone(),
                    op: s.op.clone(),
                    kernel: s.kernel.clone(),
                    inputs: s.inputs.clone(),
                    outputs: s.outputs.clone(),
                    captures: s.captures.clone(),
                    free: vec![],
                });
            }
        }
        assign_frees(&mut steps, &keep);
        let needed: HashSet<usize> = steps.iter().flat_map(|s| s.inputs.iter().flatten().chain(&s.captures).copied().collect::<Vec<_>>()).chain(keep.iter().copied()).collect();
        Some(Plan {
            graph: self.graph.clone(),
            slots: self.slots,
            constants: self.constants.iter().filter(|(s, _)| needed.contains(s)).cloned().collect(),
            inputs: self.inputs.clone(),
            outers: self.outers.clone(),
            steps,
            outputs: self.outputs.clone(),
            by_name: self.by_name.clone(),
            names: self.names.clone(),
            value_ids: self.value_ids.clone(),
        })
    }
}

/// Everything group formation looks up.
struct Fuser<'a> {
    plan: &'a Plan,
    /// Steps reading each slot (run-time values only).
    readers: &'a [Vec<usize>],
    /// Graph outputs and kept values, which must stay materialized.
    keep: &'a HashSet<usize>,
    ew: &'a [Option<Ew>],
    consts: &'a HashMap<usize, &'a Tensor>,
}

impl Fuser<'_> {
    /// Whether step `i` is a Conv whose f32 output can take an epilogue: constant weight
    /// (and bias), one output that is not a graph output.
    fn is_conv_anchor(&self, i: usize, g: &Graph) -> bool {
        let s = &self.plan.steps[i];
        let Ok(node) = g.node(s.node) else { return false };
        s.op == "Conv" && matches!(node.domain.as_str(), "" | "ai.onnx")
            && s.outputs.len() == 1 && s.outputs[0].is_some_and(|o| !self.keep.contains(&o))
            && s.inputs.get(1).copied().flatten().is_some_and(|w| self.consts.get(&w).is_some_and(|t| t.dtype() == DType::F32))
            && s.inputs.get(2).copied().flatten().is_none_or(|b| self.consts.get(&b).is_some_and(|t| t.dtype() == DType::F32))
    }

    /// Grows a group from step `start`: the epilogue of Conv step `start` (`first` is
    /// `None`), or an elementwise group whose first member is `first`. Later unassigned
    /// elementwise steps that read a value of the group join it; then members are dropped
    /// from the end until exactly one value leaves the group, produced by the last member.
    fn grow(&self, start: usize, first: Option<usize>, assigned: &[bool]) -> Option<Group> {
        let steps = &self.plan.steps;
        let (conv, root) = match first {
            None => (Some(start), steps[start].outputs[0]?),
            Some(f) => (None, *self.ew[f].as_ref()?.dynamic().first()?),
        };
        let mut members: Vec<usize> = first.into_iter().collect();
        let mut produced: HashSet<usize> = members.iter().filter_map(|&m| steps[m].outputs[0]).collect();
        if conv.is_some() {
            produced.insert(root);
        }
        let mut last = start;
        let mut t = start + 1;
        while t < steps.len() && t <= last + WINDOW {
            if !assigned[t] {
                if let Some(e) = &self.ew[t] {
                    if e.dynamic().iter().any(|v| produced.contains(v)) {
                        members.push(t);
                        produced.insert(steps[t].outputs[0]?);
                        last = t;
                    }
                }
            }
            t += 1;
        }
        while !members.is_empty() {
            if let Some(externals) = self.check(conv, root, &members) {
                return Some(Group { conv, members, externals });
            }
            members.pop();
        }
        None
    }

    /// The group's external inputs (primary first) when `members` form a valid group:
    /// exactly one member value is read outside the group (or is a graph output or unread),
    /// and it is the last member's; a Conv root is read only by members; at most
    /// [`MAX_EXTRAS`] other inputs.
    fn check(&self, conv: Option<usize>, root: usize, members: &[usize]) -> Option<Vec<usize>> {
        let steps = &self.plan.steps;
        let inside: HashSet<usize> = members.iter().copied().collect();
        let outs: Vec<usize> = members.iter().map(|&m| steps[m].outputs[0]).collect::<Option<_>>()?;
        let escapes = |v: usize| self.keep.contains(&v) || self.readers[v].is_empty() || self.readers[v].iter().any(|r| !inside.contains(r));
        let leaving: Vec<usize> = outs.iter().copied().filter(|&v| escapes(v)).collect();
        if leaving != [*outs.last()?] {
            return None;
        }
        if conv.is_some() && escapes(root) {
            return None;
        }
        let produced: HashSet<usize> = outs.iter().copied().collect();
        let mut externals = vec![root];
        for &m in members {
            for v in self.ew[m].as_ref()?.dynamic() {
                if !produced.contains(&v) && !externals.contains(&v) {
                    externals.push(v);
                }
            }
        }
        let params: usize = members.iter().map(|&m| match self.ew[m].as_ref() {
            Some(Ew::Binary(_, a, b)) => [a, b].iter().filter(|a| matches!(a, Arg::Const(_))).count(),
            Some(Ew::Affine { .. }) => 2,
            _ => 0,
        }).sum();
        (externals.len() <= 1 + MAX_EXTRAS && params + externals.len() - 1 <= MAX_OPERANDS).then_some(externals)
    }

    /// The step that runs `gr`: its program, its fallback, and its inputs (the Conv's inputs
    /// or the primary input, then the other external inputs).
    fn fused_step(&self, gr: &Group, g: &Graph, opsets: &[OpsetImport]) -> Option<Step> {
        let steps = &self.plan.steps;
        let mut slot_operand: HashMap<usize, Operand> = gr.externals.iter().enumerate().map(|(k, &s)| (s, Operand::Input(k))).collect();
        let mut insts: Vec<Inst> = vec![];
        let mut params: Vec<Param> = vec![];
        let arg = |a: &Arg, slot_operand: &HashMap<usize, Operand>, params: &mut Vec<Param>| -> Option<Operand> {
            match a {
                Arg::Dyn(s) => slot_operand.get(s).copied(),
                Arg::Const(p) => {
                    params.push(p.clone());
                    Some(Operand::Param(params.len() - 1))
                }
            }
        };
        for &m in &gr.members {
            match self.ew[m].as_ref()? {
                Ew::Unary(op, x) => insts.push(Inst::Unary(*op, *slot_operand.get(x)?)),
                Ew::Binary(op, a, b) => {
                    let (a, b) = (arg(a, &slot_operand, &mut params)?, arg(b, &slot_operand, &mut params)?);
                    insts.push(Inst::Binary(*op, a, b));
                }
                Ew::Affine { x, a, b } => {
                    params.push(Param { values: a.clone(), shape: ParamShape::Channel });
                    insts.push(Inst::Binary(Binary::Mul, *slot_operand.get(x)?, Operand::Param(params.len() - 1)));
                    params.push(Param { values: b.clone(), shape: ParamShape::Channel });
                    insts.push(Inst::Binary(Binary::Add, Operand::Value(insts.len() - 1), Operand::Param(params.len() - 1)));
                }
            }
            slot_operand.insert(steps[m].outputs[0]?, Operand::Value(insts.len() - 1));
        }
        let program = Program { inputs: gr.externals.len(), insts, params };
        let lead: Vec<Option<usize>> = match gr.conv {
            Some(c) => steps[c].inputs.clone(),
            None => vec![Some(gr.externals[0])],
        };
        let inputs: Vec<Option<usize>> = lead.iter().copied().chain(gr.externals[1..].iter().map(|&s| Some(s))).collect();
        let position = |slot: usize| -> Option<usize> { inputs.iter().position(|&s| s == Some(slot)) };
        let mut fallback = vec![];
        let mut local: HashMap<usize, usize> = HashMap::new();
        for &m in gr.conv.iter().chain(&gr.members) {
            let s = &steps[m];
            let resolve = |v: usize| -> Option<Ref> {
                match local.get(&v) {
                    Some(&j) => Some(Ref::Local(j)),
                    None => match self.consts.get(&v) {
                        Some(t) => Some(Ref::Const((*t).clone())),
                        None => position(v).map(Ref::Input),
                    },
                }
            };
            let refs = s.inputs.iter().map(|v| match v {
                None => Some(None),
                Some(v) => resolve(*v).map(Some),
            }).collect::<Option<Vec<_>>>()?;
            local.insert(s.outputs[0]?, fallback.len());
            fallback.push((s.kernel.clone(), refs));
        }
        let mut conv = match gr.conv {
            Some(c) => Some(self.conv_kernel(c, g, opsets)?),
            None => None,
        };
        let mut program = program;
        if let Some(c) = &mut conv {
            fold_into_conv(c, &mut program);
        }
        let anchor = &steps[gr.conv.unwrap_or(*gr.members.last()?)];
        let output = steps[*gr.members.last()?].outputs[0]?;
        Some(Step {
            node: anchor.node,
            label: anchor.label.clone(),
            op: if conv.is_some() { "Conv".into() } else { "Elementwise".into() },
            kernel: Arc::new(Fused { conv_inputs: lead.len(), conv, program, fallback }),
            inputs,
            outputs: vec![Some(output)],
            captures: vec![],
            free: vec![],
        })
    }

    /// A Conv kernel for step `c`, planned again from its node and constants.
    fn conv_kernel(&self, c: usize, g: &Graph, opsets: &[OpsetImport]) -> Option<Conv> {
        let s = &self.plan.steps[c];
        let node = g.node(s.node).ok()?;
        let scope = HashMap::new();
        let info = NodeInfo {
            node,
            id: s.node,
            graph: g,
            opset: opset_of(opsets, &node.domain),
            opsets,
            scope_consts: &scope,
            const_inputs: s.inputs.iter().map(|v| v.and_then(|v| self.consts.get(&v).copied())).collect(),
            input_types: node.inputs.iter().map(|v| v.and_then(|v| g.value(v).ok()).and_then(|v| v.ty.as_ref())).collect(),
        };
        build_conv(&info).ok()
    }
}

/// Folds the leading per-output-channel affine ops of a Conv's epilogue (Mul, Add, Sub or
/// Div of the Conv's output by a constant that is one value per channel or a scalar,
/// BatchNormalization) into its weight and bias, removing them from `program`, while the
/// Conv's output has no other reader in the program. Like ONNX Runtime's Conv+BN and
/// Conv+Mul/Add fusions, this changes results by rounding only.
fn fold_into_conv(conv: &mut Conv, program: &mut Program) {
    let Some(wshape) = conv.weight_shape().map(|s| s.to_vec()) else { return };
    let (m, rank) = (wshape[0], wshape.len());
    loop {
        let Some(&Inst::Binary(op, a, b)) = program.insts.first() else { return };
        let reads_input = |i: &Inst| match *i {
            Inst::Unary(_, x) => x == Operand::Input(0),
            Inst::Binary(_, x, y) => x == Operand::Input(0) || y == Operand::Input(0),
        };
        if program.insts[1..].iter().any(reads_input) {
            return;
        }
        let (p, input_first) = match (a, b) {
            (Operand::Input(0), Operand::Param(p)) => (p, true),
            (Operand::Param(p), Operand::Input(0)) => (p, false),
            _ => return,
        };
        let Some(v) = per_channel(&program.params[p], m, rank) else { return };
        let (scale, shift): (Vec<f32>, Vec<f32>) = match (op, input_first) {
            (Binary::Mul, _) => (v, vec![0.0; m]),
            (Binary::Add, _) => (vec![1.0; m], v),
            (Binary::Sub, true) => (vec![1.0; m], v.iter().map(|t| -t).collect()),
            (Binary::Div, true) if v.iter().all(|d| *d != 0.0 && (1.0 / d).is_finite()) => (v.iter().map(|d| 1.0 / d).collect(), vec![0.0; m]),
            _ => return,
        };
        conv.fold_affine(&scale, &shift);
        program.insts.remove(0);
        let shift_operand = |o: Operand| match o {
            Operand::Value(0) => Operand::Input(0),
            Operand::Value(j) => Operand::Value(j - 1),
            o => o,
        };
        for inst in program.insts.iter_mut() {
            *inst = match *inst {
                Inst::Unary(u, x) => Inst::Unary(u, shift_operand(x)),
                Inst::Binary(o, x, y) => Inst::Binary(o, shift_operand(x), shift_operand(y)),
            };
        }
    }
}

/// The values of a parameter that is one value per channel of axis 1 of a rank-`rank`
/// output with `m` channels (or one value for all), as `m` values.
fn per_channel(p: &Param, m: usize, rank: usize) -> Option<Vec<f32>> {
    match &p.shape {
        ParamShape::Channel => (p.values.len() == m).then(|| p.values.clone()),
        ParamShape::Numpy(s) => {
            if s.len() > rank || rank < 2 {
                return None;
            }
            let full: Vec<usize> = std::iter::repeat_n(1, rank - s.len()).chain(s.iter().copied()).collect();
            if full.iter().enumerate().any(|(d, &n)| n != 1 && d != 1) {
                return None;
            }
            match p.values.len() {
                1 => Some(vec![p.values[0]; m]),
                n if n == m => Some(p.values.clone()),
                _ => None,
            }
        }
    }
}

/// Where a fallback step reads an input.
enum Ref {
    /// Input `k` of the fused step.
    Input(usize),
    /// The output of fallback step `j`.
    Local(usize),
    Const(Tensor),
}

/// A fused group's kernel: a Conv with an epilogue program, or a program alone, and the
/// original kernels to run one by one when the fast path does not apply.
struct Fused {
    conv: Option<Conv>,
    /// Inputs of the fused step that are the Conv's (or the primary input); the program's
    /// other inputs follow.
    conv_inputs: usize,
    program: Program,
    fallback: Vec<FallbackStep>,
}

/// One original kernel of a fused group and where it reads its inputs.
type FallbackStep = (Arc<dyn Kernel>, Vec<Option<Ref>>);

impl Kernel for Fused {
    fn run(&self, ins: &[Option<&Tensor>], ctx: &RunCtx) -> RuntimeResult<Vec<Tensor>> {
        let extras: Option<Vec<&Tensor>> = ins.get(self.conv_inputs..).unwrap_or(&[]).iter().copied().collect();
        let fast = match (&self.conv, extras) {
            (Some(conv), Some(extras)) => conv.run_fused(&ins[..self.conv_inputs.min(ins.len())], &self.program, &extras)?,
            (None, Some(extras)) => match ins.first().copied().flatten() {
                Some(x) => run_program(&self.program, x, &extras)?,
                None => None,
            },
            _ => None,
        };
        match fast {
            Some(t) => Ok(vec![t]),
            None => self.run_fallback(ins, ctx),
        }
    }
}

impl Fused {
    /// Runs the group's original kernels in order; returns the last one's output.
    fn run_fallback(&self, ins: &[Option<&Tensor>], ctx: &RunCtx) -> RuntimeResult<Vec<Tensor>> {
        let mut values: Vec<Tensor> = Vec::with_capacity(self.fallback.len());
        for (kernel, refs) in &self.fallback {
            let args: Vec<Option<&Tensor>> = refs.iter().map(|r| match r {
                None => None,
                Some(Ref::Input(k)) => ins.get(*k).copied().flatten(),
                Some(Ref::Local(j)) => values.get(*j),
                Some(Ref::Const(t)) => Some(t),
            }).collect();
            let out = kernel.run(&args, ctx)?.into_iter().next().ok_or_else(|| kernel_error("a fused kernel returned no output"))?;
            values.push(out);
        }
        Ok(vec![values.pop().ok_or_else(|| kernel_error("an empty fused group"))?])
    }
}

/// Elements per parallel chunk of a fused elementwise pass.
const CHUNK: usize = 1 << 14;

/// Runs a program over f32 inputs in parallel chunks; `None` when an input is not f32 or
/// the program does not bind to the shapes.
fn run_program(program: &Program, x: &Tensor, extras: &[&Tensor]) -> RuntimeResult<Option<Tensor>> {
    use rayon::prelude::*;
    if x.dtype() != DType::F32 || extras.iter().any(|t| t.dtype() != DType::F32) {
        return Ok(None);
    }
    let views: Vec<(&[f32], &[usize])> = extras.iter().map(|t| (t.as_slice::<f32>().unwrap(), t.shape())).collect();
    let Some(bound) = program.bind(x.shape(), &views) else { return Ok(None) };
    let xs = x.as_slice::<f32>().unwrap();
    let mut out = uninit::<f32>(xs.len());
    if xs.len() < 2 * CHUNK || threads() == 1 {
        bound.eval(&mut out, 0, xs, &mut Scratch::new());
    } else {
        out.par_chunks_mut(CHUNK).with_min_len(min_items(CHUNK * ELEMENT_WORK)).enumerate().for_each_init(Scratch::new, |scratch, (i, chunk)| bound.eval(chunk, i * CHUNK, xs, scratch));
    }
    // SAFETY: `eval` wrote every element of each chunk, and the chunks cover `out`.
    let out = unsafe { assume_init(out) };
    Tensor::from_vec(x.shape(), out).map(Some).map_err(|e| kernel_error(e.to_string()))
}

/// The fusible form of a step, if it has one: an elementwise op of the default domain with
/// one output, whose constant operands are f32 (Clip bounds: any numeric type).
fn classify(s: &Step, g: &Graph, opsets: &[OpsetImport], consts: &HashMap<usize, &Tensor>) -> Option<Ew> {
    let node = g.node(s.node).ok()?;
    if !matches!(node.domain.as_str(), "" | "ai.onnx") || s.outputs.len() != 1 || s.outputs[0].is_none() || !s.captures.is_empty() {
        return None;
    }
    let opset = opset_of(opsets, &node.domain);
    let arg = |i: usize| -> Option<Arg> {
        let v = s.inputs.get(i).copied().flatten()?;
        match consts.get(&v) {
            Some(t) if t.dtype() == DType::F32 => Some(Arg::Const(Param { values: t.as_slice::<f32>().ok()?.to_vec(), shape: ParamShape::Numpy(t.shape().to_vec()) })),
            Some(_) => None,
            None => Some(Arg::Dyn(v)),
        }
    };
    let dyn_input = |i: usize| -> Option<usize> {
        let v = s.inputs.get(i).copied().flatten()?;
        (!consts.contains_key(&v)).then_some(v)
    };
    let unary = |op: Unary| -> Option<Ew> {
        (s.inputs.len() == 1).then_some(())?;
        Some(Ew::Unary(op, dyn_input(0)?))
    };
    let attr = |name: &str, default: f32| node.attr_float(name).unwrap_or(default);
    match s.op.as_str() {
        "Add" | "Sub" | "Mul" | "Div" => {
            if s.inputs.len() != 2 || node.attr("broadcast").is_some() {
                return None;
            }
            let op = match s.op.as_str() { "Add" => Binary::Add, "Sub" => Binary::Sub, "Mul" => Binary::Mul, _ => Binary::Div };
            let (a, b) = (arg(0)?, arg(1)?);
            matches!((&a, &b), (Arg::Dyn(_), _) | (_, Arg::Dyn(_))).then_some(Ew::Binary(op, a, b))
        }
        "Relu" => unary(Unary::Relu),
        "Sigmoid" => unary(Unary::Sigmoid),
        "Tanh" => unary(Unary::Tanh),
        "Erf" => unary(Unary::Erf),
        "HardSwish" => unary(Unary::HardSwish),
        "HardSigmoid" => unary(Unary::HardSigmoid { alpha: attr("alpha", 0.2), beta: attr("beta", 0.5) }),
        "LeakyRelu" => unary(Unary::LeakyRelu(attr("alpha", 0.01))),
        "Clip" => {
            let x = dyn_input(0)?;
            let (lo, hi) = if opset < 11 {
                (attr("min", f32::MIN), attr("max", f32::MAX))
            } else {
                let bound = |i: usize, default: f32| -> Option<f32> {
                    match s.inputs.get(i).copied().flatten() {
                        None => Some(default),
                        Some(v) => consts.get(&v)?.to_f64_vec().ok()?.first().map(|&b| b as f32),
                    }
                };
                (bound(1, f32::NEG_INFINITY)?, bound(2, f32::INFINITY)?)
            };
            Some(Ew::Unary(Unary::Clip { lo, hi }, x))
        }
        "BatchNormalization" => {
            if node.attr_int("training_mode").unwrap_or(0) != 0 || s.inputs.len() != 5 {
                return None;
            }
            let x = dyn_input(0)?;
            let p: Vec<&[f32]> = (1..5).map(|i| {
                let t = consts.get(&s.inputs[i]?)?;
                (t.dtype() == DType::F32).then(|| t.as_slice::<f32>().ok()).flatten()
            }).collect::<Option<_>>()?;
            let c = p[0].len();
            if p.iter().any(|v| v.len() != c) {
                return None;
            }
            let eps = attr("epsilon", 1e-5);
            let (scale, bias, mean, var) = (p[0], p[1], p[2], p[3]);
            let a: Vec<f32> = (0..c).map(|i| scale[i] / (var[i] + eps).sqrt()).collect();
            let b: Vec<f32> = (0..c).map(|i| bias[i] - mean[i] * a[i]).collect();
            Some(Ew::Affine { x, a, b })
        }
        _ => None,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::HashSet;

    use qforge_ir::Tensor;

    use crate::{Hooks, Session, ValueEvent};

    /// Records the name of every value a run reports.
    struct Names(HashSet<String>);

    impl Hooks for Names {
        fn on_value(&mut self, event: &ValueEvent, _: &Tensor) -> Option<Tensor> {
            self.0.insert(event.name.to_string());
            None
        }
    }

    /// Records every value a run reports, by name.
    struct Values(std::collections::BTreeMap<String, Tensor>);

    impl Hooks for Values {
        fn on_value(&mut self, event: &ValueEvent, t: &Tensor) -> Option<Tensor> {
            self.0.insert(event.name.to_string(), t.clone());
            None
        }
    }

    /// `x -> Conv -> c`, then a hardswish written out, `m = c * clip(c + 3, 0, 6)`, and
    /// `y = relu(m)`.
    pub(crate) fn conv_hardswish_relu() -> qforge_ir::Model {
        use qforge_ir::{Graph, Model, Node, OpsetImport};
        let mut g = Graph::new("g");
        let x = g.add_input("x", None).unwrap();
        let w: Vec<f32> = (0..4 * 2 * 9).map(|i| ((i * 37) % 17) as f32 / 8.0 - 1.0).collect();
        let w = g.add_initializer("w", Tensor::from_vec(&[4, 2, 3, 3], w).unwrap()).unwrap();
        let three = g.add_initializer("three", Tensor::scalar(3.0f32)).unwrap();
        let (zero, six) = (g.add_initializer("zero", Tensor::scalar(0.0f32)).unwrap(), g.add_initializer("six", Tensor::scalar(6.0f32)).unwrap());
        let node = |g: &mut Graph, op: &str, inputs: Vec<qforge_ir::ValueId>, out: &str| {
            let v = g.new_value(out, None).unwrap();
            let mut n = Node::new(op, out).with_outputs([v]);
            n.inputs = inputs.into_iter().map(Some).collect();
            g.add_node(n).unwrap();
            v
        };
        let c = node(&mut g, "Conv", vec![x, w], "c");
        let a = node(&mut g, "Add", vec![c, three], "a");
        let k = node(&mut g, "Clip", vec![a, zero, six], "k");
        let m = node(&mut g, "Mul", vec![c, k], "m");
        let y = node(&mut g, "Relu", vec![m], "y");
        g.set_outputs(vec![y]).unwrap();
        Model { ir_version: 8, opset_imports: vec![OpsetImport { domain: String::new(), version: 13 }], graph: g, ..Default::default() }
    }

    #[test]
    fn watched_runs_report_the_watched_values_of_a_full_hook_run_and_fuse_the_rest() {
        let model = conv_hardswish_relu();
        let session = Session::new(&model).unwrap();
        let data: Vec<f32> = (0..2 * 6 * 7).map(|i| ((i * 7919) % 1000) as f32 / 150.0 - 3.0).collect();
        let feed = vec![("x".to_string(), crate::Value::Tensor(Tensor::from_vec(&[1, 2, 6, 7], data).unwrap()))];
        let mut all = Values(Default::default());
        let full = session.run_values_with_hooks(feed.clone(), &mut all).unwrap();
        assert!(["x", "c", "a", "k", "m", "y"].iter().all(|v| all.0.contains_key(*v)), "{:?}", all.0.keys());
        let id = |name: &str| model.graph.values().find(|(_, v)| v.name == name).map(|(id, _)| id).unwrap();
        for (watched, fused_away) in [(vec!["c", "m"], vec!["a", "k"]), (vec!["m"], vec!["c", "a", "k"]), (vec![], vec!["c", "a", "k", "m"])] {
            let watch = session.watching(&model, &watched.iter().map(|v| id(v)).collect());
            let mut seen = Values(Default::default());
            let out = session.run_values_watching(&watch, feed.clone(), &mut seen).unwrap();
            // The elementwise ops compute the same f32 expressions, fused or not.
            assert_eq!(out[0].1.as_tensor(), full[0].1.as_tensor(), "watching {watched:?}");
            for v in watched.iter().chain(&["x", "y"]) {
                assert_eq!(seen.0.get(*v), all.0.get(*v), "watching {watched:?}: value {v}");
            }
            for v in &fused_away {
                assert!(!seen.0.contains_key(*v), "watching {watched:?}: {v} was materialized");
            }
        }
    }

    #[test]
    fn fused_runs_match_unfused_runs_and_hooks_see_every_value() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/tiny_cnn.onnx");
        let model = qforge_onnx::load(std::path::Path::new(path)).unwrap();
        let session = Session::new(&model).unwrap();
        let fused = session.fused.as_ref().expect("Conv+Relu fuses");
        assert!(fused.steps.len() < session.plan.steps.len());
        let g = &model.graph;
        let x = g.inputs()[0];
        let shape: Vec<usize> = match &g.value(x).unwrap().ty {
            Some(qforge_ir::ValueType::Tensor { shape: Some(s), .. }) => s.iter().map(|d| match d { qforge_ir::Dim::Known(k) if *k > 0 => *k as usize, _ => 1 }).collect(),
            _ => panic!("the example declares its input shape"),
        };
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let feed = vec![(g.value_name(x), Tensor::from_vec(&shape, data).unwrap())];
        let plain = session.run(feed.clone()).unwrap();
        let mut names = Names(HashSet::new());
        let hooked = session.run_with_hooks(feed, &mut names).unwrap();
        for ((_, a), (_, b)) in plain.iter().zip(&hooked) {
            for (p, q) in a.as_slice::<f32>().unwrap().iter().zip(b.as_slice::<f32>().unwrap()) {
                assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
            }
        }
        for node in g.nodes().map(|(_, n)| n) {
            for v in node.outputs.iter().flatten() {
                assert!(names.0.contains(&g.value_name(*v)), "hooks did not see {}", g.value_name(*v));
            }
        }
    }
}
