//! Static post-training quantization, end to end:
//! `fuse -> annotate -> prepare -> calibrate -> convert`, over the main graph and every
//! If/Loop subgraph, with a [`Report`] of what was done.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Instant;

use qforge_ir::{Graph, GraphPath, Model, NodeId, Tensor, ValueId};
use qforge_runtime::{Hooks, NodeEvent, Session, SessionOptions, Value, ValueEvent};
use rayon::prelude::*;

use crate::annotation::{Annotations, FloatKind};
use crate::bias_correction::InputMeans;
use crate::pair_sums::{InputMaxima, QuantizedInput, U8ChannelMaxima};
use crate::convert::{convert_graph, group_qparams, narrow_inputs, shared_downstream, ConvertLog, ConvertOptions, NarrowInput, WeightFits};
use crate::passes::{constant_input_defaults, fold_affine, fold_constant_scales, fold_constants, hoist_loop_invariants, localize_captured_weights, matmul_add_to_gemm, uncarry_loop_invariants, upcast_half, Upcast};
use crate::prepare::{qtype_of, resolve, QuantPlan};
use crate::quantizer::Quantizer;
use crate::compare::{check_outputs, CheckSample};
use crate::report::{NodeRecord, OutputCheck, Report, ViolationRecord, WidenedRecord};
use crate::spec::Edge;
use crate::weight_rounding::{InputGrams, WeightRounding};

/// The form of the quantized model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuantFormat {
    /// QuantizeLinear/DequantizeLinear around float ops (the reference form).
    #[default]
    Qdq,
    /// Integer operators (QLinearConv, QLinearMatMul, com.microsoft QLinearAdd, ...) where a
    /// QDQ unit has one; see [`crate::passes::lower_qoperator`].
    QOperator,
}

impl std::str::FromStr for QuantFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "qdq" => Ok(QuantFormat::Qdq),
            "qoperator" => Ok(QuantFormat::QOperator),
            other => Err(format!("format '{other}' is not known; use qdq or qoperator")),
        }
    }
}

/// Lowers a converted QDQ model to integer operators ([`crate::passes::lower_qoperator`], every
/// graph) and records in the report what was lowered, what stays QDQ and why, and the op
/// histogram after.
pub fn lower(m: &mut Model, report: &mut Report) -> Result<(), QuantizeError> {
    let log = crate::passes::lower_qoperator(m).map_err(stage("lower"))?;
    let mut ops = std::collections::BTreeMap::new();
    for (_, g) in m.graph.graphs() {
        for (_, n) in g.nodes() {
            *ops.entry(n.qualified_op()).or_insert(0usize) += 1;
        }
    }
    report.lowering = Some(crate::report::LoweringRecord::new(&log, ops));
    Ok(())
}

/// Calibration samples: each is one complete feed of the model. Shared by calibration
/// workers, so it is `Sync`.
pub trait SampleSource: Sync {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A name for messages (a folder, file or index).
    fn name(&self, i: usize) -> String;
    /// Sample `i` as (input name, tensor) pairs.
    fn load(&self, i: usize) -> Result<Vec<(String, Tensor)>, String>;
}

/// Samples held in memory, in order, each named by its index (`#i`).
impl SampleSource for Vec<Vec<(String, Tensor)>> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    fn name(&self, i: usize) -> String {
        format!("#{i}")
    }
    fn load(&self, i: usize) -> Result<Vec<(String, Tensor)>, String> {
        self.get(i).cloned().ok_or_else(|| format!("no sample #{i}"))
    }
}

/// The first `len` samples of a source.
pub struct FirstSamples<'a> {
    pub source: &'a dyn SampleSource,
    pub len: usize,
}

impl SampleSource for FirstSamples<'_> {
    fn len(&self) -> usize {
        self.len
    }
    fn name(&self, i: usize) -> String {
        self.source.name(i)
    }
    fn load(&self, i: usize) -> Result<Vec<(String, Tensor)>, String> {
        self.source.load(i)
    }
}

impl<'a> FirstSamples<'a> {
    /// The leading samples of `source` that fit a cost budget: at most `max`, taken while the
    /// inputs taken so far hold fewer than `elements` elements (at least one, when `source` has
    /// any). The error is the name of the sample that could not be read, and why.
    pub fn within(source: &'a dyn SampleSource, max: usize, elements: usize) -> Result<FirstSamples<'a>, (String, String)> {
        let (mut taken, mut len) = (0, 0);
        while len < source.len().min(max) && (len == 0 || taken < elements) {
            let feed = source.load(len).map_err(|reason| (source.name(len), reason))?;
            taken += feed.iter().map(|(_, t)| t.len()).sum::<usize>();
            len += 1;
        }
        Ok(FirstSamples { source, len })
    }
}

/// How the pipeline runs.
#[derive(Debug, Clone, Default)]
pub struct QuantizeOptions {
    /// Worker threads for calibration (0: all cores).
    pub threads: usize,
    /// The highest default-domain opset the output may import (`None`: as the Q/DQ need, up
    /// to 21). Below 21, 16- and 4-bit Q/DQ are written in ONNX Runtime's `com.microsoft`
    /// domain; block-wise weights, which only opset 21 expresses, are refused.
    pub max_opset: Option<i64>,
    /// Fail when the target rejects a requested qconfig instead of keeping the node float, or
    /// when an annotation breaks the target's rules (the quantizer's `validate`).
    pub strict: bool,
    /// Correct the bias of every Conv and Gemm for the mean output shift its weight rounding
    /// causes on the calibration data ([`crate::bias_correction`]).
    pub bias_correction: bool,
    /// Choose each symmetric weight slice's scale by least squared error over 80-100 % of its
    /// min/max scale instead of min/max.
    pub weight_search: bool,
    /// How weights are rounded to their grid ([`crate::weight_rounding`]).
    pub weight_rounding: WeightRounding,
    /// Calibration samples, spread over the set, whose float outputs calibration keeps and on
    /// which convert runs the quantized model (`Report::output_check`); 0: no check.
    pub check_samples: usize,
}

/// Errors of the pipeline, each naming the stage and what it concerns.
#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error("the calibration set is empty: give at least one sample")]
    NoSamples,
    #[error("the model is already quantized: it has {ops} (first: node '{first}'). qforge quantizes float models: give it the float original (a quantized model, such as a QAT export or a quantizer's output, runs as it is in ONNX Runtime)")]
    AlreadyQuantized { ops: String, first: String },
    #[error("calibration sample '{sample}': {reason}")]
    Sample { sample: String, reason: String },
    #[error("{stage}: {reason}")]
    Stage { stage: &'static str, reason: String },
    #[error("--strict: {count} node(s) stay in float because the target rejects the requested qconfig; first: {first}")]
    Strict { count: usize, first: String },
    #[error("--strict: {} node(s) break the target's rules:{}", .0.len(), .0.iter().map(|v| format!("\n  {v}")).collect::<String>())]
    Violations(Vec<ViolationRecord>),
}

fn stage<E: std::fmt::Display>(stage: &'static str) -> impl Fn(E) -> QuantizeError {
    move |e| QuantizeError::Stage { stage, reason: e.to_string() }
}

/// What [`fuse`] changed.
#[derive(Debug, Clone, Default)]
pub struct Fused {
    /// BatchNormalization and constant affine nodes folded into weights.
    pub affine_folded: usize,
    /// MatMul + Add pairs rewritten as one Gemm ([`matmul_add_to_gemm`]).
    pub matmul_add_fused: usize,
    /// Loop-carried constants that loops pass on unchanged, now read from the enclosing graph
    /// ([`uncarry_loop_invariants`]).
    pub loop_carried_uncarried: usize,
    /// Loop-invariant nodes moved out of Loop bodies ([`hoist_loop_invariants`]).
    pub loop_invariants_hoisted: usize,
    /// Graph inputs with an initializer now treated as constants ([`constant_input_defaults`]).
    pub constant_inputs: Vec<String>,
    /// How a float16/bfloat16 model was made to compute in float32 ([`upcast_half`]).
    pub upcast: Option<Upcast>,
}

/// The fusion passes, before annotation: `constant_input_defaults` and `upcast_half` (main
/// graph, which also widens its subgraphs), `uncarry_loop_invariants` and
/// `hoist_loop_invariants` (every Loop, at any depth), then on every graph (main graph first)
/// `fold_constants` and `fold_constant_scales`, `localize_captured_weights` (every subgraph,
/// after folding, so weights computed from constants moved out of a loop are constants), then
/// `matmul_add_to_gemm` (which reads the inferred ranks) and `fold_affine`. Tools that compare a
/// quantized model with its float original apply the same passes to the float model, so folded
/// tensors carry the same names.
pub fn fuse(m: &mut Model) -> Result<Fused, String> {
    let constant_inputs = constant_input_defaults(&mut m.graph);
    if !constant_inputs.is_empty() {
        m.graph.check().map_err(|e| format!("constant_input_defaults: {e}"))?;
    }
    let upcast = upcast_half(&mut m.graph, &m.opset_imports).map_err(|e| format!("upcast_half: {e}"))?;
    if upcast.is_some() {
        m.graph.check().map_err(|e| format!("upcast_half: {e}"))?;
    }
    let loop_carried_uncarried = uncarry_loop_invariants(&mut m.graph).map_err(|e| format!("uncarry_loop_invariants: {e}"))?;
    if loop_carried_uncarried > 0 {
        m.graph.check().map_err(|e| format!("uncarry_loop_invariants: {e}"))?;
    }
    let loop_invariants_hoisted = hoist_loop_invariants(&mut m.graph).map_err(|e| format!("hoist_loop_invariants: {e}"))?;
    if loop_invariants_hoisted > 0 {
        m.graph.check().map_err(|e| format!("hoist_loop_invariants: {e}"))?;
    }
    let opsets = m.opset_imports.clone();
    let paths: Vec<_> = m.graph.graphs().into_iter().map(|(p, _)| p).collect();
    for p in &paths {
        let g = m.graph.graph_at_mut(p).ok_or("a subgraph disappeared while fusing")?;
        fold_constants(g, &opsets, |_| false).map_err(|e| format!("fold_constants: {e}"))?;
        fold_constant_scales(g).map_err(|e| format!("fold_constant_scales: {e}"))?;
    }
    if localize_captured_weights(&mut m.graph).map_err(|e| format!("localize_captured_weights: {e}"))? > 0 {
        m.graph.check().map_err(|e| format!("localize_captured_weights: {e}"))?;
    }
    qforge_ir::infer::infer_model(m);
    let (mut folded, mut gemms) = (0, 0);
    let paths: Vec<_> = m.graph.graphs().into_iter().map(|(p, _)| p).collect();
    for p in &paths {
        let g = m.graph.graph_at_mut(p).ok_or("a subgraph disappeared while fusing")?;
        gemms += matmul_add_to_gemm(g).map_err(|e| format!("matmul_add_to_gemm: {e}"))?;
        folded += fold_affine(g).map_err(|e| format!("fold_affine: {e}"))?;
    }
    if gemms > 0 {
        m.graph.check().map_err(|e| format!("matmul_add_to_gemm: {e}"))?;
    }
    Ok(Fused { affine_folded: folded, matmul_add_fused: gemms, loop_carried_uncarried, loop_invariants_hoisted, constant_inputs, upcast })
}

/// Fuses a copy of `model` ([`fuse`]; a model already quantized is refused), annotates it
/// with `quantizer` (validating under `opts.strict`), and calibrates the plan's observers on
/// `samples`; when Concats come out narrow and the quantizer widens them
/// ([`widen_narrow_concats`]), annotates and calibrates once more.
pub fn calibrate(model: &Model, quantizer: &dyn Quantizer, samples: &dyn SampleSource, opts: &QuantizeOptions, progress: &mut dyn FnMut(usize, usize)) -> Result<Calibrated, QuantizeError> {
    if samples.is_empty() {
        return Err(QuantizeError::NoSamples);
    }
    already_quantized(model)?;
    let started = Instant::now();
    let mut m = model.clone();
    let fused = fuse(&mut m).map_err(stage("fuse"))?;
    let paths: Vec<_> = m.graph.graphs().into_iter().map(|(p, _)| p).collect();
    for p in &paths {
        quantizer.transform_for_annotation(m.graph.graph_at_mut(p).expect("path from graphs()"));
    }
    m.graph.check().map_err(stage("fuse"))?;
    qforge_ir::infer::infer_model(&mut m);
    let all = m.graph.graphs();
    let mut annotated: Vec<_> = all.iter().map(|(_, g)| {
        let mut a = quantizer.annotate(g);
        a.keep_non_tensors_float(g);
        a
    }).collect();
    if opts.strict {
        let rejected: Vec<String> = all.iter().zip(&annotated).flat_map(|((_, g), a)| {
            a.float.iter().filter(|f| f.kind == FloatKind::ConfigRejected).map(|f| format!("{}: {}", g.node(f.node).map(|n| n.display_name(f.node)).unwrap_or_default(), f.reason)).collect::<Vec<_>>()
        }).collect();
        if let Some(first) = rejected.first() {
            return Err(QuantizeError::Strict { count: rejected.len(), first: first.clone() });
        }
    }
    let graph_names: Vec<String> = all.iter().map(|(_, g)| g.name.clone()).collect();
    let violations = |annotated: &[Annotations]| -> Vec<ViolationRecord> {
        all.iter().zip(annotated).zip(&graph_names).flat_map(|(((_, g), a), gname)| quantizer.validate(g, a).into_iter().map(|v| ViolationRecord::new(gname, g, v))).collect()
    };
    let mut report = Report { samples: samples.len(), affine_folded: fused.affine_folded, matmul_add_fused: fused.matmul_add_fused, loop_carried_uncarried: fused.loop_carried_uncarried, loop_invariants_hoisted: fused.loop_invariants_hoisted, constant_inputs: fused.constant_inputs, upcast: fused.upcast, violations: violations(&annotated), ..Default::default() };
    if opts.strict && !report.violations.is_empty() {
        return Err(QuantizeError::Violations(report.violations));
    }
    // Prepare and calibrate; again with wider activations where a Concat's input is narrow.
    let session = Session::with_options(&m, SessionOptions { threads: opts.threads }).map_err(stage("calibration session"))?;
    let calib_started = Instant::now();
    let checked = spread(samples.len(), opts.check_samples);
    let mut calibrate_plan = |annotated: &[Annotations]| -> Result<(QuantPlan, InputStats, Vec<CheckSample>), QuantizeError> {
        let mut plan = QuantPlan::new(&m.graph, annotated.to_vec(), m.opset("").unwrap_or(1));
        let mut stats = InputStats::for_plan(&m, &plan, samples.len(), opts);
        let kept = calibrate_samples(&session, &m, &mut plan, &mut stats, samples, opts.threads, &checked, progress)?;
        plan.derive_observations();
        plan.settle_floors(&m.graph);
        Ok((plan, stats, kept))
    };
    let (mut plan, mut stats, mut check) = calibrate_plan(&annotated)?;
    if let Some((wider, records)) = widen_narrow_concats(&all, &graph_names, &plan, quantizer) {
        (plan, stats, check) = calibrate_plan(&wider)?;
        annotated = wider;
        report.widened = records;
        report.violations = violations(&annotated);
        if opts.strict && !report.violations.is_empty() {
            return Err(QuantizeError::Violations(report.violations));
        }
    }
    report.calibration_seconds = calib_started.elapsed().as_secs_f64();
    for (((_, g), a), gname) in all.iter().zip(&annotated).zip(&graph_names) {
        let record = |n: NodeId| (g.node(n).map(|x| x.display_name(n)).unwrap_or_default(), g.node(n).map(|x| x.qualified_op()).unwrap_or_default());
        for (&n, ann) in &a.nodes {
            let (name, op) = record(n);
            report.nodes.push(NodeRecord { graph: gname.clone(), name, op, quantized: true, rule: Some(ann.rule.clone()), kind: None, reason: None });
        }
        for f in &a.float {
            let (name, op) = record(f.node);
            report.nodes.push(NodeRecord { graph: gname.clone(), name, op, quantized: false, rule: None, kind: Some(f.kind), reason: Some(f.reason.clone()) });
        }
    }
    let convert = ConvertOptions { contrib: opts.max_opset.is_some_and(|v| v < 21), weight_search: opts.weight_search, typed_outputs: quantizer.typed_outputs() };
    Ok(Calibrated { model: m, plan, stats, report, graph_names, started, max_opset: opts.max_opset, convert, check, threads: opts.threads })
}

/// `k` sample indices spread evenly over `n` samples (`⌊i·n/k⌋`), all of them when `k >= n`.
pub fn spread(n: usize, k: usize) -> Vec<usize> {
    let k = k.min(n);
    (0..k).map(|i| i * n / k).collect()
}

/// Annotations that give wider activations to the Concats whose inputs the calibrated `plan`
/// leaves with fewer than [`crate::convert::FEW_LEVELS`] levels of the output's qparams
/// ([`narrow_inputs`]) and, for each Concat the quantizer widens, to the nodes that carry its
/// output on with its qparams ([`shared_downstream`]); with a record per node widened. `None`
/// when no Concat is narrow or the quantizer widens none of them
/// ([`Quantizer::annotate_wider`]).
fn widen_narrow_concats(all: &[(GraphPath, &Graph)], graph_names: &[String], plan: &QuantPlan, quantizer: &dyn Quantizer) -> Option<(Vec<Annotations>, Vec<WidenedRecord>)> {
    let mut records = vec![];
    let wider: Vec<Annotations> = all.iter().enumerate().map(|(gi, (_, g))| {
        let before = &plan.graphs[gi].annotations;
        let qparams = |v, qt| plan.graphs[gi].points.get(&(v, qt)).and_then(|&gid| group_qparams(&plan.groups[gid]).ok());
        let mut narrow: BTreeMap<NodeId, NarrowInput> = BTreeMap::new();
        for x in narrow_inputs(g, plan, gi, &qparams) {
            narrow.entry(x.node).or_insert(x);
        }
        let output_type = |a: &Annotations, n| resolve(a, Edge::Output { node: n, index: 0 }, 0).and_then(qtype_of);
        let changed = |after: &Annotations, n| output_type(before, n).zip(output_type(after, n)).filter(|(from, to)| from != to);
        let Some(roots) = (!narrow.is_empty()).then(|| quantizer.annotate_wider(g, &narrow.keys().copied().collect())).flatten() else { return before.clone() };
        // Each node to widen, with the narrow input that asks for it.
        let mut cause: BTreeMap<NodeId, &NarrowInput> = BTreeMap::new();
        for (&concat, x) in narrow.iter().filter(|(&n, _)| changed(&roots, n).is_some()) {
            for n in shared_downstream(g, plan, gi, concat) {
                cause.entry(n).or_insert(x);
            }
        }
        let Some(mut after) = (!cause.is_empty()).then(|| quantizer.annotate_wider(g, &cause.keys().copied().collect())).flatten() else { return before.clone() };
        after.keep_non_tensors_float(g);
        let name = |n: NodeId| g.node(n).map(|x| x.display_name(n)).unwrap_or_default();
        for (&n, x) in &cause {
            let Some((from, to)) = changed(&after, n) else { continue };
            records.push(WidenedRecord {
                graph: graph_names[gi].clone(),
                node: name(n),
                op: g.node(n).map(|x| x.op_type.clone()).unwrap_or_default(),
                from,
                to,
                concat: name(x.node),
                value: g.value_name(x.value).to_string(),
                levels: x.levels,
            });
        }
        after
    }).collect();
    (!records.is_empty()).then_some((wider, records))
}

/// Whether an op works on quantized data: Q/DQ, integer kernels (QLinear*, *Integer, QGemm,
/// ...), dynamic quantization, weight-only quantized MatMul/Gather.
fn is_quantized_op(op: &str) -> bool {
    matches!(op, "QuantizeLinear" | "DequantizeLinear" | "QGemm" | "QAttention" | "MatMulNBits" | "GatherBlockQuantized" | "MatMulIntegerToFloat" | "DynamicQuantizeMatMul")
        || op.starts_with("QLinear")
        || op.starts_with("DynamicQuantize")
        || op.ends_with("Integer")
}

/// [`QuantizeError::AlreadyQuantized`] when a graph of `model` has quantized ops
/// ([`is_quantized_op`]): quantizing again would stack a second set of Q/DQ on the first.
fn already_quantized(model: &Model) -> Result<(), QuantizeError> {
    let mut ops: BTreeMap<&str, usize> = BTreeMap::new();
    let mut first = None;
    for (_, g) in model.graph.graphs() {
        for (id, n) in g.nodes().filter(|(_, n)| is_quantized_op(&n.op_type)) {
            *ops.entry(n.op_type.as_str()).or_default() += 1;
            first.get_or_insert_with(|| n.display_name(id));
        }
    }
    match first {
        None => Ok(()),
        Some(first) => Err(QuantizeError::AlreadyQuantized { ops: ops.iter().map(|(op, n)| format!("{n} {op}")).collect::<Vec<_>>().join(", "), first }),
    }
}

/// Samples in flight at once during calibration. Two runs share the session's thread pool,
/// which keeps both cores busy through the parts of a run that do not parallelize (small ops,
/// loading the next sample) at the cost of a second set of activations in memory.
const CALIBRATION_WORKERS: usize = 2;

/// Streams every sample through `session` into the plan's observers. With several workers
/// ([`CALIBRATION_WORKERS`] when the observers merge exactly and `threads` is not 1), each
/// worker calibrates its own copy of the plan on the samples it takes, and the copies are
/// merged in worker order; merges are exact, so the result equals one sequential pass. The
/// error reported is that of the first failing sample.
/// `stats` collects the input statistics of weight quantization in the same runs. Returns the
/// samples `keep` names with the float outputs of their runs, in sample order.
fn calibrate_samples(session: &Session, model: &Model, plan: &mut QuantPlan, stats: &mut InputStats, samples: &dyn SampleSource, threads: usize, keep: &[usize], progress: &mut dyn FnMut(usize, usize)) -> Result<Vec<CheckSample>, QuantizeError> {
    let n = samples.len();
    let watched: HashSet<ValueId> = plan.main_graph_values().chain(stats.main_graph_values()).collect();
    let watch = session.watching(model, &watched);
    let workers = if plan.mergeable() && threads != 1 { CALIBRATION_WORKERS.min(n) } else { 1 };
    let kept: std::sync::Mutex<Vec<(usize, CheckSample)>> = std::sync::Mutex::new(vec![]);
    let run_one = |plan: &mut QuantPlan, stats: &mut InputStats, i: usize| -> Result<(), QuantizeError> {
        let feed = samples.load(i).map_err(|reason| QuantizeError::Sample { sample: samples.name(i), reason })?;
        let mut hooks = WithInputStats { inner: plan.calibrator(), stats };
        let kept_feed = keep.contains(&i).then(|| feed.clone());
        let feed = feed.into_iter().map(|(name, t)| (name, Value::Tensor(t))).collect();
        let float = session.run_values_watching(&watch, feed, &mut hooks).map_err(|e| QuantizeError::Sample { sample: samples.name(i), reason: e.to_string() })?;
        if let Some(feed) = kept_feed {
            kept.lock().expect("no worker panics holding it").push((i, CheckSample { name: samples.name(i), feed, float }));
        }
        Ok(())
    };
    let kept_in_order = |kept: std::sync::Mutex<Vec<(usize, CheckSample)>>| {
        let mut kept = kept.into_inner().expect("no worker panics holding it");
        kept.sort_by_key(|(i, _)| *i);
        kept.into_iter().map(|(_, s)| s).collect()
    };
    if workers <= 1 {
        for i in 0..n {
            run_one(plan, stats, i)?;
            progress(i + 1, n);
        }
        return Ok(kept_in_order(kept));
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let (finished, finished_rx) = std::sync::mpsc::channel::<()>();
    // Per worker: its plan and statistics, and the first sample it failed on.
    type Outcome = (QuantPlan, InputStats, Option<(usize, QuantizeError)>);
    let mut results: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers).map(|_| {
            let mut local = plan.clone();
            let mut local_stats = stats.clone();
            let (next, run_one, finished) = (&next, &run_one, finished.clone());
            s.spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= n {
                    return (local, local_stats, None);
                }
                if let Err(e) = run_one(&mut local, &mut local_stats, i) {
                    next.store(n, std::sync::atomic::Ordering::Relaxed);
                    return (local, local_stats, Some((i, e)));
                }
                let _ = finished.send(());
            })
        }).collect();
        drop(finished);
        // Progress is reported on the calling thread as samples finish.
        for (count, ()) in finished_rx.iter().enumerate() {
            progress(count + 1, n);
        }
        handles.into_iter().map(|h| h.join().expect("calibration worker")).collect()
    });
    if let Some((_, e)) = results.iter_mut().filter_map(|(_, _, e)| e.take()).min_by_key(|(i, _)| *i) {
        return Err(e);
    }
    for (local, local_stats, _) in &results {
        plan.merge_observations(local).map_err(stage("calibrate"))?;
        stats.merge(local_stats);
    }
    Ok(kept_in_order(kept))
}

/// The input statistics that weight quantization asked for, collected during calibration.
#[derive(Debug, Clone, Default)]
pub struct InputStats {
    /// The input means of bias correction ([`crate::bias_correction`]).
    pub means: Option<InputMeans>,
    /// The input second moments of GPTQ rounding ([`crate::weight_rounding`]).
    pub grams: Option<InputGrams>,
    /// The per-channel input maxima of weights fitted to pair sums ([`crate::pair_sums`]).
    pub maxima: Option<InputMaxima>,
}

impl InputStats {
    /// The values of the main graph whose statistics are collected.
    fn main_graph_values(&self) -> impl Iterator<Item = ValueId> + '_ {
        let means = self.means.iter().flat_map(|m| m.main_graph_values());
        let maxima = self.maxima.iter().flat_map(|m| m.main_graph_values());
        means.chain(self.grams.iter().flat_map(|g| g.main_graph_values())).chain(maxima)
    }

    /// Empty statistics of what `opts` asks weight quantization to use, for the nodes of `plan`
    /// in the fused model `m`, calibrated on `samples` samples.
    fn for_plan(m: &Model, plan: &QuantPlan, samples: usize, opts: &QuantizeOptions) -> InputStats {
        InputStats {
            means: opts.bias_correction.then(|| InputMeans::new(&m.graph, plan)),
            grams: (opts.weight_rounding != WeightRounding::Nearest).then(|| InputGrams::new(&m.graph, plan, samples, opts.weight_rounding)).filter(|g| opts.weight_rounding == WeightRounding::Gptq || !g.is_empty() || !g.skipped.is_empty()),
            maxima: Some(InputMaxima::new(&m.graph, plan)).filter(|m| !m.is_empty()),
        }
    }

    /// Adds the statistics of `other`, collected on other samples from a clone of the same
    /// empty state. Exact, so the order of merges does not matter.
    fn merge(&mut self, other: &InputStats) {
        if let (Some(m), Some(o)) = (&mut self.means, &other.means) {
            m.merge(o);
        }
        if let (Some(g), Some(o)) = (&mut self.grams, &other.grams) {
            g.merge(o);
        }
        if let (Some(m), Some(o)) = (&mut self.maxima, &other.maxima) {
            m.merge(o);
        }
    }
}

/// Hooks that feed another hook set (calibration observers) and the input statistics.
struct WithInputStats<'a, H: Hooks> {
    inner: H,
    stats: &'a mut InputStats,
}

impl<H: Hooks> Hooks for WithInputStats<'_, H> {
    fn on_value(&mut self, event: &ValueEvent, value: &Tensor) -> Option<Tensor> {
        let replaced = self.inner.on_value(event, value);
        let seen = replaced.as_ref().unwrap_or(value);
        if let Some(m) = &mut self.stats.means {
            m.observe(event, seen);
        }
        if let Some(g) = &mut self.stats.grams {
            g.observe(event, seen);
        }
        if let Some(m) = &mut self.stats.maxima {
            m.observe(event, seen);
        }
        replaced
    }

    fn supply(&mut self, event: &NodeEvent) -> Option<Vec<Option<Tensor>>> {
        self.inner.supply(event)
    }
}

/// A model fused, annotated and calibrated, ready to convert: the fused float model (shape
/// inference applied), the plan with its calibrated observers, and the report so far.
#[derive(Clone)]
pub struct Calibrated {
    pub model: Model,
    pub plan: QuantPlan,
    /// The input statistics weight quantization asked for.
    pub stats: InputStats,
    pub report: Report,
    graph_names: Vec<String>,
    started: Instant,
    max_opset: Option<i64>,
    convert: ConvertOptions,
    /// The samples of the output check, with the float model's outputs.
    check: Vec<CheckSample>,
    threads: usize,
}

impl Calibrated {
    /// The calibration samples convert's output check runs on (`check_samples` of them,
    /// spread over the set), with the float model's outputs.
    pub fn check_samples(&self) -> &[CheckSample] {
        &self.check
    }
}

/// Quantizes `model` (left untouched) with `quantizer`, calibrating on `samples`:
/// [`calibrate`] then [`convert`]. `progress(done, total)` is called after each calibration
/// sample.
pub fn quantize(model: &Model, quantizer: &dyn Quantizer, samples: &dyn SampleSource, opts: &QuantizeOptions, progress: &mut dyn FnMut(usize, usize)) -> Result<(Model, Report), QuantizeError> {
    convert(calibrate(model, quantizer, samples, opts, progress)?)
}

/// Inserts Q/DQ with the calibrated qparams in every graph (innermost first, so a parent's
/// patch sees its final subgraphs), raises the opset as the new nodes need, and completes the
/// report.
pub fn convert(c: Calibrated) -> Result<(Model, Report), QuantizeError> {
    convert_logged(c).map(|(m, report, _)| (m, report))
}

/// How many times [`convert_logged`] converts again for activations that go beyond their reach
/// in the quantized model.
pub const MAX_REACH_REFITS: usize = 3;

/// [`convert`], also returning what convert did in each graph of the plan
/// (`logs[i]` for `plan.graphs[i]`, value ids of the converted graph at its path).
///
/// Weights fitted to a target's pair sums ([`crate::pair_sums`]) are fitted to the reach of the
/// float model's activations, but the integers the kernels multiply are the quantized model's,
/// which upstream rounding can push further (a channel gated by a quantized squeeze-excitation
/// branch, say). So the output check, which runs the converted model's integer plan on its
/// samples, also records those activations' channel maxima; where a channel went beyond its
/// reach ([`InputMaxima::beyond_reach`]), its maximum is raised to what the quantized model
/// gave, and the model is converted and checked again, at most [`MAX_REACH_REFITS`] times,
/// refitting only the weights whose reach rose ([`WeightFits`]). `report.pair_sum_reach_raised`
/// counts the channels raised, `pair_sum_reach_exceeded` those still beyond after the last
/// refit. Readers inside If/Loop bodies keep the float model's reach.
pub fn convert_logged(c: Calibrated) -> Result<(Model, Report, Vec<ConvertLog>), QuantizeError> {
    let Calibrated { model, plan, mut stats, report, graph_names, started, max_opset, convert, check, threads } = c;
    // Range searches (entropy, MSE, ...) are independent per group.
    let params: Vec<_> = plan.groups.par_iter().map(group_qparams).collect();
    let opset_before = model.opset("").unwrap_or(1);
    let fits = WeightFits::default();
    let convert_all = |stats: &InputStats, mut report: Report| -> Result<(Model, Report, Vec<ConvertLog>), QuantizeError> {
        let mut m = model.clone();
        let mut need = opset_before;
        let mut logs = vec![ConvertLog::default(); plan.graphs.len()];
        for gi in (0..plan.graphs.len()).rev() {
            let g = m.graph.graph_at_mut(&plan.graphs[gi].path).expect("planned path");
            let log = convert_graph(g, &plan, gi, &params, stats, convert, &fits).map_err(stage("convert"))?;
            g.remove_dead_nodes();
            need = need.max(log.min_opset);
            report.add_log(&graph_names[gi], &plan, &log);
            logs[gi] = log;
        }
        m.graph.check().map_err(stage("convert"))?;
        if let Some(max) = max_opset.filter(|&max| need > max) {
            return Err(QuantizeError::Stage { stage: "convert", reason: format!("the quantized model needs opset {need}, above --max-opset {max} (the input imports {opset_before}; block-wise weights need 21)") });
        }
        if logs.iter().any(|l| l.contrib) && m.opset(qforge_ir::MS_DOMAIN).is_none() {
            m.opset_imports.push(qforge_ir::OpsetImport { domain: qforge_ir::MS_DOMAIN.into(), version: 1 });
        }
        if need > opset_before {
            crate::passes::upgrade_opset(&mut m, need).map_err(stage("upgrade_opset"))?;
        }
        Ok((m, report, logs))
    };
    // The output check, measuring with it what the activations of pair-fitted weights reach.
    let check_converted = |m: &Model, maxima: Option<&InputMaxima>| -> Result<(Option<OutputCheck>, Vec<(QuantizedInput, Vec<u8>)>), QuantizeError> {
        if check.is_empty() {
            return Ok((None, vec![]));
        }
        let inputs = maxima.map(|x| x.quantized_inputs(&m.graph)).unwrap_or_default();
        let mut reach = (!inputs.is_empty()).then(|| U8ChannelMaxima::new(inputs.iter().map(|i| (i.value.clone(), i.axis))));
        let started = Instant::now();
        let outputs = check_outputs(m, &check, threads, reach.as_mut()).map_err(stage("output check"))?;
        let seen = inputs.into_iter().filter_map(|i| {
            let u = reach.as_ref()?.get(&i.value, i.axis)?.to_vec();
            Some((i, u))
        }).collect();
        Ok((Some(OutputCheck { samples: check.len(), outputs, seconds: started.elapsed().as_secs_f64() }), seen))
    };
    let (mut m, mut converted, mut logs) = convert_all(&stats, report.clone())?;
    let (mut output_check, mut seen) = check_converted(&m, stats.maxima.as_ref())?;
    let mut check_seconds = output_check.as_ref().map_or(0.0, |c| c.seconds);
    let mut raised: BTreeSet<(NodeId, usize)> = BTreeSet::new();
    let mut beyond = 0;
    for refit in 0..=MAX_REACH_REFITS {
        let Some(maxima) = stats.maxima.as_mut() else { break };
        let over: Vec<_> = seen.iter().map(|(i, u)| (i, u, maxima.beyond_reach(i, u))).filter(|(_, _, c)| !c.is_empty()).collect();
        beyond = over.iter().map(|(_, _, c)| c.len()).sum();
        if beyond == 0 || refit == MAX_REACH_REFITS {
            break;
        }
        for (i, u, channels) in over {
            maxima.raise(i, u, &channels);
            raised.extend(channels.iter().map(|&c| (i.node, c)));
        }
        (m, converted, logs) = convert_all(&stats, report.clone())?;
        (output_check, seen) = check_converted(&m, stats.maxima.as_ref())?;
        check_seconds += output_check.as_ref().map_or(0.0, |c| c.seconds);
    }
    let mut report = converted;
    report.pair_sum_reach_raised = raised.len();
    report.pair_sum_reach_exceeded = beyond;
    report.output_check = output_check.map(|c| OutputCheck { seconds: check_seconds, ..c });
    report.bias_correction_enabled = stats.means.is_some();
    report.gptq_enabled = stats.grams.is_some();
    report.weight_range_search = convert.weight_search;
    report.opset = (opset_before, m.opset("").unwrap_or(opset_before));
    report.total_seconds = started.elapsed().as_secs_f64() - check_seconds;
    Ok((m, report, logs))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Samples of one input with `sizes[i]` elements.
    fn samples(sizes: &[usize]) -> Vec<Vec<(String, Tensor)>> {
        sizes.iter().map(|&n| vec![("x".to_string(), Tensor::from_vec(&[n], vec![0f32; n]).unwrap())]).collect()
    }

    #[test]
    fn leading_samples_stop_once_the_element_budget_is_reached() {
        let take = |sizes: &[usize], max, budget| FirstSamples::within(&samples(sizes), max, budget).unwrap().len;
        assert_eq!(take(&[10, 10, 10, 10], 8, 25), 3, "10 + 10 < 25, so a third sample is taken");
        assert_eq!(take(&[10, 10, 10, 10], 8, 20), 2);
        assert_eq!(take(&[100, 1], 8, 20), 1, "one sample is always taken");
        assert_eq!(take(&[1; 20], 8, 1000), 8, "at most `max`");
        assert_eq!(take(&[], 8, 1000), 0);
    }
}
