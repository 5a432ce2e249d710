//! Object-detection post-processing: `NonMaxSuppression`.

use std::cmp::Ordering;

use qforge_ir::Tensor;

use super::util::{input, kernel, opt_input, single_int, slice, tensor};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers the detection operators.
pub fn register(r: &mut Registry) {
    r.add("", "NonMaxSuppression", 10, LATEST, non_max_suppression);
}

/// A box as the two corners of its extent along each axis, taken as given (a box of
/// negative width or height has no area and suppresses nothing).
#[derive(Clone, Copy)]
struct Extent {
    lo: [f32; 2],
    hi: [f32; 2],
}

impl Extent {
    /// A box given as two opposite corners `[y1, x1, y2, x2]`, in either order.
    fn from_corners(b: &[f32]) -> Extent {
        Extent { lo: [b[0].min(b[2]), b[1].min(b[3])], hi: [b[0].max(b[2]), b[1].max(b[3])] }
    }

    /// A box given as `[x_center, y_center, width, height]`.
    fn from_center(b: &[f32]) -> Extent {
        let (half_w, half_h) = (b[2] / 2.0, b[3] / 2.0);
        Extent { lo: [b[0] - half_w, b[1] - half_h], hi: [b[0] + half_w, b[1] + half_h] }
    }

    fn area(&self) -> f32 {
        (self.hi[0] - self.lo[0]) * (self.hi[1] - self.lo[1])
    }

    /// Whether the intersection over union of the two boxes exceeds `threshold`; boxes that
    /// do not overlap, or either of which has no area, never do.
    fn overlaps(&self, other: &Extent, threshold: f32) -> bool {
        let mut intersection = 1f32;
        for a in 0..2 {
            let (lo, hi) = (self.lo[a].max(other.lo[a]), self.hi[a].min(other.hi[a]));
            if hi <= lo {
                return false;
            }
            intersection *= hi - lo;
        }
        let (area, other_area) = (self.area(), other.area());
        let union = area + other_area - intersection;
        if intersection <= 0.0 || area <= 0.0 || other_area <= 0.0 || union <= 0.0 {
            return false;
        }
        intersection / union > threshold
    }
}

/// Descending score order, equal scores in index order, NaN scores last.
fn by_score_descending(p: &(f32, usize), q: &(f32, usize)) -> Ordering {
    q.0.partial_cmp(&p.0).unwrap_or_else(|| p.0.is_nan().cmp(&q.0.is_nan())).then(p.1.cmp(&q.1))
}

/// A float input holding one value, or `None` when omitted or empty.
fn scalar_f32(t: Option<&Tensor>, what: &str) -> RuntimeResult<Option<f32>> {
    let Some(t) = t.filter(|t| !t.is_empty()) else { return Ok(None) };
    match slice::<f32>(t, what)? {
        &[v] => Ok(Some(v)),
        _ => Err(kernel_error(format!("{what} must hold one value, got shape {:?}", t.shape()))),
    }
}

/// `NonMaxSuppression` (opsets 10 and 11): for each batch and class, greedily keeps the boxes
/// of `boxes` `[B, N, 4]` in descending order of their `scores` `[B, C, N]` (equal scores in
/// index order, NaN last), skipping any whose intersection over union with a kept box exceeds
/// `iou_threshold` (default 0, within [0, 1]) or whose score is not above `score_threshold`
/// (when given), up to `max_output_boxes_per_class` (default 0: none) per class. Boxes are
/// `[y1, x1, y2, x2]` corners (`center_point_box = 0`) or `[x_center, y_center, width,
/// height]` (`center_point_box = 1`). Output: int64 `[selected, 3]` rows of
/// `(batch, class, box)`, by batch, then class, then selection order.
fn non_max_suppression(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let center = match info.attr_int("center_point_box", 0) {
        0 => false,
        1 => true,
        v => return Err(info.error(format!("center_point_box must be 0 or 1, got {v}"))),
    };
    kernel(move |ins| {
        let (boxes_t, scores_t) = (input(ins, 0)?, input(ins, 1)?);
        let (boxes, scores) = (slice::<f32>(boxes_t, "boxes")?, slice::<f32>(scores_t, "scores")?);
        let (&[batches, n, 4], &[score_batches, classes, score_boxes]) = (boxes_t.shape(), scores_t.shape()) else {
            return Err(kernel_error(format!("boxes must be [batches, boxes, 4] and scores [batches, classes, boxes], got {:?} and {:?}", boxes_t.shape(), scores_t.shape())));
        };
        if (score_batches, score_boxes) != (batches, n) {
            return Err(kernel_error(format!("boxes {:?} and scores {:?} disagree on batches or boxes", boxes_t.shape(), scores_t.shape())));
        }
        let max_per_class = match opt_input(ins, 2).filter(|t| !t.is_empty()) {
            Some(t) => single_int(t, "max_output_boxes_per_class")?.clamp(0, n as i64) as usize,
            None => 0,
        };
        let iou_threshold = scalar_f32(opt_input(ins, 3), "iou_threshold")?.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&iou_threshold) {
            return Err(kernel_error(format!("iou_threshold {iou_threshold} is outside [0, 1]")));
        }
        let score_threshold = scalar_f32(opt_input(ins, 4), "score_threshold")?;
        let mut selected: Vec<i64> = vec![];
        if max_per_class > 0 {
            let mut extents: Vec<Extent> = Vec::with_capacity(n);
            let mut candidates: Vec<(f32, usize)> = Vec::with_capacity(n);
            let mut kept: Vec<usize> = Vec::with_capacity(max_per_class);
            for b in 0..batches {
                extents.clear();
                let batch_boxes = boxes[b * n * 4..(b + 1) * n * 4].chunks_exact(4);
                extents.extend(batch_boxes.map(|c| if center { Extent::from_center(c) } else { Extent::from_corners(c) }));
                for c in 0..classes {
                    let s = &scores[(b * classes + c) * n..(b * classes + c + 1) * n];
                    candidates.clear();
                    candidates.extend(s.iter().enumerate().filter(|&(_, &v)| score_threshold.is_none_or(|t| v > t)).map(|(i, &v)| (v, i)));
                    candidates.sort_unstable_by(by_score_descending);
                    kept.clear();
                    for &(_, i) in &candidates {
                        if kept.len() == max_per_class {
                            break;
                        }
                        if kept.iter().all(|&j| !extents[i].overlaps(&extents[j], iou_threshold)) {
                            kept.push(i);
                            selected.extend([b as i64, c as i64, i as i64]);
                        }
                    }
                }
            }
        }
        Ok(vec![tensor(&[selected.len() / 3, 3], selected)?])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_is_intersection_over_union_above_the_threshold() {
        let a = Extent::from_corners(&[0.0, 0.0, 1.0, 1.0]);
        let b = Extent::from_corners(&[1.0, 1.0, 0.0, 0.5]);
        // Intersection 0.5, union 1.0.
        assert!(a.overlaps(&b, 0.49) && !a.overlaps(&b, 0.5));
        let c = Extent::from_center(&[0.5, 0.75, 1.0, 0.5]);
        assert!(a.overlaps(&c, 0.49) && !a.overlaps(&c, 0.5));
        let flat = Extent::from_corners(&[0.0, 0.0, 0.0, 1.0]);
        assert!(!a.overlaps(&flat, 0.0));
    }

    #[test]
    fn nan_scores_rank_last() {
        let mut v = [(f32::NAN, 0), (1.0, 1), (2.0, 2), (1.0, 3)];
        v.sort_unstable_by(by_score_descending);
        assert_eq!(v.iter().map(|p| p.1).collect::<Vec<_>>(), vec![2, 1, 3, 0]);
    }
}
