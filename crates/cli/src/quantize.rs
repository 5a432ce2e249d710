//! `qforge quantize`: static post-training quantization to a QDQ ONNX model.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use qforge_ir::Model;
use qforge_quant::backend::BackendConfig;
use qforge_quant::html::{self, Subject};
use qforge_quant::pipeline::{lower, quantize, FirstSamples, QuantFormat, QuantizeOptions};
use qforge_quant::report::Report;
use qforge_quant::sensitivity::{quantize_within_budget, Budget, BudgetOutcome, BudgetProgress, EVALUATION_ELEMENTS, EVALUATION_SAMPLES};
use qforge_quant::qconfig::{QConfigMapping, RangeName};
use qforge_quant::QType;
use qforge_quant::htp::{HtpConfig, HtpOptions, HtpQuantizer, PrecisionOptions};
use qforge_quant::quantizer::{default_mapping, default_qconfig, ConfigQuantizer, Quantizer};
use qforge_quant::weight_rounding::WeightRounding;

use crate::samples::{model_inputs, open_samples, progress, trial_progress, CalibrationSamples};

/// What `qforge quantize` was asked to do.
pub struct QuantizeArgs {
    pub model: PathBuf,
    pub output: PathBuf,
    pub calibration_data: PathBuf,
    /// Calibrate on this many samples spread over the set ([`CalibrationSamples::spread`]).
    pub calibration_samples: Option<usize>,
    pub quantizer: QuantizerArgs,
    pub report: Option<PathBuf>,
    pub strict: bool,
    pub threads: usize,
    pub json: bool,
    /// Highest default-domain opset of the output (16/4-bit Q/DQ in com.microsoft below 21).
    pub max_opset: Option<i64>,
    /// Accuracy budget: the largest relative RMS error of any output.
    pub max_output_error: Option<f64>,
    /// Accuracy budget: the lowest SQNR (dB) of any output.
    pub min_sqnr: Option<f64>,
    /// Calibration samples the written model's outputs are compared with float on (0: none).
    pub check_samples: usize,
    /// QDQ, or integer operators where a QDQ unit has one (`--format`).
    pub format: QuantFormat,
    /// Bias correction (`--bias-correction`).
    pub bias_correction: bool,
    /// Least-squares weight scales (`--weight-range mse`).
    pub weight_search: bool,
    /// How weights are rounded (`--weight-rounding`).
    pub weight_rounding: WeightRounding,
}

/// The output format of `qforge quantize`.
#[derive(clap::Args)]
pub struct FormatArgs {
    /// qdq: QuantizeLinear/DequantizeLinear around float ops; qoperator: QDQ units lowered to
    /// integer operators (QLinearConv, QLinearMatMul, MatMulInteger, com.microsoft QGemm,
    /// QLinearAdd, ...), the rest left QDQ with the reason in the report.
    #[arg(long, default_value = "qdq", value_name = "qdq|qoperator", value_parser = parse_format)]
    pub format: QuantFormat,
}

/// Corrections applied while converting (`qforge quantize`).
#[derive(clap::Args)]
pub struct CorrectionArgs {
    /// Shift the bias of every Conv and Gemm by the mean output error its weight rounding
    /// causes on the calibration data, per output channel (reported per node).
    #[arg(long, overrides_with = "no_bias_correction")]
    pub bias_correction: bool,
    /// Leave biases as they are (default).
    #[arg(long, overrides_with = "bias_correction")]
    pub no_bias_correction: bool,
    /// Weight scales: minmax (each channel's largest magnitude), or mse (the scale of least
    /// squared error among 100 %, 99 %, ..., 80 % of it, per channel).
    #[arg(long, default_value = "minmax", value_name = "minmax|mse", value_parser = ["minmax", "mse"])]
    pub weight_range: String,
    /// Weight rounding: gptq (one input at a time, moving the weights not yet rounded to make
    /// up for each rounding error, for the least layer output error on the calibration data;
    /// reported per node), nearest (each weight to its nearest integer), or auto (gptq for
    /// weights of at most 4 bits, nearest for wider ones).
    #[arg(long, default_value = "auto", value_name = "auto|nearest|gptq", value_parser = parse_rounding)]
    pub weight_rounding: WeightRounding,
}

impl CorrectionArgs {
    /// Whether bias correction runs.
    pub fn bias_correction(&self) -> bool {
        self.bias_correction && !self.no_bias_correction
    }
}

fn parse_rounding(s: &str) -> Result<WeightRounding, String> {
    match s {
        "auto" => Ok(WeightRounding::Auto),
        "nearest" => Ok(WeightRounding::Nearest),
        "gptq" => Ok(WeightRounding::Gptq),
        _ => Err(format!("'{s}' is not a weight rounding: use auto, nearest or gptq")),
    }
}

fn parse_format(s: &str) -> Result<QuantFormat, String> {
    s.parse()
}

/// How the quantizer is chosen (`--backend` and the options that go with it), shared by
/// `quantize` and `sensitivity`.
#[derive(clap::Args)]
pub struct QuantizerArgs {
    /// Target: a built-in backend (ort, x86, xnnpack, tensorrt), a BackendConfig .toml file,
    /// or htp (Qualcomm Hexagon Tensor Processor rules, with --precision and --soc).
    #[arg(long, default_value = "ort")]
    pub backend: String,
    /// A QConfigMapping .toml file (global, op_type, scope_regex, name, op_order sections);
    /// with --backend htp, per-node precisions (op_type, scope_regex, name, op_order entries
    /// with precision = "16a8w" or "float") and per-op rules ([rules] Op = "shared").
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// HTP precision (--backend htp): 8a8w (default), 16a8w, 16a16w, 16a4w, 8a4w or
    /// 16a4w-block.
    #[arg(long)]
    pub precision: Option<String>,
    /// HTP generation (v68, v69, v73, v75, v79) or chip (e.g. SM8550) to validate against
    /// (--backend htp); the newest generation when absent.
    #[arg(long)]
    pub soc: Option<String>,
    /// Input channels per weight block for block-wise 4-bit weights (16a4w-block; default 64).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Activation range: mse (the range of least squared quantization error, searched on a
    /// streaming histogram; default), minmax (the observed extremes), auto (min/max unless the
    /// mse clip cuts the quantization error 3x), percentile, entropy or l2.
    #[arg(long, default_value = "mse")]
    pub method: String,
    /// One weight scale per output channel (default).
    #[arg(long, conflicts_with = "per_tensor")]
    pub per_channel: bool,
    /// One weight scale per tensor.
    #[arg(long)]
    pub per_tensor: bool,
    /// Weights on 7 bits (int8 within [-64, 64], ONNX Runtime's `reduce_range`). On x86 CPUs
    /// without VNNI, ONNX Runtime's u8 x s8 kernels add two products into a saturating 16-bit
    /// sum; 7-bit weights keep every such sum exact.
    #[arg(long)]
    pub reduce_range: bool,
    /// Integer type of the weights: s8 (every built-in backend's default) or u8 (with
    /// --backend ort: ONNX Runtime's u8 x u8 kernels, exact on every x86 CPU, where its u8 x s8
    /// kernels saturate without VNNI; they run slower). The backend must support it.
    #[arg(long, value_name = "s8|u8")]
    pub weight_dtype: Option<String>,
    /// Keep a node, a scope, or the nodes whose scope matches a regular expression in float.
    #[arg(long, value_name = "NAME|REGEX")]
    pub exclude: Vec<String>,
    /// Print nothing on stderr (set from --json).
    #[arg(skip)]
    pub quiet: bool,
}

fn method(name: &str) -> Result<RangeName> {
    Ok(match name {
        "minmax" => RangeName::Minmax,
        "percentile" => RangeName::Percentile,
        "entropy" => RangeName::Entropy,
        "l2" => RangeName::L2,
        "mse" => RangeName::Mse,
        "auto" => RangeName::Auto,
        other => bail!("--method '{other}' is not known; use mse, minmax, auto, percentile, entropy or l2"),
    })
}

/// The QConfigMapping of the `--config` file, if one is given.
fn config_file(args: &QuantizerArgs) -> Result<Option<QConfigMapping>> {
    let Some(path) = &args.config else { return Ok(None) };
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read --config {}", path.display()))?;
    Ok(Some(QConfigMapping::from_toml(&text).map_err(|e| anyhow::anyhow!("--config {}: {e}", path.display()))?))
}

/// Builds the QConfigMapping: the config file's, or the backend's default, plus exclusions.
fn mapping(args: &QuantizerArgs, backend: &BackendConfig) -> Result<QConfigMapping> {
    let mut m = match config_file(args)? {
        Some(m) => m,
        None => default_mapping(backend, method(&args.method)?, !args.per_tensor),
    };
    if m.global.is_none() {
        m.global = Some(default_qconfig(backend, method(&args.method)?, !args.per_tensor));
    }
    if args.reduce_range {
        let global = m.global.as_mut().and_then(|q| q.weight.as_mut());
        global.context("--reduce-range: the global qconfig quantizes no weights")?.reduce_range = true;
    }
    if let Some(name) = &args.weight_dtype {
        let dtype = weight_dtype(name, backend)?;
        let global = m.global.as_mut().and_then(|q| q.weight.as_mut());
        global.context("--weight-dtype: the global qconfig quantizes no weights")?.dtype = dtype;
    }
    exclude(&mut m, &args.exclude)?;
    Ok(m)
}

/// The `--weight-dtype` type, checked against the weight types `backend` takes.
fn weight_dtype(name: &str, backend: &BackendConfig) -> Result<QType> {
    let dtype = match name {
        "s8" => QType::S8,
        "u8" => QType::U8,
        other => bail!("--weight-dtype '{other}' is not known; use s8 or u8"),
    };
    let supported = backend.weight_qtypes();
    if !supported.contains(&dtype) {
        let names: Vec<String> = supported.iter().map(|q| format!("{q:?}").to_lowercase()).collect();
        bail!("--weight-dtype {name}: backend '{}' takes weights of {} only", backend.name, names.join(", "));
    }
    Ok(dtype)
}

/// Adds `--exclude` entries (a node, a scope, or a scope regex) to keep in float.
fn exclude(m: &mut QConfigMapping, entries: &[String]) -> Result<()> {
    for ex in entries {
        if ex.chars().any(|c| "^$*+?()[]{}|\\".contains(c)) {
            let re = regex::Regex::new(ex).with_context(|| format!("--exclude '{ex}' is not a valid regular expression"))?;
            m.scope_regex.push((re, None));
        } else {
            m.name.push((ex.clone(), None));
        }
    }
    Ok(())
}

/// The HTP quantizer for `--backend htp`: `--precision` for every node, the `--config`
/// overrides, `--exclude`, validated against `--soc`.
fn htp_quantizer(args: &QuantizerArgs) -> Result<HtpQuantizer> {
    if args.weight_dtype.is_some() {
        bail!("--weight-dtype is not available with --backend htp: its precisions (--precision) fix the weight types");
    }
    if args.reduce_range {
        bail!("--reduce-range is not available with --backend htp: its precisions (--precision) fix the weight widths");
    }
    if args.per_tensor {
        bail!("--per-tensor is not available with --backend htp: HTP weights are per channel (or per block with 16a4w-block)");
    }
    let config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("cannot read --config {}", path.display()))?;
            Some(HtpConfig::from_toml(&text).with_context(|| format!("--config {}", path.display()))?)
        }
        None => None,
    };
    let options = HtpOptions {
        precision: args.precision.as_deref().unwrap_or("8a8w").parse()?,
        precision_options: PrecisionOptions { block_size: args.block_size.unwrap_or(PrecisionOptions::default().block_size), range: method(&args.method)? },
        soc: args.soc.clone(),
    };
    let mut q = HtpQuantizer::new(&options, config.as_ref())?;
    exclude(&mut q.mapping, &args.exclude)?;
    if !args.quiet {
        eprintln!("htp: precision {}, validated against {} ({})", options.precision, q.generation.name, q.generation.chips.join(", "));
    }
    Ok(q)
}

/// Checks the `--exclude` entries and the `--config` QConfigMapping entries against `model`, as
/// fused before annotation: an entry that applies to no node (a misspelt name, a regular
/// expression written for node names while it is matched against scopes) does nothing, so it is
/// an error under `strict` and a warning otherwise.
pub fn check_mapping(args: &QuantizerArgs, model: &Model, strict: bool) -> Result<()> {
    // The user's entries only: the backend's defaults are written for every model.
    let mut m = if args.backend == "htp" { QConfigMapping::default() } else { config_file(args)?.unwrap_or_default() };
    exclude(&mut m, &args.exclude)?;
    if m.op_type.is_empty() && m.scope_regex.is_empty() && m.name.is_empty() && m.op_order.is_empty() {
        return Ok(());
    }
    // Entries apply to the fused graph (a Conv with BatchNormalization folded in writes the
    // BatchNormalization's output, so a Paddle export's scope is the BatchNormalization's).
    let mut fused = model.clone();
    qforge_quant::pipeline::fuse(&mut fused).map_err(|e| anyhow::anyhow!("cannot fuse the model: {e}"))?;
    let graphs = fused.graph.graphs();
    let unmatched = m.unmatched(&graphs.iter().map(|(_, g)| *g).collect::<Vec<_>>());
    if unmatched.is_empty() {
        return Ok(());
    }
    let hint = "a name matches a node's name or scope, a regular expression (any of ^$*+?()[]{}|\\) a scope: encoder.layer.0 for /encoder/layer.0/MatMul, conv2d_12 for a Paddle node writing conv2d_12.tmp_0";
    if strict {
        bail!("--strict: {} matching no node of the model: {}; {hint}", if unmatched.len() == 1 { "an entry" } else { "entries" }, unmatched.join(", "));
    }
    for u in &unmatched {
        eprintln!("warning: {u} (--exclude or --config) matches no node of the model and does nothing");
    }
    eprintln!("  {hint}");
    Ok(())
}

/// The quantizer `--backend` names.
pub fn quantizer(args: &QuantizerArgs) -> Result<Box<dyn Quantizer>> {
    if args.backend == "htp" {
        return Ok(Box::new(htp_quantizer(args)?));
    }
    if args.precision.is_some() || args.soc.is_some() || args.block_size.is_some() {
        bail!("--precision, --soc and --block-size need --backend htp");
    }
    let backend = BackendConfig::load(&args.backend)?;
    Ok(Box::new(ConfigQuantizer { mapping: mapping(args, &backend)?, backend }))
}

pub fn run(args: QuantizeArgs) -> Result<()> {
    let same = |a: &Path, b: &Path| a.canonicalize().ok().zip(b.canonicalize().ok()).is_some_and(|(x, y)| x == y);
    if same(&args.model, &args.output) {
        bail!("-o {} is the input model; write the quantized model to another file", args.output.display());
    }
    let mut model = qforge_onnx::load(&args.model).with_context(|| format!("cannot load {}", args.model.display()))?;
    qforge_onnx::fold_constant_nodes(&mut model);
    let quantizer = quantizer(&args.quantizer)?;
    check_mapping(&args.quantizer, &model, args.strict)?;
    let mut samples = open_samples(&args.calibration_data, &model_inputs(&model))?;
    if let Some(n) = args.calibration_samples {
        samples = samples.spread(n)?;
    }
    let opts = QuantizeOptions { threads: args.threads, strict: args.strict, max_opset: args.max_opset, bias_correction: args.bias_correction, weight_search: args.weight_search, weight_rounding: args.weight_rounding, check_samples: args.check_samples };
    let (mut quantized, mut report) = match budget(&args)? {
        Some(budget) => {
            let mut analysis = trial_progress(args.json);
            let quiet = args.json;
            let evaluation = FirstSamples::within(&samples, EVALUATION_SAMPLES, EVALUATION_ELEMENTS).map_err(|(sample, reason)| anyhow::anyhow!("sample '{sample}': {reason}"))?;
            quantize_within_budget(&model, quantizer.as_ref(), &samples, &evaluation, &opts, &budget, &mut |p| match p {
                BudgetProgress::Calibrated { samples, ranking, measured } if !quiet => eprintln!("calibrated on {samples} samples; ranking every group on the first {ranking} of them, measuring the accuracy budget on {measured}"),
                BudgetProgress::Analysis { sample, samples, trial, trials } => analysis(sample, samples, trial, trials),
                BudgetProgress::Decision { step, error } if !quiet => eprintln!("accuracy budget: measurement {step}, error {error:.4e}"),
                BudgetProgress::Round(r) if !quiet => eprintln!("accuracy budget: round {}, the converted model gives {:.4e} ({:.2} dB; {:.2} dB simulated)", r.round, r.error_converted, db(r.error_converted), db(r.error_simulated)),
                _ => {}
            }).with_context(|| format!("cannot quantize {}", args.model.display()))?
        }
        None => quantize(&model, quantizer.as_ref(), &samples, &opts, &mut progress("calibrating", args.json))
            .with_context(|| format!("cannot quantize {}", args.model.display()))?,
    };
    // The HTML report compares the QDQ model (its Q/DQ pairs locate every quantized tensor).
    let qdq = (args.format == QuantFormat::QOperator && args.report.as_ref().is_some_and(|p| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("html")))).then(|| quantized.clone());
    if args.format == QuantFormat::QOperator {
        lower(&mut quantized, &mut report).with_context(|| format!("cannot lower {} to integer operators", args.model.display()))?;
    }
    qforge_onnx::save(&quantized, &args.output).with_context(|| format!("cannot write {}", args.output.display()))?;
    if let Some(path) = &args.report {
        write_report(&args, path, &model, qdq.as_ref().unwrap_or(&quantized), &report, &samples)?;
    }
    // A backend with `pair_sum_max` fits its weights to the reach of every input channel
    // (`qforge_quant::pair_sums`); for the others, the u8 x s8 weights whose pairs can saturate
    // for activations within their calibrated ranges (the largest integer each reaches).
    let fitted = BackendConfig::load(&args.quantizer.backend).is_ok_and(|b| b.pair_sum_max(qforge_quant::QType::S8).is_some());
    let saturating = (!fitted).then(|| {
        let reach: HashMap<&str, i64> = report.activations.iter().filter(|a| a.dtype == "u8" && a.scale > 0.0)
            .filter_map(|a| Some((a.value.as_str(), ((a.observed?.1 / a.scale).round() as i64 + a.zero_point).clamp(0, 255))))
            .collect();
        crate::inspect::pair_sums(&crate::inspect::folded(&quantized), &|a| a.quantized_from.as_deref().and_then(|v| reach.get(v)).map(|&r| vec![r]))
    });
    if args.json {
        let q = report.nodes.iter().filter(|n| n.quantized).count();
        println!("{}", serde_json::json!({
            "output": args.output, "nodes": report.nodes.len(), "quantized_nodes": q,
            "u8s8_pair_sums": saturating,
            "activations": report.activations.len(), "constants": report.constants.len(),
            "float": report.nodes.iter().filter(|n| !n.quantized).map(|n| serde_json::json!({"graph": n.graph, "node": n.name, "op": n.op, "reason": n.reason})).collect::<Vec<_>>(),
            "violations": report.violations,
            "widened": report.widened,
            "narrow_inputs": report.narrow_inputs,
            "narrow_weight_channels": report.narrow_weight_channels,
            "pair_sums": report.pair_sums,
            "pair_sum_reach_raised": report.pair_sum_reach_raised,
            "pair_sum_reach_exceeded": report.pair_sum_reach_exceeded,
            "accuracy_budget": report.accuracy_budget.as_ref().map(|b| serde_json::json!({
                "metric": b.metric, "max_error": b.max_error, "error_all_quantized": b.error_all_quantized, "error_final": b.error_final,
                "met": b.met, "units": b.units, "units_float": b.units_float, "weights_following": b.weights_following, "rounds": b.rounds, "prefix_search": b.prefix_search, "decisions": b.decisions,
            })),
            "calibration_seconds": report.calibration_seconds, "total_seconds": report.total_seconds,
            "lowering": report.lowering,
            "output_check": report.output_check,
        }));
    } else {
        eprint!("{}", report.summary());
        if let Some(b) = &report.accuracy_budget {
            eprint!("{}", budget_summary(b));
        }
        if let Some(c) = &report.output_check {
            eprint!("{}", c.summary());
        }
        if let Some((s, over)) = saturating.as_ref().and_then(|s| Some((s, s["saturating"].as_array().filter(|o| !o.is_empty())?))) {
            eprintln!("warning: {} of {} u8 x s8 weights have pairs whose 16-bit sum ONNX Runtime's kernels can saturate on x86 CPUs without VNNI (AVX2-only) for activations within their calibrated ranges: there, ONNX Runtime can compute other outputs than these qparams give and than the check above measured (first: weight '{}' of node '{}', {} of {} pairs); --backend ort fits the weights so that none does, and `qforge inspect` lists them",
                over.len(), s["weights"], over[0]["weight"].as_str().unwrap_or(""), over[0]["node"].as_str().unwrap_or(""), over[0]["pairs"], over[0]["of"]);
        }
        eprintln!("wrote {}", args.output.display());
    }
    Ok(())
}

/// The accuracy budget of `--max-output-error` and `--min-sqnr` (the stricter of the two:
/// a relative RMS error `E` is an SQNR of `-20·log10(E)` dB).
fn budget(args: &QuantizeArgs) -> Result<Option<Budget<'static>>> {
    if args.max_output_error.is_some_and(|e| !(e > 0.0 && e.is_finite())) {
        bail!("--max-output-error must be a positive number (a relative RMS error, e.g. 0.05)");
    }
    if args.min_sqnr.is_some_and(|d| !d.is_finite()) {
        bail!("--min-sqnr must be a finite number of dB");
    }
    let from_sqnr = args.min_sqnr.map(|db| 10f64.powf(-db / 20.0));
    Ok(match (args.max_output_error, from_sqnr) {
        (None, None) => None,
        (Some(a), Some(b)) => Some(Budget::relative_rms(a.min(b))),
        (Some(e), None) | (None, Some(e)) => Some(Budget::relative_rms(e)),
    })
}

/// An error as SQNR in dB, for a relative RMS error.
fn db(e: f64) -> f64 {
    -20.0 * e.log10()
}

/// The accuracy budget's search, for people: each round's prefix measurements, the converted
/// model's error, and the units left float (the report's `accuracy_budget` has every trial of
/// the walk back).
fn budget_summary(b: &BudgetOutcome) -> String {
    let missed = match b.rounds.last() {
        _ if b.met => String::new(),
        Some(r) if r.error_simulated > r.max_error_simulated => "; NOT MET even with every ranked group float".into(),
        Some(r) => format!("; NOT MET after {} round(s)", r.round),
        None => "; NOT MET".into(),
    };
    let mut s = format!("accuracy budget: {} <= {:.4e} ({:.2} dB): {:.4e} with every group quantized ({:.2} dB, simulated), {:.4e} ({:.2} dB) converted, after {} measurement(s); {} of {} groups float{missed}\n",
        b.metric, b.max_error, db(b.max_error), b.error_all_quantized, db(b.error_all_quantized), b.error_final, db(b.error_final),
        b.prefix_search.len() + b.decisions.len(), b.units_float, b.units);
    for r in &b.rounds {
        let prefix: Vec<String> = b.prefix_search.iter().filter(|t| t.round == r.round).map(|t| format!("{} float: {:.4e}", t.units_float, t.error)).collect();
        let walked: Vec<_> = b.decisions.iter().filter(|d| d.round == r.round).collect();
        let requantized = walked.iter().filter(|d| !d.kept_float).count();
        s += &format!("  round {}: simulated error <= {:.4e} ({:.2} dB)\n", r.round, r.max_error_simulated, db(r.max_error_simulated));
        if !prefix.is_empty() {
            s += &format!("    most sensitive groups returned to float, searched: {}\n", prefix.join("; "));
        }
        if !walked.is_empty() {
            s += &format!("    walked back over {} group(s): {requantized} quantized again\n", walked.len());
        }
        s += &format!("    {} groups float: {:.4e} simulated ({:.2} dB), {:.4e} converted ({:.2} dB)\n", r.units_float, r.error_simulated, db(r.error_simulated), r.error_converted, db(r.error_converted));
    }
    if b.units_float > 0 {
        s += "  these stay float:\n";
    }
    for d in b.decisions.iter().filter(|d| d.kept_float) {
        s += &format!("  float {} #{} [{}] ({}): {:.4e}, quantized {:.4e}\n", d.unit.kind, d.unit.id, d.unit.values.join(", "), d.unit.ops.join(", "), d.error_float, d.error_quantized);
    }
    for w in &b.weights_following {
        s += &format!("  float {} #{} [{}] ({}): with the activation it multiplies (ONNX Runtime would quantize a float activation read with an 8-bit weight at run time)\n", w.kind, w.id, w.values.join(", "), w.ops.join(", "));
    }
    s
}

/// Writes `--report`: for a path ending in `.html`, the HTML report with SVG plots, and its
/// data as JSON beside it (the same path with `.json`); otherwise the report as JSON.
fn write_report(args: &QuantizeArgs, path: &Path, model: &Model, quantized: &Model, report: &Report, samples: &CalibrationSamples) -> Result<()> {
    let write = |path: &Path, text: String| write_atomic(path, text.as_bytes()).with_context(|| format!("cannot write --report {}", path.display()));
    if !path.extension().is_some_and(|e| e.eq_ignore_ascii_case("html")) {
        return write(path, serde_json::to_string_pretty(report)?);
    }
    let json_path = path.with_extension("json");
    let backend = match &args.quantizer.precision {
        Some(p) => format!("{} {p}", args.quantizer.backend),
        None => args.quantizer.backend.clone(),
    };
    let subject = Subject {
        model: args.model.display().to_string(),
        output: args.output.display().to_string(),
        backend,
        calibration_data: args.calibration_data.display().to_string(),
        json: json_path.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
    };
    let data = html::build(subject, model, quantized, report, samples, args.threads, &mut progress("comparing for the report", args.json))
        .with_context(|| format!("cannot build the HTML report {}", path.display()))?;
    write(&json_path, serde_json::to_string_pretty(&data)?)?;
    write(path, html::render(&data))?;
    if !args.json {
        eprintln!("wrote {} and {} ({:.2} s)", path.display(), json_path.display(), data.seconds);
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
