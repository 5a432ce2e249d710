//! Observers: streaming statistics of the values a tensor takes during calibration.
//!
//! Every observer state merges associatively and commutatively, so the result does not depend
//! on how calibration data was batched, ordered or sharded across processes; states serialize
//! to JSON for that purpose. Non-finite values are counted and left out of the statistics.

mod histogram;
mod minmax;
pub mod search;

pub use histogram::Histogram;
pub use minmax::MinMax;

/// A run of `len` elements at stride `stride`, repeated: the channel layout of a tensor seen
/// along one axis. `outer` blocks of `channels * inner` elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AxisLayout {
    pub outer: usize,
    pub channels: usize,
    pub inner: usize,
}

impl AxisLayout {
    /// The layout of `shape` along `axis` (`None`: the whole tensor is one channel).
    pub fn new(shape: &[usize], axis: Option<usize>) -> Option<AxisLayout> {
        match axis {
            None => Some(AxisLayout { outer: 1, channels: 1, inner: shape.iter().product() }),
            Some(a) if a < shape.len() => Some(AxisLayout {
                outer: shape[..a].iter().product(),
                channels: shape[a],
                inner: shape[a + 1..].iter().product(),
            }),
            Some(_) => None,
        }
    }

    /// Calls `f(channel, values)` for every contiguous run of one channel's values.
    pub fn for_each_run(&self, data: &[f32], mut f: impl FnMut(usize, &[f32])) {
        for o in 0..self.outer {
            for c in 0..self.channels {
                let start = (o * self.channels + c) * self.inner;
                f(c, &data[start..start + self.inner]);
            }
        }
    }
}
