//! Normalizations: BatchNormalization (inference), LayerNormalization, InstanceNormalization.

use rayon::prelude::*;

use super::elementwise::{from_f32, to_f32};
use super::util::{axis, input, kernel, lane_sum, min_items, opt_input, par_chunks_mut, threads, vectorized, ELEMENT_WORK};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};

/// Registers the normalization operators.
pub fn register(r: &mut Registry) {
    r.add("", "BatchNormalization", 1, LATEST, batch_norm);
    r.add("", "LayerNormalization", 17, LATEST, layer_norm);
    r.add("", "InstanceNormalization", 1, LATEST, instance_norm);
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
fn layer_norm_row(row: &mut [f32], scale: &[f32], bias: Option<&[f32]>, eps: f32) -> (f32, f32) {
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
