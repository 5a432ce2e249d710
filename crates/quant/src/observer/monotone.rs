//! Monotone elementwise maps, and the observer states of their outputs.
//!
//! An activation computed from another observed one by an elementwise op with scalar
//! constants (`x + 3`, `clip(x, 0, 6)`, `0.2 * x`, `relu(x)`) takes exactly the values of the
//! map applied to its input's values. Its observer state follows from the input's: the extremes
//! exactly, a histogram's bins carried through the map when it scales by a power of two.
//! Calibration then reads each such tensor not at all.

use serde::{Deserialize, Serialize};

use super::{Histogram, MinMax, Observer};
use crate::spec::RangeMethod;

/// One elementwise step, as the op that computes it rounds in float32.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Step {
    /// `x + c`
    Add(f32),
    /// `x * c`
    Mul(f32),
    /// `x / c`
    Div(f32),
    /// `-x`
    Neg,
    /// `max(x, c)`
    Max(f32),
    /// `min(x, c)`
    Min(f32),
}

impl Step {
    fn apply(self, x: f32) -> f32 {
        match self {
            Step::Add(c) => x + c,
            Step::Mul(c) => x * c,
            Step::Div(c) => x / c,
            Step::Neg => -x,
            Step::Max(c) => x.max(c),
            Step::Min(c) => x.min(c),
        }
    }
}

/// A monotone map `x ↦ clamp(a·x + b, lo, hi)` with `a ≠ 0`, written as the steps of the ops
/// that compute it. Every step with a finite nonzero constant keeps that form: an affine step
/// moves the clamp's bounds with it (swapping them when it reverses order), a `max`/`min`
/// tightens them.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Monotone {
    pub steps: Vec<Step>,
}

/// [`Monotone`] in closed form, in f64: `clamp(a·x + b, lo, hi)`, `lo <= hi`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Affine {
    a: f64,
    b: f64,
    lo: f64,
    hi: f64,
}

impl Monotone {
    /// The map followed by `more`.
    pub fn then(&self, more: &Monotone) -> Monotone {
        Monotone { steps: self.steps.iter().chain(&more.steps).copied().collect() }
    }

    /// The map of one value, rounded step by step as the ops round it, so the image of an
    /// observed extreme is the extreme the ops' output would have shown.
    pub fn apply(&self, x: f32) -> f32 {
        self.steps.iter().fold(x, |x, s| s.apply(x))
    }

    fn affine(&self) -> Affine {
        self.steps.iter().fold(Affine { a: 1.0, b: 0.0, lo: f64::NEG_INFINITY, hi: f64::INFINITY }, |f, &s| {
            let scale = |c: f64| {
                let (lo, hi) = if c > 0.0 { (f.lo * c, f.hi * c) } else { (f.hi * c, f.lo * c) };
                Affine { a: f.a * c, b: f.b * c, lo, hi }
            };
            match s {
                Step::Add(c) => Affine { b: f.b + c as f64, lo: f.lo + c as f64, hi: f.hi + c as f64, ..f },
                Step::Mul(c) => scale(c as f64),
                Step::Div(c) => scale(1.0 / c as f64),
                Step::Neg => scale(-1.0),
                Step::Max(c) => Affine { lo: f.lo.max(c as f64), hi: f.hi.max(c as f64), ..f },
                Step::Min(c) => Affine { lo: f.lo.min(c as f64), hi: f.hi.min(c as f64), ..f },
            }
        })
    }

    /// The map written as an expression of `x`, e.g. `min(max(x + 3, 0), 6)`.
    pub fn describe(&self, x: &str) -> String {
        // (expression, whether it is a sum that a product must parenthesize)
        let (e, _) = self.steps.iter().fold((x.to_string(), false), |(e, sum), s| {
            let factor = if sum { format!("({e})") } else { e.clone() };
            match *s {
                Step::Add(c) if c < 0.0 => (format!("{e} - {}", -c), true),
                Step::Add(c) => (format!("{e} + {c}"), true),
                Step::Mul(c) => (format!("{factor} * {c}"), false),
                Step::Div(c) => (format!("{factor} / {c}"), false),
                Step::Neg => (format!("-{factor}"), false),
                Step::Max(c) => (format!("max({e}, {c})"), false),
                Step::Min(c) => (format!("min({e}, {c})"), false),
            }
        });
        e
    }

    /// Whether the map carries a histogram's zero-aligned grid onto a zero-aligned grid as
    /// fine as the output's own would be: it scales by a power of two and shifts by a multiple
    /// of 2^-10 (the `+ 3` of a hardswish's gate, not a learned offset), which lands bins of
    /// any width up to the shift's lowest power of two on the grid.
    pub fn keeps_histogram_grid(&self) -> bool {
        let Affine { a, b, .. } = self.affine();
        a.abs().is_normal() && a.abs().log2().fract() == 0.0 && (b * 1024.0).fract() == 0.0
    }

    /// Whether the map reverses order (an odd number of negative scalings).
    pub fn decreasing(&self) -> bool {
        self.affine().a < 0.0
    }

    /// The image `[lo, hi]` of an observed range.
    pub(super) fn image(&self, min: f32, max: f32) -> (f32, f32) {
        let (a, b) = (self.apply(min), self.apply(max));
        if self.decreasing() { (b, a) } else { (a, b) }
    }

    /// The uniform bins of `f(x)` for the values `x` that `h` counts: `h`'s own bins carried
    /// through the affine part (reversed when it reverses order), so a range search sees the
    /// same bins it would on a histogram of the output counted on that grid. Bins wholly past a
    /// clamp bound give their counts to the bin holding the bound, where the clamped values are.
    pub(super) fn bins(&self, h: &Histogram) -> (Vec<f64>, f64, f64) {
        let (counts, lo, hi) = h.uniform();
        let Affine { a, b, lo: clamp_lo, hi: clamp_hi } = self.affine();
        let (mut counts, lo, hi) = if a > 0.0 { (counts, a * lo + b, a * hi + b) } else { (counts.into_iter().rev().collect(), a * hi + b, a * lo + b) };
        let width = (hi - lo) / counts.len() as f64;
        let last = counts.len() - 1;
        let bin = |x: f64| (((x - lo) / width).floor().max(0.0) as usize).min(last);
        let (first, end) = (bin(clamp_lo.max(lo)), bin(clamp_hi.min(hi)));
        let below: f64 = counts[..first].iter().sum();
        let above: f64 = counts[end + 1..].iter().sum();
        counts[first] += below;
        counts[end] += above;
        let kept = counts[first..=end].to_vec();
        (kept, lo + first as f64 * width, lo + (end + 1) as f64 * width)
    }
}

impl Observer {
    /// The state this observer would have reached on `f` of every value it saw: a min/max
    /// exactly; a histogram as its bins carried through `f` ([`Monotone::bins`]), searched
    /// when the range is asked for. `None` for what does not carry over: a moving average
    /// (its per-tensor averaging does not commute with a clamp), a per-channel min/max, an
    /// entropy histogram (its search folds the zero-aligned grid at zero), and a histogram
    /// under a map that does not keep the grid ([`Monotone::keeps_histogram_grid`]). A range
    /// search scores each candidate at the bins' centers, so its choice moves with the grid:
    /// bins scaled by 1/6 (up to twice as coarse as the output's own) moved hardswish outputs'
    /// ranges by up to 15 % and cost SLANet's table decoder a third of its exact structure
    /// matches, and bins shifted by learned offsets (off zero, where a hardswish's zeros
    /// pile up) cost PP-OCRv4's detector 0.8 dB of output SQNR.
    pub fn mapped(&self, f: &Monotone) -> Option<Observer> {
        match self {
            Observer::MinMax(m) if m.axis.is_none() => {
                let mut out = MinMax { axis: None, min: vec![], max: vec![], count: m.count, nonfinite: m.nonfinite };
                if let Some((lo, hi)) = m.range() {
                    let (lo, hi) = f.image(lo, hi);
                    (out.min, out.max) = (vec![lo], vec![hi]);
                }
                Some(Observer::MinMax(out))
            }
            Observer::Histogram { range, .. } if *range != RangeMethod::Entropy && f.keeps_histogram_grid() => Some(Observer::Mapped { source: Box::new(self.clone()), map: f.clone() }),
            Observer::Mapped { source, map } if f.keeps_histogram_grid() => Some(Observer::Mapped { source: source.clone(), map: map.then(f) }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::ObserverKind;

    fn chain(steps: &[Step]) -> Monotone {
        Monotone { steps: steps.to_vec() }
    }

    /// Values from a fixed xorshift stream, roughly normal (sum of four uniforms), scaled.
    fn values(n: usize, scale: f32, shift: f32) -> Vec<f32> {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        (0..n).map(|_| ((0..4).map(|_| uniform()).sum::<f32>() - 2.0) * scale + shift).collect()
    }

    #[test]
    fn the_closed_form_is_the_step_by_step_map() {
        let maps = [
            chain(&[Step::Add(3.0), Step::Max(0.0), Step::Min(6.0)]),
            chain(&[Step::Max(0.0), Step::Mul(-0.5), Step::Add(1.0)]),
            chain(&[Step::Neg, Step::Add(2.0), Step::Min(1.0), Step::Div(-4.0), Step::Max(-0.1)]),
            // Bounds that cross: clip(x, 5, 1) is 1 everywhere, as ONNX's Clip defines it.
            chain(&[Step::Max(5.0), Step::Min(1.0), Step::Mul(3.0)]),
        ];
        for f in &maps {
            let Affine { a, b, lo, hi } = f.affine();
            assert!(lo <= hi, "{f:?}");
            for x in [-7.25f32, -1.0, -0.03, 0.0, 0.4, 2.5, 9.0] {
                let closed = (a * x as f64 + b).max(lo).min(hi);
                assert!((closed - f.apply(x) as f64).abs() <= 1e-6 * closed.abs().max(1.0), "{f:?} at {x}: {closed} vs {}", f.apply(x));
            }
        }
        assert!(maps[1].decreasing() && !maps[0].decreasing() && !maps[2].decreasing());
        assert_eq!(maps[0].describe("x"), "min(max(x + 3, 0), 6)");
        assert_eq!(maps[1].describe("x"), "max(x, 0) * -0.5 + 1");
        assert_eq!(maps[2].describe("x"), "max(min(-x + 2, 1) / -4, -0.1)");
        assert_eq!(chain(&[Step::Add(-0.25), Step::Div(4.0)]).describe("y"), "(y - 0.25) / 4");
    }

    /// The state a map's output gives when observed directly, against the one derived from the
    /// input's state: the same extremes, and a range search that agrees to one search step
    /// (MSE's candidates are 1 % of the span apart) and a few bins.
    #[test]
    fn a_derived_state_matches_observing_the_mapped_values() {
        let hardswish_gate = chain(&[Step::Add(3.0), Step::Max(0.0), Step::Min(6.0)]);
        let affine = chain(&[Step::Mul(-0.25), Step::Add(-1.25)]);
        let negated_relu = chain(&[Step::Max(0.0), Step::Neg, Step::Div(8.0)]);
        for (f, scale, shift) in [(&hardswish_gate, 2.0, -1.0), (&affine, 5.0, 0.5), (&negated_relu, 1.5, 0.3), (&hardswish_gate, 9.0, 4.0)] {
            let x = values(200_000, scale, shift);
            let y: Vec<f32> = x.iter().map(|&v| f.apply(v)).collect();
            for range in [RangeMethod::MinMax, RangeMethod::Mse, RangeMethod::L2, RangeMethod::Percentile { percentile: 99.9 }] {
                let kind = ObserverKind::Histogram { bins: 2048, range };
                let (mut seen_x, mut seen_y) = (Observer::new(&kind), Observer::new(&kind));
                for (a, b) in x.chunks(50_000).zip(y.chunks(50_000)) {
                    seen_x.observe(a);
                    seen_y.observe(b);
                }
                let derived = seen_x.mapped(f).expect("a histogram maps");
                assert_eq!(derived.extremes(), seen_y.extremes(), "{f:?}");
                let Observer::Histogram { histogram: o, .. } = &seen_y else { unreachable!() };
                let Observer::Mapped { source, .. } = &derived else { unreachable!() };
                let Observer::Histogram { histogram: h, .. } = &**source else { unreachable!() };
                let (counts, lo, hi) = f.bins(h);
                assert_eq!(counts.iter().sum::<f64>(), o.total() as f64, "{f:?}");
                let (min, max) = seen_y.extremes().unwrap();
                assert!(lo <= min as f64 + (hi - lo) / counts.len() as f64 && hi >= max as f64, "{f:?}: bins [{lo}, {hi}] for values [{min}, {max}]");
                let (dr, or) = (derived.range(256).unwrap(), seen_y.range(256).unwrap());
                let tolerance = 0.0101 * (max.max(0.0) - min.min(0.0)) + 3.0 * (hi - lo) as f32 / counts.len() as f32;
                assert!((dr.0 - or.0).abs() <= tolerance && (dr.1 - or.1).abs() <= tolerance, "{f:?} {range:?}: derived {dr:?}, observed {or:?}");
            }
            let (mut mx, mut my) = (Observer::new(&ObserverKind::MinMax), Observer::new(&ObserverKind::MinMax));
            mx.observe(&x);
            my.observe(&y);
            assert_eq!(mx.mapped(f), Some(my), "{f:?}");
        }
    }

    #[test]
    fn a_fully_clamped_input_gives_the_bound_and_entropy_states_are_observed() {
        let kind = ObserverKind::Histogram { bins: 2048, range: RangeMethod::Mse };
        let mut o = Observer::new(&kind);
        let mut negative = values(10_000, 1.0, -9.0);
        negative.push(f32::NAN);
        o.observe(&negative);
        let d = o.mapped(&chain(&[Step::Max(0.0)])).unwrap();
        assert_eq!((d.extremes(), d.range(256), d.nonfinite()), (Some((0.0, 0.0)), Some((0.0, 0.0)), 1));
        // Composing maps composes the states.
        let twice = d.mapped(&chain(&[Step::Add(2.0)])).unwrap();
        assert_eq!(twice.range(256), Some((2.0, 2.0)));
        let entropy = Observer::new(&ObserverKind::Histogram { bins: 2048, range: RangeMethod::Entropy });
        assert_eq!(entropy.mapped(&chain(&[Step::Add(1.0)])), None);
        // A scale other than a power of two maps extremes, not bins.
        let scaled = chain(&[Step::Mul(0.37)]);
        assert_eq!(o.mapped(&scaled), None);
        assert!(Observer::new(&ObserverKind::MinMax).mapped(&scaled).is_some());
        assert!(chain(&[Step::Div(-8.0), Step::Mul(0.5), Step::Add(0.375)]).keeps_histogram_grid());
        // A learned offset moves the grid off zero.
        let offset = chain(&[Step::Add(0.3)]);
        assert!(!offset.keeps_histogram_grid());
        assert_eq!(o.mapped(&offset), None);
        assert!(d.clone().merge(&o).is_err());
    }
}
