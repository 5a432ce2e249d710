//! Sample data for the commands that run a model over a calibration set: the adapter from
//! [`CalibrationSet`] to the library's [`SampleSource`], the model's inputs as the loader
//! checks them, and progress on stderr.

use std::io::IsTerminal;

use qforge_data::{CalibrationSet, ModelInput};
use qforge_ir::{Dim, Model, Tensor};
use qforge_quant::pipeline::SampleSource;

/// A calibration set as a [`SampleSource`]; load errors carry the loader's message (file,
/// sample and input).
pub struct CalibrationSamples(pub CalibrationSet);

impl SampleSource for CalibrationSamples {
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

/// Opens a calibration set for `inputs` and prints its loader's notes on stderr.
pub fn open_samples(path: &std::path::Path, inputs: &[ModelInput]) -> anyhow::Result<CalibrationSamples> {
    let set = CalibrationSet::open(path, inputs)?;
    for note in set.notes() {
        eprintln!("note: {note}");
    }
    Ok(CalibrationSamples(set))
}

/// The model's inputs as the calibration loader checks them.
pub fn model_inputs(m: &Model) -> Vec<ModelInput> {
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

/// A `progress(done, total)` callback printing `"{activity}: done/total samples"` on stderr:
/// after every sample on one rewritten line when stderr is a terminal, else at each quarter;
/// nothing when `quiet`.
pub fn progress(activity: &'static str, quiet: bool) -> impl FnMut(usize, usize) {
    let show = std::io::stderr().is_terminal() && !quiet;
    let mut last_pct = 0;
    move |done: usize, total: usize| {
        let pct = done * 100 / total;
        if show {
            eprint!("\r{activity}: {done}/{total} samples");
            if done == total {
                eprintln!();
            }
        } else if !quiet && (pct / 25 > last_pct / 25 || done == total) {
            eprintln!("{activity}: {done}/{total} samples");
        }
        last_pct = pct;
    }
}

/// A progress callback for sensitivity trials, `(sample, samples, unit, units)`: prints
/// `"sensitivity: sample s/S, group k/n"` on stderr, on one rewritten line when stderr is a
/// terminal, else at every tenth of all trials (ten lines whatever the number of samples);
/// nothing when `quiet`.
pub fn unit_progress(quiet: bool) -> impl FnMut(usize, usize, usize, usize) {
    let terminal = std::io::stderr().is_terminal();
    move |sample: usize, samples: usize, unit: usize, units: usize| {
        if quiet {
            return;
        }
        if terminal {
            eprint!("\rsensitivity: sample {sample}/{samples}, group {unit}/{units}   ");
            if unit == units && sample == samples {
                eprintln!();
            }
            return;
        }
        let (done, total) = ((sample.max(1) - 1) * units + unit, samples * units);
        if total > 0 && done * 10 / total > (done - 1) * 10 / total {
            eprintln!("sensitivity: sample {sample}/{samples}, group {unit}/{units}");
        }
    }
}
