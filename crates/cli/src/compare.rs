//! `qforge compare`: per-tensor error of a quantized model against its float original, on
//! sample data.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use qforge_ir::Model;
use qforge_quant::compare::{compare, Comparison, TensorComparison};
use qforge_quant::pipeline::SampleSource;

use crate::samples::{model_inputs, open_samples, progress};
use qforge_quant::pipeline::FirstSamples;

/// What `qforge compare` was asked to do.
pub struct CompareArgs {
    pub float: PathBuf,
    pub quantized: PathBuf,
    pub data: PathBuf,
    pub json: bool,
    pub threads: usize,
    /// Compare on the first N samples only.
    pub limit: Option<usize>,
}

fn load(path: &Path) -> Result<Model> {
    let mut model = qforge_onnx::load(path).with_context(|| format!("cannot load {}", path.display()))?;
    qforge_onnx::fold_constant_nodes(&mut model);
    Ok(model)
}

pub fn run(args: CompareArgs) -> Result<()> {
    if args.limit == Some(0) {
        bail!("--limit 0 compares nothing; give at least 1");
    }
    let float = load(&args.float)?;
    let quant = load(&args.quantized)?;
    let samples = open_samples(&args.data, &model_inputs(&float))?;
    let len = args.limit.map_or(samples.len(), |n| n.min(samples.len()));
    let started = Instant::now();
    let comparison = compare(&float, &quant, &FirstSamples { source: &samples, len }, args.threads, &mut progress("comparing", args.json))
        .with_context(|| format!("cannot compare {} with {}", args.quantized.display(), args.float.display()))?;
    let seconds = started.elapsed().as_secs_f64();
    if args.json {
        let mut doc = serde_json::to_value(&comparison)?;
        doc["float"] = args.float.display().to_string().into();
        doc["quantized"] = args.quantized.display().to_string().into();
        doc["data"] = args.data.display().to_string().into();
        doc["seconds"] = seconds.into();
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", render(&comparison, &args, seconds));
    }
    Ok(())
}

fn db(v: f64) -> String {
    if v.is_finite() { format!("{v:.2}") } else { format!("{v}") }
}

fn qualified(t: &TensorComparison) -> String {
    if t.graph.is_empty() { t.name.clone() } else { format!("{}:{}", t.graph, t.name) }
}

/// A table of tensors, one row each.
fn tensor_table(out: &mut String, rows: &[TensorComparison]) {
    let width = rows.iter().map(|t| qualified(t).len()).chain([6]).max().unwrap_or(6);
    let op_width = rows.iter().map(|t| t.op.len()).chain([2]).max().unwrap_or(2);
    let _ = writeln!(out, "{:<width$}  {:<op_width$}  Q/DQ  {:>8}  {:>9}  {:>8}  {:>9}  {:>10}", "tensor", "op", "SQNR dB", "MSE", "cosine", "max |err|", "elements");
    for t in rows {
        let m = &t.metrics;
        let _ = write!(out, "{:<width$}  {:<op_width$}  {:<4}  {:>8}  {:>9.3e}  {:>8.6}  {:>9.3e}  {:>10}", qualified(t), t.op, if t.fake_quantized { "yes" } else { "-" },
            db(m.sqnr_db), m.mse, m.cosine, m.max_abs_error, m.count);
        if m.non_finite > 0 || t.unpaired > 0 {
            let _ = write!(out, "  ({} NaN/Inf elements left out, {} occurrences unpaired)", m.non_finite, t.unpaired);
        }
        out.push('\n');
    }
}

/// The human-readable report.
fn render(c: &Comparison, args: &CompareArgs, seconds: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{} against {} on {} sample(s), {seconds:.2} s", args.quantized.display(), args.float.display(), c.samples);
    let _ = writeln!(out, "\nactivations, in graph order (Q/DQ yes: compared with the fake-quantized value; elements: over all samples)");
    tensor_table(&mut out, &c.activations);
    let _ = writeln!(out, "\ngraph outputs (the QDQ graph as written: float arithmetic between Dequantize and Quantize)");
    tensor_table(&mut out, &c.outputs);
    if let Some(as_run) = &c.outputs_as_run {
        let _ = writeln!(out, "\ngraph outputs as deployed (QDQ units as integer operators, rounding as ONNX Runtime does)");
        tensor_table(&mut out, as_run);
    }
    if !c.weights.is_empty() {
        let width = c.weights.iter().map(|w| w.name.len()).chain([6]).max().unwrap_or(6);
        let consumer_width = c.weights.iter().map(|w| w.consumer.len()).chain([8]).max().unwrap_or(8);
        let _ = writeln!(out, "\nquantized constants (per channel: over the DequantizeLinear's axis)");
        let _ = writeln!(out, "{:<width$}  {:<consumer_width$}  {:>8}  {:>9}  {:>9}  {:>8}", "weight", "read by", "SQNR dB", "min ch", "median ch", "channels");
        for w in &c.weights {
            let channel = |v: Option<f64>| v.map_or("-".to_string(), db);
            let _ = writeln!(out, "{:<width$}  {:<consumer_width$}  {:>8}  {:>9}  {:>9}  {:>8}", w.name, w.consumer, db(w.metrics.sqnr_db),
                channel(w.min_channel_sqnr_db), channel(w.median_channel_sqnr_db), w.channel_sqnr_db.len());
        }
    }
    let _ = writeln!(out, "\nworst 10 by SQNR");
    for (i, t) in c.worst(10).iter().enumerate() {
        let _ = writeln!(out, "{:>3}. {:>8} dB  {} ({})", i + 1, db(t.metrics.sqnr_db), qualified(t), t.op);
    }
    if !c.unmatched.is_empty() || !c.unmatched_weights.is_empty() {
        let _ = writeln!(out, "\nnot compared: {} float value(s) with no counterpart, {} quantized constant(s) with no float original (listed by --json)",
            c.unmatched.len(), c.unmatched_weights.len());
    }
    out
}
