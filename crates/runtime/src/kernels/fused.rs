//! Fused f32 elementwise programs: a chain of elementwise ops evaluated block by block while
//! the block is in cache, either on its own or as the epilogue of a convolution.
//!
//! A [`Program`] is a list of instructions in static single assignment form over its external
//! inputs and constant parameters; each op computes exactly the f32 expression of its
//! stand-alone kernel, so a fused run gives the same bits as the unfused one.

use std::mem::MaybeUninit;

use super::elementwise::sigmoid;
use super::util::write_slice;

/// A unary op of a program, with its attributes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Unary {
    Relu,
    Sigmoid,
    Tanh,
    Erf,
    HardSigmoid { alpha: f32, beta: f32 },
    HardSwish,
    LeakyRelu(f32),
    Clip { lo: f32, hi: f32 },
}

impl Unary {
    /// The op on one value, the same expression as its stand-alone kernel.
    #[inline(always)]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Unary::Relu => x.max(0.0),
            Unary::Sigmoid => sigmoid(x),
            Unary::Tanh => super::math::tanh(x),
            Unary::Erf => super::math::erf(x),
            Unary::HardSigmoid { alpha, beta } => (alpha * x + beta).clamp(0.0, 1.0),
            Unary::HardSwish => x * (x * (1.0 / 6.0) + 0.5).clamp(0.0, 1.0),
            Unary::LeakyRelu(a) => if x < 0.0 { a * x } else { x },
            Unary::Clip { lo, hi } => x.max(lo).min(hi),
        }
    }
}

/// A binary arithmetic op of a program.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
}

/// Where an instruction reads an operand.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Operand {
    /// External input `k` (input 0 is the primary one, whose shape is the output's).
    Input(usize),
    /// The result of instruction `i`.
    Value(usize),
    /// Constant parameter `p`.
    Param(usize),
}

/// One instruction; instruction `i` defines [`Operand::Value`]`(i)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Inst {
    Unary(Unary, Operand),
    Binary(Binary, Operand, Operand),
}

/// How a constant parameter broadcasts against the primary input.
#[derive(Debug, Clone, PartialEq)]
pub enum ParamShape {
    /// numpy broadcasting of a tensor of this shape.
    Numpy(Vec<usize>),
    /// One value per index of axis 1 (BatchNormalization's parameters).
    Channel,
}

/// A constant operand.
#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub values: Vec<f32>,
    pub shape: ParamShape,
}

/// A fused elementwise program; its result is the value of the last instruction.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// Number of external inputs.
    pub inputs: usize,
    pub insts: Vec<Inst>,
    pub params: Vec<Param>,
}

/// A periodic view of broadcast data: element `i` of the output reads
/// `values[(i / inner) % values.len()]`.
#[derive(Clone, Copy)]
enum Periodic<'a> {
    Scalar(f32),
    Repeat { values: &'a [f32], inner: usize },
}

impl<'a> Periodic<'a> {
    /// The view of `values` (of `shape`) broadcast to `out`, when it fits one of the periodic
    /// forms (a scalar, or one contiguous run of non-broadcast dimensions) and does not
    /// enlarge the output.
    fn of(values: &'a [f32], shape: &[usize], out: &[usize]) -> Option<Periodic<'a>> {
        if shape.len() > out.len() || values.len() != shape.iter().product::<usize>() {
            return None;
        }
        let lead = out.len() - shape.len();
        // The first and last dimensions where the data is not broadcast, and their count.
        let (mut first, mut last, mut count) = (usize::MAX, 0, 0);
        for (d, &o) in out.iter().enumerate() {
            let n = if d < lead { 1 } else { shape[d - lead] };
            if n != 1 && n != o {
                return None;
            }
            if n != 1 {
                first = first.min(d);
                last = d;
                count += 1;
            }
        }
        if count == 0 {
            return values.first().map(|&v| Periodic::Scalar(v));
        }
        if count != last - first + 1 {
            return None;
        }
        Some(Periodic::Repeat { values, inner: out[last + 1..].iter().product() })
    }

    /// The run length over which the view is one value (`inner`), or the period of a
    /// per-element view; `None` for a scalar.
    fn unit(&self) -> Option<usize> {
        match *self {
            Periodic::Scalar(_) => None,
            Periodic::Repeat { inner, .. } if inner > 1 => Some(inner),
            Periodic::Repeat { values, .. } => Some(values.len()),
        }
    }

    /// The operand for the elements `[at, at + len)`: one value or a slice of `values` when
    /// the block allows, otherwise written to `buf` (at least `len` long).
    fn resolve<'b>(&self, at: usize, len: usize, buf: &'b mut [f32]) -> Src<'b>
    where
        'a: 'b,
    {
        match *self {
            Periodic::Scalar(v) => Src::Scalar(v),
            Periodic::Repeat { values, inner } => {
                let count = values.len();
                if inner > 1 && at / inner == (at + len - 1) / inner {
                    return Src::Scalar(values[(at / inner) % count]);
                }
                if inner == 1 && at / count == (at + len - 1) / count {
                    let s = at % count;
                    return Src::Slice(&values[s..s + len]);
                }
                let mut i = 0;
                while i < len {
                    let idx = at + i;
                    let run = (inner - idx % inner).min(len - i);
                    if inner > 1 {
                        buf[i..i + run].fill(values[(idx / inner) % count]);
                        i += run;
                    } else {
                        let s = idx % count;
                        let run = (count - s).min(len - i);
                        buf[i..i + run].copy_from_slice(&values[s..s + run]);
                        i += run;
                    }
                }
                Src::Slice(&buf[..len])
            }
        }
    }
}

/// A bound external input: the full data (same shape as the output) or a broadcast view.
#[derive(Clone, Copy)]
enum Bind<'a> {
    Full(&'a [f32]),
    Broadcast(Periodic<'a>),
}

/// An operand for one block: one value for the block, or one per element.
#[derive(Clone, Copy)]
enum Src<'a> {
    Scalar(f32),
    Slice(&'a [f32]),
}

/// A program bound to the shapes of one run.
pub struct Bound<'a> {
    prog: &'a Program,
    params: Vec<Periodic<'a>>,
    /// Inputs 1.. (input 0 is given per block).
    extras: Vec<Bind<'a>>,
    /// Blocks do not cross multiples of this (0: no constraint), so operands broadcast
    /// over runs this long stay one value per block.
    unit: usize,
    /// Elements per evaluated block (one scratch register each).
    block: usize,
}

/// Scratch for [`Bound::apply`] and [`Bound::eval`] (one per thread).
pub type Scratch = Vec<f32>;

/// Most constant parameters plus broadcast inputs a bound program may have.
pub const MAX_OPERANDS: usize = 24;

impl Program {
    /// Binds the program to a primary input (and output) of shape `out` and to the other
    /// inputs `extras` (data and shape, inputs 1..): `None` when an operand would broadcast
    /// beyond `out` or in a form blocks cannot follow (then the caller runs the ops
    /// unfused).
    pub fn bind<'a>(&'a self, out: &[usize], extras: &[(&'a [f32], &'a [usize])]) -> Option<Bound<'a>> {
        if extras.len() + 1 != self.inputs {
            return None;
        }
        let params: Vec<Periodic> = self.params.iter().map(|p| match &p.shape {
            ParamShape::Numpy(s) => Periodic::of(&p.values, s, out),
            ParamShape::Channel => {
                let c = *out.get(1)?;
                (p.values.len() == c).then(|| Periodic::Repeat { values: &p.values, inner: out[2..].iter().product() })
            }
        }).collect::<Option<_>>()?;
        let extras: Vec<Bind> = extras.iter().map(|&(v, s)| {
            if s == out {
                Some(Bind::Full(v))
            } else {
                Periodic::of(v, s, out).map(Bind::Broadcast)
            }
        }).collect::<Option<_>>()?;
        let mut units: Vec<usize> = params.iter().chain(extras.iter().filter_map(|e| match e {
            Bind::Broadcast(p) => Some(p),
            Bind::Full(_) => None,
        })).filter_map(|p| p.unit()).collect();
        if params.len() + extras.len() > MAX_OPERANDS {
            return None;
        }
        let block = if self.insts.len() + params.len() <= 16 { 512 } else { 256 };
        // Runs shorter than a quarter block are cheaper to expand per element than to
        // evaluate one by one.
        units.sort_unstable();
        units.dedup();
        let unit = match units.as_slice() {
            [u] if *u >= block / 4 => *u,
            _ => 0,
        };
        Some(Bound { prog: self, params, extras, unit, block })
    }
}

impl Bound<'_> {
    /// Replaces `dst`, the elements `[offset, offset + dst.len())` of input 0, by the
    /// program's result there.
    pub fn apply(&self, dst: &mut [f32], offset: usize, scratch: &mut Scratch) {
        self.blocks(offset, dst.len(), |at, len| {
            let local = at - offset;
            let r = self.eval_block(&dst[local..local + len], at, scratch);
            dst[local..local + len].copy_from_slice(&scratch[r..r + len]);
        });
    }

    /// Writes the program's result for the elements `[offset, offset + out.len())` to
    /// every element of `out`, reading input 0 from `primary` (all of it).
    pub fn eval(&self, out: &mut [MaybeUninit<f32>], offset: usize, primary: &[f32], scratch: &mut Scratch) {
        self.blocks(offset, out.len(), |at, len| {
            let r = self.eval_block(&primary[at..at + len], at, scratch);
            let local = at - offset;
            write_slice(&mut out[local..local + len], &scratch[r..r + len]);
        });
    }

    /// Splits `[offset, offset + len)` into blocks of at most `self.block` elements that
    /// cross no multiple of `self.unit`.
    fn blocks(&self, offset: usize, len: usize, mut f: impl FnMut(usize, usize)) {
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let mut next = (at + self.block).min(end);
            if let Some(q) = at.checked_div(self.unit) {
                next = next.min((q + 1) * self.unit);
            }
            f(at, next - at);
            at = next;
        }
    }

    /// Evaluates one block (`first`: input 0 there; `at`: its flat offset) into `scratch`;
    /// returns where the result starts in `scratch`.
    fn eval_block(&self, first: &[f32], at: usize, scratch: &mut Scratch) -> usize {
        let n = self.prog.insts.len();
        let need = (n + 2) * self.block;
        if scratch.len() < need {
            scratch.resize(need, 0.0);
        }
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports AVX-512F, checked just above.
                unsafe { self.eval_avx512(first, at, scratch) };
                return (n - 1) * self.block;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2, checked just above.
                unsafe { self.eval_avx2(first, at, scratch) };
                return (n - 1) * self.block;
            }
        }
        self.eval_generic(first, at, scratch);
        (n - 1) * self.block
    }

    /// [`Bound::eval_generic`] compiled for AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn eval_avx512(&self, first: &[f32], at: usize, scratch: &mut [f32]) {
        self.eval_generic(first, at, scratch)
    }

    /// [`Bound::eval_generic`] compiled for AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn eval_avx2(&self, first: &[f32], at: usize, scratch: &mut [f32]) {
        self.eval_generic(first, at, scratch)
    }

    /// Runs every instruction over one block: instruction `i` writes
    /// `scratch[i * block..][..len]`; broadcast operands that vary within the block are
    /// expanded into the two blocks after the instructions' registers.
    #[inline(always)]
    fn eval_generic(&self, first: &[f32], at: usize, scratch: &mut [f32]) {
        let len = first.len();
        let block = self.block;
        let (regs, bufs) = scratch.split_at_mut(self.prog.insts.len() * block);
        let (buf_a, buf_b) = bufs.split_at_mut(block);
        for (i, inst) in self.prog.insts.iter().enumerate() {
            let (done, rest) = regs.split_at_mut(i * block);
            let d = &mut rest[..len];
            let done: &[f32] = done;
            match *inst {
                Inst::Unary(op, a) => unary(op, d, self.operand(a, first, done, at, buf_a)),
                Inst::Binary(op, a, b) => binary(op, d, self.operand(a, first, done, at, buf_a), self.operand(b, first, done, at, buf_b)),
            }
        }
    }

    /// Operand `o` for the block at `at` (input 0 there: `first`; earlier registers:
    /// `done`), expanded into `buf` when it varies within the block.
    #[inline(always)]
    fn operand<'s>(&'s self, o: Operand, first: &'s [f32], done: &'s [f32], at: usize, buf: &'s mut [f32]) -> Src<'s> {
        let len = first.len();
        match o {
            Operand::Input(0) => Src::Slice(first),
            Operand::Input(k) => match self.extras[k - 1] {
                Bind::Full(v) => Src::Slice(&v[at..at + len]),
                Bind::Broadcast(p) => p.resolve(at, len, buf),
            },
            Operand::Value(j) => Src::Slice(&done[j * self.block..j * self.block + len]),
            Operand::Param(p) => self.params[p].resolve(at, len, buf),
        }
    }
}

/// `d[i] = op(a[i])`, one loop per op so each vectorizes.
#[inline(always)]
fn unary(op: Unary, d: &mut [f32], a: Src) {
    let a = match a {
        Src::Slice(s) => s,
        Src::Scalar(v) => return d.fill(op.apply(v)),
    };
    #[inline(always)]
    fn map(d: &mut [f32], a: &[f32], f: impl Fn(f32) -> f32) {
        for (o, &x) in d.iter_mut().zip(a) {
            *o = f(x);
        }
    }
    match op {
        Unary::Relu => map(d, a, |x| Unary::Relu.apply(x)),
        Unary::Sigmoid => map(d, a, |x| Unary::Sigmoid.apply(x)),
        Unary::Tanh => map(d, a, |x| Unary::Tanh.apply(x)),
        Unary::Erf => map(d, a, |x| Unary::Erf.apply(x)),
        Unary::HardSigmoid { alpha, beta } => map(d, a, |x| Unary::HardSigmoid { alpha, beta }.apply(x)),
        Unary::HardSwish => map(d, a, |x| Unary::HardSwish.apply(x)),
        Unary::LeakyRelu(s) => map(d, a, |x| Unary::LeakyRelu(s).apply(x)),
        Unary::Clip { lo, hi } => map(d, a, |x| Unary::Clip { lo, hi }.apply(x)),
    }
}

/// `d[i] = a[i] op b[i]` for each combination of per-element and per-block operands.
#[inline(always)]
fn binary(op: Binary, d: &mut [f32], a: Src, b: Src) {
    #[inline(always)]
    fn go(d: &mut [f32], a: Src, b: Src, f: impl Fn(f32, f32) -> f32) {
        match (a, b) {
            (Src::Slice(x), Src::Slice(y)) => {
                for ((o, &p), &q) in d.iter_mut().zip(x).zip(y) {
                    *o = f(p, q);
                }
            }
            (Src::Slice(x), Src::Scalar(q)) => {
                for (o, &p) in d.iter_mut().zip(x) {
                    *o = f(p, q);
                }
            }
            (Src::Scalar(p), Src::Slice(y)) => {
                for (o, &q) in d.iter_mut().zip(y) {
                    *o = f(p, q);
                }
            }
            (Src::Scalar(p), Src::Scalar(q)) => d.fill(f(p, q)),
        }
    }
    match op {
        Binary::Add => go(d, a, b, |p, q| p + q),
        Binary::Sub => go(d, a, b, |p, q| p - q),
        Binary::Mul => go(d, a, b, |p, q| p * q),
        Binary::Div => go(d, a, b, |p, q| p / q),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::util::{assume_init, uninit};

    #[test]
    fn program_matches_op_by_op_evaluation() {
        // y = hardswish(x * s[c] + b[c]) / 6 + r, with a per-channel scale, a scalar, and a
        // same-shape second input, on a [1, 3, 2, 5] tensor.
        let shape = [1, 3, 2, 5];
        let x: Vec<f32> = (0..30).map(|i| i as f32 * 0.37 - 4.0).collect();
        let r: Vec<f32> = (0..30).map(|i| (i as f32).sin()).collect();
        let prog = Program {
            inputs: 2,
            insts: vec![
                Inst::Binary(Binary::Mul, Operand::Input(0), Operand::Param(0)),
                Inst::Binary(Binary::Add, Operand::Value(0), Operand::Param(1)),
                Inst::Unary(Unary::HardSwish, Operand::Value(1)),
                Inst::Binary(Binary::Div, Operand::Value(2), Operand::Param(2)),
                Inst::Binary(Binary::Add, Operand::Value(3), Operand::Input(1)),
            ],
            params: vec![
                Param { values: vec![0.5, -1.0, 2.0], shape: ParamShape::Numpy(vec![3, 1, 1]) },
                Param { values: vec![0.1, 0.2, 0.3], shape: ParamShape::Channel },
                Param { values: vec![6.0], shape: ParamShape::Numpy(vec![]) },
            ],
        };
        let want: Vec<f32> = (0..30).map(|i| {
            let c = i / 10;
            let a = x[i] * [0.5, -1.0, 2.0][c] + [0.1, 0.2, 0.3][c];
            Unary::HardSwish.apply(a) / 6.0 + r[i]
        }).collect();
        let bound = prog.bind(&shape, &[(&r, &shape)]).unwrap();
        let mut out = uninit::<f32>(30);
        let mut scratch = vec![];
        bound.eval(&mut out, 0, &x, &mut scratch);
        // SAFETY: `eval` writes every element.
        let out = unsafe { assume_init(out) };
        assert_eq!(out, want);
        let mut part = x[7..23].to_vec();
        bound.apply(&mut part, 7, &mut scratch);
        assert_eq!(part, want[7..23]);
        // A per-last-axis parameter and a broadcast input.
        let prog2 = Program {
            inputs: 2,
            insts: vec![
                Inst::Binary(Binary::Sub, Operand::Param(0), Operand::Input(0)),
                Inst::Binary(Binary::Mul, Operand::Value(0), Operand::Input(1)),
            ],
            params: vec![Param { values: vec![1.0, 2.0, 3.0, 4.0, 5.0], shape: ParamShape::Numpy(vec![5]) }],
        };
        let s = [10.0, 20.0, 30.0];
        let bound = prog2.bind(&shape, &[(&s, &[1, 3, 1, 1])]).unwrap();
        let mut out = uninit::<f32>(30);
        bound.eval(&mut out, 0, &x, &mut scratch);
        // SAFETY: `eval` writes every element.
        let out = unsafe { assume_init(out) };
        let want: Vec<f32> = (0..30).map(|i| ((i % 5 + 1) as f32 - x[i]) * s[i / 10]).collect();
        assert_eq!(out, want);
        assert!(prog2.bind(&[1, 3, 2, 4], &[(&s, &[1, 3, 1, 1])]).is_none());
    }
}
