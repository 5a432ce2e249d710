//! `qforge sensitivity`: how much each observation group and quantized weight alone moves the
//! outputs, most sensitive first.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use qforge_quant::pipeline::{calibrate, QuantizeOptions, SampleSource};
use qforge_quant::sensitivity::{analyze, Sensitivity, EVALUATION_ELEMENTS, EVALUATION_SAMPLES};

use crate::quantize::{check_mapping, quantizer, QuantizerArgs};
use crate::samples::{model_inputs, open_samples, progress, trial_progress};
use qforge_quant::pipeline::FirstSamples;

/// What `qforge sensitivity` was asked to do.
pub struct SensitivityArgs {
    pub model: PathBuf,
    pub calibration_data: PathBuf,
    /// Calibrate on this many samples spread over the set.
    pub calibration_samples: Option<usize>,
    /// Evaluation samples; the calibration data when absent.
    pub data: Option<PathBuf>,
    pub quantizer: QuantizerArgs,
    pub json: bool,
    pub threads: usize,
    /// Evaluate on the first N samples; by default as many of the first samples as
    /// [`EVALUATION_SAMPLES`] and [`EVALUATION_ELEMENTS`] allow.
    pub limit: Option<usize>,
}

pub fn run(args: SensitivityArgs) -> Result<()> {
    if args.limit == Some(0) {
        bail!("--limit 0 evaluates nothing; give at least 1");
    }
    let mut model = qforge_onnx::load(&args.model).with_context(|| format!("cannot load {}", args.model.display()))?;
    qforge_onnx::fold_constant_nodes(&mut model);
    let quantizer = quantizer(&args.quantizer)?;
    check_mapping(&args.quantizer, &model, false)?;
    let inputs = model_inputs(&model);
    let mut calibration = open_samples(&args.calibration_data, &inputs)?;
    if let Some(n) = args.calibration_samples {
        calibration = calibration.spread(n)?;
    }
    let evaluation = match &args.data {
        Some(path) => open_samples(path, &inputs)?,
        None => open_samples(&args.calibration_data, &inputs)?,
    };
    let first = match args.limit {
        Some(n) => FirstSamples { source: &evaluation, len: n.min(evaluation.len()) },
        None => FirstSamples::within(&evaluation, EVALUATION_SAMPLES, EVALUATION_ELEMENTS)
            .map_err(|(sample, reason)| anyhow::anyhow!("sample '{sample}': {reason}"))?,
    };
    let opts = QuantizeOptions { threads: args.threads, strict: false, ..Default::default() };
    let calibrated = calibrate(&model, quantizer.as_ref(), &calibration, &opts, &mut progress("calibrating", args.json))
        .with_context(|| format!("cannot calibrate {}", args.model.display()))?;
    let analysis = analyze(&calibrated, &first, args.threads, &mut trial_progress(args.json))
        .with_context(|| format!("cannot analyze {}", args.model.display()))?;
    if args.json {
        let mut doc = serde_json::to_value(&analysis)?;
        doc["model"] = args.model.display().to_string().into();
        doc["data"] = args.data.as_ref().unwrap_or(&args.calibration_data).display().to_string().into();
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", render(&analysis, &args));
    }
    Ok(())
}

fn db(v: f64) -> String {
    if v.is_finite() { format!("{v:.2}") } else { format!("{v}") }
}

/// The ranking table, most sensitive first.
fn render(s: &Sensitivity, args: &SensitivityArgs) -> String {
    let mut out = String::new();
    let deployed = s.all_quantized_as_deployed_sqnr_db.map(|v| format!(" ({} dB as deployed: QDQ units as integer operators, rounding as ONNX Runtime does)", db(v))).unwrap_or_default();
    let _ = writeln!(out, "{}: {} group(s) on {} sample(s) in {:.1} s; every group quantized: lowest output SQNR {} dB{deployed}",
        args.model.display(), s.ranking.len(), s.samples, s.seconds, db(s.all_quantized_sqnr_db));
    let _ = writeln!(out, "most sensitive first (SQNR: the lowest over the graph outputs, against the float model)\n");
    let cell = |v: &[String]| {
        let mut text = v.iter().take(2).cloned().collect::<Vec<_>>().join(", ");
        if v.len() > 2 {
            let _ = write!(text, " (+{})", v.len() - 2);
        }
        text
    };
    let rows: Vec<[String; 7]> = s.ranking.iter().enumerate().map(|(rank, u)| {
        let mut ops = u.unit.ops.clone();
        ops.dedup();
        [format!("{}", rank + 1), format!("{} #{}", u.unit.kind, u.unit.id), cell(&u.unit.values), cell(&u.unit.nodes), cell(&ops), db(u.only_quantized_sqnr_db), db(u.only_float_sqnr_db)]
    }).collect();
    let header = ["rank", "group", "values", "nodes", "ops", "only quantized dB", "only float dB"];
    let widths: Vec<usize> = (0..header.len()).map(|c| rows.iter().map(|r| r[c].len()).chain([header[c].len()]).max().unwrap_or(0)).collect();
    let line = |cells: &[String]| -> String {
        let mut l = String::new();
        for (c, text) in cells.iter().enumerate() {
            let w = widths[c];
            if c == 0 || c >= 5 {
                let _ = write!(l, "{text:>w$}  ");
            } else {
                let _ = write!(l, "{text:<w$}  ");
            }
        }
        l.trim_end().to_string()
    };
    let _ = writeln!(out, "{}", line(&header.map(String::from)));
    for r in &rows {
        let _ = writeln!(out, "{}", line(r));
    }
    if !s.not_measured.is_empty() {
        let _ = writeln!(out, "\nnot measured: {} (listed by --json)", s.not_measured.len());
    }
    out
}
