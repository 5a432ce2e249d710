//! Static post-training quantization, end to end:
//! `fuse -> annotate -> prepare -> calibrate -> convert`, over the main graph and every
//! If/Loop subgraph, with a [`Report`] of what was done.

use std::time::Instant;

use qforge_ir::{Model, Tensor};
use qforge_runtime::{Session, SessionOptions};

use crate::annotation::FloatKind;
use crate::convert::{convert_graph, group_qparams};
use crate::passes::{fold_batch_norm, fold_constants};
use crate::prepare::{graph_at_mut, graphs, QuantPlan};
use crate::quantizer::Quantizer;
use crate::report::{NodeRecord, Report};

/// Calibration samples: each is one complete feed of the model.
pub trait SampleSource {
    fn len(&self) -> usize;
    /// A name for messages (a folder, file or index).
    fn name(&self, i: usize) -> String;
    /// Sample `i` as (input name, tensor) pairs.
    fn load(&self, i: usize) -> Result<Vec<(String, Tensor)>, String>;
}

/// How the pipeline runs.
#[derive(Debug, Clone, Default)]
pub struct QuantizeOptions {
    /// Worker threads for calibration (0: all cores).
    pub threads: usize,
    /// Fail when the target rejects a requested qconfig instead of keeping the node float.
    pub strict: bool,
}

/// Errors of the pipeline, each naming the stage and what it concerns.
#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error("the calibration set is empty: give at least one sample")]
    NoSamples,
    #[error("calibration sample '{sample}': {reason}")]
    Sample { sample: String, reason: String },
    #[error("{stage}: {reason}")]
    Stage { stage: &'static str, reason: String },
    #[error("--strict: {count} node(s) stay in float because the target rejects the requested qconfig; first: {first}")]
    Strict { count: usize, first: String },
}

fn stage<E: std::fmt::Display>(stage: &'static str) -> impl Fn(E) -> QuantizeError {
    move |e| QuantizeError::Stage { stage, reason: e.to_string() }
}

/// Quantizes `model` (left untouched) with `quantizer`, calibrating on `samples`.
/// `progress(done, total)` is called after each calibration sample.
pub fn quantize(model: &Model, quantizer: &dyn Quantizer, samples: &dyn SampleSource, opts: &QuantizeOptions, progress: &mut dyn FnMut(usize, usize)) -> Result<(Model, Report), QuantizeError> {
    if samples.len() == 0 {
        return Err(QuantizeError::NoSamples);
    }
    let started = Instant::now();
    let mut m = model.clone();
    // Fuse.
    let paths: Vec<_> = graphs(&m.graph).into_iter().map(|(p, _)| p).collect();
    let mut folded = 0;
    let opsets = m.opset_imports.clone();
    for p in &paths {
        let g = graph_at_mut(&mut m.graph, p).expect("path from graphs()");
        fold_constants(g, &opsets).map_err(stage("fold_constants"))?;
        folded += fold_batch_norm(g).map_err(stage("fold_batch_norm"))?;
    }
    m.graph.check().map_err(stage("fuse"))?;
    qforge_ir::infer::infer_model(&mut m);
    // Annotate.
    let all = graphs(&m.graph);
    let annotated: Vec<_> = all.iter().map(|(_, g)| quantizer.annotate(g)).collect();
    if opts.strict {
        let rejected: Vec<String> = all.iter().zip(&annotated).flat_map(|((_, g), a)| {
            a.float.iter().filter(|f| f.kind == FloatKind::ConfigRejected).map(|f| format!("{}: {}", g.node(f.node).map(|n| n.display_name(f.node)).unwrap_or_default(), f.reason)).collect::<Vec<_>>()
        }).collect();
        if let Some(first) = rejected.first() {
            return Err(QuantizeError::Strict { count: rejected.len(), first: first.clone() });
        }
    }
    let mut report = Report { samples: samples.len(), batch_norms_folded: folded, ..Default::default() };
    let graph_names: Vec<String> = all.iter().map(|(_, g)| g.name.clone()).collect();
    for (((_, g), a), gname) in all.iter().zip(&annotated).zip(&graph_names) {
        let record = |n: qforge_ir::NodeId| (g.node(n).map(|x| x.display_name(n)).unwrap_or_default(), g.node(n).map(|x| x.qualified_op()).unwrap_or_default());
        for (&n, ann) in &a.nodes {
            let (name, op) = record(n);
            report.nodes.push(NodeRecord { graph: gname.clone(), name, op, quantized: true, rule: Some(ann.rule.clone()), kind: None, reason: None });
        }
        for f in &a.float {
            let (name, op) = record(f.node);
            report.nodes.push(NodeRecord { graph: gname.clone(), name, op, quantized: false, rule: None, kind: Some(f.kind), reason: Some(f.reason.clone()) });
        }
    }
    // Prepare and calibrate.
    let mut plan = QuantPlan::new(&m.graph, annotated);
    let session = Session::with_options(&m, SessionOptions { threads: opts.threads }).map_err(stage("calibration session"))?;
    let calib_started = Instant::now();
    for i in 0..samples.len() {
        let feed = samples.load(i).map_err(|reason| QuantizeError::Sample { sample: samples.name(i), reason })?;
        session.run_with_hooks(feed, &mut plan.calibrator()).map_err(|e| QuantizeError::Sample { sample: samples.name(i), reason: e.to_string() })?;
        progress(i + 1, samples.len());
    }
    report.calibration_seconds = calib_started.elapsed().as_secs_f64();
    // Convert, innermost graphs first so a parent's patch sees its final subgraphs.
    let params: Vec<_> = plan.groups.iter().map(group_qparams).collect();
    let opset_before = m.opset("").unwrap_or(1);
    let mut need = opset_before;
    for gi in (0..plan.graphs.len()).rev() {
        let g = graph_at_mut(&mut m.graph, &plan.graphs[gi].path).expect("planned path");
        let log = convert_graph(g, &plan, gi, &params).map_err(stage("convert"))?;
        g.remove_dead_nodes();
        need = need.max(log.min_opset);
        report.add_log(&graph_names[gi], &plan, &log);
    }
    m.graph.check().map_err(stage("convert"))?;
    if need > opset_before {
        crate::passes::upgrade_opset(&mut m, need).map_err(stage("upgrade_opset"))?;
    }
    report.opset = (opset_before, m.opset("").unwrap_or(opset_before));
    report.total_seconds = started.elapsed().as_secs_f64();
    Ok((m, report))
}
