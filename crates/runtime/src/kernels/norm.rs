//! Normalizations: BatchNormalization (inference), LayerNormalization, InstanceNormalization,
//! GroupNormalization, RMSNormalization, LpNormalization, MeanVarianceNormalization.

use rayon::prelude::*;

use super::elementwise::{from_f32, to_f32};
use super::util::{axis, binary, input, kernel, lane_sum, min_items, opt_input, par_chunks_mut, threads, vectorized, ELEMENT_WORK};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers the normalization operators.
pub fn register(r: &mut Registry) {
    r.add("", "BatchNormalization", 1, LATEST, batch_norm);
    r.add("", "LayerNormalization", 1, LATEST, layer_norm);
    r.add("", "InstanceNormalization", 1, LATEST, instance_norm);
    r.add("", "GroupNormalization", 18, LATEST, group_norm);
    r.add("", "RMSNormalization", 23, LATEST, rms_norm);
    r.add("", "LpNormalization", 1, LATEST, lp_norm);
    r.add("", "MeanVarianceNormalization", 9, LATEST, mean_variance_norm);
}

fn batch_norm(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let eps = info.attr_float("epsilon", 1e-5);
    if info.attr_int("training_mode", 0) != 0 {
        return Err(info.error("training mode is not supported"));
    }
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let s = x.shape();
        if s.len() < 2 {
            return Err(kernel_error(format!("BatchNormalization needs rank >= 2, got {s:?}")));
        }
        let c = s[1];
        let p: Vec<Vec<f32>> = (1..5).map(|i| to_f32(input(ins, i)?).map(|v| v.into_owned())).collect::<RuntimeResult<_>>()?;
        if p.iter().any(|v| v.len() != c) {
            return Err(kernel_error(format!("scale, bias, mean and var must have {c} values")));
        }
        let (scale, bias, mean, var) = (&p[0], &p[1], &p[2], &p[3]);
        let a: Vec<f32> = (0..c).map(|i| scale[i] / (var[i] + eps).sqrt()).collect();
        let b: Vec<f32> = (0..c).map(|i| bias[i] - mean[i] * a[i]).collect();
        let plane: usize = s[2..].iter().product();
        let mut v = to_f32(x)?.into_owned();
        par_chunks_mut(&mut v, plane, min_items(plane * ELEMENT_WORK), || (), |_, i, row| {
            let ch = i % c;
            row.iter_mut().for_each(|x| *x = *x * a[ch] + b[ch]);
        });
        Ok(vec![from_f32(x.dtype(), s, v)?])
    })
}

/// LayerNormalization: `(x - mean) / sqrt(var + epsilon) * scale + bias` over the dimensions
/// from `axis` (default -1) on, with the mean and `1 / sqrt(var + epsilon)` of each row as
/// the optional outputs (shaped like X with 1s from `axis` on). ONNX's op from opset 17, and
/// before it ONNX Runtime's contrib op of the same name and contract in the default domain
/// (which ONNX Runtime's transformer optimizer emits whatever the model's opset).
fn layer_norm(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.attr_int("axis", -1);
    let eps = info.attr_float("epsilon", 1e-5);
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let s = x.shape();
        let ax = axis(a, s.len())?;
        let (rows, d) = (s[..ax].iter().product::<usize>(), s[ax..].iter().product::<usize>());
        let scale = to_f32(input(ins, 1)?)?.into_owned();
        let bias = opt_input(ins, 2).map(|b| to_f32(b).map(|v| v.into_owned())).transpose()?;
        // Scale and bias broadcast to the normalized shape.
        let expand = |v: Vec<f32>| -> RuntimeResult<Vec<f32>> {
            if v.len() == d { Ok(v) } else if v.len() == 1 { Ok(vec![v[0]; d]) } else { Err(kernel_error(format!("scale/bias of {} values do not fit {d}", v.len()))) }
        };
        let scale = expand(scale)?;
        let bias = bias.map(expand).transpose()?;
        let mut v = to_f32(x)?.into_owned();
        let mut means = vec![0f32; rows];
        let mut inv = vec![0f32; rows];
        let d = d.max(1);
        let norm_rows = |rows: &mut [f32], means: &mut [f32], inv: &mut [f32]| vectorized(|| {
            for ((row, m), iv) in rows.chunks_mut(d).zip(means).zip(inv) {
                (*m, *iv) = layer_norm_row(row, &scale, bias.as_deref(), eps);
            }
        });
        if v.len() < 1 << 15 || threads() == 1 {
            norm_rows(&mut v, &mut means, &mut inv);
        } else {
            let per = (1 << 13) / d + 1;
            v.par_chunks_mut(per * d).zip(means.par_chunks_mut(per).zip(inv.par_chunks_mut(per))).for_each(|(r, (m, iv))| norm_rows(r, m, iv));
        }
        let stat_shape: Vec<usize> = s.iter().enumerate().map(|(i, &dim)| if i < ax { dim } else { 1 }).collect();
        Ok(vec![
            from_f32(x.dtype(), s, v)?,
            super::util::tensor(&stat_shape, means)?,
            super::util::tensor(&stat_shape, inv)?,
        ])
    })
}

/// Normalizes one row in place to `(x - mean) / sqrt(var + eps) * scale + bias` (scale and
/// bias as long as the row); returns the mean and `1 / sqrt(var + eps)`.
#[inline(always)]
pub(super) fn layer_norm_row(row: &mut [f32], scale: &[f32], bias: Option<&[f32]>, eps: f32) -> (f32, f32) {
    let d = row.len() as f32;
    let mean = lane_sum(row, |x| x) / d;
    let var = lane_sum(row, |x| (x - mean) * (x - mean)) / d;
    let inv = 1.0 / (var + eps).sqrt();
    match bias {
        Some(b) => row.iter_mut().zip(scale).zip(b).for_each(|((x, &s), &b)| *x = (*x - mean) * inv * s + b),
        None => row.iter_mut().zip(scale).for_each(|(x, &s)| *x = (*x - mean) * inv * s),
    }
    (mean, inv)
}

fn instance_norm(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let eps = info.attr_float("epsilon", 1e-5);
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let s = x.shape();
        let c = s[1];
        let plane: usize = s[2..].iter().product();
        let (scale, bias) = (to_f32(input(ins, 1)?)?.into_owned(), to_f32(input(ins, 2)?)?.into_owned());
        let mut v = to_f32(x)?.into_owned();
        par_chunks_mut(&mut v, plane, min_items(plane * ELEMENT_WORK), || (), |_, i, row| {
            let ch = i % c;
            let mean = row.iter().sum::<f32>() / plane as f32;
            let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / plane as f32;
            let inv = 1.0 / (var + eps).sqrt();
            row.iter_mut().for_each(|x| *x = (*x - mean) * inv * scale[ch] + bias[ch]);
        });
        Ok(vec![from_f32(x.dtype(), s, v)?])
    })
}

/// GroupNormalization (opsets 18 and 21): `X` of shape `(N, C, ...)` with its `C` channels
/// split into `num_groups` groups; each group of each batch item is normalized to
/// `(x - mean) / sqrt(var + epsilon)` over its channels and spatial positions, then scaled
/// and shifted per group (opset 18: `scale` and `bias` of `num_groups` values) or per
/// channel (opset 21: `C` values). Statistics are computed in f32 (`stash_type` 1, the
/// default, for every input type).
fn group_norm(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let eps = info.attr_float("epsilon", 1e-5);
    let groups = info.node.attr_int("num_groups").ok_or_else(|| info.error("the 'num_groups' attribute is required"))?;
    if groups <= 0 {
        return Err(info.error(format!("num_groups must be positive, got {groups}")));
    }
    let groups = groups as usize;
    let per_channel = info.opset >= 21;
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let s = x.shape();
        if s.len() < 2 {
            return Err(kernel_error(format!("GroupNormalization needs X of rank >= 2 (N, C, ...), got {s:?}")));
        }
        let c = s[1];
        if c % groups != 0 {
            return Err(kernel_error(format!("{c} channels do not split into {groups} groups")));
        }
        let (scale, bias) = (to_f32(input(ins, 1)?)?, to_f32(input(ins, 2)?)?);
        let (what, expected) = if per_channel { ("channels", c) } else { ("groups", groups) };
        if scale.len() != expected || bias.len() != expected {
            return Err(kernel_error(format!("scale and bias need one value per {what} ({expected}), got {} and {}", scale.len(), bias.len())));
        }
        let mut v = to_f32(x)?.into_owned();
        let plane: usize = s[2..].iter().product();
        let channels_per_group = c / groups;
        let group_len = channels_per_group * plane;
        if v.is_empty() {
            return Ok(vec![from_f32(x.dtype(), s, v)?]);
        }
        par_chunks_mut(&mut v, group_len, min_items(group_len * ELEMENT_WORK), || (), |_, i, group| vectorized(|| {
            let g = i % groups;
            let len = group.len() as f32;
            let mean = lane_sum(group, |x| x) / len;
            let var = lane_sum(group, |x| (x - mean) * (x - mean)) / len;
            let inv = 1.0 / (var + eps).sqrt();
            for (k, channel) in group.chunks_mut(plane).enumerate() {
                let p = if per_channel { g * channels_per_group + k } else { g };
                let (a, b) = (inv * scale[p], bias[p]);
                channel.iter_mut().for_each(|x| *x = (*x - mean) * a + b);
            }
        }));
        Ok(vec![from_f32(x.dtype(), s, v)?])
    })
}

/// RMSNormalization (opset 23): `X / sqrt(mean(X^2) + epsilon) * scale`, the mean over the
/// dimensions from `axis` (default -1) on, `scale` broadcast against `X`. Computed in f32
/// (`stash_type` 1, the default, for every input type).
fn rms_norm(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.attr_int("axis", -1);
    let eps = info.attr_float("epsilon", 1e-5);
    kernel(move |ins| {
        let (x, scale) = (input(ins, 0)?, input(ins, 1)?);
        let s = x.shape();
        let ax = axis(a, s.len())?;
        let d: usize = s[ax..].iter().product();
        let mut v = to_f32(x)?.into_owned();
        let sv = to_f32(scale)?;
        // A scale shaped like the normalized dimensions (leading 1s aside) applies row by row.
        let ss = scale.shape();
        let per_row = ss.len() <= s.len() - ax && ss.iter().rev().zip(s.iter().rev()).all(|(p, q)| p == q) && sv.len() == d;
        if !v.is_empty() {
            par_chunks_mut(&mut v, d, min_items(d * ELEMENT_WORK), || (), |_, _, row| vectorized(|| {
                let inv = rms_inv(row, eps);
                if per_row {
                    row.iter_mut().zip(sv.iter()).for_each(|(x, &g)| *x *= inv * g);
                } else {
                    row.iter_mut().for_each(|x| *x *= inv);
                }
            }));
        }
        if per_row {
            return Ok(vec![from_f32(x.dtype(), s, v)?]);
        }
        let (out, shape) = binary(&v, s, &sv, ss, |p: f32, g: f32| p * g)?;
        if shape != s {
            return Err(kernel_error(format!("scale of shape {ss:?} does not broadcast to X's shape {s:?}")));
        }
        Ok(vec![from_f32(x.dtype(), s, out)?])
    })
}

/// `1 / sqrt(mean(x^2) + eps)` over one row (the row's root mean square, inverted).
#[inline(always)]
pub(super) fn rms_inv(row: &[f32], eps: f32) -> f32 {
    1.0 / (lane_sum(row, |x| x * x) / row.len() as f32 + eps).sqrt()
}

/// LpNormalization (opsets 1 and 22): `X` divided by its L`p` norm along `axis` (default
/// -1); `p` (default 2) is 1 or 2. A zero vector stays zero.
fn lp_norm(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let a = info.attr_int("axis", -1);
    let p = info.attr_int("p", 2);
    if p != 1 && p != 2 {
        return Err(info.error(format!("p must be 1 or 2, got {p}")));
    }
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let s = x.shape();
        let ax = axis(a, s.len())?;
        let mut v = to_f32(x)?.into_owned();
        let (d, inner) = (s.get(ax).copied().unwrap_or(1), s[(ax + 1).min(s.len())..].iter().product::<usize>());
        if v.is_empty() {
            return Ok(vec![from_f32(x.dtype(), s, v)?]);
        }
        let mut norms = vec![0f32; inner];
        for block in v.chunks_mut(d * inner) {
            norms.fill(0.0);
            for row in block.chunks(inner) {
                norms.iter_mut().zip(row).for_each(|(n, &x)| *n += if p == 1 { x.abs() } else { x * x });
            }
            if p == 2 {
                norms.iter_mut().for_each(|n| *n = n.sqrt());
            }
            for row in block.chunks_mut(inner) {
                row.iter_mut().zip(&norms).for_each(|(x, &n)| *x = if n == 0.0 { 0.0 } else { *x / n });
            }
        }
        Ok(vec![from_f32(x.dtype(), s, v)?])
    })
}

/// MeanVarianceNormalization (opsets 9 and 13): `(X - mean) / (sqrt(var) + 1e-9)`, mean and
/// (population) variance over `axes` (default `[0, 2, 3]`; negative axes count from the
/// end).
fn mean_variance_norm(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let axes_attr = info.attr_ints("axes").unwrap_or_else(|| vec![0, 2, 3]);
    kernel(move |ins| {
        let x = input(ins, 0)?;
        let s = x.shape();
        let mut axes: Vec<usize> = axes_attr.iter().map(|&a| axis(a, s.len())).collect::<RuntimeResult<_>>()?;
        axes.sort_unstable();
        axes.dedup();
        let v = to_f32(x)?;
        let kept: Vec<usize> = s.iter().enumerate().map(|(i, &d)| if axes.contains(&i) { 1 } else { d }).collect();
        let mean = super::reduce::reduce_f32(&v, s, &axes, 0.0, |a, b| a + b, |a, n| a / n as f32);
        let (centered, _) = binary(&v, s, &mean, &kept, |x: f32, m: f32| x - m)?;
        let var = super::reduce::reduce_f32(&centered, s, &axes, 0.0, |a, b| a + b * b, |a, n| a / n as f32);
        let (out, _) = binary(&centered, s, &var, &kept, |c: f32, var: f32| c / (var.sqrt() + 1e-9))?;
        Ok(vec![from_f32(x.dtype(), s, out)?])
    })
}
