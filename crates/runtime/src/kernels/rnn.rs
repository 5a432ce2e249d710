//! Recurrent layers: RNN, LSTM and GRU (forward, reverse, bidirectional; layout 0 and 1).

use super::util::check_output_size;
use super::elementwise::{from_f32, to_f32};
use super::gemm::{sgemm, MatRef};
use super::util::{input, ints, kernel, opt_input};
use crate::{kernel_error, Kernel, NodeInfo, Registry, RuntimeResult, LATEST};
use qforge_ir::DType;

/// Registers RNN, LSTM and GRU.
pub fn register(r: &mut Registry) {
    r.add("", "RNN", 7, LATEST, rnn);
    r.add("", "LSTM", 7, LATEST, lstm);
    r.add("", "GRU", 7, LATEST, gru);
}

/// An RNN activation by its ONNX name, as `f(x, alpha, beta)`.
fn activation(name: &str) -> RuntimeResult<fn(f32, f32, f32) -> f32> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "sigmoid" => |x, _, _| super::elementwise::sigmoid(x),
        "tanh" => |x, _, _| super::math::tanh(x),
        "relu" => |x, _, _| x.max(0.0),
        "hardsigmoid" => |x, a, b| (a * x + b).clamp(0.0, 1.0),
        "affine" => |x, a, b| a * x + b,
        "leakyrelu" => |x, a, _| if x < 0.0 { a * x } else { x },
        "softsign" => |x, _, _| x / (1.0 + x.abs()),
        "softplus" => |x, _, _| x.exp().ln_1p(),
        "thresholdedrelu" => |x, a, _| if x > a { x } else { 0.0 },
        "scaledtanh" => |x, a, b| a * super::math::tanh(b * x),
        "elu" => |x, a, _| if x < 0.0 { a * (x.exp() - 1.0) } else { x },
        _ => return Err(kernel_error(format!("activation '{name}' is not supported"))),
    })
}

/// Activation functions with their alpha/beta, one per gate role, per direction.
#[derive(Clone)]
struct Acts(Vec<(fn(f32, f32, f32) -> f32, f32, f32)>);

impl Acts {
    /// The activations of a node: its `activations` attribute (one name per gate role per
    /// direction) or `defaults` repeated for each of `dirs` directions. `activation_alpha` and
    /// `activation_beta` are consumed in order by the activations that take them (alpha:
    /// Affine, LeakyRelu, ThresholdedRelu, ScaledTanh, HardSigmoid, Elu; beta: Affine,
    /// ScaledTanh, HardSigmoid); missing values take the spec's defaults.
    fn from_node(info: &NodeInfo, defaults: &[&str], dirs: usize) -> RuntimeResult<Acts> {
        let names: Vec<String> = match info.node.attr("activations") {
            Some(qforge_ir::Attr::Strings(v)) => v.iter().map(|s| String::from_utf8_lossy(s).into_owned()).collect(),
            _ => (0..dirs).flat_map(|_| defaults.iter().map(|s| s.to_string())).collect(),
        };
        let floats = |n: &str| match info.node.attr(n) { Some(qforge_ir::Attr::Floats(v)) => v.clone(), _ => vec![] };
        let (alphas, betas) = (floats("activation_alpha"), floats("activation_beta"));
        let (mut next_alpha, mut next_beta) = (alphas.into_iter(), betas.into_iter());
        let mut v = vec![];
        for n in &names {
            let f = activation(n).map_err(|e| info.error(e.to_string()))?;
            let lower = n.to_ascii_lowercase();
            let alpha = match lower.as_str() {
                "affine" | "thresholdedrelu" | "scaledtanh" | "elu" => next_alpha.next().unwrap_or(1.0),
                "leakyrelu" => next_alpha.next().unwrap_or(0.01),
                "hardsigmoid" => next_alpha.next().unwrap_or(0.2),
                _ => 1.0,
            };
            let beta = match lower.as_str() {
                "affine" => next_beta.next().unwrap_or(0.0),
                "scaledtanh" => next_beta.next().unwrap_or(1.0),
                "hardsigmoid" => next_beta.next().unwrap_or(0.5),
                _ => 0.0,
            };
            v.push((f, alpha, beta));
        }
        if v.len() != defaults.len() * dirs {
            return Err(info.error(format!("{} activations given, {} needed", v.len(), defaults.len() * dirs)));
        }
        Ok(Acts(v))
    }
    fn apply(&self, i: usize, x: f32) -> f32 {
        let (f, a, b) = self.0[i];
        f(x, a, b)
    }
}

/// Shared RNN inputs, normalized to layout 0: X [seq, batch, input].
struct Common {
    x: Vec<f32>,
    seq: usize,
    batch: usize,
    inp: usize,
    lens: Vec<usize>,
}

fn common(ins: &[Option<&qforge_ir::Tensor>], layout: i64) -> RuntimeResult<Common> {
    let x = input(ins, 0)?;
    if x.rank() != 3 {
        return Err(kernel_error(format!("X must be 3-D, got {:?}", x.shape())));
    }
    let mut xv = to_f32(x)?.into_owned();
    let (mut seq, mut batch, inp) = (x.shape()[0], x.shape()[1], x.shape()[2]);
    if layout == 1 {
        std::mem::swap(&mut seq, &mut batch);
        let mut t = vec![0f32; xv.len()];
        for b in 0..batch { for s in 0..seq { t[(s * batch + b) * inp..(s * batch + b + 1) * inp].copy_from_slice(&xv[(b * seq + s) * inp..(b * seq + s + 1) * inp]); } }
        xv = t;
    }
    let lens = match opt_input(ins, 4) {
        Some(t) => ints(t, "sequence_lens")?.into_iter().map(|v| (v.max(0) as usize).min(seq)).collect(),
        None => vec![seq; batch],
    };
    if lens.len() != batch {
        return Err(kernel_error("sequence_lens must have one entry per batch item"));
    }
    Ok(Common { x: xv, seq, batch, inp, lens })
}

/// Converts [seq, dirs, batch, hidden] (or [dirs, batch, hidden]) outputs to layout 1.
fn to_layout1(v: Vec<f32>, dims: &[usize]) -> Vec<f32> {
    let hidden = *dims.last().unwrap();
    let mut out = vec![0f32; v.len()];
    if dims.len() == 4 {
        let (s, d, b) = (dims[0], dims[1], dims[2]);
        for si in 0..s { for di in 0..d { for bi in 0..b {
            let src = ((si * d + di) * b + bi) * hidden;
            let dst = ((bi * s + si) * d + di) * hidden;
            out[dst..dst + hidden].copy_from_slice(&v[src..src + hidden]);
        }}}
    } else {
        let (d, b) = (dims[0], dims[1]);
        for di in 0..d { for bi in 0..b {
            let src = (di * b + bi) * hidden;
            let dst = (bi * d + di) * hidden;
            out[dst..dst + hidden].copy_from_slice(&v[src..src + hidden]);
        }}
    }
    out
}

fn directions(info: &NodeInfo) -> RuntimeResult<(usize, bool)> {
    match info.attr_str("direction", "forward").as_str() {
        "forward" => Ok((1, false)),
        "reverse" => Ok((1, true)),
        "bidirectional" => Ok((2, false)),
        d => Err(info.error(format!("unknown direction '{d}'"))),
    }
}

fn lstm(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let (dirs, reverse) = directions(info)?;
    let hidden = info.attr_int("hidden_size", 0).max(0) as usize;
    let layout = info.attr_int("layout", 0);
    let clip = info.node.attr_float("clip");
    let input_forget = info.attr_int("input_forget", 0) != 0;
    let acts = Acts::from_node(info, &["Sigmoid", "Tanh", "Tanh"], dirs)?;
    kernel(move |ins| {
        let c = common(ins, layout)?;
        let (w, r) = (input(ins, 1)?, input(ins, 2)?);
        let h = if hidden > 0 { hidden } else { r.shape()[2] };
        let (wv, rv) = (to_f32(w)?, to_f32(r)?);
        if w.shape() != [dirs, 4 * h, c.inp] || r.shape() != [dirs, 4 * h, h] {
            return Err(kernel_error(format!("W {:?} / R {:?} do not fit {dirs} directions, hidden {h}, input {}", w.shape(), r.shape(), c.inp)));
        }
        let bias = opt_input(ins, 3).map(|t| to_f32(t).map(|v| v.into_owned())).transpose()?;
        let init = |i: usize| opt_input(ins, i).map(|t| to_f32(t).map(|v| v.into_owned())).transpose();
        let (h0, c0, peep) = (init(5)?, init(6)?, init(7)?);
        let (seq, batch) = (c.seq, c.batch);
        let mut y = vec![0f32; seq * dirs * batch * h];
        let mut yh = vec![0f32; dirs * batch * h];
        let mut yc = vec![0f32; dirs * batch * h];
        for d in 0..dirs {
            let backward = reverse || d == 1;
            // X W^T for every step: [seq*batch, 4h].
            let mut xw = vec![0f32; seq * batch * 4 * h];
            sgemm(seq * batch, 4 * h, c.inp, MatRef::rows(&c.x, c.inp), MatRef::transposed(&wv[d * 4 * h * c.inp..(d + 1) * 4 * h * c.inp], c.inp), &mut xw, false);
            let rd = &rv[d * 4 * h * h..(d + 1) * 4 * h * h];
            let bsum: Vec<f32> = match &bias {
                Some(b) => (0..4 * h).map(|k| b[d * 8 * h + k] + b[d * 8 * h + 4 * h + k]).collect(),
                None => vec![0.0; 4 * h],
            };
            let mut hs = h0.as_ref().map_or(vec![0.0; batch * h], |v| v[d * batch * h..(d + 1) * batch * h].to_vec());
            let mut cs = c0.as_ref().map_or(vec![0.0; batch * h], |v| v[d * batch * h..(d + 1) * batch * h].to_vec());
            let p = peep.as_ref().map(|v| &v[d * 3 * h..(d + 1) * 3 * h]);
            let mut gates = vec![0f32; batch * 4 * h];
            for step in 0..seq {
                let t = if backward { seq - 1 - step } else { step };
                gates.copy_from_slice(&xw[t * batch * 4 * h..(t + 1) * batch * 4 * h]);
                sgemm(batch, 4 * h, h, MatRef::rows(&hs, h), MatRef::transposed(rd, h), &mut gates, true);
                for b in 0..batch {
                    // Each item runs over its own length; a reverse run starts at its last step.
                    if step >= c.lens[b] {
                        continue;
                    }
                    let tt = if backward { c.lens[b] - 1 - step } else { t };
                    if backward && tt != t {
                        // Recompute this item's input projection at its own time index.
                        let xrow = &c.x[(tt * batch + b) * c.inp..(tt * batch + b + 1) * c.inp];
                        let wd = &wv[d * 4 * h * c.inp..(d + 1) * 4 * h * c.inp];
                        for k in 0..4 * h {
                            let mut acc: f32 = (0..h).map(|j| hs[b * h + j] * rd[k * h + j]).sum();
                            acc += (0..c.inp).map(|j| xrow[j] * wd[k * c.inp + j]).sum::<f32>();
                            gates[b * 4 * h + k] = acc;
                        }
                    }
                    let g = &mut gates[b * 4 * h..(b + 1) * 4 * h];
                    for k in 0..h {
                        let cl = |v: f32| clip.map_or(v, |c| v.clamp(-c, c));
                        let cprev = cs[b * h + k];
                        let mut gi = cl(g[k] + bsum[k] + p.map_or(0.0, |p| p[k] * cprev));
                        let mut gf = cl(g[2 * h + k] + bsum[2 * h + k] + p.map_or(0.0, |p| p[2 * h + k] * cprev));
                        gi = acts.apply(d * 3, gi);
                        gf = acts.apply(d * 3, gf);
                        if input_forget { gf = 1.0 - gi; }
                        let gc = acts.apply(d * 3 + 1, cl(g[3 * h + k] + bsum[3 * h + k]));
                        let cnew = gf * cprev + gi * gc;
                        let go = acts.apply(d * 3, cl(g[h + k] + bsum[h + k] + p.map_or(0.0, |p| p[h + k] * cnew)));
                        let hnew = go * acts.apply(d * 3 + 2, cnew);
                        cs[b * h + k] = cnew;
                        hs[b * h + k] = hnew;
                        y[((tt * dirs + d) * batch + b) * h + k] = hnew;
                    }
                }
            }
            yh[d * batch * h..(d + 1) * batch * h].copy_from_slice(&hs);
            yc[d * batch * h..(d + 1) * batch * h].copy_from_slice(&cs);
        }
        let dt = input(ins, 0)?.dtype();
        let (ys, ss) = ([seq, dirs, batch, h], [dirs, batch, h]);
        if layout == 1 {
            return Ok(vec![
                from_f32(dt, &[batch, seq, dirs, h], to_layout1(y, &ys))?,
                from_f32(dt, &[batch, dirs, h], to_layout1(yh, &ss))?,
                from_f32(dt, &[batch, dirs, h], to_layout1(yc, &ss))?,
            ]);
        }
        Ok(vec![from_f32(dt, &ys, y)?, from_f32(dt, &ss, yh)?, from_f32(dt, &ss, yc)?])
    })
}

fn gru(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let (dirs, reverse) = directions(info)?;
    let hidden = info.attr_int("hidden_size", 0).max(0) as usize;
    let layout = info.attr_int("layout", 0);
    let lbr = info.attr_int("linear_before_reset", 0) != 0;
    let clip = info.node.attr_float("clip");
    let acts = Acts::from_node(info, &["Sigmoid", "Tanh"], dirs)?;
    kernel(move |ins| {
        let c = common(ins, layout)?;
        if c.lens.iter().any(|&l| l != c.seq) {
            return Err(kernel_error("GRU with sequence_lens shorter than the sequence is not supported"));
        }
        let (w, r) = (input(ins, 1)?, input(ins, 2)?);
        let h = if hidden > 0 { hidden } else { r.shape()[2] };
        let (wv, rv) = (to_f32(w)?, to_f32(r)?);
        if w.shape() != [dirs, 3 * h, c.inp] || r.shape() != [dirs, 3 * h, h] {
            return Err(kernel_error(format!("W {:?} / R {:?} do not fit {dirs} directions, hidden {h}", w.shape(), r.shape())));
        }
        let bias = opt_input(ins, 3).map(|t| to_f32(t).map(|v| v.into_owned())).transpose()?;
        let h0 = opt_input(ins, 5).map(|t| to_f32(t).map(|v| v.into_owned())).transpose()?;
        let (seq, batch) = (c.seq, c.batch);
        let mut y = vec![0f32; seq * dirs * batch * h];
        let mut yh = vec![0f32; dirs * batch * h];
        for d in 0..dirs {
            let backward = reverse || d == 1;
            let mut xw = vec![0f32; seq * batch * 3 * h];
            sgemm(seq * batch, 3 * h, c.inp, MatRef::rows(&c.x, c.inp), MatRef::transposed(&wv[d * 3 * h * c.inp..(d + 1) * 3 * h * c.inp], c.inp), &mut xw, false);
            let rd = &rv[d * 3 * h * h..(d + 1) * 3 * h * h];
            let (wb, rb): (Vec<f32>, Vec<f32>) = match &bias {
                Some(b) => (b[d * 6 * h..d * 6 * h + 3 * h].to_vec(), b[d * 6 * h + 3 * h..(d + 1) * 6 * h].to_vec()),
                None => (vec![0.0; 3 * h], vec![0.0; 3 * h]),
            };
            let mut hs = h0.as_ref().map_or(vec![0.0; batch * h], |v| v[d * batch * h..(d + 1) * batch * h].to_vec());
            let mut hr = vec![0f32; batch * 3 * h];
            for step in 0..seq {
                let t = if backward { seq - 1 - step } else { step };
                sgemm(batch, 3 * h, h, MatRef::rows(&hs, h), MatRef::transposed(rd, h), &mut hr, false);
                let cl = |v: f32| clip.map_or(v, |c| v.clamp(-c, c));
                let mut z = vec![0f32; h];
                let mut rgate = vec![0f32; h];
                for b in 0..batch {
                    let xg = &xw[(t * batch + b) * 3 * h..(t * batch + b + 1) * 3 * h];
                    let rg = &hr[b * 3 * h..(b + 1) * 3 * h];
                    for k in 0..h {
                        z[k] = acts.apply(d * 2, cl(xg[k] + wb[k] + rg[k] + rb[k]));
                        rgate[k] = acts.apply(d * 2, cl(xg[h + k] + wb[h + k] + rg[h + k] + rb[h + k]));
                    }
                    for k in 0..h {
                        let recur = if lbr {
                            rgate[k] * (rg[2 * h + k] + rb[2 * h + k])
                        } else {
                            (0..h).map(|j| rgate[j] * hs[b * h + j] * rd[(2 * h + k) * h + j]).sum::<f32>() + rb[2 * h + k]
                        };
                        let hh = acts.apply(d * 2 + 1, cl(xg[2 * h + k] + wb[2 * h + k] + recur));
                        y[((t * dirs + d) * batch + b) * h + k] = (1.0 - z[k]) * hh + z[k] * hs[b * h + k];
                    }
                }
                for b in 0..batch {
                    for k in 0..h {
                        hs[b * h + k] = y[((t * dirs + d) * batch + b) * h + k];
                    }
                }
            }
            yh[d * batch * h..(d + 1) * batch * h].copy_from_slice(&hs);
        }
        let dt = input(ins, 0)?.dtype();
        let (ys, ss) = ([seq, dirs, batch, h], [dirs, batch, h]);
        if layout == 1 {
            return Ok(vec![from_f32(dt, &[batch, seq, dirs, h], to_layout1(y, &ys))?, from_f32(dt, &[batch, dirs, h], to_layout1(yh, &ss))?]);
        }
        Ok(vec![from_f32(dt, &ys, y)?, from_f32(dt, &ss, yh)?])
    })
}

/// The float values of an optional input that must have `shape`, or `None` when absent; the
/// error names the input `what` and both shapes.
fn shaped_input(ins: &[Option<&qforge_ir::Tensor>], i: usize, what: &str, shape: &[usize]) -> RuntimeResult<Option<Vec<f32>>> {
    let Some(t) = opt_input(ins, i) else { return Ok(None) };
    if t.shape() != shape {
        return Err(kernel_error(format!("RNN: {what} has shape {:?}; expected {shape:?}", t.shape())));
    }
    Ok(Some(to_f32(t)?.into_owned()))
}

/// Plans an RNN node (opsets 7, 14, 22): X `[seq, batch, input]` (layout 1: `[batch, seq,
/// input]`), W `[dirs, hidden, input]`, R `[dirs, hidden, hidden]`, optional B `[dirs,
/// 2 * hidden]` (Wb then Rb), sequence_lens `[batch]` (each in `0..=seq`) and initial_h
/// `[dirs, batch, hidden]`. Each direction computes `H_t = f(clip(X_t W^T + H_{t-1} R^T + Wb
/// + Rb))` with `f` its activation (Tanh by default); the reverse direction walks each batch
/// item from its own last step. Outputs Y `[seq, dirs, batch, hidden]` (zero past an item's
/// length) and Y_h `[dirs, batch, hidden]` (each item's last computed state), or their
/// batch-first forms under layout 1. The input projection of all steps is one GEMM per
/// direction; each step adds one `[batch, hidden] x [hidden, hidden]` GEMM.
fn rnn(info: &NodeInfo) -> RuntimeResult<Box<dyn Kernel>> {
    let (dirs, reverse) = directions(info)?;
    let hidden_attr = info.attr_int("hidden_size", 0);
    if hidden_attr < 0 {
        return Err(info.error(format!("hidden_size is {hidden_attr}; it must not be negative")));
    }
    let layout = if info.opset >= 14 { info.attr_int("layout", 0) } else { 0 };
    if !(0..=1).contains(&layout) {
        return Err(info.error(format!("layout is {layout}; it must be 0 or 1")));
    }
    let clip = info.node.attr_float("clip");
    if let Some(c) = clip.filter(|c| c.is_nan() || *c < 0.0) {
        return Err(info.error(format!("clip is {c}; it must not be negative")));
    }
    let acts = Acts::from_node(info, &["Tanh"], dirs)?;
    kernel(move |ins| {
        let x = input(ins, 0)?;
        if x.rank() != 3 {
            return Err(kernel_error(format!("RNN: X must be 3-D, got shape {:?}", x.shape())));
        }
        let (seq, batch, inp) = if layout == 0 { (x.shape()[0], x.shape()[1], x.shape()[2]) } else { (x.shape()[1], x.shape()[0], x.shape()[2]) };
        let (w, r) = (input(ins, 1)?, input(ins, 2)?);
        if r.rank() != 3 {
            return Err(kernel_error(format!("RNN: R must be 3-D, got shape {:?}", r.shape())));
        }
        let h = if hidden_attr > 0 { hidden_attr as usize } else { r.shape()[2] };
        if w.shape() != [dirs, h, inp] || r.shape() != [dirs, h, h] {
            return Err(kernel_error(format!("RNN: W {:?} and R {:?} do not fit {dirs} direction(s), hidden size {h} and input size {inp}; expected {:?} and {:?}", w.shape(), r.shape(), [dirs, h, inp], [dirs, h, h])));
        }
        let dt = x.dtype();
        let y_shape = [seq, dirs, batch, h];
        check_output_size("RNN output Y", dt, &y_shape)?;
        check_output_size("RNN input projection", DType::F32, &[seq * batch, h])?;
        let lens: Vec<usize> = match opt_input(ins, 4) {
            Some(t) => {
                let v = ints(t, "sequence_lens")?;
                if v.len() != batch {
                    return Err(kernel_error(format!("RNN: sequence_lens has {} values; batch size is {batch}", v.len())));
                }
                v.iter().map(|&l| usize::try_from(l).ok().filter(|&l| l <= seq).ok_or_else(|| kernel_error(format!("RNN: sequence length {l} is outside 0..={seq}")))).collect::<RuntimeResult<_>>()?
            }
            None => vec![seq; batch],
        };
        let bias = shaped_input(ins, 3, "B", &[dirs, 2 * h])?;
        let h0 = shaped_input(ins, 5, "initial_h", &[dirs, batch, h])?;
        let xv = to_f32(x)?;
        let xs: std::borrow::Cow<[f32]> = if layout == 0 { xv } else { std::borrow::Cow::Owned(to_layout1(xv.into_owned(), &[batch, seq, inp])) };
        let (wv, rv) = (to_f32(w)?, to_f32(r)?);
        let mut y = vec![0f32; seq * dirs * batch * h];
        let mut yh = vec![0f32; dirs * batch * h];
        let mut projected = vec![0f32; seq * batch * h];
        let mut recurrent = vec![0f32; batch * h];
        let limit = |v: f32| clip.map_or(v, |c| v.clamp(-c, c));
        for d in 0..dirs {
            let backward = reverse || d == 1;
            if inp > 0 && h > 0 && seq * batch > 0 {
                sgemm(seq * batch, h, inp, MatRef::rows(&xs, inp), MatRef::transposed(&wv[d * h * inp..(d + 1) * h * inp], inp), &mut projected, false);
            } else {
                projected.fill(0.0);
            }
            let rd = &rv[d * h * h..(d + 1) * h * h];
            let gate_bias: Vec<f32> = match &bias {
                Some(b) => (0..h).map(|k| b[d * 2 * h + k] + b[d * 2 * h + h + k]).collect(),
                None => vec![0.0; h],
            };
            let mut state = h0.as_ref().map_or(vec![0.0; batch * h], |v| v[d * batch * h..(d + 1) * batch * h].to_vec());
            for step in 0..seq {
                if h > 0 && batch > 0 {
                    sgemm(batch, h, h, MatRef::rows(&state, h), MatRef::transposed(rd, h), &mut recurrent, false);
                }
                for (b, &len) in lens.iter().enumerate() {
                    if step >= len {
                        continue;
                    }
                    let t = if backward { len - 1 - step } else { step };
                    let xw = &projected[(t * batch + b) * h..(t * batch + b + 1) * h];
                    let out = &mut y[((t * dirs + d) * batch + b) * h..((t * dirs + d) * batch + b + 1) * h];
                    for k in 0..h {
                        out[k] = acts.apply(d, limit(xw[k] + recurrent[b * h + k] + gate_bias[k]));
                    }
                    state[b * h..(b + 1) * h].copy_from_slice(out);
                }
            }
            yh[d * batch * h..(d + 1) * batch * h].copy_from_slice(&state);
        }
        let state_shape = [dirs, batch, h];
        if layout == 1 {
            return Ok(vec![from_f32(dt, &[batch, seq, dirs, h], to_layout1(y, &y_shape))?, from_f32(dt, &[batch, dirs, h], to_layout1(yh, &state_shape))?]);
        }
        Ok(vec![from_f32(dt, &y_shape, y)?, from_f32(dt, &state_shape, yh)?])
    })
}
