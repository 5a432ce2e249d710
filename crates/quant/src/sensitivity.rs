//! Sensitivity analysis and the accuracy budget.
//!
//! A *unit* is what one decision quantizes or keeps in float: an observation group
//! ([`crate::prepare::Group`], one set of qparams) or a quantized constant input (a weight; the
//! bias derived from it follows it). The model is calibrated and converted once. Trials run the
//! QDQ model in a [`Session`] planned without constant folding ([`Folding::Off`]), with hooks
//! that switch units off: a switched-off unit's `DequantizeLinear` is supplied its float
//! original (the input of its `QuantizeLinear`, or the float constant) and that
//! `QuantizeLinear` is skipped. A `DequantizeLinear` owned by several units (a bias: its input's
//! group and its weight) is quantized only while all of them are, as convert would emit it.
//! No model is re-exported per trial.
//!
//! Per sample, two runs are kept: every unit off (the float model) and every unit on. Each trial
//! recomputes only the nodes downstream of its unit ([`Session::run_from`]), as many trials at
//! once as the session has threads:
//! * *only this unit quantized*: from the float run, with the unit on;
//! * *only this unit float*: from the quantized run, with the unit off.
//!
//! Every graph output is compared with the float run's over all samples, with the figures of
//! [`crate::compare`] (SQNR, cosine, MSE, max error).
//!
//! The accuracy budget ([`quantize_within_budget`]) ranks the units this way, then searches
//! the shortest prefix of the ranking whose return to float meets the budget (bisection), and
//! walks that prefix back, least sensitive first, quantizing again every unit the budget can
//! do without ([`return_to_float`]). Returning a unit to float removes its edges from the
//! annotations, so convert inserts no Q/DQ for it.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use qforge_ir::{Graph, Model, NodeId, Tensor, ValueId};
use qforge_runtime::{Folding, Hooks, NodeEvent, RunValues, Session, SessionOptions, ValueEvent};
use serde::Serialize;

use crate::annotation::FloatKind;
use crate::compare::{db, db_option, graph_index, Metrics, Sums};
use crate::convert::{ConvertLog, Dequantized, MATMUL_NBITS_OPS};
use crate::pipeline::{calibrate, convert, convert_logged, Calibrated, QuantizeError, QuantizeOptions, SampleSource};
use crate::prepare::{defining_value, edge_value, qtype_of, resolve};
use qforge_ir::GraphPath;
use crate::quantizer::Quantizer;
use crate::report::Report;
use crate::spec::{Edge, Spec};

/// Errors of a sensitivity analysis or a budgeted quantization.
#[derive(Debug, thiserror::Error)]
pub enum SensitivityError {
    #[error(transparent)]
    Quantize(#[from] QuantizeError),
    #[error("the QDQ model: {0}")]
    Model(String),
    #[error("sample '{sample}': {reason}")]
    Sample { sample: String, reason: String },
    #[error("nothing to analyze: the model has no quantized activation or constant")]
    NothingQuantized,
}

/// What a decision quantizes or keeps in float.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Unit {
    /// Observation group `group` of the plan.
    Activation { group: usize },
    /// The quantized constant read by input `input` of `node` in plan graph `graph`.
    Constant { graph: usize, node: NodeId, input: usize },
}

/// A unit as reported.
#[derive(Debug, Clone, Serialize)]
pub struct UnitRecord {
    /// The unit's index in the analysis (stable for one model, quantizer and calibration).
    pub id: usize,
    /// `activation` (an observation group) or `constant` (a quantized constant input such as a
    /// weight, with the bias derived from it).
    pub kind: &'static str,
    /// The observation group, for an activation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<usize>,
    /// The float values it quantizes (`graph:value` inside subgraphs).
    pub values: Vec<String>,
    /// The nodes whose quantized edges it holds (`graph:node` inside subgraphs).
    pub nodes: Vec<String>,
    /// Their op types, in the same order.
    pub ops: Vec<String>,
}

/// One graph output of a trial compared with the float model's, over all samples.
#[derive(Debug, Clone, Serialize)]
pub struct OutputError {
    pub output: String,
    #[serde(flatten)]
    pub metrics: Metrics,
}

/// The lowest SQNR over the outputs (NaN when none was compared).
fn lowest_sqnr(outputs: &[OutputError]) -> f64 {
    outputs.iter().map(|o| o.metrics.sqnr_db).filter(|x| !x.is_nan()).min_by(f64::total_cmp).unwrap_or(f64::NAN)
}

/// The lowest cosine over the outputs (NaN when none was compared).
fn lowest_cosine(outputs: &[OutputError]) -> f64 {
    outputs.iter().map(|o| o.metrics.cosine).filter(|x| !x.is_nan()).min_by(f64::total_cmp).unwrap_or(f64::NAN)
}

/// How the outputs react to one unit.
#[derive(Debug, Clone, Serialize)]
pub struct UnitSensitivity {
    #[serde(flatten)]
    pub unit: UnitRecord,
    /// The lowest output SQNR when only this unit is quantized.
    #[serde(serialize_with = "db")]
    pub only_quantized_sqnr_db: f64,
    /// The lowest output cosine when only this unit is quantized.
    pub only_quantized_cosine: f64,
    /// The lowest output SQNR when only this unit is float (every other unit quantized).
    #[serde(serialize_with = "db")]
    pub only_float_sqnr_db: f64,
    /// The lowest output cosine when only this unit is float.
    pub only_float_cosine: f64,
    /// Every output, only this unit quantized.
    pub only_quantized: Vec<OutputError>,
    /// Every output, only this unit float.
    pub only_float: Vec<OutputError>,
}

/// What a sensitivity analysis found.
#[derive(Debug, Clone, Serialize)]
pub struct Sensitivity {
    pub samples: usize,
    /// Every unit quantized (the converted model) against the float model.
    pub all_quantized: Vec<OutputError>,
    /// The lowest output SQNR with every unit quantized.
    #[serde(serialize_with = "db")]
    pub all_quantized_sqnr_db: f64,
    /// The converted model as it deploys, its QDQ units run as integer operators that round
    /// as ONNX Runtime's kernels do, against the float model (`None` when nothing lowers).
    /// The figures above and the ranking come from the QDQ graph's float arithmetic, which
    /// rounds a few values differently.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub all_quantized_as_deployed: Option<Vec<OutputError>>,
    #[serde(serialize_with = "db_option", skip_serializing_if = "Option::is_none")]
    pub all_quantized_as_deployed_sqnr_db: Option<f64>,
    /// The units, most sensitive first: lowest "only quantized" SQNR, ties broken by the
    /// highest "only float" SQNR.
    pub ranking: Vec<UnitSensitivity>,
    /// Units the converted model has no Q/DQ for, with the reason.
    pub not_measured: Vec<String>,
    pub seconds: f64,
}

/// Where a switched-off `DequantizeLinear` takes its float value from.
enum FloatSource {
    /// A value of the QDQ model: `(graph index, value)` where it is defined.
    Value((usize, ValueId)),
    Constant(Tensor),
}

/// One inserted `DequantizeLinear`: the units that own it and its float original.
struct Switch {
    owners: Vec<usize>,
    source: FloatSource,
}

/// The QDQ model planned for trials, with every unit's switches.
struct Switchboard {
    session: Session,
    paths: Vec<GraphPath>,
    /// `DequantizeLinear` nodes by `(graph index, node)`.
    switches: HashMap<(usize, NodeId), Switch>,
    /// `QuantizeLinear` nodes read only by a switch, to that switch.
    quantizers: HashMap<(usize, NodeId), (usize, NodeId)>,
    /// Float sources to record as they are produced.
    sources: HashSet<(usize, ValueId)>,
    /// Per unit, the main-graph nodes to recompute when it changes (empty: no Q/DQ).
    dirty: Vec<Vec<NodeId>>,
    /// The main-graph `DequantizeLinear` outputs a kept run drops: a trial that reads one
    /// dequantizes its kept input again (or takes the switch's float source), which costs
    /// little next to holding a float copy of every quantized activation.
    dropped: HashSet<ValueId>,
}

/// Trial hooks: switches off the units marked in `off`.
struct Trial<'a> {
    board: &'a Switchboard,
    off: &'a [bool],
    base: Option<&'a RunValues>,
    seen: HashMap<(usize, ValueId), Tensor>,
    missing: Option<String>,
}

impl<'a> Trial<'a> {
    fn new(board: &'a Switchboard, off: &'a [bool], base: Option<&'a RunValues>) -> Trial<'a> {
        Trial { board, off, base, seen: HashMap::new(), missing: None }
    }

    fn is_off(&self, key: &(usize, NodeId)) -> bool {
        self.board.switches.get(key).is_some_and(|s| s.owners.iter().any(|&u| self.off[u]))
    }

    fn float_value(&mut self, source: &FloatSource) -> Option<Tensor> {
        match source {
            FloatSource::Constant(t) => Some(t.clone()),
            FloatSource::Value(key) => {
                let found = self.seen.get(key).cloned().or_else(|| if key.0 == 0 { self.base.and_then(|b| b.get(key.1)).cloned() } else { None });
                if found.is_none() {
                    self.missing.get_or_insert_with(|| format!("the float value {key:?} of a switched-off DequantizeLinear was not computed"));
                }
                found
            }
        }
    }

    fn finish(self) -> Result<(), String> {
        self.missing.map_or(Ok(()), Err)
    }
}

impl Hooks for Trial<'_> {
    fn on_value(&mut self, event: &ValueEvent, value: &Tensor) -> Option<Tensor> {
        let gi = graph_index(&self.board.paths, event.path)?;
        if self.board.sources.contains(&(gi, event.value)) {
            self.seen.insert((gi, event.value), value.clone());
        }
        None
    }

    fn supply(&mut self, event: &NodeEvent) -> Option<Vec<Option<Tensor>>> {
        let gi = graph_index(&self.board.paths, event.path)?;
        let key = (gi, event.node);
        if let Some(dq) = self.board.quantizers.get(&key) {
            return self.is_off(dq).then(|| vec![None]);
        }
        if !self.is_off(&key) {
            return None;
        }
        let source = &self.board.switches.get(&key)?.source;
        self.float_value(source).map(|t| vec![Some(t)])
    }
}

/// The units of a calibrated plan: every observation group, then every constant input
/// annotated `Quantize`.
fn units(c: &Calibrated) -> Vec<Unit> {
    let all = c.model.graph.graphs();
    let mut units: Vec<Unit> = (0..c.plan.groups.len()).map(|group| Unit::Activation { group }).collect();
    for (gi, gp) in c.plan.graphs.iter().enumerate() {
        let g = all[gi].1;
        for (&node, ann) in &gp.annotations.nodes {
            for (input, s) in ann.inputs.iter().enumerate() {
                let constant = edge_value(g, Edge::Input { node, index: input }).is_some_and(|v| g.value(v).is_ok_and(|x| x.is_constant()));
                if constant && matches!(s, Some(Spec::Quantize(_))) {
                    units.push(Unit::Constant { graph: gi, node, input });
                }
            }
        }
    }
    units
}

/// The annotated edges of plan graph `gi` whose point belongs to observation group `group`.
fn group_edges(c: &Calibrated, g: &Graph, gi: usize, group: usize) -> Vec<Edge> {
    let gp = &c.plan.graphs[gi];
    let a = &gp.annotations;
    let mut edges = vec![];
    for (&node, ann) in &a.nodes {
        let inputs = (0..ann.inputs.len()).map(|index| Edge::Input { node, index });
        let outputs = (0..ann.outputs.len()).map(|index| Edge::Output { node, index });
        for e in inputs.chain(outputs) {
            let Some(qt) = resolve(a, e, 0).and_then(qtype_of) else { continue };
            if edge_value(g, e).and_then(|v| gp.points.get(&(v, qt))) == Some(&group) {
                edges.push(e);
            }
        }
    }
    edges
}

fn edge_node(e: Edge) -> NodeId {
    match e {
        Edge::Input { node, .. } | Edge::Output { node, .. } => node,
    }
}

/// A unit's record for reports.
fn record(c: &Calibrated, units: &[Unit], id: usize) -> UnitRecord {
    let all = c.model.graph.graphs();
    let qualified = |gi: usize, name: String| if gi == 0 { name } else { format!("{}:{name}", all[gi].1.name) };
    let mut values = vec![];
    let mut nodes: Vec<(usize, NodeId)> = vec![];
    let (kind, group) = match units[id] {
        Unit::Activation { group } => {
            for &(gi, v) in &c.plan.groups[group].points {
                values.push(qualified(gi, all[gi].1.value_name(v)));
            }
            for (gi, (_, g)) in all.iter().enumerate() {
                nodes.extend(group_edges(c, g, gi, group).into_iter().map(|e| (gi, edge_node(e))));
            }
            ("activation", Some(group))
        }
        Unit::Constant { graph, node, input } => {
            let g = all[graph].1;
            if let Some(v) = edge_value(g, Edge::Input { node, index: input }) {
                values.push(qualified(graph, g.value_name(v)));
            }
            nodes.push((graph, node));
            ("constant", None)
        }
    };
    let nodes: BTreeSet<(usize, NodeId)> = nodes.into_iter().collect();
    let (names, ops) = nodes.iter().filter_map(|&(gi, n)| {
        let node = all[gi].1.node(n).ok()?;
        Some((qualified(gi, node.display_name(n)), node.qualified_op()))
    }).unzip();
    UnitRecord { id, kind, group, values, nodes: names, ops }
}

impl Switchboard {
    /// Plans `qdq` (converted from `c`, with `logs`) for trials over `units`.
    fn new(c: &Calibrated, units: &[Unit], qdq: &Model, logs: &[ConvertLog], threads: usize) -> Result<Switchboard, SensitivityError> {
        let session = Session::with_folding(qdq, SessionOptions { threads }, Folding::Off).map_err(|e| SensitivityError::Model(e.to_string()))?;
        let all_q = qdq.graph.graphs();
        let all_f = c.model.graph.graphs();
        let paths: Vec<GraphPath> = all_q.iter().map(|(p, _)| p.clone()).collect();
        let unit_index: HashMap<Unit, usize> = units.iter().enumerate().map(|(i, u)| (*u, i)).collect();
        let mut board = Switchboard { session, paths, switches: HashMap::new(), quantizers: HashMap::new(), sources: HashSet::new(), dirty: vec![vec![]; units.len()], dropped: HashSet::new() };
        for (gi, log) in logs.iter().enumerate() {
            let Some(qi) = board.paths.iter().position(|p| *p == c.plan.graphs[gi].path) else { continue };
            let (gq, gf) = (all_q[qi].1, all_f[gi].1);
            let gp = &c.plan.graphs[gi];
            for &(d, what) in &log.dequantized {
                let Some((dq, _)) = gq.producer(d) else { continue };
                let (owners, source, quantizer) = match what {
                    Dequantized::Activation { group, float } => {
                        let Some(at) = defining_value(&all_q, qi, float) else { continue };
                        let quantizer = gq.node(dq).ok().and_then(|n| n.input(0)).and_then(|q| gq.producer(q)).map(|(n, _)| n)
                            .filter(|&n| gq.node(n).is_ok_and(|x| x.op_type == "QuantizeLinear"))
                            .filter(|&n| gq.node(n).ok().and_then(|x| x.output(0)).is_some_and(|o| gq.consumers(o) == [(dq, 0)]));
                        (vec![unit_index[&Unit::Activation { group }]], FloatSource::Value(at), quantizer)
                    }
                    Dequantized::Constant { node, input, float } => {
                        let Some(data) = gf.value(float).ok().and_then(|v| v.initializer()).cloned() else { continue };
                        let owners = match gp.annotations.get(node).and_then(|a| a.input(input)) {
                            Some(Spec::Derived { from, .. }) => from.iter().filter_map(|&e| match e {
                                Edge::Input { node: wn, index } if gf.value(gf.node(wn).ok()?.input(index)?).is_ok_and(|v| v.is_constant()) => {
                                    unit_index.get(&Unit::Constant { graph: gi, node: wn, input: index }).copied()
                                }
                                e => {
                                    let qt = resolve(&gp.annotations, e, 0).and_then(qtype_of)?;
                                    let group = *gp.points.get(&(edge_value(gf, e)?, qt))?;
                                    unit_index.get(&Unit::Activation { group }).copied()
                                }
                            }).collect(),
                            _ => unit_index.get(&Unit::Constant { graph: gi, node, input }).into_iter().copied().collect(),
                        };
                        (owners, FloatSource::Constant(data), None)
                    }
                };
                let main_nodes: Vec<NodeId> = match board.paths[qi].first() {
                    Some(&(owner, _)) => vec![owner],
                    None => std::iter::once(dq).chain(quantizer).collect(),
                };
                for &u in &owners {
                    board.dirty[u].extend(&main_nodes);
                }
                if let FloatSource::Value(at) = source {
                    board.sources.insert(at);
                }
                if let Some(q) = quantizer {
                    board.quantizers.insert((qi, q), (qi, dq));
                }
                if qi == 0 && !gq.is_output(d) {
                    board.dropped.insert(d);
                }
                let switch = board.switches.entry((qi, dq)).or_insert(Switch { owners: vec![], source });
                for u in owners {
                    if !switch.owners.contains(&u) {
                        switch.owners.push(u);
                    }
                }
            }
        }
        for d in &mut board.dirty {
            d.sort();
            d.dedup();
        }
        let sources = &board.sources;
        board.dropped.retain(|&v| !sources.contains(&(0, v)));
        Ok(board)
    }

    /// A full run with the units marked in `off` switched off.
    fn run(&self, feed: Vec<(String, Tensor)>, off: &[bool]) -> Result<Vec<(String, Tensor)>, String> {
        let mut hooks = Trial::new(self, off, None);
        let out = self.session.run_with_hooks(feed, &mut hooks).map_err(|e| e.to_string())?;
        hooks.finish()?;
        Ok(out)
    }

    /// [`Switchboard::run`], keeping the values [`Switchboard::run_from`] reads (all but
    /// `dropped`).
    fn run_keeping(&self, feed: Vec<(String, Tensor)>, off: &[bool]) -> Result<(Vec<(String, Tensor)>, RunValues), String> {
        let mut hooks = Trial::new(self, off, None);
        let out = self.session.run_keeping(feed, &mut hooks, &self.dropped).map_err(|e| e.to_string())?;
        hooks.finish()?;
        Ok(out)
    }

    /// Re-runs `base` (kept with every unit but `unit` as in `off`) with `unit` as in `off`.
    fn run_from(&self, base: &RunValues, unit: usize, off: &[bool]) -> Result<Vec<(String, Tensor)>, String> {
        let mut hooks = Trial::new(self, off, Some(base));
        let out = self.session.run_from(base, &self.dirty[unit], &mut hooks).map_err(|e| e.to_string())?;
        hooks.finish()?;
        Ok(out)
    }
}

/// Streaming output comparison: one [`Sums`] per graph output.
#[derive(Clone)]
struct OutputSums(Vec<Sums>);

impl OutputSums {
    fn new(outputs: usize) -> OutputSums {
        OutputSums(vec![Sums::default(); outputs])
    }

    fn add(&mut self, float: &[(String, Tensor)], trial: &[(String, Tensor)]) {
        for ((s, (_, x)), (_, y)) in self.0.iter_mut().zip(float).zip(trial) {
            if let Some(d) = Sums::of_tensors(x, y) {
                *s = s.merge(d);
            }
        }
    }

    fn errors(&self, names: &[String]) -> Vec<OutputError> {
        names.iter().zip(&self.0).map(|(n, s)| OutputError { output: n.clone(), metrics: s.metrics() }).collect()
    }
}

fn sample_error(samples: &dyn SampleSource, i: usize) -> impl Fn(String) -> SensitivityError + '_ {
    move |reason| SensitivityError::Sample { sample: samples.name(i), reason }
}

/// Progress of an analysis: after each trial of each sample, `(sample, samples, trial, trials)`
/// (1-based counts).
pub type Progress<'a> = dyn FnMut(usize, usize, usize, usize) + 'a;

/// Measures every unit of a calibrated model on `samples` (see the module documentation);
/// `threads` worker threads (0: all cores). `c` is not modified.
pub fn analyze(c: &Calibrated, samples: &dyn SampleSource, threads: usize, progress: &mut Progress) -> Result<Sensitivity, SensitivityError> {
    analyze_with_board(c, samples, threads, true, progress).map(|(s, _, _)| s)
}

/// [`analyze`], also returning the units and the switchboard for further trials; the figures
/// as deployed only when `as_deployed` (the accuracy budget measures its own).
fn analyze_with_board(c: &Calibrated, samples: &dyn SampleSource, threads: usize, as_deployed: bool, progress: &mut Progress) -> Result<(Sensitivity, Vec<Unit>, Switchboard), SensitivityError> {
    if samples.is_empty() {
        return Err(QuantizeError::NoSamples.into());
    }
    let started = Instant::now();
    let units = units(c);
    if units.is_empty() {
        return Err(SensitivityError::NothingQuantized);
    }
    let (qdq, _, logs) = convert_logged(c.clone())?;
    let board = Switchboard::new(c, &units, &qdq, &logs, threads)?;
    let measured: Vec<usize> = (0..units.len()).filter(|&u| !board.dirty[u].is_empty()).collect();
    let names: Vec<String> = board.session.output_names().iter().map(|s| s.to_string()).collect();
    let mut all_quantized = OutputSums::new(names.len());
    let deployed = as_deployed.then(|| Session::with_options(&qdq, SessionOptions { threads })).transpose().map_err(|e| SensitivityError::Model(e.to_string()))?
        .filter(|d| d.qdq_lowering().is_some());
    let mut as_deployed = deployed.as_ref().map(|_| OutputSums::new(names.len()));
    let mut only_quantized = vec![OutputSums::new(names.len()); units.len()];
    let mut only_float = vec![OutputSums::new(names.len()); units.len()];
    let (all_on, all_off) = (vec![false; units.len()], vec![true; units.len()]);
    // Each sample runs two passes of trials, one per kept run: every unit quantized alone
    // (from the all-float run), then every unit float alone (from the all-quantized run), so
    // that only one run's values are held at a time.
    let trials = 2 * measured.len();
    for i in 0..samples.len() {
        let fail = sample_error(samples, i);
        let feed = samples.load(i).map_err(&fail)?;
        let (float_out, float_run) = board.run_keeping(feed.clone(), &all_off).map_err(&fail)?;
        if let (Some(sums), Some(deployed)) = (&mut as_deployed, &deployed) {
            sums.add(&float_out, &deployed.run(feed.clone()).map_err(|e| fail(format!("the converted model failed: {e}")))?);
        }
        let mut done = 0;
        let mut pass = |base: &RunValues, all: &[bool], sums: &mut [OutputSums]| -> Result<(), SensitivityError> {
            let next = AtomicUsize::new(0);
            let trial = |u: usize| -> Result<(usize, NamedTensors), String> {
                let mut off = all.to_vec();
                off[u] = !off[u];
                Ok((u, board.run_from(base, u, &off)?))
            };
            std::thread::scope(|scope| -> Result<(), SensitivityError> {
                let (sender, results) = mpsc::channel();
                for _ in 0..board.session.threads().max(1) {
                    let (sender, next, measured, trial) = (sender.clone(), &next, &measured, &trial);
                    scope.spawn(move || {
                        while let Some(&u) = measured.get(next.fetch_add(1, Ordering::Relaxed)) {
                            if sender.send(trial(u)).is_err() {
                                break;
                            }
                        }
                    });
                }
                drop(sender);
                for result in results.iter() {
                    let (u, out) = result.map_err(&fail)?;
                    sums[u].add(&float_out, &out);
                    done += 1;
                    progress(i + 1, samples.len(), done, trials);
                }
                Ok(())
            })
        };
        pass(&float_run, &all_off, &mut only_quantized)?;
        drop(float_run);
        let (quant_out, quant_run) = board.run_keeping(feed, &all_on).map_err(&fail)?;
        all_quantized.add(&float_out, &quant_out);
        pass(&quant_run, &all_on, &mut only_float)?;
    }
    let mut ranking: Vec<UnitSensitivity> = measured.iter().map(|&u| {
        let (q, f) = (only_quantized[u].errors(&names), only_float[u].errors(&names));
        UnitSensitivity {
            unit: record(c, &units, u),
            only_quantized_sqnr_db: lowest_sqnr(&q),
            only_quantized_cosine: lowest_cosine(&q),
            only_float_sqnr_db: lowest_sqnr(&f),
            only_float_cosine: lowest_cosine(&f),
            only_quantized: q,
            only_float: f,
        }
    }).collect();
    ranking.sort_by(|a, b| a.only_quantized_sqnr_db.total_cmp(&b.only_quantized_sqnr_db).then(b.only_float_sqnr_db.total_cmp(&a.only_float_sqnr_db)));
    let not_measured = (0..units.len()).filter(|&u| board.dirty[u].is_empty()).map(|u| {
        let r = record(c, &units, u);
        format!("{} {}: the converted model has no Q/DQ for it", r.kind, r.values.join(", "))
    }).collect();
    let all_quantized = all_quantized.errors(&names);
    let all_quantized_as_deployed = as_deployed.map(|s| s.errors(&names));
    let sensitivity = Sensitivity {
        samples: samples.len(),
        all_quantized_sqnr_db: lowest_sqnr(&all_quantized),
        all_quantized,
        all_quantized_as_deployed_sqnr_db: all_quantized_as_deployed.as_deref().map(lowest_sqnr),
        all_quantized_as_deployed,
        ranking,
        not_measured,
        seconds: started.elapsed().as_secs_f64(),
    };
    Ok((sensitivity, units, board))
}

/// Calibrates `model` with `quantizer` ([`calibrate`]) and measures every unit ([`analyze`]).
pub fn sensitivity(model: &Model, quantizer: &dyn Quantizer, samples: &dyn SampleSource, opts: &QuantizeOptions, progress: &mut Progress) -> Result<Sensitivity, SensitivityError> {
    let c = calibrate(model, quantizer, samples, opts, &mut |_, _| {})?;
    analyze(&c, samples, opts.threads, progress)
}

/// The graph outputs of one sample: the float model's and a trial's, in graph order.
pub struct SampleOutputs {
    pub float: Vec<(String, Tensor)>,
    pub trial: Vec<(String, Tensor)>,
}

/// Named tensors: a feed or a run's outputs, in graph order.
type NamedTensors = Vec<(String, Tensor)>;

/// Scores a trial from the outputs of every sample (lower is better).
pub type BudgetError<'a> = Box<dyn Fn(&[SampleOutputs]) -> f64 + 'a>;

/// An accuracy budget: `error` scores a trial from the outputs of every sample (lower is
/// better) and the budget is met when the score is at most `max_error`.
pub struct Budget<'a> {
    /// What `error` measures, for the report.
    pub metric: String,
    pub error: BudgetError<'a>,
    pub max_error: f64,
}

/// The relative RMS error `sqrt(Σ(x−y)²/Σx²)` of the worst graph output over all samples
/// (float outputs only; 0 when they are equal). It is `10^(−SQNR/20)`.
pub fn relative_rms_error(outputs: &[SampleOutputs]) -> f64 {
    let Some(first) = outputs.first() else { return 0.0 };
    let mut sums = OutputSums::new(first.float.len());
    for s in outputs {
        sums.add(&s.float, &s.trial);
    }
    sums.0.iter().map(|s| s.metrics().sqnr_db).filter(|x| !x.is_nan()).map(|db| 10f64.powf(-db / 20.0)).fold(0.0, f64::max)
}

impl Budget<'static> {
    /// At most `max` relative RMS error on every graph output ([`relative_rms_error`]).
    pub fn relative_rms(max: f64) -> Budget<'static> {
        Budget { metric: "relative RMS error of the worst output".into(), error: Box::new(relative_rms_error), max_error: max }
    }

    /// At least `min_db` SQNR on every graph output: a relative RMS error of at most
    /// `10^(−min_db/20)`.
    pub fn min_sqnr(min_db: f64) -> Budget<'static> {
        Budget::relative_rms(10f64.powf(-min_db / 20.0))
    }
}

/// One unit of the prefix the accuracy budget returned to float, tried quantized again.
#[derive(Debug, Clone, Serialize)]
pub struct BudgetDecision {
    /// The search round ([`BudgetRound::round`]) that measured it.
    pub round: usize,
    pub unit: UnitRecord,
    /// The error with this unit float and with it quantized, the other units as decided
    /// before this trial.
    pub error_float: f64,
    pub error_quantized: f64,
    /// Whether the unit stays float (quantized, it breaks the budget).
    pub kept_float: bool,
}

/// One measurement of the accuracy budget's prefix search: the units earlier rounds left
/// float and the most sensitive of the others, `units_float` in all, float; the rest quantized.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PrefixTrial {
    /// The search round ([`BudgetRound::round`]) that measured it.
    pub round: usize,
    pub units_float: usize,
    pub error: f64,
}

/// One round of the accuracy budget: a search in the Q/DQ simulation for at most
/// `max_error_simulated`, then the converted model measured as qforge's runtime runs it (QDQ
/// units as integer operators, as ONNX Runtime runs them). Integer arithmetic rounds a few
/// values differently from the simulation, and deep models amplify that, so the converted
/// model can miss a budget the simulation met; the next round then aims the simulation at
/// `max_error * error_simulated / error_converted`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BudgetRound {
    /// 1-based.
    pub round: usize,
    pub max_error_simulated: f64,
    pub error_simulated: f64,
    pub error_converted: f64,
    /// Units float in the converted model: the search's, and the weights that follow their
    /// MatMul or Gemm activation to float.
    pub units_float: usize,
}

/// What the accuracy budget did.
#[derive(Debug, Clone, Serialize)]
pub struct BudgetOutcome {
    pub metric: String,
    pub max_error: f64,
    /// The error with every unit quantized (in the Q/DQ simulation), and that of the model
    /// written, as qforge's runtime runs it ([`BudgetRound`]).
    pub error_all_quantized: f64,
    pub error_final: f64,
    /// Whether `error_final` is within `max_error`.
    pub met: bool,
    /// Units measured, and units returned to float.
    pub units: usize,
    pub units_float: usize,
    /// The weights returned to float with the MatMul or Gemm activation they multiply, among
    /// `units_float` (see [`quantize_within_budget`]).
    pub weights_following: Vec<UnitRecord>,
    /// The rounds of search and measurement of the converted model.
    pub rounds: Vec<BudgetRound>,
    /// The prefix searches, in the order measured.
    pub prefix_search: Vec<PrefixTrial>,
    /// The walks back over the prefixes found, least sensitive unit first.
    pub decisions: Vec<BudgetDecision>,
    /// The sensitivity ranking the decisions followed.
    pub ranking: Vec<UnitSensitivity>,
    pub seconds: f64,
}

/// Progress of a budgeted quantization, for people.
pub enum BudgetProgress {
    /// Calibrated on `samples`; the units are ranked on `ranking` samples and the budget is
    /// measured on `measured` samples.
    Calibrated { samples: usize, ranking: usize, measured: usize },
    /// As [`Progress`].
    Analysis { sample: usize, samples: usize, trial: usize, trials: usize },
    /// After measurement `step` (1-based) of the search, with the error it gave.
    Decision { step: usize, error: f64 },
    /// After a round's converted model was measured.
    Round(BudgetRound),
}

/// The most rounds of [`quantize_within_budget`].
pub const MAX_BUDGET_ROUNDS: usize = 4;

/// The most samples [`analyze`] and the accuracy budget are given by default: every group
/// costs two partial runs per sample.
pub const EVALUATION_SAMPLES: usize = 8;

/// By default, evaluation samples are taken while their inputs hold fewer elements than this
/// together (at least one sample).
pub const EVALUATION_ELEMENTS: usize = 1 << 20;

/// Quantizes `model` so that the outputs stay within `budget`: calibrates once on `samples`,
/// ranks the units on `evaluation` ([`analyze`]), then returns to float the fewest of the most
/// sensitive units that meet the budget and quantizes again those of them it can do without
/// ([`return_to_float`]), measuring every candidate set in the Q/DQ simulation on the samples
/// of convert's output check (`opts.check_samples` spread over `samples`, those the report's
/// check is measured on), or on `evaluation` when there are none. The model converted from
/// that set is then measured on the same samples as qforge's runtime runs it (QDQ units as
/// integer operators); when it misses the budget, the search continues from that set for a
/// simulated error as much smaller as the converted model's is too large, at most
/// [`MAX_BUDGET_ROUNDS`] rounds ([`BudgetRound`]). The budget is met when the converted model
/// meets it. An activation returned to float takes with it the weights of the MatMul and Gemm
/// nodes that read it, in every measurement and in the model written: ONNX Runtime runs a
/// float activation with an 8-bit weight as MatMulNBits, which quantizes the activation at
/// run time.
///
/// Each unit returned to float loses its annotated edges, so convert emits no Q/DQ for it; the
/// nodes it touched are reported float with [`FloatKind::AccuracyBudget`]. The report's
/// `accuracy_budget` lists every measurement. When even the float model misses the budget (a
/// metric other than the distance to it), the set of least error measured is kept and the
/// report says the budget was not met.
pub fn quantize_within_budget(model: &Model, quantizer: &dyn Quantizer, samples: &dyn SampleSource, evaluation: &dyn SampleSource, opts: &QuantizeOptions, budget: &Budget, progress: &mut dyn FnMut(BudgetProgress)) -> Result<(Model, Report), SensitivityError> {
    let started = Instant::now();
    let mut c = calibrate(model, quantizer, samples, opts, &mut |_, _| {})?;
    let checked = c.check_samples().len();
    progress(BudgetProgress::Calibrated { samples: samples.len(), ranking: evaluation.len(), measured: if checked > 0 { checked } else { evaluation.len() } });
    if units(&c).is_empty() {
        // Nothing is quantized, so the outputs are the float model's: the budget holds.
        let outcome = BudgetOutcome {
            metric: budget.metric.clone(), max_error: budget.max_error, error_all_quantized: 0.0, error_final: 0.0, met: true,
            units: 0, units_float: 0, weights_following: vec![], rounds: vec![], prefix_search: vec![], decisions: vec![], ranking: vec![], seconds: started.elapsed().as_secs_f64(),
        };
        let (m, mut report) = convert(c)?;
        report.accuracy_budget = Some(outcome);
        return Ok((m, report));
    }
    let (analysis, units, board) = analyze_with_board(&c, evaluation, opts.threads, false, &mut |sample, samples, trial, trials| progress(BudgetProgress::Analysis { sample, samples, trial, trials }))?;
    // The measured samples, by name, with their float outputs.
    let mut measured: Vec<(String, Vec<(String, Tensor)>)> = c.check_samples().iter().map(|s| (s.name.clone(), s.feed.clone())).collect();
    if measured.is_empty() {
        for i in 0..evaluation.len() {
            measured.push((evaluation.name(i), evaluation.load(i).map_err(sample_error(evaluation, i))?));
        }
    }
    let failed = |name: &str| {
        let sample = name.to_string();
        move |reason: String| SensitivityError::Sample { sample, reason }
    };
    let mut float_outputs = vec![];
    for (name, feed) in &measured {
        float_outputs.push(board.run(feed.clone(), &vec![true; units.len()]).map_err(failed(name))?);
    }
    // A set the search measures, with the weights that return to float with its activations.
    let followers = weights_following(&c, &units);
    let with_followers = |off: &[bool]| -> Vec<bool> {
        let mut all = off.to_vec();
        for u in (0..off.len()).filter(|&u| off[u]) {
            for &w in &followers[u] {
                all[w] = true;
            }
        }
        all
    };
    let measure = |off: &[bool]| -> Result<f64, SensitivityError> {
        let off = with_followers(off);
        let mut outputs = vec![];
        for ((name, feed), float) in measured.iter().zip(&float_outputs) {
            outputs.push(SampleOutputs { float: float.clone(), trial: board.run(feed.clone(), &off).map_err(failed(name))? });
        }
        Ok((budget.error)(&outputs))
    };
    let error_all_quantized = measure(&vec![false; units.len()])?;
    let order: Vec<usize> = analysis.ranking.iter().map(|e| e.unit.id).collect();
    let mut steps = 0;
    let mut float_now = vec![false; units.len()];
    let mut written = None;
    let found = search_in_rounds(&order, units.len(), error_all_quantized, budget.max_error, &mut |off| measure(off), &mut |off| {
        let off = with_followers(off);
        let newly_float: Vec<usize> = (0..off.len()).filter(|&u| off[u] && !float_now[u]).collect();
        keep_units_float(&mut c, &newly_float);
        float_now = off;
        let units_float = float_now.iter().filter(|&&o| o).count();
        let (m, report) = convert(c.clone())?;
        let error = measure_model(&m, &measured, &float_outputs, budget, opts.threads)?;
        written = Some((m, report));
        Ok((error, units_float))
    }, &mut |event| match event {
        RoundEvent::Measured(error) => {
            steps += 1;
            progress(BudgetProgress::Decision { step: steps, error });
        }
        RoundEvent::Converted(r) => progress(BudgetProgress::Round(r)),
    })?;
    let (m, mut report) = written.expect("every round converts");
    let record = |u: usize| analysis.ranking.iter().find(|e| e.unit.id == u).expect("ranked unit").unit.clone();
    let last = *found.rounds.last().expect("at least one round");
    report.accuracy_budget = Some(BudgetOutcome {
        metric: budget.metric.clone(),
        max_error: budget.max_error,
        error_all_quantized,
        error_final: last.error_converted,
        met: last.error_converted <= budget.max_error,
        units: analysis.ranking.len(),
        units_float: last.units_float,
        weights_following: with_followers(&found.off).iter().zip(&found.off).enumerate().filter(|(_, (&all, &searched))| all && !searched).map(|(u, _)| self::record(&c, &units, u)).collect(),
        rounds: found.rounds,
        prefix_search: found.prefix,
        decisions: found.walk_back.iter().map(|&(round, t)| BudgetDecision { round, unit: record(t.unit), error_float: t.error_float, error_quantized: t.error_quantized, kept_float: t.kept_float }).collect(),
        ranking: analysis.ranking,
        seconds: started.elapsed().as_secs_f64(),
    });
    Ok((m, report))
}

/// What [`search_in_rounds`] reports as it goes.
enum RoundEvent {
    /// A float set measured in the simulation, with its error.
    Measured(f64),
    /// A round's converted model measured.
    Converted(BudgetRound),
}

/// What [`search_in_rounds`] found: each round, and every measurement of the searches.
#[derive(Debug, Clone, PartialEq)]
struct RoundsFound {
    /// The last round's float set.
    off: Vec<bool>,
    rounds: Vec<BudgetRound>,
    prefix: Vec<PrefixTrial>,
    /// `(round, trial)`.
    walk_back: Vec<(usize, WalkBackTrial)>,
}

/// The accuracy budget's rounds over `units` units ranked in `order`, from every unit quantized
/// (simulated error `error_all_quantized`): each round searches ([`return_to_float`], with
/// `simulated` measuring a float set) from the float set the previous round left, then
/// `converted` measures the model converted with that set (its error, and how many units it
/// has float). The rounds end when the converted model meets `max_error`, when the search
/// cannot meet its own target, when every unit is float, or after [`MAX_BUDGET_ROUNDS`].
/// Otherwise the converted model's error is taken to keep its ratio to the simulated one, so
/// the next round aims the simulation at `max_error * simulated / converted`, below the
/// simulated error it has.
fn search_in_rounds<E>(order: &[usize], units: usize, error_all_quantized: f64, max_error: f64, simulated: &mut dyn FnMut(&[bool]) -> Result<f64, E>, converted: &mut dyn FnMut(&[bool]) -> Result<(f64, usize), E>, event: &mut dyn FnMut(RoundEvent)) -> Result<RoundsFound, E> {
    let (mut off, mut error) = (vec![false; units], error_all_quantized);
    let mut found = RoundsFound { off: vec![], rounds: vec![], prefix: vec![], walk_back: vec![] };
    let mut target = max_error;
    loop {
        let round = found.rounds.len() + 1;
        let search = return_to_float(order, &off, error, target, simulated, &mut |e| event(RoundEvent::Measured(e)))?;
        found.prefix.extend(search.prefix.iter().map(|&(units_float, error)| PrefixTrial { round, units_float, error }));
        found.walk_back.extend(search.walk_back.iter().map(|&t| (round, t)));
        (off, error) = (search.off, search.error);
        let (error_converted, units_float) = converted(&off)?;
        let r = BudgetRound { round, max_error_simulated: target, error_simulated: error, error_converted, units_float };
        found.rounds.push(r);
        event(RoundEvent::Converted(r));
        let settled = error_converted <= max_error || error > target || units_float == units || round == MAX_BUDGET_ROUNDS || !(error_converted.is_finite() && error_converted > 0.0);
        if settled {
            found.off = off;
            return Ok(found);
        }
        target = max_error * error / error_converted;
    }
}

/// `budget`'s error of `model` as qforge's runtime runs it (QDQ units as integer operators)
/// on the `measured` samples, against their float outputs.
fn measure_model(model: &Model, measured: &[(String, NamedTensors)], float_outputs: &[NamedTensors], budget: &Budget, threads: usize) -> Result<f64, SensitivityError> {
    let session = Session::with_options(model, SessionOptions { threads }).map_err(|e| SensitivityError::Model(format!("the converted model does not run: {e}")))?;
    let mut outputs = vec![];
    for ((name, feed), float) in measured.iter().zip(float_outputs) {
        let trial = session.run(feed.clone()).map_err(|e| SensitivityError::Sample { sample: name.clone(), reason: format!("the converted model failed: {e}") })?;
        outputs.push(SampleOutputs { float: float.clone(), trial });
    }
    Ok((budget.error)(&outputs))
}

/// One unit of the walk back in [`return_to_float`]: the error with unit `unit` float and with
/// it quantized, and whether it stayed float.
#[derive(Debug, Clone, Copy, PartialEq)]
struct WalkBackTrial {
    unit: usize,
    error_float: f64,
    error_quantized: f64,
    kept_float: bool,
}

/// What [`return_to_float`] found: the float set (`true`: float), its error, and the
/// measurements that led there.
#[derive(Debug, Clone, PartialEq)]
struct BudgetSearch {
    off: Vec<bool>,
    error: f64,
    /// `(units float, error)` of each prefix measured.
    prefix: Vec<(usize, f64)>,
    walk_back: Vec<WalkBackTrial>,
}

/// The accuracy budget's search from the float set `start` (`true`: float; its error is
/// `error`) over the units of `order` (most sensitive first) not yet float, with `measure`
/// giving the error of a float set:
/// 1. *prefix search*: the fewest leading candidates whose return to float brings the error to
///    at most `max_error`, by bisection (the error of a longer prefix is taken to be no larger;
///    the prefix found is measured, so it meets the budget whatever the shape);
/// 2. *walk back*: each unit of that prefix, least sensitive first, is quantized again when
///    the budget still holds without it, so every unit it leaves float is needed.
///
/// Units of `start` stay float. Quantization errors that compound over many layers, none of
/// which fixes the output alone, need a long prefix, which a unit-at-a-time search never
/// reaches. When even every candidate float misses the budget, the prefix of least error is
/// returned. `decided(error)` follows every measurement.
fn return_to_float<E>(order: &[usize], start: &[bool], error: f64, max_error: f64, measure: &mut dyn FnMut(&[bool]) -> Result<f64, E>, decided: &mut dyn FnMut(f64)) -> Result<BudgetSearch, E> {
    let candidates: Vec<usize> = order.iter().copied().filter(|&u| !start[u]).collect();
    let floats = start.iter().filter(|&&o| o).count();
    let prefix_set = |k: usize| {
        let mut off = start.to_vec();
        for &u in &candidates[..k] {
            off[u] = true;
        }
        off
    };
    let mut search = BudgetSearch { off: start.to_vec(), error, prefix: vec![], walk_back: vec![] };
    if error <= max_error || candidates.is_empty() {
        return Ok(search);
    }
    let mut measure_prefix = |k: usize, search: &mut BudgetSearch| -> Result<f64, E> {
        let e = measure(&prefix_set(k))?;
        search.prefix.push((floats + k, e));
        decided(e);
        Ok(e)
    };
    // Invariant: the prefix of `lo` units misses the budget, that of `hi` units meets it.
    let (mut lo, mut hi) = (0, candidates.len());
    let mut hi_error = measure_prefix(hi, &mut search)?;
    if hi_error > max_error {
        let (k, best) = search.prefix.iter().map(|&(n, e)| (n - floats, e)).chain([(0, error)]).min_by(|a, b| a.1.total_cmp(&b.1)).expect("two candidates");
        (search.off, search.error) = (prefix_set(k), best);
        return Ok(search);
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        let e = measure_prefix(mid, &mut search)?;
        if e <= max_error {
            (hi, hi_error) = (mid, e);
        } else {
            lo = mid;
        }
    }
    let (mut off, mut error) = (prefix_set(hi), hi_error);
    for &u in candidates[..hi].iter().rev() {
        off[u] = false;
        let quantized = measure(&off)?;
        let kept_float = quantized > max_error;
        search.walk_back.push(WalkBackTrial { unit: u, error_float: error, error_quantized: quantized, kept_float });
        if kept_float {
            off[u] = true;
        } else {
            error = quantized;
        }
        decided(quantized);
    }
    (search.off, search.error) = (off, error);
    Ok(search)
}

/// For each unit, the weight units that return to float with it: for an activation unit, the
/// quantized weights of the [`MATMUL_NBITS_OPS`] nodes that read it, which ONNX Runtime would
/// otherwise run quantizing the activation returned to float.
fn weights_following(c: &Calibrated, units: &[Unit]) -> Vec<Vec<usize>> {
    let all = c.model.graph.graphs();
    let index: HashMap<Unit, usize> = units.iter().enumerate().map(|(i, &u)| (u, i)).collect();
    units.iter().map(|&u| {
        let Unit::Activation { group } = u else { return vec![] };
        let mut weights = vec![];
        for (gi, (_, g)) in all.iter().enumerate() {
            for e in group_edges(c, g, gi, group) {
                let Edge::Input { node, index: read } = e else { continue };
                if !g.node(node).is_ok_and(|n| MATMUL_NBITS_OPS.contains(&n.op_type.as_str())) {
                    continue;
                }
                let inputs = g.node(node).map(|n| n.inputs.len()).unwrap_or(0);
                weights.extend((0..inputs).filter(|&i| i != read).filter_map(|input| index.get(&Unit::Constant { graph: gi, node, input }).copied()));
            }
        }
        weights.sort();
        weights.dedup();
        weights
    }).collect()
}

/// Returns the units `ids` (as [`UnitRecord::id`] numbers them) to float in `c`: their annotated
/// edges are cleared, so convert emits no Q/DQ for them nor the biases derived from them, and
/// the nodes they touch are reported float with [`FloatKind::AccuracyBudget`]. Unknown ids are
/// ignored.
pub fn keep_units_float(c: &mut Calibrated, ids: &[usize]) {
    let units = units(c);
    for &u in ids.iter().filter(|&&u| u < units.len()) {
        keep_unit_float(c, &units, u);
    }
}

fn keep_unit_float(c: &mut Calibrated, units: &[Unit], u: usize) {
    let record = record(c, units, u);
    let reason = format!("accuracy budget: {} {} returned to float", record.kind, record.values.join(", "));
    let mut cleared: Vec<(usize, Edge)> = vec![];
    {
        let all = c.model.graph.graphs();
        match units[u] {
            Unit::Activation { group } => {
                for (gi, (_, g)) in all.iter().enumerate() {
                    cleared.extend(group_edges(c, g, gi, group).into_iter().map(|e| (gi, e)));
                }
            }
            Unit::Constant { graph, node, input } => cleared.push((graph, Edge::Input { node, index: input })),
        }
    }
    let all = c.model.graph.graphs();
    for &(gi, e) in &cleared {
        let a = &mut c.plan.graphs[gi].annotations;
        if let Some(ann) = a.nodes.get_mut(&edge_node(e)) {
            let slot = match e {
                Edge::Input { index, .. } => ann.inputs.get_mut(index),
                Edge::Output { index, .. } => ann.outputs.get_mut(index),
            };
            if let Some(s) = slot {
                *s = None;
            }
        }
        a.keep_float(edge_node(e), FloatKind::AccuracyBudget, reason.clone());
        let g = all[gi].1;
        let Ok(node) = g.node(edge_node(e)) else { continue };
        let name = node.display_name(edge_node(e));
        for n in c.report.nodes.iter_mut().filter(|n| n.graph == g.name && n.name == name && n.quantized) {
            n.quantized = false;
            n.rule = None;
            n.kind = Some(FloatKind::AccuracyBudget);
            n.reason = Some(reason.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Errors of three units where unit 0's quantization noise partly cancels unit 1's: with
    /// unit 1 quantized, returning unit 0 to float raises the error; once unit 1 is float, it
    /// lowers it to 0.
    fn masked(off: &[bool]) -> Result<f64, ()> {
        Ok(match (off[0], off[1], off[2]) {
            (false, false, false) => 0.50,
            (true, false, _) => 0.60,
            (false, true, false) => 0.30,
            (false, true, true) => 0.20,
            (true, true, true) => 0.0,
            (true, true, false) => 0.10,
            (false, false, true) => 0.45,
        })
    }

    fn walked(s: &BudgetSearch) -> Vec<(usize, bool)> {
        s.walk_back.iter().map(|t| (t.unit, t.kept_float)).collect()
    }

    #[test]
    fn a_unit_whose_noise_others_mask_stays_float_when_the_budget_needs_it() {
        // Unit 0 alone raises the error, yet the budget needs all three float.
        let s = return_to_float(&[0, 1, 2], &[false; 3], 0.5, 0.01, &mut masked, &mut |_| {}).unwrap();
        assert_eq!((s.off.clone(), s.error), (vec![true, true, true], 0.0));
        // Prefixes of 3, 1 and 2 units: 0.0 meets it, 0.60 and 0.10 do not.
        assert_eq!(s.prefix, [(3, 0.0), (1, 0.60), (2, 0.10)]);
        assert_eq!(walked(&s), [(2, true), (1, true), (0, true)]);
        assert_eq!((s.walk_back[2].error_float, s.walk_back[2].error_quantized), (0.0, 0.20));
    }

    #[test]
    fn the_walk_back_quantizes_again_what_the_budget_does_without() {
        // Order [1, 2, 0], at most 0.25: the prefix of two units (1 and 2) gives 0.20; without
        // unit 2 it is 0.30, without unit 1 0.45, so both stay float.
        let s = return_to_float(&[1, 2, 0], &[false; 3], 0.5, 0.25, &mut masked, &mut |_| {}).unwrap();
        assert_eq!((s.off.clone(), s.error), (vec![false, true, true], 0.20));
        assert_eq!(walked(&s), [(2, true), (1, true)]);
        // At most 0.35, order [0, 2, 1]: the prefixes of one and two units both give 0.60, so
        // the search ends at all three float. Walking back, unit 1 stays float (0.60 without
        // it), unit 2 is quantized again (0.10), then unit 0 (0.30).
        let s = return_to_float(&[0, 2, 1], &[false; 3], 0.5, 0.35, &mut masked, &mut |_| {}).unwrap();
        assert_eq!(s.prefix.iter().map(|t| t.0).collect::<Vec<_>>(), [3, 1, 2]);
        assert_eq!(walked(&s), [(1, true), (2, false), (0, false)]);
        assert_eq!((s.off.clone(), s.error), (vec![false, true, false], 0.30));
    }

    #[test]
    fn errors_that_compound_over_many_units_are_met_by_a_long_prefix() {
        // Every quantized unit adds its error and the error the budget allows is that of
        // three: no single unit returned to float meets it; the search needs log2(n) + k
        // measurements, not one pass per unit.
        let n = 64;
        let mut calls = 0;
        let mut additive = |off: &[bool]| -> Result<f64, ()> {
            calls += 1;
            Ok(off.iter().filter(|&&o| !o).count() as f64)
        };
        let order: Vec<usize> = (0..n).collect();
        let s = return_to_float(&order, &vec![false; n], n as f64, 3.0, &mut additive, &mut |_| {}).unwrap();
        assert_eq!(s.error, 3.0);
        assert_eq!(s.off.iter().filter(|&&o| o).count(), n - 3);
        assert_eq!(s.prefix.last().map(|t| t.0), Some(n - 3));
        // The walk back tries each of the 61 float units once and keeps all of them float.
        assert_eq!(s.walk_back.len(), n - 3);
        assert!(s.walk_back.iter().all(|t| t.kept_float));
        assert!(calls <= 1 + 6 + (n - 3), "{calls} measurements");
    }

    #[test]
    fn a_budget_the_float_model_misses_keeps_the_set_of_least_error() {
        let mut flat = |off: &[bool]| -> Result<f64, ()> { Ok(if off.iter().all(|&o| o) { 0.7 } else { 1.0 }) };
        let s = return_to_float(&[0, 1, 2], &[false; 3], 0.5, 0.1, &mut flat, &mut |_| {}).unwrap();
        // All float gives 0.7, worse than all quantized (0.5): nothing is returned to float.
        assert_eq!((s.off.clone(), s.error, s.prefix.len()), (vec![false; 3], 0.5, 1));
        // Already within the budget: nothing is measured.
        let s = return_to_float(&[0, 1, 2], &[false; 3], 0.5, 0.5, &mut masked, &mut |_| {}).unwrap();
        assert!(s.prefix.is_empty() && s.walk_back.is_empty() && s.off == vec![false; 3]);
    }

    #[test]
    fn a_later_round_keeps_the_units_already_float_and_searches_the_others() {
        // Additive errors, units 0 and 1 already float (error 2 of 4): a tighter budget of 1
        // returns one more unit to float, the most sensitive candidate (3), and never
        // measures a set without units 0 and 1.
        let mut sets = vec![];
        let mut additive = |off: &[bool]| -> Result<f64, ()> {
            sets.push(off.to_vec());
            Ok(off.iter().filter(|&&o| !o).count() as f64)
        };
        let s = return_to_float(&[3, 0, 2, 1], &[true, true, false, false], 2.0, 1.0, &mut additive, &mut |_| {}).unwrap();
        assert_eq!((s.off.clone(), s.error), (vec![true, true, false, true], 1.0));
        assert!(sets.iter().all(|o| o[0] && o[1]), "{sets:?}");
        // The prefixes count every float unit: 4 (both candidates), then 3.
        assert_eq!(s.prefix, [(4, 0.0), (3, 1.0)]);
        assert_eq!(walked(&s), [(3, true)]);
    }

    /// `1/8` per quantized unit, in the simulation (exact in binary).
    fn eighth_per_quantized(off: &[bool]) -> Result<f64, ()> {
        Ok(0.125 * off.iter().filter(|&&o| !o).count() as f64)
    }

    #[test]
    fn a_converted_model_that_misses_the_budget_starts_a_tighter_round_from_its_float_set() {
        // The converted model adds 1/16 to the simulated error: with at most 3/8, round 1 meets
        // 3/8 simulated (3 of 10 units quantized) and misses converted (7/16); round 2 aims at
        // 3/8 * 6/7 and meets it with 2 quantized, 5/16 converted.
        let first_round_float: std::cell::RefCell<Option<Vec<bool>>> = Default::default();
        let mut sets_after = vec![];
        let mut simulated = |off: &[bool]| {
            if first_round_float.borrow().is_some() {
                sets_after.push(off.to_vec());
            }
            eighth_per_quantized(off)
        };
        let mut converted = |off: &[bool]| -> Result<(f64, usize), ()> {
            first_round_float.borrow_mut().get_or_insert_with(|| off.to_vec());
            Ok((eighth_per_quantized(off)? + 0.0625, off.iter().filter(|&&o| o).count()))
        };
        let order: Vec<usize> = (0..10).collect();
        let found = search_in_rounds(&order, 10, 1.25, 0.375, &mut simulated, &mut converted, &mut |_| {}).unwrap();
        let r: Vec<(usize, usize)> = found.rounds.iter().map(|r| (r.round, r.units_float)).collect();
        assert_eq!(r, [(1, 7), (2, 8)]);
        let (r1, r2) = (found.rounds[0], found.rounds[1]);
        assert_eq!((r1.max_error_simulated, r1.error_converted), (0.375, 0.4375));
        assert!((r2.max_error_simulated - 0.375 * 6.0 / 7.0).abs() < 1e-12 && r2.error_converted == 0.3125, "{r2:?}");
        // Round 2 measured only sets that keep round 1's float units float.
        let first = first_round_float.into_inner().unwrap();
        assert!(!sets_after.is_empty() && sets_after.iter().all(|o| (0..10).all(|u| !first[u] || o[u])));
        assert!(found.prefix.iter().any(|t| t.round == 2) && found.walk_back.iter().all(|&(round, _)| round <= 2));
    }

    #[test]
    fn rounds_stop_at_their_limit_when_the_converted_model_never_meets_the_budget() {
        let mut converted = |off: &[bool]| -> Result<(f64, usize), ()> { Ok((1.0, off.iter().filter(|&&o| o).count())) };
        let order: Vec<usize> = (0..1000).collect();
        let mut sim = |off: &[bool]| Ok(0.001 * off.iter().filter(|&&o| !o).count() as f64);
        let found = search_in_rounds(&order, 1000, 1.0, 0.5, &mut sim, &mut converted, &mut |_| {}).unwrap();
        assert_eq!(found.rounds.len(), MAX_BUDGET_ROUNDS);
        // Each round aims the simulation at half what the last one reached, as the converted
        // model missed by a factor of 1 / 0.5; each returns more units to float.
        for w in found.rounds.windows(2) {
            assert!((w[1].max_error_simulated - w[0].error_simulated / 2.0).abs() < 1e-12, "{w:?}");
            assert!(w[1].units_float > w[0].units_float, "{w:?}");
        }
    }
}
