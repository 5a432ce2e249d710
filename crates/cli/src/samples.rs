//! Sample data for the commands that run a model over a calibration set: the adapter from
//! [`CalibrationSet`] to the library's [`SampleSource`], the model's inputs as the loader
//! checks them, and progress on stderr.

use std::io::IsTerminal;

use qforge_data::{CalibrationSet, DataError, ModelInput};
use qforge_ir::{Dim, Model, Tensor};
use qforge_quant::pipeline::SampleSource;

/// A calibration set, or the samples picked from it, as a [`SampleSource`]; load errors carry
/// the loader's message (file, sample and input).
pub struct CalibrationSamples {
    set: CalibrationSet,
    /// The set's indices of the samples used, in order.
    picked: Vec<usize>,
}

impl CalibrationSamples {
    /// Keeps `n` samples spread evenly over the set, sample `⌊i·len/n⌋` for `i < n`, so that a
    /// set sorted by class or by recording is still covered end to end; a note on stderr says
    /// so. With `n` at least the set's size every sample is kept, and a warning says so.
    pub fn spread(self, n: usize) -> anyhow::Result<CalibrationSamples> {
        let len = self.set.len();
        if n == 0 {
            anyhow::bail!("--calibration-samples 0 calibrates on nothing; give at least 1");
        }
        if n >= len {
            if n > len {
                eprintln!("warning: --calibration-samples {n}: {} holds {len} samples; calibrating on all of them", self.set.path().display());
            }
            return Ok(self);
        }
        eprintln!("note: calibrating on {n} of the {len} samples, spread evenly over the set (--calibration-samples)");
        Ok(CalibrationSamples { picked: qforge_quant::pipeline::spread(len, n), set: self.set })
    }
}

impl SampleSource for CalibrationSamples {
    fn len(&self) -> usize {
        self.picked.len()
    }
    fn name(&self, i: usize) -> String {
        self.set.sample_name(self.picked[i]).to_string()
    }
    /// The sample's feed; an error without the sample's name, which the caller's error gives.
    fn load(&self, i: usize) -> Result<Vec<(String, Tensor)>, String> {
        self.set.load(self.picked[i]).map_err(|e| match e {
            DataError::Calibration { path, input, reason, .. } => DataError::Calibration { path, sample: None, input, reason },
            e => e,
        }.to_string())
    }
}

/// Opens a calibration set for `inputs` and prints its loader's notes on stderr.
pub fn open_samples(path: &std::path::Path, inputs: &[ModelInput]) -> anyhow::Result<CalibrationSamples> {
    let set = CalibrationSet::open(path, inputs)?;
    for note in set.notes() {
        eprintln!("note: {note}");
    }
    Ok(CalibrationSamples { picked: (0..set.len()).collect(), set })
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

/// A progress callback for sensitivity trials, `(sample, samples, trial, trials)` (each group
/// quantized alone, then each float alone): prints `"sensitivity: sample s/S, trial k/n"` on
/// stderr, on one rewritten line when stderr is a
/// terminal, else at every tenth of all trials (ten lines whatever the number of samples);
/// nothing when `quiet`.
pub fn trial_progress(quiet: bool) -> impl FnMut(usize, usize, usize, usize) {
    let terminal = std::io::stderr().is_terminal();
    move |sample: usize, samples: usize, trial: usize, trials: usize| {
        if quiet {
            return;
        }
        if terminal {
            eprint!("\rsensitivity: sample {sample}/{samples}, trial {trial}/{trials}   ");
            if trial == trials && sample == samples {
                eprintln!();
            }
            return;
        }
        let (done, total) = ((sample.max(1) - 1) * trials + trial, samples * trials);
        if total > 0 && done * 10 / total > (done - 1) * 10 / total {
            eprintln!("sensitivity: sample {sample}/{samples}, trial {trial}/{trials}");
        }
    }
}
