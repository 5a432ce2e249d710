//! The kernel interface and the operator registry.
//!
//! An operator is one registry line: `(domain, op_type, first opset, last opset) -> builder`.
//! A builder runs once per node when a session is planned: it reads the node's attributes,
//! may inspect or pre-pack constant inputs, and returns a [`Kernel`] that the session calls
//! for every run.

use std::collections::HashMap;

use qforge_ir::{Graph, Node, NodeId, OpsetImport, Tensor, ValueType};

use crate::{kernel_error, RuntimeError, RuntimeResult, Value};

/// What a kernel builder sees of its node.
pub struct NodeInfo<'a> {
    pub node: &'a Node,
    pub id: NodeId,
    pub graph: &'a Graph,
    /// The opset version of the node's domain imported by the model.
    pub opset: i64,
    /// All opsets the model imports (for planning subgraphs).
    pub opsets: &'a [OpsetImport],
    /// Constants visible to the node's subgraphs, by name (empty for nodes without subgraphs).
    pub scope_consts: &'a HashMap<String, Tensor>,
    /// Constant data of each input, when it is an initializer (or folded to a constant).
    pub const_inputs: Vec<Option<&'a Tensor>>,
    /// Declared or inferred type of each input, when known.
    pub input_types: Vec<Option<&'a ValueType>>,
}

impl NodeInfo<'_> {
    /// A [`RuntimeError::Node`] naming this node.
    pub fn error(&self, reason: impl Into<String>) -> RuntimeError {
        RuntimeError::Node { node: self.node.display_name(self.id), op: self.node.op_type.clone(), reason: reason.into() }
    }
    pub fn attr_int(&self, name: &str, default: i64) -> i64 {
        self.node.attr_int(name).unwrap_or(default)
    }
    pub fn attr_float(&self, name: &str, default: f32) -> f32 {
        self.node.attr_float(name).unwrap_or(default)
    }
    pub fn attr_ints(&self, name: &str) -> Option<Vec<i64>> {
        self.node.attr_ints(name).map(|v| v.to_vec())
    }
    pub fn attr_str(&self, name: &str, default: &str) -> String {
        self.node.attr_str(name).unwrap_or(default).to_string()
    }
    /// Constant data of input `i`, if it is constant.
    pub fn const_input(&self, i: usize) -> Option<&Tensor> {
        self.const_inputs.get(i).copied().flatten()
    }
}

/// Per-run context handed to kernels.
pub struct RunCtx<'a> {
    /// Looks up a value visible from the node's graph by name: the graph's own values and
    /// those of enclosing graphs. Control-flow kernels hand it to their subgraphs.
    pub scope: &'a dyn Fn(&str) -> Option<Value>,
    /// The run's hooks and the path of the node's graph, when the run has hooks.
    /// Control-flow kernels extend the path and hand it to their subgraphs.
    pub hooks: Option<HookSink<'a>>,
}

/// The run's hooks behind a lock, so kernels can hand them to subgraphs.
pub(crate) trait ReportValue: Sync {
    fn report(&self, event: &crate::ValueEvent, value: &Tensor) -> Option<Tensor>;
    fn supply(&self, event: &crate::NodeEvent) -> Option<Vec<Option<Tensor>>>;
}

impl ReportValue for std::sync::Mutex<&mut dyn crate::Hooks> {
    fn report(&self, event: &crate::ValueEvent, value: &Tensor) -> Option<Tensor> {
        self.lock().unwrap_or_else(|p| p.into_inner()).on_value(event, value)
    }
    fn supply(&self, event: &crate::NodeEvent) -> Option<Vec<Option<Tensor>>> {
        self.lock().unwrap_or_else(|p| p.into_inner()).supply(event)
    }
}

/// Hooks as seen from one (sub)graph: the run's hooks and the path from the main graph.
#[derive(Clone, Copy)]
pub struct HookSink<'a> {
    pub(crate) hooks: &'a (dyn ReportValue + 'a),
    /// `(node, graph attribute)` steps from the main graph down to this graph; empty for the
    /// main graph.
    pub path: &'a [(NodeId, &'static str)],
}

/// A planned operator instance.
pub trait Kernel: Send + Sync {
    /// Computes the node's outputs. `inputs[i]` is `None` for an omitted optional input.
    /// Returns one tensor per declared output (omitted optional outputs may be any tensor).
    fn run(&self, inputs: &[Option<&Tensor>], ctx: &RunCtx) -> RuntimeResult<Vec<Tensor>>;

    /// The kernel as a [`ValueKernel`], for ops that take or produce sequences or optionals
    /// (built with [`value_kernel`]): plans run it on values, and [`Kernel::run`] serves the
    /// callers that hold tensors only. `None` (the default): the op sees tensors only.
    fn values(&self) -> Option<&dyn ValueKernel> {
        None
    }
}

/// A planned instance of an op that takes or produces values other than tensors (sequences,
/// optionals), or passes any value on (Identity, control flow).
pub trait ValueKernel: Send + Sync {
    /// Computes the node's outputs. `inputs[i]` is `None` for an omitted optional input (an
    /// empty optional given as input is `Some(Value::Optional(None))`). Returns one value per
    /// declared output.
    fn run_values(&self, inputs: &[Option<&Value>], ctx: &RunCtx) -> RuntimeResult<Vec<Value>>;
}

/// A [`ValueKernel`] as a [`Kernel`]: its [`Kernel::run`] feeds tensors in and fails when an
/// output is not a tensor.
struct OnValues<K>(K);

impl<K: ValueKernel> Kernel for OnValues<K> {
    fn run(&self, inputs: &[Option<&Tensor>], ctx: &RunCtx) -> RuntimeResult<Vec<Tensor>> {
        let values: Vec<Option<Value>> = inputs.iter().map(|t| t.map(|t| Value::Tensor(t.clone()))).collect();
        let refs: Vec<Option<&Value>> = values.iter().map(Option::as_ref).collect();
        self.0.run_values(&refs, ctx)?.into_iter().enumerate()
            .map(|(k, v)| v.into_tensor().map_err(|v| kernel_error(format!("output {k} is {v}, not a tensor"))))
            .collect()
    }

    fn values(&self) -> Option<&dyn ValueKernel> {
        Some(&self.0)
    }
}

/// Boxes a [`ValueKernel`] for a [`KernelBuilder`].
pub fn value_kernel(k: impl ValueKernel + 'static) -> RuntimeResult<Box<dyn Kernel>> {
    Ok(Box::new(OnValues(k)))
}

/// Plans a kernel for one node.
pub type KernelBuilder = fn(&NodeInfo) -> RuntimeResult<Box<dyn Kernel>>;

struct Entry {
    since: i64,
    until: i64,
    build: KernelBuilder,
}

/// Kernels by (domain, op type), each covering a range of opset versions.
#[derive(Default)]
pub struct Registry {
    ops: HashMap<(String, String), Vec<Entry>>,
}

fn norm_domain(d: &str) -> &str {
    if d == "ai.onnx" { "" } else { d }
}

impl Registry {
    /// Registers a kernel for opsets `since..=until` of `domain`.
    pub fn add(&mut self, domain: &str, op_type: &str, since: i64, until: i64, build: KernelBuilder) {
        self.ops.entry((norm_domain(domain).to_string(), op_type.to_string())).or_default().push(Entry { since, until, build });
    }

    /// The builder for an op at an opset, if the registry has one.
    pub fn lookup(&self, domain: &str, op_type: &str, opset: i64) -> Option<KernelBuilder> {
        self.ops.get(&(norm_domain(domain).to_string(), op_type.to_string()))?
            .iter().find(|e| (e.since..=e.until).contains(&opset)).map(|e| e.build)
    }

    /// Whether any opset of the op is supported.
    pub fn knows(&self, domain: &str, op_type: &str) -> bool {
        self.ops.contains_key(&(norm_domain(domain).to_string(), op_type.to_string()))
    }

    /// All registered (domain, op type) pairs, sorted.
    pub fn op_types(&self) -> Vec<(String, String)> {
        let mut v: Vec<_> = self.ops.keys().cloned().collect();
        v.sort();
        v
    }

    /// The registry with every built-in kernel (built once).
    pub fn builtin() -> &'static Registry {
        static BUILTIN: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
        BUILTIN.get_or_init(|| {
            let mut r = Registry::default();
            crate::kernels::register_all(&mut r);
            r
        })
    }
}

/// Opset bound for "every later version".
pub const LATEST: i64 = i64::MAX;
