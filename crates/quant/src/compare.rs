//! Compare: per-tensor numeric comparison of a float model with its quantized QDQ model (the
//! idea of PyTorch's Numeric Suite, `torch.ao.ns`).
//!
//! Both models run in qforge's runtime on the same samples, with hooks that see every value
//! (inside If/Loop bodies too). Subgraphs are paired by the name of their owning node (its
//! first output's name when it has none) and attribute. In paired graphs, a float value `X`
//! (a graph input or a node output) is compared with, in the quantized model:
//! 1. the output of the `DequantizeLinear` reading the `QuantizeLinear` that reads `X` (the
//!    fake-quantized `X`), found by graph structure, so qforge's and ONNX Runtime's quantizers
//!    are both understood;
//! 2. else the value named `X`: a quantized graph output keeps its name on the
//!    `DequantizeLinear` output, any other such value is float, downstream of quantized ones;
//! 3. else the `DequantizeLinear` output named `X_DequantizeLinear_Output` (ONNX Runtime's
//!    naming).
//!
//! A value produced several times per sample (a Loop body) is paired by occurrence; an
//! occurrence without a counterpart of the same shape is counted as unpaired. Every graph
//! output is also compared with the quantized model's output of the same name.
//!
//! The float model is compared after the quantizer's fusion passes
//! ([`crate::pipeline::fuse`]), so folded layers carry the names the quantized model gives them; the
//! fused model computes the same function up to float rounding.
//!
//! Weights: every `DequantizeLinear` whose input is an initializer is dequantized with the
//! runtime's kernel and compared with the float initializer at the same input of the same-named
//! reader in the fused float model, else with the float initializer named like its quantized
//! data without `_quantized`, or like its output without `_DequantizeLinear_Output`. A per-axis
//! `DequantizeLinear` also gets one SQNR per channel along its axis.
//!
//! Figures accumulate over samples as streaming sums in f64 (memory holds the matched float
//! values of one sample, never the data set). With `x` float and `y` quantized: SQNR
//! `10·log10(Σx²/Σ(x−y)²)` dB (+inf when equal), MSE, cosine `Σxy/√(Σx²·Σy²)` (1 when both are
//! zero, 0 when one is), max `|x−y|`. Elements where either side is NaN or infinite are left
//! out and counted. In JSON, non-finite SQNR figures are the strings `"inf"`, `"-inf"`, `"nan"`.

use std::collections::{HashMap, VecDeque};

use qforge_ir::{DType, Graph, Model, Node, Tensor, ValueId, ValueKind, CAPTURE_USE};
use qforge_runtime::{Hooks, Session, SessionOptions, Value, ValueEvent};
use rayon::prelude::*;
use serde::{Serialize, Serializer};

use crate::observer::AxisLayout;
use crate::pair_sums::U8ChannelMaxima;
use crate::passes::fold_constants;
use crate::pipeline::SampleSource;
use qforge_ir::GraphPath;

/// Errors of a comparison, each naming the model, sample or tensor concerned.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    #[error("the sample set is empty: give at least one sample")]
    NoSamples,
    #[error("the models have different inputs: the float model takes {float}, the quantized model takes {quantized}")]
    InputsDiffer { float: String, quantized: String },
    #[error("no tensor of the quantized model matches the float model (no value or Q/DQ of a float value by name, no dequantized float initializer): was it quantized from this float model?")]
    NoMatches,
    #[error("the {model} model: {reason}")]
    Model { model: &'static str, reason: String },
    #[error("sample '{sample}': {reason}")]
    Sample { sample: String, reason: String },
}

/// Error figures of one tensor over all samples (`x` float, `y` quantized).
#[derive(Debug, Clone, Serialize)]
pub struct Metrics {
    /// Elements compared.
    pub count: u64,
    /// `10·log10(Σx²/Σ(x−y)²)`; +inf when equal, NaN when nothing was compared.
    #[serde(serialize_with = "db")]
    pub sqnr_db: f64,
    /// Mean of `(x−y)²`.
    pub mse: f64,
    /// `Σxy/√(Σx²·Σy²)`; 1 when both are zero, 0 when one is.
    pub cosine: f64,
    /// Largest `|x−y|`.
    pub max_abs_error: f64,
    /// Elements left out because either side was NaN or infinite.
    pub non_finite: u64,
}

/// One float value compared with its counterpart in the quantized model.
#[derive(Debug, Clone, Serialize)]
pub struct TensorComparison {
    /// The graph holding the value: empty for the main graph, else `node/attribute` steps
    /// joined by `/`.
    pub graph: String,
    /// The float model's value.
    pub name: String,
    /// Op type producing it in the float model (`input` for a graph input).
    pub op: String,
    /// The quantized model's value it was compared with.
    pub compared_with: String,
    /// Whether that value is a `DequantizeLinear` output (the fake-quantized value).
    pub fake_quantized: bool,
    /// Occurrences with no counterpart of the same shape and a float type on the other side.
    pub unpaired: u64,
    #[serde(flatten)]
    pub metrics: Metrics,
    /// For an integer, boolean or string value (which the metrics leave out), how many of its
    /// elements equal the float model's; `None` for float values.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exact: Option<ExactMatch>,
}

/// Elements of a non-float value equal to the float model's, out of those compared.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ExactMatch {
    pub equal: u64,
    pub count: u64,
}

impl ExactMatch {
    /// The equal elements of two non-float tensors of one dtype and shape; `None` for float
    /// tensors or tensors that do not pair up.
    fn of_tensors(x: &Tensor, y: &Tensor) -> Option<ExactMatch> {
        if is_float(x.dtype()) || x.dtype() != y.dtype() || x.shape() != y.shape() {
            return None;
        }
        let count = x.len() as u64;
        let equal = match (x.strings(), y.strings(), x.raw_bytes(), y.raw_bytes()) {
            (Some(a), Some(b), _, _) => a.iter().zip(b).filter(|(p, q)| p == q).count(),
            (_, _, Some(a), Some(b)) if x.dtype().bits() >= 8 => {
                let size = x.dtype().bits() / 8;
                a.chunks_exact(size).zip(b.chunks_exact(size)).filter(|(p, q)| p == q).count()
            }
            _ => x.to_f64_vec().ok()?.iter().zip(&y.to_f64_vec().ok()?).filter(|(p, q)| p == q).count(),
        } as u64;
        Some(ExactMatch { equal, count })
    }

    fn merge(self, o: ExactMatch) -> ExactMatch {
        ExactMatch { equal: self.equal + o.equal, count: self.count + o.count }
    }
}

/// One quantized initializer compared with its float original.
#[derive(Debug, Clone, Serialize)]
pub struct WeightComparison {
    /// The graph holding it, as in [`TensorComparison::graph`].
    pub graph: String,
    /// The float model's initializer.
    pub name: String,
    /// The quantized model's `DequantizeLinear` output it was compared with.
    pub compared_with: String,
    /// The node reading the dequantized weight (the first, when several do).
    pub consumer: String,
    /// That node's op type.
    pub op: String,
    /// The channel axis of a per-axis `DequantizeLinear`; `None` per tensor or per block.
    pub axis: Option<usize>,
    #[serde(flatten)]
    pub metrics: Metrics,
    /// SQNR of each channel along `axis` (empty without an axis).
    #[serde(serialize_with = "db_list")]
    pub channel_sqnr_db: Vec<f64>,
    /// The lowest channel SQNR.
    #[serde(serialize_with = "db_option")]
    pub min_channel_sqnr_db: Option<f64>,
    /// The median channel SQNR (mean of the middle two for an even count).
    #[serde(serialize_with = "db_option")]
    pub median_channel_sqnr_db: Option<f64>,
}

/// Everything a comparison found.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// Samples run.
    pub samples: usize,
    /// Matched values, in topological order (a subgraph's values before its owning node's
    /// outputs); values never compared (not float, or never produced) are left out.
    pub activations: Vec<TensorComparison>,
    /// The float model's graph outputs, compared with the quantized model's outputs of the
    /// same name, in graph order (a sequence item by item, an optional by what it holds).
    pub outputs: Vec<TensorComparison>,
    /// The same outputs with the quantized model run as it deploys: its QDQ units as integer
    /// operators, rounding as ONNX Runtime's kernels do. `outputs` and `activations` come from
    /// the QDQ graph as written (float arithmetic between Dequantize and Quantize), which is
    /// what lets every tensor be paired; the two can differ where integer kernels round a
    /// value differently and later layers amplify it. `None` when nothing lowers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outputs_as_run: Option<Vec<TensorComparison>>,
    /// Quantized initializers, in topological order of their `DequantizeLinear`.
    pub weights: Vec<WeightComparison>,
    /// Float values with no counterpart (`graph:name` inside subgraphs).
    pub unmatched: Vec<String>,
    /// Dequantized initializers of the quantized model with no float initializer to compare
    /// with, and why.
    pub unmatched_weights: Vec<String>,
}

impl Comparison {
    /// The `n` activations with the lowest SQNR, lowest first.
    pub fn worst(&self, n: usize) -> Vec<&TensorComparison> {
        let mut all: Vec<&TensorComparison> = self.activations.iter().filter(|t| t.metrics.count > 0).collect();
        all.sort_by(|a, b| a.metrics.sqnr_db.total_cmp(&b.metrics.sqnr_db));
        all.truncate(n);
        all
    }
}

pub(crate) fn db<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    if v.is_finite() {
        s.serialize_f64(*v)
    } else if v.is_nan() {
        s.serialize_str("nan")
    } else {
        s.serialize_str(if *v > 0.0 { "inf" } else { "-inf" })
    }
}

struct Db(f64);

impl Serialize for Db {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        db(&self.0, s)
    }
}

fn db_list<S: Serializer>(v: &[f64], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|&x| Db(x)))
}

pub(crate) fn db_option<S: Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(x) => db(x, s),
        None => s.serialize_none(),
    }
}

/// Streaming sums of a pair of tensors; merging is exact up to f64 rounding and deterministic
/// for a fixed chunking.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Sums {
    count: u64,
    non_finite: u64,
    xx: f64,
    yy: f64,
    xy: f64,
    ee: f64,
    max_abs: f64,
}

/// Elements per parallel chunk: fixed, so the sums do not depend on the thread count.
const CHUNK: usize = 1 << 15;

impl Sums {
    fn serial<T: Copy + Into<f64>>(x: &[T], y: &[T]) -> Sums {
        let mut s = Sums::default();
        for (&a, &b) in x.iter().zip(y) {
            let (a, b): (f64, f64) = (a.into(), b.into());
            if !a.is_finite() || !b.is_finite() {
                s.non_finite += 1;
                continue;
            }
            let e = a - b;
            s.count += 1;
            s.xx += a * a;
            s.yy += b * b;
            s.xy += a * b;
            s.ee += e * e;
            s.max_abs = s.max_abs.max(e.abs());
        }
        s
    }

    fn of<T: Copy + Into<f64> + Sync>(x: &[T], y: &[T]) -> Sums {
        if x.len() <= CHUNK {
            return Sums::serial(x, y);
        }
        let parts: Vec<Sums> = x.par_chunks(CHUNK).zip(y.par_chunks(CHUNK)).map(|(a, b)| Sums::serial(a, b)).collect();
        parts.into_iter().fold(Sums::default(), Sums::merge)
    }

    /// The sums of two float tensors of the same shape; `None` otherwise.
    pub(crate) fn of_tensors(x: &Tensor, y: &Tensor) -> Option<Sums> {
        if x.shape() != y.shape() || !is_float(x.dtype()) || !is_float(y.dtype()) {
            return None;
        }
        match (x.as_slice::<f32>(), y.as_slice::<f32>()) {
            (Ok(a), Ok(b)) => Some(Sums::of(a, b)),
            _ => Some(Sums::of(&x.to_f64_vec().ok()?, &y.to_f64_vec().ok()?)),
        }
    }

    /// The sums of two graph output values: two tensors as [`Sums::of_tensors`], two sequences
    /// of the same length item by item, two optionals by what they hold (both empty: nothing
    /// to add); `None` when the values do not pair up.
    fn of_values(x: &Value, y: &Value) -> Option<Sums> {
        match (x, y) {
            (Value::Tensor(a), Value::Tensor(b)) => Sums::of_tensors(a, b),
            (Value::Sequence(a), Value::Sequence(b)) if a.items.len() == b.items.len() => {
                a.items.iter().zip(&b.items).try_fold(Sums::default(), |s, (p, q)| Some(s.merge(Sums::of_tensors(p, q)?)))
            }
            (Value::Optional(None), Value::Optional(None)) => Some(Sums::default()),
            (Value::Optional(Some(a)), Value::Optional(Some(b))) => Sums::of_values(a, b),
            _ => None,
        }
    }

    pub(crate) fn merge(self, o: Sums) -> Sums {
        Sums {
            count: self.count + o.count,
            non_finite: self.non_finite + o.non_finite,
            xx: self.xx + o.xx,
            yy: self.yy + o.yy,
            xy: self.xy + o.xy,
            ee: self.ee + o.ee,
            max_abs: self.max_abs.max(o.max_abs),
        }
    }

    fn sqnr_db(&self) -> f64 {
        if self.count == 0 {
            f64::NAN
        } else if self.ee == 0.0 {
            f64::INFINITY
        } else {
            10.0 * (self.xx / self.ee).log10()
        }
    }

    pub(crate) fn metrics(&self) -> Metrics {
        let cosine = match (self.xx == 0.0, self.yy == 0.0) {
            _ if self.count == 0 => f64::NAN,
            (true, true) => 1.0,
            (true, false) | (false, true) => 0.0,
            (false, false) => self.xy / (self.xx * self.yy).sqrt(),
        };
        Metrics {
            count: self.count,
            sqnr_db: self.sqnr_db(),
            mse: if self.count == 0 { f64::NAN } else { self.ee / self.count as f64 },
            cosine,
            max_abs_error: self.max_abs,
            non_finite: self.non_finite,
        }
    }
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}

/// A float value with its counterpart in the quantized model.
struct Pair {
    float: (usize, ValueId),
    quant: (usize, ValueId),
    order: usize,
    template: TensorComparison,
}

/// The graph index of a hook event's path among `paths`.
pub(crate) fn graph_index(paths: &[GraphPath], path: &[(qforge_ir::NodeId, &str)]) -> Option<usize> {
    paths.iter().position(|p| p.len() == path.len() && p.iter().zip(path).all(|(a, b)| a.0 == b.0 && a.1 == b.1))
}

/// A node's identity across the two models: its name, or its first output's name.
fn node_key(g: &Graph, n: &Node) -> String {
    if n.name.is_empty() { n.output(0).map(|v| g.value_name(v)).unwrap_or_default() } else { n.name.clone() }
}

/// The `(node key, attribute)` steps to the graph at `path`.
fn graph_key(main: &Graph, path: &GraphPath) -> Option<Vec<(String, String)>> {
    let mut g = main;
    let mut key = vec![];
    for (id, attr) in path {
        let node = g.node(*id).ok()?;
        key.push((node_key(g, node), attr.clone()));
        g = node.subgraphs().find(|(a, _)| a == attr)?.1;
    }
    Some(key)
}

fn graph_label(key: &[(String, String)]) -> String {
    key.iter().map(|(n, a)| format!("{n}/{a}")).collect::<Vec<_>>().join("/")
}

fn produced_by(g: &Graph, v: ValueId, op: &str) -> bool {
    g.producer(v).and_then(|(n, _)| g.node(n).ok()).is_some_and(|n| n.op_type == op)
}

/// The output of the `DequantizeLinear` reading the `QuantizeLinear` that reads `v`.
fn fake_quantized(g: &Graph, v: ValueId) -> Option<ValueId> {
    let reader_with_op = |v: ValueId, op: &str| -> Option<ValueId> {
        g.consumers(v).iter().filter(|u| u.1 == 0).find_map(|&(n, _)| g.node(n).ok().filter(|n| n.op_type == op).and_then(|n| n.output(0)))
    };
    g.consumers(v).iter().filter(|u| u.1 == 0).find_map(|&(n, _)| {
        let q = g.node(n).ok().filter(|n| n.op_type == "QuantizeLinear")?.output(0)?;
        reader_with_op(q, "DequantizeLinear")
    })
}

/// The quantized model's value to compare a float value named `name` with (see the module
/// documentation).
fn counterpart(gq: &Graph, name: &str) -> Option<ValueId> {
    let runtime_value = |v: ValueId| gq.value(v).is_ok_and(|x| matches!(x.kind(), ValueKind::Input | ValueKind::NodeOutput));
    if let Some(v) = gq.value_by_name(name).filter(|&v| runtime_value(v)) {
        return Some(fake_quantized(gq, v).unwrap_or(v));
    }
    gq.value_by_name(&format!("{name}_DequantizeLinear_Output")).filter(|&d| produced_by(gq, d, "DequantizeLinear"))
}

fn producer_op(g: &Graph, v: ValueId) -> String {
    match g.producer(v).and_then(|(n, _)| g.node(n).ok()) {
        Some(n) => n.qualified_op(),
        None => "input".into(),
    }
}

/// Topological position of every value of every graph: graph inputs, then each node's
/// subgraph values followed by its outputs.
fn value_order(all: &[(GraphPath, &Graph)]) -> Result<HashMap<(usize, ValueId), usize>, String> {
    fn walk(all: &[(GraphPath, &Graph)], gi: usize, order: &mut HashMap<(usize, ValueId), usize>) -> Result<(), String> {
        let (path, g) = &all[gi];
        for &v in g.inputs() {
            let next = order.len();
            order.insert((gi, v), next);
        }
        for id in g.topo_order().map_err(|e| e.to_string())? {
            let node = g.node(id).map_err(|e| e.to_string())?;
            for (attr, _) in node.subgraphs() {
                let sub = all.iter().position(|(p, _)| p.len() == path.len() + 1 && p.starts_with(path) && p[path.len()] == (id, attr.to_string()));
                if let Some(si) = sub {
                    walk(all, si, order)?;
                }
            }
            for &v in node.outputs.iter().flatten() {
                let next = order.len();
                order.insert((gi, v), next);
            }
        }
        Ok(())
    }
    let mut order = HashMap::new();
    walk(all, 0, &mut order)?;
    Ok(order)
}

/// A copy of `model` with `pass` applied to every graph (the main graph first).
fn with_pass(model: &Model, pass: impl Fn(&mut Graph) -> Result<(), String>) -> Result<Model, String> {
    let mut m = model.clone();
    let paths: Vec<GraphPath> = m.graph.graphs().into_iter().map(|(p, _)| p).collect();
    for p in &paths {
        pass(m.graph.graph_at_mut(p).ok_or("a subgraph disappeared while folding")?)?;
    }
    Ok(m)
}

/// The float model as the quantizer sees it: [`crate::pipeline::fuse`] applied.
fn fused(float: &Model) -> Result<Model, String> {
    let mut m = float.clone();
    crate::pipeline::fuse(&mut m)?;
    Ok(m)
}

/// The quantized model with every constant subexpression computed, so each
/// `DequantizeLinear` of an initializer becomes an initializer of the same name.
fn dequantized(quant: &Model) -> Result<Model, String> {
    with_pass(quant, |g| fold_constants(g, &quant.opset_imports, |_| false).map(drop))
}

/// Float values recorded in the float run, per pair, in order of production.
struct Recorder<'a> {
    paths: &'a [GraphPath],
    watch: &'a HashMap<(usize, ValueId), usize>,
    seen: Vec<VecDeque<Tensor>>,
}

impl Hooks for Recorder<'_> {
    fn on_value(&mut self, event: &ValueEvent, value: &Tensor) -> Option<Tensor> {
        let gi = graph_index(self.paths, event.path)?;
        let &pair = self.watch.get(&(gi, event.value))?;
        if is_float(value.dtype()) {
            self.seen[pair].push_back(value.clone());
        }
        None
    }
}

/// Compares each quantized value with the float occurrence recorded for its pairs.
struct Comparer<'a> {
    paths: &'a [GraphPath],
    watch: &'a HashMap<(usize, ValueId), Vec<usize>>,
    seen: Vec<VecDeque<Tensor>>,
    sums: &'a mut [Sums],
    unpaired: &'a mut [u64],
}

impl Hooks for Comparer<'_> {
    fn on_value(&mut self, event: &ValueEvent, value: &Tensor) -> Option<Tensor> {
        let gi = graph_index(self.paths, event.path)?;
        for &pair in self.watch.get(&(gi, event.value))? {
            let float = self.seen[pair].pop_front();
            if float.is_none() && !is_float(value.dtype()) {
                continue;
            }
            match float.and_then(|x| Sums::of_tensors(&x, value)) {
                Some(s) => self.sums[pair] = self.sums[pair].merge(s),
                None => self.unpaired[pair] += 1,
            }
        }
        None
    }
}

impl Comparer<'_> {
    /// Counts float occurrences the quantized run never matched.
    fn finish(self) {
        for (pair, left) in self.seen.iter().enumerate() {
            self.unpaired[pair] += left.len() as u64;
        }
    }
}

/// Pairs every float value of `all_f` with its counterpart in `all_q`; also returns the float
/// values with none.
fn pair_values(all_f: &[(GraphPath, &Graph)], all_q: &[(GraphPath, &Graph)], graph_pairs: &[(usize, usize, String)]) -> Result<(Vec<Pair>, Vec<String>), String> {
    let order = value_order(all_f)?;
    let mut pairs = vec![];
    let mut unmatched = vec![];
    for (fi, qi, label) in graph_pairs {
        let (gf, gq) = (all_f[*fi].1, all_q[*qi].1);
        for (v, val) in gf.values() {
            if !matches!(val.kind(), ValueKind::Input | ValueKind::NodeOutput) {
                continue;
            }
            let Some(q) = counterpart(gq, &val.name) else {
                unmatched.push(if label.is_empty() { val.name.clone() } else { format!("{label}:{}", val.name) });
                continue;
            };
            let template = TensorComparison {
                graph: label.clone(),
                name: val.name.clone(),
                op: producer_op(gf, v),
                compared_with: gq.value_name(q),
                fake_quantized: produced_by(gq, q, "DequantizeLinear"),
                unpaired: 0,
                metrics: Sums::default().metrics(),
                exact: None,
            };
            pairs.push(Pair { float: (*fi, v), quant: (*qi, q), order: order.get(&(*fi, v)).copied().unwrap_or(usize::MAX), template });
        }
    }
    pairs.sort_by_key(|p| p.order);
    Ok((pairs, unmatched))
}

/// The float initializer a dequantized weight stands for: the one at the same input of the
/// same-named reader (`float_nodes`: the float graph's nodes by name), else one named like the
/// quantized data or the output without their suffix.
fn float_weight<'g>(gf: &'g Graph, float_nodes: &HashMap<&str, &Node>, gq: &Graph, dq: &Node, out: ValueId) -> Option<(ValueId, &'g Tensor)> {
    let float_const = |v: ValueId| gf.value(v).ok().filter(|x| x.is_constant()).and_then(|x| x.initializer()).filter(|t| is_float(t.dtype())).map(|t| (v, t));
    let by_reader = gq.consumers(out).iter().filter(|u| u.1 != CAPTURE_USE).find_map(|&(n, i)| {
        let name = gq.node(n).ok()?.name.as_str();
        float_nodes.get(name).filter(|_| !name.is_empty())?.input(i).and_then(float_const)
    });
    let data = dq.input(0).map(|v| gq.value_name(v)).unwrap_or_default();
    let out_name = gq.value_name(out);
    by_reader.or_else(|| {
        [data.strip_suffix("_quantized"), out_name.strip_suffix("_DequantizeLinear_Output")].into_iter().flatten()
            .find_map(|n| gf.value_by_name(n).and_then(float_const))
    })
}

/// The channel axis of a per-axis `DequantizeLinear` over data of `shape`.
fn channel_axis(gq: &Graph, dq: &Node, shape: &[usize]) -> Option<usize> {
    if dq.attr_int("block_size").unwrap_or(0) > 0 {
        return None;
    }
    let scale = gq.value(dq.input(1)?).ok()?.initializer()?;
    if scale.rank() != 1 {
        return None;
    }
    let axis = dq.attr_int("axis").unwrap_or(1);
    let axis = if axis < 0 { axis + shape.len() as i64 } else { axis };
    let axis = usize::try_from(axis).ok().filter(|&a| a < shape.len())?;
    (shape[axis] == scale.len()).then_some(axis)
}

/// Compares every dequantized initializer of the quantized model with its float original.
fn compare_weights(quant: &Model, all_f: &[(GraphPath, &Graph)], all_q: &[(GraphPath, &Graph)], graph_pairs: &[(usize, usize, String)]) -> Result<(Vec<WeightComparison>, Vec<String>), CompareError> {
    let model_error = |reason: String| CompareError::Model { model: "quantized", reason };
    let folded = dequantized(quant).map_err(&model_error)?;
    let all_d = folded.graph.graphs();
    let mut weights = vec![];
    let mut unmatched = vec![];
    for (fi, qi, label) in graph_pairs {
        let (gf, gq) = (all_f[*fi].1, all_q[*qi].1);
        let Some((_, gd)) = all_d.iter().find(|(p, _)| *p == all_q[*qi].0) else { continue };
        let float_nodes: HashMap<&str, &Node> = gf.nodes().map(|(_, n)| (n.name.as_str(), n)).collect();
        for id in gq.topo_order().map_err(|e| model_error(e.to_string()))? {
            let dq = gq.node(id).map_err(|e| model_error(e.to_string()))?;
            let (Some(data), Some(out)) = (dq.input(0), dq.output(0)) else { continue };
            if dq.op_type != "DequantizeLinear" || !gq.value(data).is_ok_and(|v| v.is_constant()) {
                continue;
            }
            let out_name = gq.value_name(out);
            let qualified = if label.is_empty() { out_name.clone() } else { format!("{label}:{out_name}") };
            let Some(y) = gd.value_by_name(&out_name).and_then(|v| gd.value(v).ok()).and_then(|v| v.initializer()) else {
                unmatched.push(format!("{qualified}: not computable from constants"));
                continue;
            };
            let Some((fv, x)) = float_weight(gf, &float_nodes, gq, dq, out) else {
                unmatched.push(format!("{qualified}: no float initializer found"));
                continue;
            };
            if x.shape() != y.shape() {
                unmatched.push(format!("{qualified}: shape {:?}, the float initializer '{}' has {:?}", y.shape(), gf.value_name(fv), x.shape()));
                continue;
            }
            let (Ok(xs), Ok(ys)) = (x.to_f64_vec(), y.to_f64_vec()) else {
                unmatched.push(format!("{qualified}: not a float tensor"));
                continue;
            };
            let axis = channel_axis(gq, dq, x.shape());
            let mut channel_sqnr_db = vec![];
            if let Some(layout) = axis.and_then(|a| AxisLayout::new(x.shape(), Some(a))) {
                let mut per = vec![Sums::default(); layout.channels];
                for o in 0..layout.outer {
                    for (c, s) in per.iter_mut().enumerate() {
                        let start = (o * layout.channels + c) * layout.inner;
                        let range = start..start + layout.inner;
                        *s = s.merge(Sums::serial(&xs[range.clone()], &ys[range]));
                    }
                }
                channel_sqnr_db = per.iter().map(Sums::sqnr_db).collect();
            }
            let mut sorted = channel_sqnr_db.clone();
            sorted.sort_by(f64::total_cmp);
            let median = match sorted.len() {
                0 => None,
                n if n % 2 == 1 => Some(sorted[n / 2]),
                n => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
            };
            let (consumer, op) = gq.consumers(out).iter().filter(|u| u.1 != CAPTURE_USE).find_map(|&(n, _)| gq.node(n).ok().map(|c| (c.display_name(n), c.qualified_op()))).unwrap_or_default();
            weights.push(WeightComparison {
                graph: label.clone(),
                name: gf.value_name(fv),
                compared_with: out_name,
                consumer,
                op,
                axis,
                metrics: Sums::of(&xs, &ys).metrics(),
                min_channel_sqnr_db: sorted.first().copied(),
                median_channel_sqnr_db: median,
                channel_sqnr_db,
            });
        }
    }
    Ok((weights, unmatched))
}

/// Whether any float element of a sample is NaN or infinite.
fn has_non_finite(t: &Tensor) -> bool {
    match t.as_slice::<f32>() {
        Ok(v) => v.iter().any(|x| !x.is_finite()),
        Err(_) => is_float(t.dtype()) && t.to_f64_vec().is_ok_and(|v| v.iter().any(|x| !x.is_finite())),
    }
}

/// Compares `quant` with the `float` model it was quantized from, running both on every
/// sample of `samples` with `threads` worker threads each (0: all cores), as the module
/// documentation describes. `progress(done, total)` is called after each sample. Neither model
/// is modified.
pub fn compare(float: &Model, quant: &Model, samples: &dyn SampleSource, threads: usize, progress: &mut dyn FnMut(usize, usize)) -> Result<Comparison, CompareError> {
    if samples.is_empty() {
        return Err(CompareError::NoSamples);
    }
    let fused = fused(float).map_err(|reason| CompareError::Model { model: "float", reason })?;
    let options = SessionOptions { threads };
    let float_session = Session::with_options(&fused, options.clone()).map_err(|e| CompareError::Model { model: "float", reason: e.to_string() })?;
    let quant_session = Session::with_options(quant, options).map_err(|e| CompareError::Model { model: "quantized", reason: e.to_string() })?;
    let listed = |s: &Session| {
        let mut names: Vec<String> = s.input_names().iter().map(|n| format!("'{n}'")).collect();
        names.sort();
        names.join(", ")
    };
    let (float_inputs, quant_inputs) = (listed(&float_session), listed(&quant_session));
    if float_inputs != quant_inputs {
        return Err(CompareError::InputsDiffer { float: float_inputs, quantized: quant_inputs });
    }

    let all_f = fused.graph.graphs();
    let all_q = quant.graph.graphs();
    let quant_keys: Vec<Option<Vec<(String, String)>>> = all_q.iter().map(|(p, _)| graph_key(&quant.graph, p)).collect();
    let graph_pairs: Vec<(usize, usize, String)> = all_f.iter().enumerate().filter_map(|(fi, (p, _))| {
        let key = graph_key(&fused.graph, p)?;
        let qi = quant_keys.iter().position(|k| k.as_ref() == Some(&key))?;
        Some((fi, qi, graph_label(&key)))
    }).collect();
    let (pairs, unmatched) = pair_values(&all_f, &all_q, &graph_pairs).map_err(|reason| CompareError::Model { model: "float", reason })?;
    let (weights, unmatched_weights) = compare_weights(quant, &all_f, &all_q, &graph_pairs)?;

    let float_outputs: Vec<String> = float_session.output_names().iter().map(|s| s.to_string()).collect();
    let quant_outputs: Vec<String> = quant_session.output_names().iter().map(|s| s.to_string()).collect();
    let output_pairs: Vec<(usize, usize)> = float_outputs.iter().enumerate()
        .filter_map(|(i, name)| quant_outputs.iter().position(|q| q == name).map(|k| (i, k))).collect();
    let node_values = pairs.iter().filter(|p| all_f[p.float.0].1.producer(p.float.1).is_some()).count();
    if node_values == 0 && output_pairs.is_empty() && weights.is_empty() {
        return Err(CompareError::NoMatches);
    }

    let float_paths: Vec<GraphPath> = all_f.iter().map(|(p, _)| p.clone()).collect();
    let quant_paths: Vec<GraphPath> = all_q.iter().map(|(p, _)| p.clone()).collect();
    let float_watch: HashMap<(usize, ValueId), usize> = pairs.iter().enumerate().map(|(i, p)| (p.float, i)).collect();
    let mut quant_watch: HashMap<(usize, ValueId), Vec<usize>> = HashMap::new();
    for (i, p) in pairs.iter().enumerate() {
        quant_watch.entry(p.quant).or_default().push(i);
    }
    let mut sums = vec![Sums::default(); pairs.len()];
    let mut unpaired = vec![0u64; pairs.len()];
    let mut output_sums = vec![Sums::default(); output_pairs.len()];
    let mut output_unpaired = vec![0u64; output_pairs.len()];
    let lowered = quant_session.qdq_lowering().is_some();
    let mut as_run_sums = vec![Sums::default(); output_pairs.len()];
    let mut as_run_unpaired = vec![0u64; output_pairs.len()];
    for i in 0..samples.len() {
        let sample_error = |reason: String| CompareError::Sample { sample: samples.name(i), reason };
        let feed = samples.load(i).map_err(sample_error)?;
        if let Some((name, _)) = feed.iter().find(|(_, t)| has_non_finite(t)) {
            return Err(sample_error(format!("input '{name}' holds NaN or infinite values")));
        }
        let mut recorder = Recorder { paths: &float_paths, watch: &float_watch, seen: vec![VecDeque::new(); pairs.len()] };
        let feed: Vec<(String, Value)> = feed.into_iter().map(|(n, t)| (n, Value::Tensor(t))).collect();
        let float_out = float_session.run_values_with_hooks(feed.clone(), &mut recorder).map_err(|e| sample_error(format!("the float model failed: {e}")))?;
        let mut comparer = Comparer { paths: &quant_paths, watch: &quant_watch, seen: recorder.seen, sums: &mut sums, unpaired: &mut unpaired };
        let as_run = if lowered {
            Some(quant_session.run_values(feed.clone()).map_err(|e| sample_error(format!("the quantized model failed as integer operators: {e}")))?)
        } else {
            None
        };
        let quant_out = quant_session.run_values_with_hooks(feed, &mut comparer).map_err(|e| sample_error(format!("the quantized model failed: {e}")))?;
        comparer.finish();
        let add = |out: &[(String, Value)], sums: &mut [Sums], unpaired: &mut [u64]| {
            for (k, &(fo, qo)) in output_pairs.iter().enumerate() {
                match Sums::of_values(&float_out[fo].1, &out[qo].1) {
                    Some(s) => sums[k] = sums[k].merge(s),
                    None => unpaired[k] += 1,
                }
            }
        };
        add(&quant_out, &mut output_sums, &mut output_unpaired);
        if let Some(out) = &as_run {
            add(out, &mut as_run_sums, &mut as_run_unpaired);
        }
        progress(i + 1, samples.len());
    }

    let activations = pairs.into_iter().zip(sums.iter().zip(&unpaired)).filter(|(_, (s, u))| s.count + s.non_finite + **u > 0)
        .map(|(p, (s, &u))| TensorComparison { unpaired: u, metrics: s.metrics(), ..p.template }).collect();
    let output_table = |sums: &[Sums], unpaired: &[u64]| -> Vec<TensorComparison> {
        output_pairs.iter().zip(sums.iter().zip(unpaired)).map(|(&(fo, _), (s, &u))| output_comparison(all_f[0].1, all_q[0].1, &float_outputs[fo], s, u)).collect()
    };
    let outputs = output_table(&output_sums, &output_unpaired);
    let outputs_as_run = lowered.then(|| output_table(&as_run_sums, &as_run_unpaired));
    Ok(Comparison { samples: samples.len(), activations, outputs, outputs_as_run, weights, unmatched, unmatched_weights })
}

/// A calibration sample kept for the output check ([`check_outputs`]): its feed and the float
/// model's outputs on it, recorded during calibration.
#[derive(Debug, Clone)]
pub struct CheckSample {
    pub name: String,
    pub feed: Vec<(String, Tensor)>,
    pub float: Vec<(String, Value)>,
}

/// The graph outputs of `quant` compared with the float outputs kept in `samples` (matched by
/// name), running `quant` on each sample's feed: the cheap check of a quantization run,
/// without the per-value pairing of [`compare`]. Samples run in parallel unless `threads` is
/// 1; their sums merge in sample order. With `u8_maxima`, the runs also record the u8 channel
/// maxima it watches (of the integer plan's step outputs, [`Session::run_values_observed`]).
pub fn check_outputs(quant: &Model, samples: &[CheckSample], threads: usize, u8_maxima: Option<&mut U8ChannelMaxima>) -> Result<Vec<TensorComparison>, CompareError> {
    let Some(first) = samples.first() else { return Err(CompareError::NoSamples) };
    let session = Session::with_options(quant, SessionOptions { threads }).map_err(|e| CompareError::Model { model: "quantized", reason: e.to_string() })?;
    let names: Vec<String> = session.output_names().iter().map(|s| s.to_string()).collect();
    let pairs: Vec<(usize, usize)> = first.float.iter().enumerate().filter_map(|(i, (name, _))| names.iter().position(|q| q == name).map(|k| (i, k))).collect();
    let empty = u8_maxima.as_deref().map(U8ChannelMaxima::cleared);
    type SampleResult = (Vec<(Option<Sums>, Option<ExactMatch>)>, Option<U8ChannelMaxima>);
    let run = |s: &CheckSample| -> Result<SampleResult, CompareError> {
        let feed: Vec<(String, Value)> = s.feed.iter().map(|(n, t)| (n.clone(), Value::Tensor(t.clone()))).collect();
        let mut seen = empty.clone();
        let q = match &mut seen {
            Some(h) => session.run_values_observed(feed, h),
            None => session.run_values(feed),
        }.map_err(|e| CompareError::Sample { sample: s.name.clone(), reason: format!("the quantized model failed: {e}") })?;
        Ok((pairs.iter().map(|&(fo, qo)| (Sums::of_values(&s.float[fo].1, &q[qo].1), exact_of_values(&s.float[fo].1, &q[qo].1))).collect(), seen))
    };
    let per_sample: Vec<SampleResult> = if threads == 1 {
        samples.iter().map(run).collect::<Result<_, _>>()?
    } else {
        samples.par_iter().with_max_len(1).map(run).collect::<Result<_, _>>()?
    };
    let (per_sample, seen): (Vec<_>, Vec<_>) = per_sample.into_iter().unzip();
    if let Some(all) = u8_maxima {
        for h in seen.iter().flatten() {
            all.merge(h);
        }
    }
    let mut sums = vec![Sums::default(); pairs.len()];
    let mut unpaired = vec![0u64; pairs.len()];
    let mut exact: Vec<Option<ExactMatch>> = vec![None; pairs.len()];
    for sample in per_sample {
        for (k, (s, e)) in sample.into_iter().enumerate() {
            match (s, e) {
                (Some(s), _) => sums[k] = sums[k].merge(s),
                (None, Some(e)) => exact[k] = Some(exact[k].unwrap_or_default().merge(e)),
                (None, None) => unpaired[k] += 1,
            }
        }
    }
    let g = &quant.graph;
    // The op computing an output: its producer, or for a fake-quantized output the producer of
    // what its QuantizeLinear reads.
    let op = |name: &str| -> String {
        let Some(v) = g.value_by_name(name) else { return String::new() };
        let through = |v: ValueId, op: &str| g.producer(v).and_then(|(n, _)| g.node(n).ok()).filter(|n| n.op_type == op).and_then(|n| n.input(0));
        producer_op(g, through(v, "DequantizeLinear").and_then(|q| through(q, "QuantizeLinear")).unwrap_or(v))
    };
    Ok(pairs.iter().zip(sums.iter().zip(&unpaired)).zip(exact).map(|((&(fo, _), (s, &u)), exact)| {
        let name = &first.float[fo].0;
        TensorComparison { op: op(name), exact, ..output_comparison(g, g, name, s, u) }
    }).collect())
}

/// [`ExactMatch::of_tensors`] of two graph output values, sequences item by item.
fn exact_of_values(x: &Value, y: &Value) -> Option<ExactMatch> {
    match (x, y) {
        (Value::Tensor(a), Value::Tensor(b)) => ExactMatch::of_tensors(a, b),
        (Value::Sequence(a), Value::Sequence(b)) if a.items.len() == b.items.len() => {
            a.items.iter().zip(&b.items).try_fold(ExactMatch::default(), |e, (p, q)| Some(e.merge(ExactMatch::of_tensors(p, q)?)))
        }
        (Value::Optional(Some(a)), Value::Optional(Some(b))) => exact_of_values(a, b),
        _ => None,
    }
}

/// The comparison of graph output `name` of the main graphs `float` and `quant`.
fn output_comparison(float: &Graph, quant: &Graph, name: &str, sums: &Sums, unpaired: u64) -> TensorComparison {
    TensorComparison {
        graph: String::new(),
        name: name.to_string(),
        op: float.value_by_name(name).map(|v| producer_op(float, v)).unwrap_or_default(),
        compared_with: name.to_string(),
        fake_quantized: quant.value_by_name(name).is_some_and(|v| produced_by(quant, v, "DequantizeLinear")),
        unpaired,
        metrics: sums.metrics(),
        exact: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_give_the_defined_figures_at_the_edges() {
        let same = Sums::serial(&[1.0f32, -2.0], &[1.0, -2.0]).metrics();
        assert_eq!((same.sqnr_db, same.cosine, same.mse), (f64::INFINITY, 1.0, 0.0));
        let zeros = Sums::serial(&[0.0f32; 3], &[0.0; 3]).metrics();
        assert_eq!((zeros.sqnr_db, zeros.cosine), (f64::INFINITY, 1.0));
        let one_zero = Sums::serial(&[0.0f32, 0.0], &[1.0, 0.0]).metrics();
        assert_eq!((one_zero.sqnr_db, one_zero.cosine), (f64::NEG_INFINITY, 0.0));
        let nan = Sums::serial(&[f32::NAN, 3.0], &[1.0, 4.0]).metrics();
        assert_eq!((nan.count, nan.non_finite, nan.max_abs_error, nan.mse), (1, 1, 1.0, 1.0));
        // x = (3, 4), y = (3, 3): Σx² = 25, Σe² = 1.
        let m = Sums::serial(&[3.0f32, 4.0], &[3.0, 3.0]).metrics();
        assert!((m.sqnr_db - 10.0 * 25f64.log10()).abs() < 1e-12);
        assert!((m.cosine - 21.0 / (25f64 * 18.0).sqrt()).abs() < 1e-12);
    }

    #[test]
    fn chunked_sums_do_not_depend_on_the_split() {
        let x: Vec<f32> = (0..3 * CHUNK + 17).map(|i| (i as f32 * 0.37).sin()).collect();
        let y: Vec<f32> = x.iter().map(|v| (v * 64.0).round() / 64.0).collect();
        let (a, b) = (Sums::of(&x, &y), Sums::serial(&x, &y));
        assert_eq!(a.count, b.count);
        assert!((a.ee - b.ee).abs() <= 1e-9 * b.ee && (a.xx - b.xx).abs() <= 1e-9 * b.xx);
    }
}
