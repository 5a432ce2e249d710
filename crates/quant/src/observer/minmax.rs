use serde::{Deserialize, Serialize};

use super::{finite_extremes, AxisLayout};

/// Running minimum and maximum, per tensor or per channel along `axis`
/// (PyTorch's `MinMaxObserver` / `PerChannelMinMaxObserver`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MinMax {
    pub axis: Option<usize>,
    /// Per-channel minima (one entry per tensor); `+inf` until a finite value is seen.
    pub min: Vec<f32>,
    pub max: Vec<f32>,
    /// Finite values observed.
    pub count: u64,
    /// NaN and infinite values observed (ignored for the range).
    pub nonfinite: u64,
}

impl MinMax {
    pub fn new(axis: Option<usize>) -> MinMax {
        MinMax { axis, min: vec![], max: vec![], count: 0, nonfinite: 0 }
    }

    /// Observes a tensor given as data and shape. Errors when the axis is out of range or the
    /// channel count differs from earlier tensors.
    pub fn observe(&mut self, data: &[f32], shape: &[usize]) -> Result<(), String> {
        let layout = AxisLayout::new(shape, self.axis)
            .ok_or_else(|| format!("axis {:?} is out of range for shape {shape:?}", self.axis))?;
        self.ensure_channels(layout.channels)?;
        let mut nonfinite = 0u64;
        if layout.inner == 1 && layout.channels > 1 {
            // Channels along the last axis: one pass over rows, channel by channel across each.
            for row in data.chunks_exact(layout.channels) {
                for ((lo, hi), &x) in self.min.iter_mut().zip(self.max.iter_mut()).zip(row) {
                    if x.is_finite() {
                        *lo = if x < *lo { x } else { *lo };
                        *hi = if x > *hi { x } else { *hi };
                    } else {
                        nonfinite += 1;
                    }
                }
            }
        } else {
            layout.for_each_run(data, |c, run| {
                let (lo, hi, bad) = finite_extremes(run);
                self.min[c] = self.min[c].min(lo);
                self.max[c] = self.max[c].max(hi);
                nonfinite += bad;
            });
        }
        self.count += data.len() as u64 - nonfinite;
        self.nonfinite += nonfinite;
        Ok(())
    }

    fn ensure_channels(&mut self, n: usize) -> Result<(), String> {
        if self.min.is_empty() {
            self.min = vec![f32::INFINITY; n];
            self.max = vec![f32::NEG_INFINITY; n];
        } else if self.min.len() != n {
            return Err(format!("observed {n} channels, earlier tensors had {}", self.min.len()));
        }
        Ok(())
    }

    /// Combines another state of the same axis into this one.
    pub fn merge(&mut self, other: &MinMax) -> Result<(), String> {
        if other.axis != self.axis {
            return Err(format!("cannot merge axis {:?} into axis {:?}", other.axis, self.axis));
        }
        if other.min.is_empty() {
            return Ok(());
        }
        self.ensure_channels(other.min.len())?;
        for c in 0..self.min.len() {
            self.min[c] = self.min[c].min(other.min[c]);
            self.max[c] = self.max[c].max(other.max[c]);
        }
        self.count += other.count;
        self.nonfinite += other.nonfinite;
        Ok(())
    }

    /// The per-tensor range (over all channels), if any finite value was seen.
    pub fn range(&self) -> Option<(f32, f32)> {
        let lo = self.min.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = self.max.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        (lo <= hi).then_some((lo, hi))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_channel_along_axis() {
        let mut m = MinMax::new(Some(1));
        // shape [2, 3, 2]: channel c holds values at [o, c, i].
        let data: Vec<f32> = (0..12).map(|v| v as f32).collect();
        m.observe(&data, &[2, 3, 2]).unwrap();
        assert_eq!(m.min, vec![0., 2., 4.]);
        assert_eq!(m.max, vec![7., 9., 11.]);
        assert!(m.observe(&data, &[2, 2, 3]).is_err());
    }

    #[test]
    fn channels_along_the_last_axis_skip_nonfinite_values() {
        // shape [3, 2]: channel c holds column c.
        let data = [1.0f32, -2.0, f32::NAN, 4.0, -5.0, f32::INFINITY];
        let mut m = MinMax::new(Some(1));
        m.observe(&data, &[3, 2]).unwrap();
        assert_eq!((m.min.clone(), m.max.clone()), (vec![-5.0, -2.0], vec![1.0, 4.0]));
        assert_eq!((m.count, m.nonfinite), (4, 2));
    }

    #[test]
    fn merge_equals_single_pass_and_skips_nonfinite() {
        let a = [1.0f32, -3.0, f32::NAN, 2.0];
        let b = [5.0f32, f32::INFINITY, -1.0];
        let mut whole = MinMax::new(None);
        whole.observe(&[a.as_slice(), b.as_slice()].concat(), &[7]).unwrap();
        let (mut x, mut y) = (MinMax::new(None), MinMax::new(None));
        x.observe(&a, &[4]).unwrap();
        y.observe(&b, &[3]).unwrap();
        y.merge(&x).unwrap();
        assert_eq!(y, whole);
        assert_eq!(whole.range(), Some((-3.0, 5.0)));
        assert_eq!(whole.nonfinite, 2);
        assert_eq!(whole.count, 5);
    }
}
