//! The HTML quantization report: one self-contained page (inline CSS and SVG, no scripts, no
//! network references) with the run's summary, per-layer SQNR along the graph order,
//! activation histograms with their quantization ranges, per-channel weight ranges, the
//! sensitivity ranking of an accuracy budget, and every node left in float with its reason.
//!
//! [`build`] gathers the data: it runs [`compare`] between the float model (fused as the
//! quantizer fuses it) and the quantized model on the first calibration samples (see
//! [`FirstSamples::within`]), then one more float run that histograms the
//! [`WORST_ACTIVATIONS`] activations with the lowest SQNR, and reads the per-channel ranges of
//! the [`WORST_WEIGHTS`] weights with the lowest channel SQNR from the models. [`render`]
//! writes the page; it is a pure function of the [`HtmlReport`], so the same data gives the
//! same bytes. The [`HtmlReport`] serializes to JSON with everything the page shows.

mod render;
pub mod svg;

use std::collections::HashMap;
use std::time::Instant;

use qforge_ir::{Graph, Model, Tensor, ValueKind};
use qforge_runtime::{Hooks, Session, SessionOptions, ValueEvent};
use serde::Serialize;

use crate::compare::{compare, CompareError, Comparison};
use crate::observer::{AxisLayout, Histogram};
use crate::pipeline::{fuse, FirstSamples, SampleSource};
use crate::report::Report;
use crate::QType;

pub use render::render;

/// The most samples the report compares and histograms.
pub const MAX_REPORT_SAMPLES: usize = 8;
/// Samples are taken while the inputs taken so far hold fewer elements than this (at least one
/// sample is always taken), so large inputs keep the report's cost near one comparison run.
pub const REPORT_ELEMENT_BUDGET: usize = 1 << 20;
/// Activations given a histogram: those with the lowest SQNR.
pub const WORST_ACTIVATIONS: usize = 12;
/// Weights given a per-channel range plot: those with the lowest channel SQNR (int32 biases
/// aside).
pub const WORST_WEIGHTS: usize = 8;
/// Histogram bins at most (canonical grid, see [`Histogram`]).
pub const HISTOGRAM_BINS: usize = 256;

/// Errors while gathering the report's data.
#[derive(Debug, thiserror::Error)]
pub enum HtmlReportError {
    #[error("comparing the quantized model with the float model: {0}")]
    Compare(#[from] CompareError),
    #[error("the float model: {0}")]
    Model(String),
    #[error("sample '{sample}': {reason}")]
    Sample { sample: String, reason: String },
}

/// What the report is about, as the user named it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Subject {
    /// The float model (a path or name).
    pub model: String,
    /// The quantized model written.
    pub output: String,
    /// The backend or quantizer.
    pub backend: String,
    /// The calibration data.
    pub calibration_data: String,
    /// Where the same data is written as JSON, as the page names it.
    pub json: String,
}

/// The calibration histogram of one quantized activation with a low SQNR.
#[derive(Debug, Clone, Serialize)]
pub struct ActivationHistogram {
    /// Its index in [`Comparison::activations`].
    pub comparison: usize,
    /// Its index in [`Report::activations`] (scale, zero point, ranges).
    pub activation: usize,
    pub value: String,
    /// The values it took on the report's samples.
    pub histogram: Histogram,
}

/// The per-channel ranges of one quantized weight.
#[derive(Debug, Clone, Serialize)]
pub struct WeightRanges {
    /// Its index in [`Comparison::weights`].
    pub comparison: usize,
    pub name: String,
    /// Per channel along the comparison's axis (one entry for a weight without one), the float
    /// weight's smallest and largest value.
    pub min: Vec<f32>,
    pub max: Vec<f32>,
    /// Per channel, the real values the stored integer type represents,
    /// `scale·(qmin − zero_point)` to `scale·(qmax − zero_point)`; empty when the scales are
    /// not one per channel (block-wise weights).
    pub clip: Vec<(f32, f32)>,
}

/// Everything the HTML report shows.
#[derive(Debug, Clone, Serialize)]
pub struct HtmlReport<'a> {
    pub subject: Subject,
    /// The quantization run's report.
    pub report: &'a Report,
    /// The float model against the quantized one on the first [`Comparison::samples`]
    /// calibration samples.
    pub comparison: Comparison,
    /// Histograms of the activations with the lowest SQNR, lowest first.
    pub histograms: Vec<ActivationHistogram>,
    /// Per-channel ranges of the weights with the lowest channel SQNR, in graph order.
    pub weights: Vec<WeightRanges>,
    /// Time spent gathering this data (comparison, histograms, weight ranges).
    pub seconds: f64,
}

/// Gathers the report's data for `quantized`, quantized from `float` with `report`, on the
/// first samples of `samples` ([`MAX_REPORT_SAMPLES`] at most, within [`REPORT_ELEMENT_BUDGET`], see [`FirstSamples::within`]) with `threads` worker threads (0: all
/// cores). `progress(done, total)` is called after each compared sample. Neither model is
/// modified.
pub fn build<'a>(subject: Subject, float: &Model, quantized: &Model, report: &'a Report, samples: &dyn SampleSource, threads: usize, progress: &mut dyn FnMut(usize, usize)) -> Result<HtmlReport<'a>, HtmlReportError> {
    let started = Instant::now();
    let first = FirstSamples::within(samples, MAX_REPORT_SAMPLES, REPORT_ELEMENT_BUDGET).map_err(|(sample, reason)| HtmlReportError::Sample { sample, reason })?;
    let comparison = compare(float, quantized, &first, threads, progress)?;
    let mut fused = float.clone();
    fuse(&mut fused).map_err(HtmlReportError::Model)?;
    let histograms = worst_histograms(&fused, &comparison, report, &first, threads)?;
    let weights = worst_weight_ranges(&fused, quantized, &comparison);
    Ok(HtmlReport { subject, report, comparison, histograms, weights, seconds: started.elapsed().as_secs_f64() })
}

/// Histograms, on `samples`, of the [`WORST_ACTIVATIONS`] compared activations with Q/DQ and
/// the lowest SQNR, lowest first.
fn worst_histograms(fused: &Model, comparison: &Comparison, report: &Report, samples: &dyn SampleSource, threads: usize) -> Result<Vec<ActivationHistogram>, HtmlReportError> {
    let by_value: HashMap<&str, usize> = report.activations.iter().enumerate().rev().map(|(i, a)| (a.value.as_str(), i)).collect();
    let mut candidates: Vec<(usize, usize)> = comparison.activations.iter().enumerate()
        .filter(|(_, t)| t.fake_quantized && t.metrics.count > 0)
        .filter_map(|(i, t)| by_value.get(t.name.as_str()).map(|&a| (i, a)))
        .collect();
    candidates.sort_by(|a, b| comparison.activations[a.0].metrics.sqnr_db.total_cmp(&comparison.activations[b.0].metrics.sqnr_db).then(a.0.cmp(&b.0)));
    candidates.truncate(WORST_ACTIVATIONS);
    if candidates.is_empty() {
        return Ok(vec![]);
    }
    let session = Session::with_options(fused, SessionOptions { threads }).map_err(|e| HtmlReportError::Model(e.to_string()))?;
    let mut recorder = HistogramRecorder {
        slots: candidates.iter().enumerate().map(|(k, &(i, _))| (comparison.activations[i].name.clone(), k)).collect(),
        histograms: vec![Histogram::new(HISTOGRAM_BINS); candidates.len()],
    };
    for i in 0..samples.len() {
        let sample_error = |reason: String| HtmlReportError::Sample { sample: samples.name(i), reason };
        let feed = samples.load(i).map_err(sample_error)?;
        session.run_with_hooks(feed, &mut recorder).map_err(|e| sample_error(format!("the float model failed: {e}")))?;
    }
    Ok(candidates.into_iter().zip(recorder.histograms).map(|((comparison_index, activation), histogram)| ActivationHistogram {
        comparison: comparison_index,
        activation,
        value: comparison.activations[comparison_index].name.clone(),
        histogram,
    }).collect())
}

/// Hooks adding the float32 values of watched value names to their histograms.
struct HistogramRecorder {
    slots: HashMap<String, usize>,
    histograms: Vec<Histogram>,
}

impl Hooks for HistogramRecorder {
    fn on_value(&mut self, event: &ValueEvent, value: &Tensor) -> Option<Tensor> {
        let &k = self.slots.get(event.name)?;
        if let Ok(data) = value.as_slice::<f32>() {
            self.histograms[k].observe(data);
        }
        None
    }
}

/// Per-channel ranges of the [`WORST_WEIGHTS`] compared weights with the lowest channel SQNR
/// (whole-tensor SQNR without channels), in graph order. Constants stored as int32 (biases,
/// whose range follows from their input's and weight's scales) and weights whose float
/// initializer or `DequantizeLinear` is not found are left out.
fn worst_weight_ranges(fused: &Model, quantized: &Model, comparison: &Comparison) -> Vec<WeightRanges> {
    let quant_graphs = quantized.graph.graphs();
    let mut stored: Vec<(usize, Vec<(f32, f32)>)> = comparison.weights.iter().enumerate().filter_map(|(i, w)| {
        let (qtype, clip) = quant_graphs.iter().find_map(|(_, g)| dequantized_range(g, &w.compared_with))?;
        (qtype != QType::S32).then_some((i, clip))
    }).collect();
    let key = |i: usize| {
        let w = &comparison.weights[i];
        w.min_channel_sqnr_db.unwrap_or(w.metrics.sqnr_db)
    };
    stored.sort_by(|a, b| key(a.0).total_cmp(&key(b.0)).then(a.0.cmp(&b.0)));
    stored.truncate(WORST_WEIGHTS);
    stored.sort_by_key(|s| s.0);
    let float_graphs = fused.graph.graphs();
    stored.into_iter().filter_map(|(i, clip)| {
        let w = &comparison.weights[i];
        let tensor = float_graphs.iter().find_map(|(_, g)| constant(g, &w.name))?;
        let (min, max) = channel_extremes(tensor, w.axis)?;
        let clip = if clip.len() == min.len() { clip } else { vec![] };
        Some(WeightRanges { comparison: i, name: w.name.clone(), min, max, clip })
    }).collect()
}

/// The initializer named `name` in `g`.
fn constant<'g>(g: &'g Graph, name: &str) -> Option<&'g Tensor> {
    g.value(g.value_by_name(name)?).ok()?.initializer()
}

/// The smallest and largest finite value of each channel of `t` along `axis` (the whole
/// tensor as one channel without an axis).
fn channel_extremes(t: &Tensor, axis: Option<usize>) -> Option<(Vec<f32>, Vec<f32>)> {
    let data: Vec<f32> = match t.as_slice::<f32>() {
        Ok(d) => d.to_vec(),
        Err(_) => t.to_f64_vec().ok()?.into_iter().map(|v| v as f32).collect(),
    };
    let layout = AxisLayout::new(t.shape(), axis)?;
    let mut min = vec![f32::INFINITY; layout.channels];
    let mut max = vec![f32::NEG_INFINITY; layout.channels];
    layout.for_each_run(&data, |c, run| {
        let (lo, hi, _) = crate::observer::finite_extremes(run);
        min[c] = min[c].min(lo);
        max[c] = max[c].max(hi);
    });
    Some((min, max))
}

/// The stored integer type of the `DequantizeLinear` producing `output` in `g`, and per scale
/// the real range that type represents.
fn dequantized_range(g: &Graph, output: &str) -> Option<(QType, Vec<(f32, f32)>)> {
    let v = g.value_by_name(output).filter(|&v| g.value(v).is_ok_and(|x| x.kind() == ValueKind::NodeOutput))?;
    let dq = g.node(g.producer(v)?.0).ok().filter(|n| n.op_type == "DequantizeLinear")?;
    let initializer = |i: usize| dq.input(i).and_then(|v| g.value(v).ok()).and_then(|v| v.initializer());
    let qtype = QType::from_dtype(initializer(0)?.dtype())?;
    let (qmin, qmax) = qtype.range();
    let scales = initializer(1)?.to_f64_vec().ok()?;
    let zero_points = match initializer(2) {
        Some(z) => z.to_f64_vec().ok()?,
        None => vec![0.0; scales.len()],
    };
    (zero_points.len() == scales.len()).then(|| (qtype, scales.iter().zip(&zero_points).map(|(&s, &z)| {
        let (s, z) = (s as f32, z as i64);
        (s * (qmin - z) as f32, s * (qmax - z) as f32)
    }).collect()))
}
