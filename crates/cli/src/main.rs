//! The `qforge` command-line tool.

mod inspect;
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
        Command::Bench { model, inputs, shapes, threads, runs, warmup, profile, json } => {
            run::bench(&model, &inputs, &shapes, run::BenchOptions { threads, runs, warmup, profile, json })
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
