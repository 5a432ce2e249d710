//! Sessions: a model planned once, run many times.

use qforge_ir::{Model, Tensor};

use crate::hooks::Hooks;
use crate::plan::{Plan, StepTime};
use crate::{Registry, RuntimeError, RuntimeResult};

/// How a session runs.
#[derive(Debug, Clone, Default)]
pub struct SessionOptions {
    /// Worker threads; 0 uses every core.
    pub threads: usize,
}

/// A model ready to run: planned once (constants folded, kernels built), with its own
/// thread pool. Runs may use different input shapes.
pub struct Session {
    plan: Plan,
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
        let plan = Plan::build(&model.graph, &model.opset_imports, Registry::builtin(), &Default::default())?;
        let threads = if opts.threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { opts.threads };
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()
            .map_err(|e| RuntimeError::Kernel(format!("cannot start {threads} worker threads: {e}")))?;
        Ok(Session { plan, pool })
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

    /// Runs the model on named inputs; returns the outputs in graph order.
    pub fn run(&self, inputs: Vec<(String, Tensor)>) -> RuntimeResult<Vec<(String, Tensor)>> {
        self.run_inner(inputs, None, None)
    }

    /// [`Session::run`], reporting every produced value to `hooks` (which may replace it).
    pub fn run_with_hooks(&self, inputs: Vec<(String, Tensor)>, hooks: &mut dyn Hooks) -> RuntimeResult<Vec<(String, Tensor)>> {
        self.run_inner(inputs, Some(hooks), None)
    }

    /// [`Session::run`], also returning the wall time of every executed node.
    pub fn run_profiled(&self, inputs: Vec<(String, Tensor)>) -> RuntimeResult<(Vec<(String, Tensor)>, Vec<StepTime>)> {
        let mut times = vec![];
        let outs = self.run_inner(inputs, None, Some(&mut times))?;
        Ok((outs, times))
    }

    fn run_inner(&self, inputs: Vec<(String, Tensor)>, hooks: Option<&mut dyn Hooks>, profile: Option<&mut Vec<StepTime>>) -> RuntimeResult<Vec<(String, Tensor)>> {
        let mut feeds: Vec<Option<Tensor>> = vec![None; self.plan.inputs.len()];
        for (name, t) in inputs {
            let i = self.plan.inputs.iter().position(|p| p.name == name).ok_or_else(|| RuntimeError::Input {
                input: name.clone(),
                reason: format!("the model has no such input; its inputs are {}", self.plan.inputs.iter().map(|i| format!("'{}'", i.name)).collect::<Vec<_>>().join(", ")),
            })?;
            if feeds[i].replace(t).is_some() {
                return Err(RuntimeError::Input { input: name, reason: "is given more than once".into() });
            }
        }
        let no_scope = |_: &str| None;
        let outs = self.pool.install(|| self.plan.run_profiled(feeds, &no_scope, hooks, profile))?;
        Ok(self.plan.outputs.iter().map(|o| o.0.clone()).zip(outs).collect())
    }
}
