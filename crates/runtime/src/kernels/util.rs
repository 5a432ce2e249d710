//! Shared kernel helpers: input access, numpy broadcasting, axes, typed dispatch.

use std::mem::MaybeUninit;

use qforge_ir::{DType, Elem, Tensor};

use crate::{kernel_error, value_kernel, Kernel, RunCtx, RuntimeResult, Value, ValueKernel};

/// A kernel from a closure over the inputs.
pub struct FnKernel<F>(pub F);

impl<F> Kernel for FnKernel<F>
where
    F: Fn(&[Option<&Tensor>]) -> RuntimeResult<Vec<Tensor>> + Send + Sync,
{
    fn run(&self, inputs: &[Option<&Tensor>], _ctx: &RunCtx) -> RuntimeResult<Vec<Tensor>> {
        (self.0)(inputs)
    }
}

/// Boxes a closure kernel.
pub fn kernel<F>(f: F) -> RuntimeResult<Box<dyn Kernel>>
where
    F: Fn(&[Option<&Tensor>]) -> RuntimeResult<Vec<Tensor>> + Send + Sync + 'static,
{
    Ok(Box::new(FnKernel(f)))
}

struct FnValueKernel<F>(F);

impl<F> ValueKernel for FnValueKernel<F>
where
    F: Fn(&[Option<&Value>]) -> RuntimeResult<Vec<Value>> + Send + Sync,
{
    fn run_values(&self, inputs: &[Option<&Value>], _ctx: &RunCtx) -> RuntimeResult<Vec<Value>> {
        (self.0)(inputs)
    }
}

/// Boxes a closure over values (sequences, optionals) as a kernel (see [`ValueKernel`]).
pub fn values_fn<F>(f: F) -> RuntimeResult<Box<dyn Kernel>>
where
    F: Fn(&[Option<&Value>]) -> RuntimeResult<Vec<Value>> + Send + Sync + 'static,
{
    value_kernel(FnValueKernel(f))
}

/// Storage for `len` elements that a kernel writes completely before anything reads it: the
/// elements start uninitialized (sparing a zero-filling pass) and are written through raw
/// pointers or [`MaybeUninit::write`]; [`assume_init`] and its siblings give the values once
/// written.
pub fn uninit<T>(len: usize) -> Vec<MaybeUninit<T>> {
    let mut v = Vec::with_capacity(len);
    // SAFETY: the capacity is `len`, and `MaybeUninit` needs no initialization.
    unsafe { v.set_len(len) };
    v
}

/// A vector of `n` elements of any type, written by `fill` into uninitialized storage (no
/// zero-filling pass).
///
/// # Safety
/// `fill` writes every one of the `n` elements it is given.
pub unsafe fn written<O>(n: usize, fill: impl FnOnce(&mut [MaybeUninit<O>])) -> Vec<O> {
    let mut out = Vec::with_capacity(n);
    fill(&mut out.spare_capacity_mut()[..n]);
    // SAFETY: the capacity is at least `n`, and the caller guarantees `fill` initialized all
    // `n` elements.
    unsafe { out.set_len(n) };
    out
}

/// The values of a buffer from [`uninit`].
///
/// # Safety
/// Every element of `v` has been written.
pub unsafe fn assume_init<T>(v: Vec<MaybeUninit<T>>) -> Vec<T> {
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: `MaybeUninit<T>` has the layout of `T`, the allocation is handed over whole
    // (pointer, length, capacity), and the caller guarantees every element is written.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<T>(), v.len(), v.capacity()) }
}

/// The values of a written region of a buffer from [`uninit`].
///
/// # Safety
/// Every element of `s` has been written.
pub unsafe fn assume_init_mut(s: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    // SAFETY: `MaybeUninit<f32>` has the layout of `f32`; the caller guarantees the values
    // are initialized.
    unsafe { &mut *(s as *mut [MaybeUninit<f32>] as *mut [f32]) }
}

/// Writes `src` into the region `dst` of a buffer from [`uninit`] (equal lengths).
#[inline(always)]
pub fn write_slice(dst: &mut [MaybeUninit<f32>], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "regions of one length");
    for (d, &v) in dst.iter_mut().zip(src) {
        d.write(v);
    }
}

/// Input `i`, which must be present.
pub fn input<'a>(ins: &[Option<&'a Tensor>], i: usize) -> RuntimeResult<&'a Tensor> {
    ins.get(i).copied().flatten().ok_or_else(|| kernel_error(format!("input {i} is required")))
}

/// Input `i` if given.
pub fn opt_input<'a>(ins: &[Option<&'a Tensor>], i: usize) -> Option<&'a Tensor> {
    ins.get(i).copied().flatten()
}

/// Input `i` of a [`ValueKernel`], which must be present.
pub fn value_input<'a>(ins: &[Option<&'a Value>], i: usize) -> RuntimeResult<&'a Value> {
    ins.get(i).copied().flatten().ok_or_else(|| kernel_error(format!("input {i} is required")))
}

/// Input `i` of a [`ValueKernel`] as a tensor; an error naming it `what` when it is missing or
/// another kind of value.
pub fn tensor_input<'a>(ins: &[Option<&'a Value>], i: usize, what: &str) -> RuntimeResult<&'a Tensor> {
    opt_tensor_input(ins, i, what)?.ok_or_else(|| kernel_error(format!("{what} (input {i}) is required")))
}

/// Input `i` of a [`ValueKernel`] as a tensor, if given.
pub fn opt_tensor_input<'a>(ins: &[Option<&'a Value>], i: usize, what: &str) -> RuntimeResult<Option<&'a Tensor>> {
    match ins.get(i).copied().flatten() {
        None => Ok(None),
        Some(Value::Tensor(t)) => Ok(Some(t)),
        Some(v) => Err(kernel_error(format!("{what} (input {i}) must be a tensor, got {v}"))),
    }
}

/// A typed view, with the error naming the input.
pub fn slice<'a, T: Elem>(t: &'a Tensor, what: &str) -> RuntimeResult<&'a [T]> {
    t.as_slice::<T>().map_err(|_| kernel_error(format!("{what} must be {}, got {}", T::DTYPE, t.dtype())))
}

/// A tensor from a vector whose length is known to match the shape.
pub fn tensor<T: Elem>(shape: &[usize], v: Vec<T>) -> RuntimeResult<Tensor> {
    Tensor::from_vec(shape, v).map_err(|e| kernel_error(e.to_string()))
}

/// Integer values of a shape-like input (int64 or int32).
pub fn ints(t: &Tensor, what: &str) -> RuntimeResult<Vec<i64>> {
    match t.dtype() {
        DType::I64 | DType::I32 => t.to_i64_vec().map_err(|e| kernel_error(e.to_string())),
        d => Err(kernel_error(format!("{what} must be int64, got {d}"))),
    }
}

/// The one integer of a scalar-like input (int64 or int32, of rank 0 or holding one element).
pub fn single_int(t: &Tensor, what: &str) -> RuntimeResult<i64> {
    match ints(t, what)?.as_slice() {
        &[v] => Ok(v),
        _ => Err(kernel_error(format!("{what} must hold one integer, got shape {:?}", t.shape()))),
    }
}

/// The most bytes one tensor that a kernel allocates (output or intermediate) may take.
pub(crate) const MAX_KERNEL_BYTES: u64 = 8 << 30;

/// Checks that a tensor of `dtype` elements and `shape`, which a kernel is about to allocate,
/// stays within [`MAX_KERNEL_BYTES`]; the error names it `what`.
pub(crate) fn check_output_size(what: &str, dtype: DType, shape: &[usize]) -> RuntimeResult<()> {
    Tensor::checked_byte_len(dtype, shape, MAX_KERNEL_BYTES).map(|_| ()).map_err(|e| kernel_error(format!("{what} {shape:?} is too large: {e}")))
}

/// `axis` in `[-rank, rank)` as an index.
pub fn axis(axis: i64, rank: usize) -> RuntimeResult<usize> {
    let r = rank as i64;
    if axis < -r || axis >= r {
        return Err(kernel_error(format!("axis {axis} is out of range for rank {rank}")));
    }
    Ok(if axis < 0 { (axis + r) as usize } else { axis as usize })
}

/// The numpy broadcast of two shapes.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> RuntimeResult<Vec<usize>> {
    let n = a.len().max(b.len());
    let get = |s: &[usize], i: usize| if i + s.len() >= n { s[i + s.len() - n] } else { 1 };
    (0..n).map(|i| {
        let (x, y) = (get(a, i), get(b, i));
        if x == y || y == 1 { Ok(x) } else if x == 1 { Ok(y) } else {
            Err(kernel_error(format!("shapes {a:?} and {b:?} cannot be broadcast together")))
        }
    }).collect()
}

/// Strides of `shape` (row-major) seen from `out` (length `out.len()`), 0 on broadcast dims.
fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; out.len()];
    let mut s = 1;
    for i in (0..shape.len()).rev() {
        let o = i + out.len() - shape.len();
        strides[o] = if shape[i] == 1 && out[o] != 1 { 0 } else { s };
        s *= shape[i];
    }
    strides
}

/// Output shape and per-input strides with adjacent dimensions merged where every input
/// steps through them the same way, so inner loops are as long as possible.
fn coalesce(out: &[usize], strides: &[Vec<usize>]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut dims: Vec<usize> = vec![];
    let mut st: Vec<Vec<usize>> = vec![vec![]; strides.len()];
    for d in 0..out.len() {
        if out[d] == 1 {
            continue;
        }
        if let Some(&last) = dims.last() {
            let mergeable = strides.iter().enumerate().all(|(k, s)| *st[k].last().unwrap() == s[d] * out[d]);
            if mergeable {
                *dims.last_mut().unwrap() = last * out[d];
                for (k, s) in strides.iter().enumerate() {
                    *st[k].last_mut().unwrap() = s[d];
                }
                continue;
            }
        }
        dims.push(out[d]);
        for (k, s) in strides.iter().enumerate() {
            st[k].push(s[d]);
        }
    }
    if dims.is_empty() {
        dims.push(1);
        for s in st.iter_mut() {
            s.push(0);
        }
    }
    (dims, st)
}

/// The broadcast iteration space of an output: coalesced dimensions and per-input strides.
struct Runs<const N: usize> {
    dims: Vec<usize>,
    strides: Vec<Vec<usize>>,
}

impl<const N: usize> Runs<N> {
    fn new(out: &[usize], shapes: [&[usize]; N]) -> Self {
        let strides: Vec<Vec<usize>> = shapes.iter().map(|s| broadcast_strides(s, out)).collect();
        let (dims, strides) = coalesce(out, &strides);
        Runs { dims, strides }
    }
    fn inner(&self) -> usize {
        *self.dims.last().unwrap()
    }
    fn outer(&self) -> usize {
        self.dims[..self.dims.len() - 1].iter().product()
    }
    /// Visits outer indices `range` as contiguous runs along the last dimension:
    /// `f(run index, input offsets, run length, input inner strides)`.
    fn visit(&self, range: std::ops::Range<usize>, mut f: impl FnMut(usize, [usize; N], usize, [usize; N])) {
        let last = self.dims.len() - 1;
        let inner = self.dims[last];
        let inner_st: [usize; N] = std::array::from_fn(|k| self.strides[k][last]);
        // Odometer state at range.start.
        let mut idx = vec![0usize; last];
        let mut rem = range.start;
        for d in (0..last).rev() {
            idx[d] = rem % self.dims[d];
            rem /= self.dims[d];
        }
        let mut offs: [usize; N] = std::array::from_fn(|k| (0..last).map(|d| idx[d] * self.strides[k][d]).sum());
        for o in range {
            f(o, offs, inner, inner_st);
            for d in (0..last).rev() {
                idx[d] += 1;
                for k in 0..N {
                    offs[k] += self.strides[k][d];
                }
                if idx[d] < self.dims[d] {
                    break;
                }
                for k in 0..N {
                    offs[k] -= self.strides[k][d] * self.dims[d];
                }
                idx[d] = 0;
            }
        }
    }
}

thread_local! {
    static SINGLE_THREADED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` on the calling thread as a one-thread run: inside it [`threads`] is 1 and
/// [`par_chunks_mut`] and [`par_steps`] split nothing, so kernels that divide their work
/// through them neither hand it to a pool nor read the size of rayon's.
pub fn single_threaded<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SINGLE_THREADED.set(self.0);
        }
    }
    let _restore = Restore(SINGLE_THREADED.replace(true));
    f()
}

/// How long a worker lent to [`with_spinning_workers`] waits without finding work before it
/// goes back to the pool's own sleep.
const SPIN_IDLE: std::time::Duration = std::time::Duration::from_millis(1);

/// Runs `f` on the calling worker of a rayon pool while every other worker of the pool
/// spins for work instead of sleeping, so the work kernels split off (through
/// [`par_chunks_mut`], [`par_steps`] or any rayon join) is taken at once rather than after
/// waking a sleeping thread, which on a busy machine costs tens of microseconds per split.
/// A spinning worker runs stolen work as it comes, yields its CPU to other processes between
/// looks, and stops when `f` returns (or panics), or after [`SPIN_IDLE`] without work.
/// Outside a pool, or in a one-thread pool, just runs `f`.
pub fn with_spinning_workers<R>(f: impl FnOnce() -> R) -> R {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    struct Done(Arc<AtomicBool>);
    impl Drop for Done {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    let Some(owner) = rayon::current_thread_index() else { return f() };
    let done = Done(Arc::new(AtomicBool::new(false)));
    for _ in 1..rayon::current_num_threads() {
        let done = done.0.clone();
        rayon::spawn(move || {
            // The owner runs this only while it waits inside `f`, where spinning would
            // keep `f` from going on.
            if rayon::current_thread_index() == Some(owner) {
                return;
            }
            let mut idle_since: Option<std::time::Instant> = None;
            while !done.load(Ordering::Acquire) {
                match rayon::yield_now() {
                    Some(rayon::Yield::Executed) => idle_since = None,
                    Some(rayon::Yield::Idle) => {
                        if idle_since.get_or_insert_with(std::time::Instant::now).elapsed() > SPIN_IDLE {
                            return;
                        }
                        // Lets other processes' threads run, but not this pool's sleep.
                        std::thread::yield_now();
                    }
                    None => return,
                }
            }
        });
    }
    f()
}

/// The threads a kernel may split its work across: 1 inside [`single_threaded`], else
/// those of the rayon pool the caller runs in.
pub fn threads() -> usize {
    if SINGLE_THREADED.get() { 1 } else { rayon::current_num_threads() }
}

/// `f(state, i, chunk)` for every chunk `i` of `chunk` elements of `v` (the last may be
/// shorter), split across [`threads`] in tasks of at least `min` chunks, each task with its
/// own `init()` state; on the calling thread, with one state, when there is one thread or
/// one task.
pub fn par_chunks_mut<T: Send, S>(v: &mut [T], chunk: usize, min: usize, init: impl Fn() -> S + Sync + Send, f: impl Fn(&mut S, usize, &mut [T]) + Sync + Send) {
    use rayon::prelude::*;
    let chunk = chunk.max(1);
    if threads() == 1 || v.len().div_ceil(chunk) / 2 < min {
        let mut state = init();
        v.chunks_mut(chunk).enumerate().for_each(|(i, c)| f(&mut state, i, c));
    } else {
        v.par_chunks_mut(chunk).with_min_len(min).enumerate().for_each_init(init, |state, (i, c)| f(state, i, c));
    }
}

/// `f(state, start)` for every `start` of `(0..len).step_by(step)`, split across
/// [`threads`] in tasks of at least `min` starts, each task with its own `init()` state; on
/// the calling thread, with one state, when there is one thread or one task.
pub fn par_steps<S>(len: usize, step: usize, min: usize, init: impl Fn() -> S + Sync + Send, f: impl Fn(&mut S, usize) + Sync + Send) {
    use rayon::prelude::*;
    let step = step.max(1);
    if threads() == 1 || len.div_ceil(step) / 2 < min {
        let mut state = init();
        (0..len).step_by(step).for_each(|start| f(&mut state, start));
    } else {
        (0..len).into_par_iter().step_by(step).with_min_len(min).for_each_init(init, f);
    }
}

/// Work (multiply-adds, or elements times [`ELEMENT_WORK`]) below which a task is not split
/// off to another thread: waking a worker and joining it costs more than such a share
/// saves, and on a loaded machine a preempted worker stalls the join.
pub const PAR_MIN_WORK: usize = 1 << 18;

/// The work [`PAR_MIN_WORK`] counts per element of an elementwise pass.
pub const ELEMENT_WORK: usize = 16;

/// The fewest items of `work_per_item` each that a parallel task should take (for rayon's
/// `with_min_len`): one task, on the calling thread, when all items together are less
/// than [`PAR_MIN_WORK`].
pub fn min_items(work_per_item: usize) -> usize {
    PAR_MIN_WORK.div_ceil(work_per_item.max(1))
}

/// Elements per parallel chunk of elementwise work.
const CHUNK: usize = 1 << 15;

/// Fills `out` (row-major over the broadcast shape) run by run: `f(dst, input offsets,
/// input strides)`. Large outputs are split across the thread pool, by groups of runs or,
/// for long runs, within each run.
fn fill_runs<const N: usize, O: Send>(runs: &Runs<N>, out: &mut [O], f: impl Fn(&mut [O], [usize; N], [usize; N]) + Sync) {
    use rayon::prelude::*;
    let inner = runs.inner();
    let outer = runs.outer();
    if outer * inner < 2 * CHUNK || threads() == 1 {
        runs.visit(0..outer, |o, offs, len, st| f(&mut out[o * inner..o * inner + len], offs, st));
    } else if inner >= CHUNK {
        runs.visit(0..outer, |o, offs, _, st| {
            out[o * inner..(o + 1) * inner].par_chunks_mut(CHUNK).enumerate().for_each(|(c, dst)| {
                let shifted: [usize; N] = std::array::from_fn(|k| offs[k] + c * CHUNK * st[k]);
                f(dst, shifted, st)
            })
        });
    } else {
        let per_chunk = CHUNK / inner;
        out.par_chunks_mut(per_chunk * inner).enumerate().for_each(|(c, chunk)| {
            let start = c * per_chunk;
            let end = (start + per_chunk).min(outer);
            runs.visit(start..end, |o, offs, len, st| {
                let at = (o - start) * inner;
                f(&mut chunk[at..at + len], offs, st)
            });
        });
    }
}

/// `dst[i] = f(src[i])`, compiled for AVX2 when the CPU has it (the loop vectorizes eight
/// lanes wide instead of four).
#[inline(always)]
pub fn map_into<T: Copy, O>(dst: &mut [O], src: &[T], f: impl Fn(T) -> O) {
    #[inline(always)]
    fn body<T: Copy, O>(dst: &mut [O], src: &[T], f: impl Fn(T) -> O) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = f(x);
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn body_avx2<T: Copy, O>(dst: &mut [O], src: &[T], f: impl Fn(T) -> O) {
            body(dst, src, f)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { body_avx2(dst, src, f) };
        }
    }
    body(dst, src, f)
}

/// `v = f(v)` over a slice, compiled for AVX2 when the CPU has it.
#[inline(always)]
pub fn map_in_place(v: &mut [f32], f: impl Fn(f32) -> f32) {
    #[inline(always)]
    fn body(v: &mut [f32], f: impl Fn(f32) -> f32) {
        for x in v.iter_mut() {
            *x = f(*x);
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn body_avx2(v: &mut [f32], f: impl Fn(f32) -> f32) {
            body(v, f)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { body_avx2(v, f) };
        }
    }
    body(v, f)
}

/// Runs `f` compiled for AVX2 when the CPU has it: loops that `f` inlines vectorize eight
/// lanes wide. A loop that writes one slice while reading another should take both as
/// arguments of an inlined function (as [`map_into`] does): references captured by `f` lose
/// the no-alias facts the vectorizer needs.
#[inline(always)]
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// Runs `f` compiled for AVX-512 (F, BW, VL) or AVX2, each with FMA, when the CPU has them,
/// so `mul_add` in loops that `f` inlines is one fused vector instruction, not a call.
#[inline(always)]
pub fn vectorized_wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn fma<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        let fma_ok = std::arch::is_x86_feature_detected!("fma");
        if fma_ok && std::arch::is_x86_feature_detected!("avx512bw") && std::arch::is_x86_feature_detected!("avx512vl") {
            // SAFETY: the CPU supports AVX-512 F/BW/VL and FMA, checked just above.
            return unsafe { avx512(f) };
        }
        if fma_ok && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 and FMA, checked just above.
            return unsafe { fma(f) };
        }
    }
    f()
}

/// `sum f(v[i])`, accumulated in sixteen interleaved lanes so the loop vectorizes.
#[inline(always)]
pub fn lane_sum(v: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    const L: usize = 16;
    let mut acc = [0f32; L];
    let chunks = v.chunks_exact(L);
    let tail: f32 = chunks.remainder().iter().map(|&x| f(x)).sum();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += f(x);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `dst[i] = f(a[i], b[i])`, compiled for AVX2 when the CPU has it.
#[inline(always)]
pub fn zip_map_into<A: Copy, B: Copy, O>(dst: &mut [O], a: &[A], b: &[B], f: impl Fn(A, B) -> O) {
    #[inline(always)]
    fn body<A: Copy, B: Copy, O>(dst: &mut [O], a: &[A], b: &[B], f: impl Fn(A, B) -> O) {
        for ((d, &x), &y) in dst.iter_mut().zip(a).zip(b) {
            *d = f(x, y);
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn body_avx2<A: Copy, B: Copy, O>(dst: &mut [O], a: &[A], b: &[B], f: impl Fn(A, B) -> O) {
            body(dst, a, b, f)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { body_avx2(dst, a, b, f) };
        }
    }
    body(dst, a, b, f)
}

/// `f` applied elementwise with numpy broadcasting (in parallel for large outputs).
pub fn binary<A: Copy + Sync, B: Copy + Sync, O: Copy + Send>(a: &[A], ashape: &[usize], b: &[B], bshape: &[usize], f: impl Fn(A, B) -> O + Sync) -> RuntimeResult<(Vec<O>, Vec<usize>)> {
    let shape = broadcast_shape(ashape, bshape)?;
    let n: usize = shape.iter().product();
    if n == 0 {
        return Ok((vec![], shape));
    }
    let runs = Runs::new(&shape, [ashape, bshape]);
    let written_run = |dst: &mut [MaybeUninit<O>], [ia, ib]: [usize; 2], [sa, sb]: [usize; 2]| {
        let len = dst.len();
        match (sa, sb) {
            (1, 1) => zip_map_into(dst, &a[ia..ia + len], &b[ib..ib + len], |x, y| MaybeUninit::new(f(x, y))),
            (1, 0) => { let y = b[ib]; map_into(dst, &a[ia..ia + len], |x| MaybeUninit::new(f(x, y))) }
            (0, 1) => { let x = a[ia]; map_into(dst, &b[ib..ib + len], |y| MaybeUninit::new(f(x, y))) }
            _ => dst.iter_mut().enumerate().for_each(|(i, d)| { d.write(f(a[ia + i * sa], b[ib + i * sb])); }),
        }
    };
    // SAFETY: the runs of `shape` cover every output element once, and each run writes all of
    // its elements.
    let out = unsafe { written(n, |dst| fill_runs(&runs, dst, written_run)) };
    Ok((out, shape))
}

/// `f` applied elementwise to three broadcast inputs (for `Where`).
pub fn ternary<A: Copy, B: Copy, C: Copy, O: Copy + Default>(
    a: (&[A], &[usize]), b: (&[B], &[usize]), c: (&[C], &[usize]), f: impl Fn(A, B, C) -> O,
) -> RuntimeResult<(Vec<O>, Vec<usize>)> {
    let shape = broadcast_shape(&broadcast_shape(a.1, b.1)?, c.1)?;
    let n: usize = shape.iter().product();
    let mut out = vec![O::default(); n];
    if n == 0 {
        return Ok((out, shape));
    }
    let runs = Runs::new(&shape, [a.1, b.1, c.1]);
    let inner = runs.inner();
    runs.visit(0..runs.outer(), |o, [ia, ib, ic], len, [sa, sb, sc]| {
        for (i, d) in out[o * inner..o * inner + len].iter_mut().enumerate() {
            *d = f(a.0[ia + i * sa], b.0[ib + i * sb], c.0[ic + i * sc]);
        }
    });
    Ok((out, shape))
}

/// Copies `src` (of `shape`) broadcast to `out` (for `Expand`).
pub fn broadcast_to<T: Copy + Default>(src: &[T], shape: &[usize], out: &[usize]) -> Vec<T> {
    let n: usize = out.iter().product();
    let mut dst = vec![T::default(); n];
    if n == 0 {
        return dst;
    }
    let runs = Runs::new(out, [shape]);
    let inner = runs.inner();
    runs.visit(0..runs.outer(), |o, [i], len, [s]| {
        let d = &mut dst[o * inner..o * inner + len];
        if s == 1 {
            d.copy_from_slice(&src[i..i + len]);
        } else {
            d.fill(src[i]);
        }
    });
    dst
}

/// Copies the data of any tensor whose elements have a fixed byte size into a new tensor of
/// another shape with elements picked by `index` (a gather of whole elements), keeping dtype.
pub fn gather_elements(t: &Tensor, shape: &[usize], index: impl Iterator<Item = usize>) -> RuntimeResult<Tensor> {
    if let Some(s) = t.strings() {
        let v: Vec<Vec<u8>> = index.map(|i| s[i].clone()).collect();
        return Tensor::from_strings(shape, v).map_err(|e| kernel_error(e.to_string()));
    }
    let width = t.dtype().bits() / 8;
    if width == 0 || !t.dtype().bits().is_multiple_of(8) {
        return Err(kernel_error(format!("{} tensors are not supported here", t.dtype())));
    }
    let src = t.raw_bytes().unwrap();
    let mut out = Vec::with_capacity(shape.iter().product::<usize>() * width);
    match width {
        4 => {
            let s: &[u32] = bytemuck_u32(src);
            let v: Vec<u32> = index.map(|i| s[i]).collect();
            out.extend_from_slice(bytemuck::cast_slice(&v));
        }
        _ => {
            for i in index {
                out.extend_from_slice(&src[i * width..(i + 1) * width]);
            }
        }
    }
    Tensor::from_raw(t.dtype(), shape, &out).map_err(|e| kernel_error(e.to_string()))
}

fn bytemuck_u32(b: &[u8]) -> &[u32] {
    // Tensor storage is 8-byte aligned, so a 4-byte view of it is always valid.
    bytemuck::cast_slice(b)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// Every chunk and every step is visited once with its index, on one thread inside
    /// `single_threaded` (even within a larger pool) and split across a pool's threads.
    #[test]
    fn parallel_helpers_cover_their_range_on_one_or_many_threads() {
        let caller = std::thread::current().id();
        let check = |expect_caller: bool| {
            let mut v = vec![0usize; 1000];
            par_chunks_mut(&mut v, 7, 1, || (), |_, i, c| {
                assert!(!expect_caller || std::thread::current().id() == caller);
                c.iter_mut().enumerate().for_each(|(k, x)| *x = i * 7 + k);
            });
            assert!(v.iter().enumerate().all(|(i, &x)| x == i));
            let seen: Vec<std::sync::atomic::AtomicUsize> = (0..1000).map(|_| Default::default()).collect();
            par_steps(1000, 3, 1, || (), |_, start| {
                assert!(!expect_caller || std::thread::current().id() == caller);
                seen[start].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            });
            assert!(seen.iter().enumerate().all(|(i, n)| n.load(std::sync::atomic::Ordering::Relaxed) == usize::from(i % 3 == 0)));
        };
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        pool.install(|| {
            assert_eq!(threads(), 4);
            check(false);
        });
        single_threaded(|| {
            assert_eq!(threads(), 1);
            pool.install(|| assert_eq!(threads(), 4));
            check(true);
            assert_eq!(threads(), 1);
        });
        assert!(!SINGLE_THREADED.get());
    }

    /// Work split inside `with_spinning_workers` is done completely, run after run, and the
    /// other worker takes part (within a minute, however busy the machine); a panic in `f`
    /// propagates and leaves the pool usable; outside a pool `f` just runs.
    #[test]
    fn spinning_workers_take_split_work_and_stop() {
        assert_eq!(with_spinning_workers(|| 7), 7);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let mut helped = false;
        let start = std::time::Instant::now();
        for round in 0.. {
            if round >= 50 && helped {
                break;
            }
            assert!(start.elapsed() < std::time::Duration::from_secs(60), "the second worker never took part");
            let (sum, threads) = pool.install(|| with_spinning_workers(|| {
                let ids: std::sync::Mutex<HashSet<usize>> = Default::default();
                let mut v = vec![0u64; 1 << 16];
                par_chunks_mut(&mut v, 64, 1, || (), |_, i, c| {
                    ids.lock().unwrap().insert(rayon::current_thread_index().unwrap());
                    c.iter_mut().enumerate().for_each(|(k, x)| *x = (i * 64 + k) as u64 + round);
                });
                (v.iter().sum::<u64>(), ids.into_inner().unwrap().len())
            }));
            let n = 1u64 << 16;
            assert_eq!(sum, n * (n - 1) / 2 + n * round);
            helped |= threads == 2;
        }
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pool.install(|| with_spinning_workers(|| panic!("in f")))));
        assert!(caught.is_err());
        assert_eq!(pool.install(|| with_spinning_workers(|| rayon::join(|| 1, || 2))), (1, 2));
    }

    #[test]
    fn broadcasting_matches_numpy_rules() {
        assert_eq!(broadcast_shape(&[2, 1, 4], &[3, 1]).unwrap(), vec![2, 3, 4]);
        assert!(broadcast_shape(&[2, 3], &[4]).is_err());
        // a[i,j] + b[j] for a 2x3 and b 3-vector, and a column [2,1].
        let a = [1, 2, 3, 4, 5, 6];
        let (v, s) = binary(&a, &[2, 3], &[10, 20, 30], &[3], |x, y| x + y).unwrap();
        assert_eq!((v, s), (vec![11, 22, 33, 14, 25, 36], vec![2, 3]));
        let (v, _) = binary(&a, &[2, 3], &[100, 200], &[2, 1], |x, y| x + y).unwrap();
        assert_eq!(v, vec![101, 102, 103, 204, 205, 206]);
        // Outer product [3,1] x [1,2].
        let (v, s) = binary(&[1, 2, 3], &[3, 1], &[10, 20], &[1, 2], |x, y| x * y).unwrap();
        assert_eq!((v, s), (vec![10, 20, 20, 40, 30, 60], vec![3, 2]));
        // NCHW + [1,C,1,1] bias.
        let x: Vec<i32> = (0..16).collect();
        let (v, _) = binary(&x, &[1, 2, 2, 4], &[0, 100], &[1, 2, 1, 1], |x, y| x + y).unwrap();
        assert_eq!(&v[6..10], &[6, 7, 108, 109]);
    }

    #[test]
    fn expand_and_where() {
        assert_eq!(broadcast_to(&[1, 2], &[2, 1], &[2, 3]), vec![1, 1, 1, 2, 2, 2]);
        let (v, _) = ternary((&[true, false], &[2]), (&[1, 2], &[2]), (&[9], &[1]), |c, x, y| if c { x } else { y }).unwrap();
        assert_eq!(v, vec![1, 9]);
    }
}
