//! `qforge quantize`: static post-training quantization to a QDQ ONNX model.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use qforge_data::{CalibrationSet, ModelInput};
use qforge_ir::{Dim, Model, Tensor};
use qforge_quant::backend::BackendConfig;
use qforge_quant::pipeline::{quantize, QuantizeOptions, SampleSource};
use qforge_quant::qconfig::{QConfigMapping, RangeName};
use qforge_quant::quantizer::{default_qconfig, ConfigQuantizer};

/// What `qforge quantize` was asked to do.
pub struct QuantizeArgs {
    pub model: PathBuf,
    pub output: PathBuf,
    pub calibration_data: PathBuf,
    pub backend: String,
    pub config: Option<PathBuf>,
    pub method: String,
    pub per_tensor: bool,
    pub exclude: Vec<String>,
    pub report: Option<PathBuf>,
    pub strict: bool,
    pub threads: usize,
    pub json: bool,
}

struct Samples(CalibrationSet);

impl SampleSource for Samples {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn name(&self, i: usize) -> String {
        self.0.sample_name(i).to_string()
    }
    fn load(&self, i: usize) -> Result<Vec<(String, Tensor)>, String> {
        self.0.load(i).map_err(|e| e.to_string())
    }
}

/// The model's inputs as the calibration loader checks them.
fn model_inputs(m: &Model) -> Vec<ModelInput> {
    let g = &m.graph;
    g.inputs().iter().filter_map(|&v| g.value(v).ok()).map(|v| ModelInput {
        name: v.name.clone(),
        dtype: v.ty.as_ref().and_then(|t| t.elem()),
        dims: v.ty.as_ref().and_then(|t| t.shape()).map(|s| s.iter().map(|d| match d {
            Dim::Known(k) if *k >= 0 => Some(*k as usize),
            _ => None,
        }).collect()),
        required: v.initializer().is_none(),
    }).collect()
}

fn method(name: &str) -> Result<RangeName> {
    Ok(match name {
        "minmax" => RangeName::Minmax,
        "percentile" => RangeName::Percentile,
        "entropy" => RangeName::Entropy,
        "l2" => RangeName::L2,
        "mse" => RangeName::Mse,
        other => bail!("--method '{other}' is not known; use minmax, percentile, entropy, l2 or mse"),
    })
}

/// Builds the QConfigMapping: the config file's, or the backend's default, plus exclusions.
fn mapping(args: &QuantizeArgs, backend: &BackendConfig) -> Result<QConfigMapping> {
    let mut m = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("cannot read --config {}", path.display()))?;
            QConfigMapping::from_toml(&text).map_err(|e| anyhow::anyhow!("--config {}: {e}", path.display()))?
        }
        None => QConfigMapping::default(),
    };
    if m.global.is_none() {
        m.global = Some(default_qconfig(backend, method(&args.method)?, !args.per_tensor));
    }
    for ex in &args.exclude {
        if ex.chars().any(|c| "^$*+?()[]{}|\\".contains(c)) {
            let re = regex::Regex::new(ex).with_context(|| format!("--exclude '{ex}' is not a valid regular expression"))?;
            m.scope_regex.push((re, None));
        } else {
            m.name.push((ex.clone(), None));
        }
    }
    Ok(m)
}

pub fn run(args: QuantizeArgs) -> Result<()> {
    let same = |a: &Path, b: &Path| a.canonicalize().ok().zip(b.canonicalize().ok()).is_some_and(|(x, y)| x == y);
    if same(&args.model, &args.output) {
        bail!("-o {} is the input model; write the quantized model to another file", args.output.display());
    }
    let mut model = qforge_onnx::load(&args.model).with_context(|| format!("cannot load {}", args.model.display()))?;
    qforge_onnx::fold_constant_nodes(&mut model);
    let backend = BackendConfig::load(&args.backend)?;
    let quantizer = ConfigQuantizer { mapping: mapping(&args, &backend)?, backend };
    let calib = CalibrationSet::open(&args.calibration_data, &model_inputs(&model))?;
    let show = std::io::stderr().is_terminal() && !args.json;
    let mut last_pct = 0;
    let mut progress = |done: usize, total: usize| {
        let pct = done * 100 / total;
        if show {
            eprint!("\rcalibrating: {done}/{total} samples");
            if done == total {
                eprintln!();
            }
        } else if !args.json && (pct / 25 > last_pct / 25 || done == total) {
            eprintln!("calibrating: {done}/{total} samples");
        }
        last_pct = pct;
    };
    let opts = QuantizeOptions { threads: args.threads, strict: args.strict };
    let (quantized, report) = quantize(&model, &quantizer, &Samples(calib), &opts, &mut progress)
        .with_context(|| format!("cannot quantize {}", args.model.display()))?;
    qforge_onnx::save(&quantized, &args.output).with_context(|| format!("cannot write {}", args.output.display()))?;
    if let Some(path) = &args.report {
        let text = serde_json::to_string_pretty(&report)?;
        write_atomic(path, text.as_bytes()).with_context(|| format!("cannot write --report {}", path.display()))?;
    }
    if args.json {
        let q = report.nodes.iter().filter(|n| n.quantized).count();
        println!("{}", serde_json::json!({
            "output": args.output, "nodes": report.nodes.len(), "quantized_nodes": q,
            "activations": report.activations.len(), "constants": report.constants.len(),
            "float": report.nodes.iter().filter(|n| !n.quantized).map(|n| serde_json::json!({"graph": n.graph, "node": n.name, "op": n.op, "reason": n.reason})).collect::<Vec<_>>(),
            "calibration_seconds": report.calibration_seconds, "total_seconds": report.total_seconds,
        }));
    } else {
        eprint!("{}", report.summary());
        eprintln!("wrote {}", args.output.display());
    }
    Ok(())
}

/// Writes a file through a temporary file in the same folder and a rename.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp = dir.join(format!(".{}.tmp{}", path.file_name().and_then(|n| n.to_str()).unwrap_or("report"), std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}
