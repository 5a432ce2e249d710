//! The `qforge` command-line tool.

mod compare;
mod inspect;
mod quantize;
mod run;
mod samples;
mod sensitivity;

/// The runtime allocates and frees tensors of the same sizes on every run. mimalloc, told not
/// to return freed pages to the OS while the process lives, reuses them instead of taking a
/// page fault per page when they are touched again (a det sensitivity analysis took 407k
/// faults and 35 s of system time with a 5 s purge delay, 4k and 7 s without purging). The
/// peak resident memory is the same either way; it is kept until the command exits.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` of `mimalloc.h` (v3, the version libmimalloc-sys builds by
/// default; the same index in v2): milliseconds before freed memory is purged, -1 for never.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// qforge: post-training quantization for ONNX models.
#[derive(Parser)]
#[command(name = "qforge", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Describe a model: opsets, inputs and outputs, op histogram, parameters, subgraphs,
    /// and ops the qforge runtime does not support.
    Inspect {
        model: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Sample data (calibration-data formats) to run the model on: the pair-sum check then
        /// uses how far each activation channel reaches on it instead of the full u8 range.
        #[arg(long, value_name = "PATH")]
        data: Option<PathBuf>,
        /// With --data, run only the first N samples.
        #[arg(long, value_name = "N", requires = "data")]
        limit: Option<usize>,
    },
    /// Run a model on inputs given as .npy files and save its outputs as .npz.
    Run {
        model: PathBuf,
        /// An input as NAME=FILE.npy; repeat for each input.
        #[arg(long = "input", value_name = "NAME=FILE")]
        inputs: Vec<String>,
        /// Where to write the outputs (.npz, one array per output).
        #[arg(short, long)]
        output: PathBuf,
        /// Worker threads (0 = all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
    },
    /// Quantize a float model to QDQ ONNX with static post-training quantization: fuse,
    /// annotate for a backend, calibrate on sample data, and insert Quantize/DequantizeLinear.
    Quantize {
        model: PathBuf,
        /// Where to write the quantized model (atomically; never the input model).
        #[arg(short, long)]
        output: PathBuf,
        /// Calibration data: a folder of sample folders (<sample>/<input>.npy, optional
        /// manifest.json), one stacked .npz, a folder of .npz files (one per sample), or a
        /// folder of PNG/JPEG images with a preprocess.toml.
        #[arg(long, value_name = "PATH")]
        calibration_data: PathBuf,
        /// Calibrate on N samples spread evenly over the set (sample i*len/N for i < N)
        /// instead of all of them.
        #[arg(long, value_name = "N")]
        calibration_samples: Option<usize>,
        #[command(flatten)]
        quantizer: quantize::QuantizerArgs,
        /// Write a report: every node (quantized or why not), ranges and scales, as JSON; a
        /// path ending in .html writes a self-contained HTML page with plots, and the JSON
        /// beside it.
        #[arg(long, value_name = "FILE.json|FILE.html")]
        report: Option<PathBuf>,
        /// Fail when the backend rejects a requested qconfig instead of keeping the node float,
        /// when a node breaks the target's rules (htp: the --soc generation's constraints), or
        /// when an --exclude or --config entry matches no node.
        #[arg(long)]
        strict: bool,
        /// Worker threads (0 = all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Print a JSON summary on stdout instead of text on stderr.
        #[arg(long)]
        json: bool,
        /// Highest default-domain opset the output may import. Below 21, 16- and 4-bit Q/DQ
        /// are written as ONNX Runtime's com.microsoft QuantizeLinear/DequantizeLinear;
        /// block-wise weights (opset 21 only) are then refused.
        #[arg(long, value_name = "N")]
        max_opset: Option<i64>,
        /// Accuracy budget: after calibration, return the most sensitive groups to float until
        /// every output's relative RMS error (sqrt(MSE)/RMS of the float output, over the
        /// calibration samples) is at most E.
        #[arg(long, value_name = "E")]
        max_output_error: Option<f64>,
        /// Accuracy budget: as --max-output-error, until every output's SQNR is at least DB.
        #[arg(long, value_name = "DB")]
        min_sqnr: Option<f64>,
        /// After quantizing, compare every output of the written model with the float model's
        /// on N calibration samples spread over the set (SQNR, cosine; a warning below 10 dB),
        /// and fit weights to what their activations reach there (`ort`'s pair sums); 0 skips
        /// the check.
        #[arg(long, value_name = "N", default_value_t = 4)]
        check_samples: usize,
        #[command(flatten)]
        format: quantize::FormatArgs,
        #[command(flatten)]
        correction: quantize::CorrectionArgs,
    },
    /// Rank the observation groups and quantized weights by how much each alone moves the
    /// outputs: SQNR and cosine of every output with only that group quantized, and with only
    /// that group float.
    Sensitivity {
        model: PathBuf,
        /// Calibration data, as for `quantize`.
        #[arg(long, value_name = "PATH")]
        calibration_data: PathBuf,
        /// Calibrate on N samples spread evenly over the set, as for `quantize`.
        #[arg(long, value_name = "N")]
        calibration_samples: Option<usize>,
        /// Evaluation samples (any layout --calibration-data takes); default: the calibration data.
        #[arg(long, value_name = "PATH")]
        data: Option<PathBuf>,
        #[command(flatten)]
        quantizer: quantize::QuantizerArgs,
        /// Print one JSON document on stdout instead of the table.
        #[arg(long)]
        json: bool,
        /// Worker threads (0 = all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Evaluate on the first N samples (calibration uses them all). Default: the first
        /// samples whose inputs hold under 2^20 elements together, at most 8 (at least one),
        /// since every group costs two partial runs per sample.
        #[arg(long, value_name = "N")]
        limit: Option<usize>,
    },
    /// Compare a quantized model with its float original, tensor by tensor, on sample data:
    /// SQNR, MSE, cosine and max error of every matched activation, graph output and weight.
    Compare {
        /// The float model.
        float: PathBuf,
        /// The QDQ model quantized from it.
        quantized: PathBuf,
        /// Sample data, in any layout --calibration-data of `quantize` takes.
        #[arg(long, value_name = "PATH")]
        data: PathBuf,
        /// Print one JSON document on stdout instead of tables.
        #[arg(long)]
        json: bool,
        /// Worker threads (0 = all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Compare on the first N samples only.
        #[arg(long, value_name = "N")]
        limit: Option<usize>,
    },
    /// Time a model: median latency over repeated runs on given or random inputs.
    Bench {
        model: PathBuf,
        /// An input as NAME=FILE.npy; inputs not given are filled with seeded random data.
        #[arg(long = "input", value_name = "NAME=FILE")]
        inputs: Vec<String>,
        /// The shape of a random input with dynamic dimensions, as NAME=D0,D1,...
        #[arg(long = "shape", value_name = "NAME=DIMS")]
        shapes: Vec<String>,
        /// Worker threads (0 = all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Timed runs.
        #[arg(long, default_value_t = 20)]
        runs: usize,
        /// Untimed runs before timing.
        #[arg(long, default_value_t = 3)]
        warmup: usize,
        /// Also time every node and print the time per op type.
        #[arg(long)]
        profile: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn main() {
    // SAFETY: sets a process-wide allocator option before any thread is started.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    let cli = Cli::parse();
    let result: Result<()> = match cli.command {
        Command::Inspect { model, json, data, limit } => inspect::inspect(&model, json, data.as_deref(), limit),
        Command::Run { model, inputs, output, threads } => run::run(&model, &inputs, &output, threads),
        Command::Quantize { model, output, calibration_data, calibration_samples, mut quantizer, report, strict, threads, json, max_opset, max_output_error, min_sqnr, check_samples, format, correction } => {
            quantizer.quiet = json;
            quantize::run(quantize::QuantizeArgs { model, output, calibration_data, calibration_samples, quantizer, report, strict, threads, json, max_opset, max_output_error, min_sqnr, check_samples, format: format.format, bias_correction: correction.bias_correction(), weight_search: correction.weight_range == "mse", weight_rounding: correction.weight_rounding })
        }
        Command::Sensitivity { model, calibration_data, calibration_samples, data, mut quantizer, json, threads, limit } => {
            quantizer.quiet = json;
            sensitivity::run(sensitivity::SensitivityArgs { model, calibration_data, calibration_samples, data, quantizer, json, threads, limit })
        }
        Command::Compare { float, quantized, data, json, threads, limit } => compare::run(compare::CompareArgs { float, quantized, data, json, threads, limit }),
        Command::Bench { model, inputs, shapes, threads, runs, warmup, profile, json } => {
            run::bench(&model, &inputs, &shapes, run::BenchOptions { threads, runs, warmup, profile, json })
        }
    };
    if let Err(e) = result {
        eprintln!("error: {}", error_text(&e));
        std::process::exit(1);
    }
}

/// The error and its causes joined by ": ", leaving out a cause that the text before it
/// already ends with (a library error whose message includes its source).
fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain().map(|c| c.to_string()) {
        if text.ends_with(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}
