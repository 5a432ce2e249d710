//! The `qforge` command-line tool.

mod inspect;
mod quantize;
mod run;

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
        /// manifest.json), one stacked .npz, or a folder of .npz files (one per sample).
        #[arg(long, value_name = "PATH")]
        calibration_data: PathBuf,
        /// Target: a built-in backend (ort, x86, xnnpack, tensorrt) or a BackendConfig .toml file.
        #[arg(long, default_value = "ort")]
        backend: String,
        /// A QConfigMapping .toml file (global, op_type, scope_regex, name, op_order sections).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Activation range: minmax, percentile, entropy, l2 or mse.
        #[arg(long, default_value = "minmax")]
        method: String,
        /// One weight scale per output channel (default).
        #[arg(long, conflicts_with = "per_tensor")]
        per_channel: bool,
        /// One weight scale per tensor.
        #[arg(long)]
        per_tensor: bool,
        /// Keep a node, a scope, or the nodes whose scope matches a regular expression in float.
        #[arg(long, value_name = "NAME|REGEX")]
        exclude: Vec<String>,
        /// Write a JSON report: every node (quantized or why not), ranges and scales.
        #[arg(long, value_name = "FILE.json")]
        report: Option<PathBuf>,
        /// Fail when the backend rejects a requested qconfig instead of keeping the node float.
        #[arg(long)]
        strict: bool,
        /// Worker threads (0 = all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Print a JSON summary on stdout instead of text on stderr.
        #[arg(long)]
        json: bool,
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
    let cli = Cli::parse();
    let result: Result<()> = match cli.command {
        Command::Inspect { model, json } => inspect::inspect(&model, json),
        Command::Run { model, inputs, output, threads } => run::run(&model, &inputs, &output, threads),
        Command::Quantize { model, output, calibration_data, backend, config, method, per_channel: _, per_tensor, exclude, report, strict, threads, json } => {
            quantize::run(quantize::QuantizeArgs { model, output, calibration_data, backend, config, method, per_tensor, exclude, report, strict, threads, json })
        }
        Command::Bench { model, inputs, shapes, threads, runs, warmup, profile, json } => {
            run::bench(&model, &inputs, &shapes, run::BenchOptions { threads, runs, warmup, profile, json })
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
