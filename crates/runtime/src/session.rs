//! Sessions: a model planned once, run many times.

use std::collections::HashSet;

use qforge_ir::{Model, NodeId, Tensor, ValueId};

use crate::hooks::Hooks;
use crate::kernels::util::{single_threaded, with_spinning_workers};
use crate::plan::{Folding, Plan, StepTime};
use crate::{fold_constants, lower_qoperator_with, LowerLog, LowerOptions, Registry, RuntimeError, RuntimeResult, Value};

/// How a session runs.
#[derive(Debug, Clone, Default)]
pub struct SessionOptions {
    /// Worker threads; 0 uses every core.
    pub threads: usize,
}

/// A session's plan for hook runs that watch only some values (see [`Session::watching`]).
pub struct Watch {
    /// `None` when nothing fuses: such runs use the session's plan for hooks.
    plan: Option<Plan>,
}

/// Every value of one run of a session's main graph (see [`Session::run_keeping`]).
pub struct RunValues {
    table: Vec<Option<Value>>,
}

impl RunValues {
    /// The tensor `v` of the main graph as the run left it (`None`: never computed, not a
    /// tensor, or not a value of the graph).
    pub fn get(&self, v: ValueId) -> Option<&Tensor> {
        self.table.get(v.0 as usize)?.as_ref()?.as_tensor()
    }
}

/// A model ready to run: planned once (constants folded, kernels built), with its own
/// thread pool. Runs may use different input shapes.
///
/// Runs without hooks use a second plan, built from a rewritten graph:
/// * QDQ units (`DequantizeLinear -> Conv -> QuantizeLinear` and the other patterns of
///   [`lower_qoperator`](crate::lower_qoperator)) run as integer operators, as ONNX Runtime runs them, so a result may
///   differ from the QDQ graph's float arithmetic by one quantization step where a value lies
///   on a rounding boundary; units of other pointwise ops (HardSwish, HardSigmoid, Tanh, ...)
///   run as 256-entry lookup tables of exactly what their QDQ nodes compute
///   ([`LowerOptions::lookup_tables`]);
/// * chains of f32 elementwise ops are fused (into the epilogue of the Conv that feeds them,
///   with per-channel affine ops folded into its weights, or into one pass), which changes
///   results by rounding at most.
///
/// Runs with hooks use the plan of the graph as given, so hooks see every value, except runs
/// with a [`Watch`] ([`Session::watching`]), which fuse the chains between the watched values,
/// and [`Session::run_values_observed`], which runs the plan of runs without hooks.
/// Setting the environment variable `QFORGE_NO_FUSION` (to anything) when a session is created
/// turns both rewrites off, to compare.
pub struct Session {
    pub(crate) plan: Plan,
    /// The plan for runs without hooks, when anything lowers or fuses.
    pub(crate) fused: Option<Plan>,
    lowering: Option<LowerLog>,
    /// Whether the session fuses elementwise chains (constants folded, fusion not turned off).
    fuses: bool,
    pool: rayon::ThreadPool,
}

impl Session {
    /// Plans a model with default options.
    pub fn new(model: &Model) -> RuntimeResult<Session> {
        Self::with_options(model, SessionOptions::default())
    }

    /// Plans a model. Fails when an op is unsupported or a node's attributes are invalid,
    /// naming the node.
    pub fn with_options(model: &Model, opts: SessionOptions) -> RuntimeResult<Session> {
        Self::with_folding(model, opts, Folding::Constants)
    }

    /// [`Session::with_options`] with a choice of [`Folding`] for the main graph.
    pub fn with_folding(model: &Model, opts: SessionOptions, folding: Folding) -> RuntimeResult<Session> {
        let plan = Plan::build_with(&model.graph, &model.opset_imports, Registry::builtin(), &Default::default(), folding)?;
        let fuse = folding == Folding::Constants && std::env::var_os("QFORGE_NO_FUSION").is_none();
        let (fused, lowering) = if fuse { Self::fast_plan(model, &plan) } else { (None, None) };
        let threads = if opts.threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { opts.threads };
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()
            .map_err(|e| RuntimeError::Kernel(format!("cannot start {threads} worker threads: {e}")))?;
        Ok(Session { plan, fused, lowering, fuses: fuse, pool })
    }

    /// The plan for runs without hooks, and the lowering it ran when the model has QDQ units:
    /// constants except `DequantizeLinear` outputs are folded ([`fold_constants`], so weights
    /// quantized at run time become integer constants), QDQ units are rewritten into integer operators
    /// or lookup tables ([`lower_qoperator_with`]),
    /// as ONNX Runtime fuses `DequantizeLinear -> op -> QuantizeLinear` groups when it builds a
    /// session, then chains of f32 elementwise ops are fused. Falls back to the graph as given
    /// when lowering changes nothing, fails, or yields a graph that does not plan.
    fn fast_plan(model: &Model, plan: &Plan) -> (Option<Plan>, Option<LowerLog>) {
        let has_qdq = model.graph.graphs().iter().any(|(_, g)| g.nodes().any(|(_, n)| n.domain.is_empty() && n.op_type == "DequantizeLinear"));
        if has_qdq {
            let mut lowered = model.clone();
            for (path, _) in model.graph.graphs() {
                if let Some(g) = lowered.graph.graph_at_mut(&path) {
                    // Weights quantized at run time (`QuantizeLinear` of a constant) become
                    // constants; dequantized constants stay, as the lowering reads them.
                    let _ = fold_constants(g, &model.opset_imports, |n| n.op_type == "DequantizeLinear");
                }
            }
            if let Ok(log) = lower_qoperator_with(&mut lowered, LowerOptions { lookup_tables: true }) {
                let changed = !log.lowered.is_empty() || log.pairs_removed > 0;
                let planned = changed.then(|| Plan::build_with(&lowered.graph, &lowered.opset_imports, Registry::builtin(), &Default::default(), Folding::Constants));
                if let Some(Ok(lp)) = planned.filter(|p| p.as_ref().is_ok_and(|p| same_interface(p, plan))) {
                    let fused = lp.fused(&lowered.graph, &lowered.opset_imports, &HashSet::new()).unwrap_or(lp);
                    return (Some(fused), Some(log));
                }
            }
        }
        (plan.fused(&model.graph, &model.opset_imports, &HashSet::new()), None)
    }

    /// What the session's QDQ lowering did, when the model has QDQ units and runs without
    /// hooks execute them as integer operators (see [`Session`]).
    pub fn qdq_lowering(&self) -> Option<&LowerLog> {
        self.lowering.as_ref()
    }

    /// Names of the inputs a caller must feed (inputs with defaults may be omitted).
    pub fn input_names(&self) -> Vec<&str> {
        self.plan.inputs.iter().filter(|i| i.default.is_none()).map(|i| i.name.as_str()).collect()
    }

    pub fn output_names(&self) -> Vec<&str> {
        self.plan.outputs.iter().map(|o| o.0.as_str()).collect()
    }

    /// Worker threads the session runs on.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs the model on named inputs; returns the outputs in graph order. Fails when an
    /// output is a sequence or an optional (see [`Session::run_values`]).
    pub fn run(&self, inputs: Vec<(String, Tensor)>) -> RuntimeResult<Vec<(String, Tensor)>> {
        self.run_inner(tensors_in(inputs), None, None).and_then(tensors_out)
    }

    /// [`Session::run`] for models whose inputs or outputs may be sequences or optionals.
    pub fn run_values(&self, inputs: Vec<(String, Value)>) -> RuntimeResult<Vec<(String, Value)>> {
        self.run_inner(inputs, None, None)
    }

    /// [`Session::run`], reporting every produced value to `hooks` (which may replace it).
    pub fn run_with_hooks(&self, inputs: Vec<(String, Tensor)>, hooks: &mut dyn Hooks) -> RuntimeResult<Vec<(String, Tensor)>> {
        self.run_inner(tensors_in(inputs), Some(hooks), None).and_then(tensors_out)
    }

    /// [`Session::run_values`], reporting every produced tensor to `hooks` (which may replace
    /// it).
    pub fn run_values_with_hooks(&self, inputs: Vec<(String, Value)>, hooks: &mut dyn Hooks) -> RuntimeResult<Vec<(String, Value)>> {
        self.run_inner(inputs, Some(hooks), None)
    }

    /// A plan for hook runs that need to see only `values` of the main graph, built from this
    /// session's plan of `model`, the model the session was created from (for another model,
    /// runs with the returned `Watch` use the full hook plan):
    /// chains of f32 elementwise ops that produce none of `values` are fused, as in runs
    /// without hooks (see [`Session`]), and their intermediate values are never materialized.
    /// Hooks of [`Session::run_values_watching`] see `values`, the graph inputs and outputs,
    /// every value of If/Loop bodies, and the outputs of the steps that did not fuse. Fused
    /// chains change results by rounding at most, where a per-channel affine op folds into a
    /// Conv's weights.
    pub fn watching(&self, model: &Model, values: &HashSet<ValueId>) -> Watch {
        let planned_from = |m: &Model| self.plan.steps.iter().all(|s| m.graph.node(s.node).is_ok_and(|n| n.op_type == s.op));
        let kept: HashSet<usize> = (0..self.plan.slots).filter(|&s| values.contains(&self.plan.value_ids[s])).collect();
        let plan = (self.fuses && planned_from(model)).then(|| self.plan.fused(&model.graph, &model.opset_imports, &kept)).flatten();
        Watch { plan }
    }

    /// [`Session::run_values`] (the plan of runs without hooks: QDQ units lowered to integer
    /// operators, elementwise chains fused), with `hooks` seeing the outputs of its steps: an
    /// integer unit's quantized output and the values between steps, not what a fused chain or
    /// a lowered unit computes inside. For hooks that read; a value they replace changes only
    /// the readers of that step output.
    pub fn run_values_observed(&self, inputs: Vec<(String, Value)>, hooks: &mut dyn Hooks) -> RuntimeResult<Vec<(String, Value)>> {
        self.run_plan(self.fused.as_ref().unwrap_or(&self.plan), inputs, Some(hooks), None)
    }

    /// [`Session::run_values_with_hooks`] on the plan of `watch`, from [`Session::watching`] of
    /// this session: `hooks` sees the values `watch` was made for (and may replace them) but
    /// not the intermediate values of fused chains. Hooks that supply outputs
    /// ([`Hooks::supply`]) need every node: they must use [`Session::run_values_with_hooks`].
    pub fn run_values_watching(&self, watch: &Watch, inputs: Vec<(String, Value)>, hooks: &mut dyn Hooks) -> RuntimeResult<Vec<(String, Value)>> {
        self.run_plan(watch.plan.as_ref().unwrap_or(&self.plan), inputs, Some(hooks), None)
    }

    /// [`Session::run`], also returning the wall time of every executed node.
    pub fn run_profiled(&self, inputs: Vec<(String, Tensor)>) -> RuntimeResult<(Vec<(String, Tensor)>, Vec<StepTime>)> {
        let mut times = vec![];
        let outs = self.run_inner(tensors_in(inputs), None, Some(&mut times)).and_then(tensors_out)?;
        Ok((outs, times))
    }

    /// [`Session::run_with_hooks`], keeping the values of the main graph for
    /// [`Session::run_from`] (memory holds all of them, not only the live ones), except the
    /// computed values in `dropped`: they are freed after their last reader, and
    /// [`Session::run_from`] computes again, as this run did, those it needs. Dropping values
    /// that are cheap to compute from kept ones (a DequantizeLinear's output) trades a little
    /// recomputation for memory.
    pub fn run_keeping(&self, inputs: Vec<(String, Tensor)>, hooks: &mut dyn Hooks, dropped: &HashSet<ValueId>) -> RuntimeResult<(Vec<(String, Tensor)>, RunValues)> {
        let feeds = self.feeds(tensors_in(inputs))?;
        let (outs, table) = self.enter(|| self.plan.run_keeping(feeds, hooks, dropped))?;
        Ok((tensors_out(self.named(outs))?, RunValues { table }))
    }

    /// Recomputes part of a run: the `dirty` nodes of the main graph and every node
    /// downstream of them (reading, directly or through a subgraph, a recomputed value) run
    /// again, with `hooks`, and so do the nodes that compute what those read and `base`
    /// dropped; every other value is taken from `base`, which must come from
    /// [`Session::run_keeping`] of this session. Returns the outputs in graph order. The
    /// result equals a full run when the hooks act on the recomputed nodes as they did on
    /// `base`'s run everywhere else.
    pub fn run_from(&self, base: &RunValues, dirty: &[NodeId], hooks: &mut dyn Hooks) -> RuntimeResult<Vec<(String, Tensor)>> {
        let dirty: HashSet<NodeId> = dirty.iter().copied().collect();
        let outs = self.enter(|| self.plan.run_from(&base.table, &dirty, hooks))?;
        tensors_out(self.named(outs))
    }

    fn named(&self, outs: Vec<Value>) -> Vec<(String, Value)> {
        self.plan.outputs.iter().map(|o| o.0.clone()).zip(outs).collect()
    }

    /// Feeds in the plan's input order, checking names.
    fn feeds(&self, inputs: Vec<(String, Value)>) -> RuntimeResult<Vec<Option<Value>>> {
        let mut feeds: Vec<Option<Value>> = vec![None; self.plan.inputs.len()];
        for (name, t) in inputs {
            let i = self.plan.inputs.iter().position(|p| p.name == name).ok_or_else(|| RuntimeError::Input {
                input: name.clone(),
                reason: format!("the model has no such input; its inputs are {}", self.plan.inputs.iter().map(|i| format!("'{}'", i.name)).collect::<Vec<_>>().join(", ")),
            })?;
            if feeds[i].replace(t).is_some() {
                return Err(RuntimeError::Input { input: name, reason: "is given more than once".into() });
            }
        }
        Ok(feeds)
    }

    fn run_inner(&self, inputs: Vec<(String, Value)>, hooks: Option<&mut dyn Hooks>, profile: Option<&mut Vec<StepTime>>) -> RuntimeResult<Vec<(String, Value)>> {
        let plan = match (&hooks, &self.fused) {
            (None, Some(fused)) => fused,
            _ => &self.plan,
        };
        self.run_plan(plan, inputs, hooks, profile)
    }

    /// Runs `plan`, this session's or one derived from it, on named inputs.
    fn run_plan(&self, plan: &Plan, inputs: Vec<(String, Value)>, hooks: Option<&mut dyn Hooks>, profile: Option<&mut Vec<StepTime>>) -> RuntimeResult<Vec<(String, Value)>> {
        let feeds = self.feeds(inputs)?;
        let no_scope = |_: &str| None;
        let outs = self.enter(|| plan.run_profiled(feeds, &no_scope, hooks, profile))?;
        Ok(self.named(outs))
    }

    /// Runs `f`, a run of a plan, on the session's threads: on the calling thread as a
    /// one-thread run ([`single_threaded`]) when the session has one thread, which spares
    /// handing the run to a worker and waking the caller when it ends (kernels split their
    /// work through [`crate::kernels::util::threads`] and its helpers, which see one thread
    /// there); else on the session's pool, whose other workers spin for the work nodes
    /// split off while the run lasts ([`with_spinning_workers`]).
    fn enter<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.threads() == 1 { single_threaded(f) } else { self.pool.install(|| with_spinning_workers(f)) }
    }
}

fn tensors_in(inputs: Vec<(String, Tensor)>) -> Vec<(String, Value)> {
    inputs.into_iter().map(|(n, t)| (n, Value::Tensor(t))).collect()
}

/// The outputs as tensors; an error naming the first output that is not one.
fn tensors_out(outs: Vec<(String, Value)>) -> RuntimeResult<Vec<(String, Tensor)>> {
    outs.into_iter().map(|(name, v)| match v.into_tensor() {
        Ok(t) => Ok((name, t)),
        Err(v) => Err(RuntimeError::Kernel(format!("output '{name}' is {v}; Session::run_values returns values other than tensors"))),
    }).collect()
}

/// Whether two plans take the same inputs and give the same outputs, by name and order.
fn same_interface(a: &Plan, b: &Plan) -> bool {
    a.inputs.iter().map(|i| &i.name).eq(b.inputs.iter().map(|i| &i.name)) && a.outputs.iter().map(|o| &o.0).eq(b.outputs.iter().map(|o| &o.0))
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashSet};

    use qforge_ir::{Tensor, ValueId};

    use crate::{Hooks, Session, ValueEvent};

    /// Records the name of every value a run reports, and adds one to `a` where it is
    /// computed when `bump` is set.
    struct Trial {
        bump: bool,
        seen: BTreeSet<String>,
    }

    impl Hooks for Trial {
        fn on_value(&mut self, event: &ValueEvent, t: &Tensor) -> Option<Tensor> {
            self.seen.insert(event.name.to_string());
            (self.bump && event.name == "a").then(|| Tensor::from_vec(t.shape(), t.as_slice::<f32>().unwrap().iter().map(|v| v + 1.0).collect()).unwrap())
        }
    }

    #[test]
    fn a_rerun_computes_again_what_the_kept_run_dropped_and_equals_a_full_run() {
        let model = crate::fuse::tests::conv_hardswish_relu();
        let id = |name: &str| model.graph.values().find(|(_, v)| v.name == name).map(|(id, _)| id).unwrap();
        let session = Session::new(&model).unwrap();
        let data: Vec<f32> = (0..2 * 6 * 7).map(|i| ((i * 7919) % 1000) as f32 / 150.0 - 3.0).collect();
        let feed = vec![("x".to_string(), Tensor::from_vec(&[1, 2, 6, 7], data).unwrap())];
        let mut changed = Trial { bump: true, seen: BTreeSet::new() };
        let want = session.run_with_hooks(feed.clone(), &mut changed).unwrap();
        let add = model.graph.producer(id("a")).unwrap().0;
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
        // Kept whole, the rerun from the Add runs the Add and what follows it; with the Conv's
        // and the Clip's outputs dropped, it computes the Conv's again (the Mul reads it), and
        // the Clip's anyway (it follows the Add). Both equal the full run with the change.
        for (dropped, rerun) in [(vec![], names(&["a", "k", "m", "y"])), (vec!["c", "k"], names(&["c", "a", "k", "m", "y"]))] {
            let dropped: HashSet<ValueId> = dropped.iter().map(|n| id(n)).collect();
            let mut same = Trial { bump: false, seen: BTreeSet::new() };
            let (_, base) = session.run_keeping(feed.clone(), &mut same, &dropped).unwrap();
            for n in ["c", "a", "k", "m", "y"] {
                assert_eq!(base.get(id(n)).is_none(), dropped.contains(&id(n)), "{n} kept or dropped as asked ({dropped:?})");
            }
            let mut trial = Trial { bump: true, seen: BTreeSet::new() };
            let got = session.run_from(&base, &[add], &mut trial).unwrap();
            assert_eq!(trial.seen, rerun, "values recomputed with {dropped:?} dropped");
            assert_eq!(got, want, "{dropped:?} dropped");
        }
    }
}
