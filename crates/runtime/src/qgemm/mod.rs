//! 8-bit integer matrix multiplication: `C[i32] = (A - a_zp) (B - b_zp)`, `A` (`m x k`, u8
//! or i8 activations) row by row, `B` (`k x n`, i8 or u8 weights) packed once.
//!
//! The kernels multiply the raw (possibly shifted) values and the zero points enter through
//! correction terms, as ONNX Runtime's MLAS does:
//!
//! `C[i][j] = sum_k a'b' - a_zp'_i colsum_j - b_zp'_j rowsum_i + k a_zp'_i b_zp'_j`
//!
//! with `rowsum` the sums of A's stored rows (computed while a block of A is prepared),
//! `colsum` the sums of B's stored columns (computed once when B is packed), and `'` marking
//! values after the shift a kernel family applies (see [`PackedB`] and the `pack` module).
//! All arithmetic is in wrapping `i32`, so every path gives the same integers, equal to the
//! exact product modulo 2^32.
//!
//! * Kernels: AVX-512 VNNI (`vpdpbusd`, tiles of 12 x 32), AVX2 on bytes (`vpmaddubsw`, 6 x
//!   16) for weights whose 16-bit pair sums cannot saturate, AVX2 on 16-bit values
//!   (`vpmaddwd`, 6 x 16) for all others, and a portable scalar one, chosen at run time
//!   ([`Isa::best`], and [`PackedB::pack_with`] for the AVX2 pair check) or forced by packing B
//!   for a family.
//! * Blocking: the product runs in blocks of `MC = 144` rows by `NC = 256` columns, each over
//!   depth blocks of 512 bytes per row (`KC`; 512 u8 or 256 i16). A block's rows of A are read
//!   in place when they already are in stored form (u8 activations for VNNI), else copied
//!   into a per-thread buffer (shifted, widened, or unfolded from an image by a [`FillRows`]
//!   source); the L2-resident rows then meet one `KC x NR` B panel (16 KiB) at a time in L1.
//! * The zero point terms are added by the kernels to their registers after the last depth
//!   block (with one A zero point; a per-row A zero point is applied in a pass over the
//!   block), so a finished block is handed to the caller's output stage ([`requantize_block`],
//!   [`scale_to_f32`], or in place for `i32` output, [`gemm_i32`]) while it is in cache.
//! * Parallelism: blocks are spread over the current rayon pool.

mod avx2;
mod avx512vnni;
#[cfg(target_arch = "x86_64")]
pub(crate) mod conv;
#[cfg(target_arch = "x86_64")]
pub(crate) mod depthwise;
#[cfg(target_arch = "x86_64")]
pub(crate) mod depthwise_avx2;
mod output;
mod pack;
mod portable;
#[cfg(all(test, target_arch = "x86_64"))]
mod test_reference;

use std::ops::Range;

pub use output::{requantize, requantize_block, scale_to_f32, Out8, Scale};
pub use pack::PackedB;
use pack::{store_row, sum_rows_u8, AlignedBuf};

/// Element type of an 8-bit operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Int8 {
    U8,
    I8,
}

/// A micro-kernel family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// AVX-512 F/BW with VNNI: `vpdpbusd`, 64 multiply-adds per instruction.
    Avx512Vnni,
    /// AVX2 on bytes: `vpmaddubsw` multiplies 32 u8 x i8 pairs and adds each two into a
    /// saturating 16-bit sum, `vpmaddwd` adds those into 32-bit lanes. Exact only for weights
    /// of which no two paired ones can overflow the 16-bit sum against any u8 activations:
    /// [`PackedB::pack_with`] checks that and packs for [`Isa::Avx2`] otherwise.
    Avx2Pairs,
    /// AVX2: `vpmaddwd` on 16-bit values, 16 multiply-adds per instruction.
    Avx2,
    /// Scalar code on any CPU.
    Portable,
}

/// A tile kernel: `(groups, A rows, A row stride in bytes, packed B panel, C, ldc,
/// accumulate, zero point terms)`.
pub(crate) type TileFn = unsafe fn(usize, *const u8, usize, *const u8, *mut i32, usize, bool, Option<&Epilogue>);

/// Zero point terms a tile adds after its last depth block: `c[r][j] += col[j] + row[r]`
/// when `bz` is null (one B zero point, already folded into `row`), else `c[r][j] += col[j] +
/// bz[j] row[r]`. Pointers are positioned at the tile's first row and column.
#[derive(Clone, Copy)]
pub(crate) struct Epilogue {
    pub col: *const i32,
    pub row: *const i32,
    pub bz: *const i32,
}

impl Isa {
    /// Every family, fastest first.
    pub const ALL: [Isa; 4] = [Isa::Avx512Vnni, Isa::Avx2Pairs, Isa::Avx2, Isa::Portable];

    /// Whether this CPU can run the family.
    pub fn available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Pairs | Isa::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            Isa::Portable => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The fastest family this CPU runs (detected once).
    pub fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| Isa::ALL.into_iter().find(|i| i.available()).unwrap_or(Isa::Portable))
    }

    /// A short name (`avx512vnni`, `avx2pairs`, `avx2`, `portable`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Avx2Pairs => "avx2pairs",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }

    /// The tile kernel for `rows` rows (at most the family's tallest) of a panel whose first
    /// `cols` columns are wanted (the kernel may leave the others of C untouched).
    fn tile(self, rows: usize, cols: usize) -> TileFn {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => avx512vnni::tile_fn(rows, cols),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Pairs => avx2::tile_fn::<true>(rows, cols),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2::tile_fn::<false>(rows, cols),
            _ => portable::tile_fn(rows),
        }
    }
}

/// Zero points of A (one, or one per row) or of B (one, or one per column).
#[derive(Clone, Copy, Debug)]
pub enum ZeroPoints<'a> {
    Tensor(i32),
    Each(&'a [i32]),
}

impl ZeroPoints<'_> {
    /// The zero point of row or column `i`.
    #[inline(always)]
    fn at(&self, i: usize) -> i32 {
        match self {
            ZeroPoints::Tensor(z) => *z,
            ZeroPoints::Each(v) => v[i],
        }
    }
    /// Whether the zero points fit `n` rows or columns.
    fn len_ok(&self, n: usize) -> bool {
        match self {
            ZeroPoints::Tensor(_) => true,
            ZeroPoints::Each(v) => v.len() == n,
        }
    }
}

/// Fills rows of A on demand (an im2col view of an image, for instance).
pub trait FillRows: Sync {
    /// Writes rows `rows`, depths `ks`, row-major into `dst` with row stride `ld`
    /// (`ks.len() <= ld`).
    fn fill(&self, rows: Range<usize>, ks: Range<usize>, dst: &mut [u8], ld: usize);
}

/// Where A's rows come from.
#[derive(Clone, Copy)]
pub enum ASource<'a> {
    /// A row-major matrix: row `i` is `data[i * lda..i * lda + k]`.
    Rows { data: &'a [u8], lda: usize },
    /// Rows produced on demand.
    Fill(&'a dyn FillRows),
}

/// A finished block of the product, corrected for the zero points: element `(r, c)` is
/// `data[r * ld + c]`, the value of `C[row0 + r][col0 + c]`. The output stage may modify it
/// (to add a bias before requantizing, say).
pub struct Block<'a> {
    pub row0: usize,
    pub col0: usize,
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
    pub data: &'a mut [i32],
}

impl Block<'_> {
    /// Row `r` of the block (`cols` values).
    pub fn row(&self, r: usize) -> &[i32] {
        &self.data[r * self.ld..r * self.ld + self.cols]
    }
    /// Row `r` of the block, mutable.
    pub fn row_mut(&mut self, r: usize) -> &mut [i32] {
        &mut self.data[r * self.ld..r * self.ld + self.cols]
    }
}

/// One product `(A - a_zp)(B - b_zp)`.
#[derive(Clone, Copy)]
pub struct Gemm<'a> {
    /// Rows of A and C.
    pub m: usize,
    pub a: ASource<'a>,
    pub a_type: Int8,
    /// One zero point, or one per row of A.
    pub a_zp: ZeroPoints<'a>,
    pub b: &'a PackedB,
    /// One zero point, or one per column of B.
    pub b_zp: ZeroPoints<'a>,
}

/// Rows of A per block (a multiple of both tile heights).
const MC: usize = 144;
/// Bytes of depth per block (16 KiB B panels for VNNI; the AVX2 layout stores 2 bytes per
/// element, so its blocks hold half the depth).
const KC_BYTES: usize = 512;
/// Columns per block.
const NC: usize = 256;

/// Where finished blocks go.
enum Output<'a> {
    /// Handed to the caller's output stage.
    Sink(&'a (dyn Fn(Block) + Sync)),
    /// Written into a row-major `i32` matrix with row stride `ldc`.
    Direct(SharedOut<'a, i32>, usize),
}

/// Per-thread buffers, reused across blocks.
#[derive(Default)]
struct Scratch {
    a: AlignedBuf,
    staging: Vec<u8>,
    tile: AlignedBuf,
    row_sums: Vec<i32>,
    colterm: Vec<i32>,
    rowterm: Vec<i32>,
    bz: Vec<i32>,
}

/// Runs the product and hands every finished block to `out` (blocks cover `C` exactly once;
/// they are disjoint, and `out` may run on several threads at once). Uses the current rayon
/// pool when `parallel` and the product is large enough. Zero points are in the operands'
/// own domain (`0..=255` for u8, `-128..=127` for i8) but any `i32` works.
///
/// Panics when the operands disagree (A too short for `m` rows of `k`, zero point vectors of
/// the wrong length); kernels check shapes before calling it.
pub fn gemm(g: &Gemm, out: &(dyn Fn(Block) + Sync), parallel: bool) {
    run(g, &Output::Sink(out), parallel)
}

/// [`gemm`] with every block going to `out`.
fn run(g: &Gemm, out: &Output, parallel: bool) {
    let (m, n, k) = (g.m, g.b.n, g.b.k);
    assert!(g.a_zp.len_ok(m) && g.b_zp.len_ok(n), "zero point vectors must match the rows of A and the columns of B");
    if let ASource::Rows { data, lda } = g.a {
        assert!(m == 0 || k == 0 || (m - 1) * lda + k <= data.len(), "A of {} bytes is too short for {m} x {k} (lda {lda})", data.len());
    }
    if m == 0 || n == 0 {
        return;
    }
    let isa = g.b.isa;
    assert!(isa.available(), "B was packed for {}, which this CPU does not support", isa.name());
    let geo = isa.geometry();
    let elem = if geo.wide { 2 } else { 1 };
    let kc_max = (KC_BYTES / elem).max(geo.kg);
    let kblocks = g.b.kp.div_ceil(kc_max).max(1);
    let kc = g.b.kp.div_ceil(kblocks).div_ceil(geo.kg) * geo.kg;
    let mc = MC.min(m.div_ceil(geo.mr) * geo.mr);
    let nc = if n <= NC + NC / 2 { n.div_ceil(geo.nr) * geo.nr } else { NC };
    let (mt, nt) = (m.div_ceil(mc), n.div_ceil(nc));
    let plan = Plan { g, mc, nc, kc, kblocks };
    let threads = crate::kernels::util::threads();
    if parallel && threads > 1 && mt * nt > 1 && (m as u64) * (n as u64) * (k as u64) >= 1 << 18 {
        use rayon::prelude::*;
        (0..mt * nt).into_par_iter().for_each_init(Scratch::default, |s, t| plan.block(s, t / nt, t % nt, out));
    } else {
        let mut s = Scratch::default();
        for t in 0..mt * nt {
            plan.block(&mut s, t / nt, t % nt, out);
        }
    }
}

/// Applies the zero point corrections to one row of raw products when A's zero points vary
/// by row (the kernels fuse them otherwise): `C = raw - az' colsum - bz' rowsum + k az' bz'`
/// with `az'` the row's shifted A zero point and `bz'` the shifted B zero points of the row's
/// columns, in wrapping arithmetic.
fn correct_row(row: &mut [i32], row_sum: i32, colsum: &[i32], az: i32, bz: ZeroPoints, k: i32) {
    let t = k.wrapping_mul(az).wrapping_sub(row_sum);
    match bz {
        ZeroPoints::Tensor(z) => {
            let c = z.wrapping_mul(t);
            for (v, &cs) in row.iter_mut().zip(colsum) {
                *v = v.wrapping_sub(az.wrapping_mul(cs)).wrapping_add(c);
            }
        }
        ZeroPoints::Each(zs) => {
            for ((v, &cs), &z) in row.iter_mut().zip(colsum).zip(zs) {
                *v = v.wrapping_sub(az.wrapping_mul(cs)).wrapping_add(z.wrapping_mul(t));
            }
        }
    }
}

/// Block sizes of one product.
struct Plan<'a> {
    g: &'a Gemm<'a>,
    mc: usize,
    nc: usize,
    kc: usize,
    kblocks: usize,
}

impl Plan<'_> {
    /// Computes block `(mb, nb)` over the whole depth, corrects it and hands it to `out`.
    fn block(&self, s: &mut Scratch, mb: usize, nb: usize, out: &Output) {
        let g = self.g;
        let b = g.b;
        let isa = b.isa;
        let geo = isa.geometry();
        let (m, n, k) = (g.m, b.n, b.k);
        let rows = mb * self.mc..(mb * self.mc + self.mc).min(m);
        let cols = nb * self.nc..(nb * self.nc + self.nc).min(n);
        let (mrows, ncols) = (rows.len(), cols.len());
        let ncp = ncols.div_ceil(geo.nr) * geo.nr;
        // The accumulators: the output itself when it is `i32` and the block's columns fill
        // whole panels, else the per-thread tile.
        let in_place = matches!(out, Output::Direct(..)) && ncols % geo.nr == 0;
        let (tile, ldt): (*mut i32, usize) = match out {
            // SAFETY: the block's first element of C; kernels write `h` rows of whole panels
            // inside this block's rows and columns, which no other block touches.
            Output::Direct(c, ldc) if in_place => (unsafe { c.ptr(rows.start * ldc + cols.start, (mrows - 1) * ldc + ncols) }, *ldc),
            _ => {
                s.tile.reserve_len(mrows.div_ceil(geo.mr) * geo.mr * ncp * 4);
                (s.tile.i32s_mut().as_mut_ptr(), ncp)
            }
        };
        s.row_sums.clear();
        s.row_sums.resize(mrows, 0);
        let (ash, bsh) = (isa.a_shift(g.a_type), isa.b_shift(b.dtype));
        let colsum = &b.col_sums[cols.clone()];
        // Zero point terms, added by the kernels after the last depth block when A has one
        // zero point: C = raw - az' colsum + bz' (k az' - rowsum).
        let fused = matches!(g.a_zp, ZeroPoints::Tensor(_));
        let az = g.a_zp.at(0).wrapping_add(ash);
        if fused {
            s.colterm.clear();
            s.colterm.extend(colsum.iter().map(|&c| az.wrapping_mul(c).wrapping_neg()));
            s.colterm.resize(ncp, 0);
            if let ZeroPoints::Each(v) = g.b_zp {
                s.bz.clear();
                s.bz.extend(v[cols.clone()].iter().map(|&z| z.wrapping_add(bsh)));
                s.bz.resize(ncp, 0);
            }
        }
        // A's row sums only ever meet B's stored zero points: when those are all 0 (symmetric
        // int8 weights), the sums are not needed and stay 0.
        let row_sums_needed = match g.b_zp {
            ZeroPoints::Tensor(z) => z.wrapping_add(bsh) != 0,
            ZeroPoints::Each(v) => v[cols.clone()].iter().any(|&z| z.wrapping_add(bsh) != 0),
        };
        let panels: Vec<(usize, usize)> = (0..mrows).step_by(geo.mr).map(|r0| (r0, geo.mr.min(mrows - r0))).collect();
        let elem = if geo.wide { 2 } else { 1 };
        let flip = isa.a_shift(g.a_type) != 0;
        let signed = g.a_type == Int8::I8;
        let mut last = None;
        for kb in 0..self.kblocks {
            let k0 = kb * self.kc;
            let k1 = (k0 + self.kc).min(b.kp);
            if k0 >= k1 {
                break;
            }
            last = Some(kb);
            let groups = (k1 - k0) / geo.kg;
            let (kr0, kr1) = (k0.min(k), k1.min(k));
            // A's rows for depths k0..k1 in their stored form: in place when the source's
            // bytes are already that form, else copied (shifted or widened, zero-padded).
            let (abase, lda): (*const u8, usize) = match g.a {
                ASource::Rows { data, lda } if !geo.wide && !flip && k1 <= k => {
                    if row_sums_needed {
                        sum_rows_u8(&data[rows.start * lda + kr0..], lda, kr1 - kr0, &mut s.row_sums);
                    }
                    (data[rows.start * lda + kr0..].as_ptr(), lda)
                }
                ASource::Fill(f) if !geo.wide && !flip => {
                    // Filled straight into the stored form, the depth padded with zeros.
                    let (ld, w) = (k1 - k0, kr1 - kr0);
                    s.a.reserve_len(mrows * ld);
                    let dst = s.a.bytes_mut();
                    f.fill(rows.clone(), kr0..kr1, dst, ld);
                    if w < ld {
                        (0..mrows).for_each(|r| dst[r * ld + w..(r + 1) * ld].fill(0));
                    }
                    if row_sums_needed {
                        sum_rows_u8(dst, ld, w, &mut s.row_sums);
                    }
                    (s.a.bytes().as_ptr(), ld)
                }
                _ => {
                    let ld = (k1 - k0) * elem;
                    s.a.reserve_len(mrows * ld);
                    if let ASource::Fill(f) = g.a {
                        let w = kr1 - kr0;
                        s.staging.resize(mrows * w, 0);
                        f.fill(rows.clone(), kr0..kr1, &mut s.staging, w);
                    }
                    let dst = s.a.bytes_mut();
                    for (r, sum) in s.row_sums.iter_mut().enumerate() {
                        let src = match g.a {
                            ASource::Rows { data, lda } => {
                                let i = rows.start + r;
                                &data[i * lda + kr0..i * lda + kr1]
                            }
                            ASource::Fill(_) => &s.staging[r * (kr1 - kr0)..(r + 1) * (kr1 - kr0)],
                        };
                        *sum = sum.wrapping_add(store_row(src, &mut dst[r * ld..(r + 1) * ld], geo.wide, signed, flip));
                    }
                    (s.a.bytes().as_ptr(), ld)
                }
            };
            let last_block = k1 == b.kp;
            if fused && last_block {
                s.rowterm.clear();
                let kk = (k as i32).wrapping_mul(az);
                match g.b_zp {
                    ZeroPoints::Tensor(z) => {
                        let bz = z.wrapping_add(bsh);
                        s.rowterm.extend(s.row_sums.iter().map(|&rs| bz.wrapping_mul(kk.wrapping_sub(rs))));
                    }
                    ZeroPoints::Each(_) => s.rowterm.extend(s.row_sums.iter().map(|&rs| kk.wrapping_sub(rs))),
                }
            }
            for jp in 0..ncp / geo.nr {
                let bp = b.panel(cols.start / geo.nr + jp, k0 / geo.kg);
                let width = (ncols - jp * geo.nr).min(geo.nr);
                for &(r0, h) in &panels {
                    let f = isa.tile(h, width);
                    let epi = (fused && last_block).then(|| Epilogue {
                        col: s.colterm[jp * geo.nr..].as_ptr(),
                        row: s.rowterm[r0..].as_ptr(),
                        bz: if matches!(g.b_zp, ZeroPoints::Each(_)) { s.bz[jp * geo.nr..].as_ptr() } else { std::ptr::null() },
                    });
                    // SAFETY: rows `r0..r0 + h` of A hold `groups` groups at stride `lda`
                    // (in place: depths below `k`; copied: the padded block), the B panel holds
                    // `groups` groups from `k0` on, the accumulators have room for rows `r0..r0
                    // + h` and columns `jp * nr..(jp + 1) * nr` at stride `ldt` (the tile is
                    // `mr`-row padded and `ncp` wide; in place, `ncols` is whole panels), the
                    // epilogue's vectors hold `ncp` columns and `mrows` rows; `isa` was
                    // checked available above.
                    unsafe { f(groups, abase.add(r0 * lda), lda, bp, tile.add(r0 * ldt + jp * geo.nr), ldt, kb > 0, epi.as_ref()) };
                }
            }
        }
        // Row `r` of the accumulators (`ncols` values; rows of different blocks are disjoint).
        // SAFETY: `tile` holds `mrows` rows of at least `ncols` values at stride `ldt` (the
        // scratch tile, or this block's part of C), and each row slice is used alone.
        let acc_row = |r: usize| unsafe { std::slice::from_raw_parts_mut(tile.add(r * ldt), ncols) };
        if last.is_none() {
            // No depth: every product is 0.
            (0..mrows).for_each(|r| acc_row(r).fill(0));
        } else if !fused {
            let bz = match g.b_zp {
                ZeroPoints::Tensor(z) => ZeroPoints::Tensor(z.wrapping_add(bsh)),
                ZeroPoints::Each(v) => {
                    s.bz.clear();
                    s.bz.extend(v[cols.clone()].iter().map(|&z| z.wrapping_add(bsh)));
                    ZeroPoints::Each(&s.bz)
                }
            };
            for r in 0..mrows {
                let az = g.a_zp.at(rows.start + r).wrapping_add(ash);
                correct_row(acc_row(r), s.row_sums[r], colsum, az, bz, k as i32);
            }
        }
        match out {
            Output::Sink(f) => {
                // SAFETY: the scratch tile holds `mrows` rows of `ncp >= ncols` values.
                let data = unsafe { std::slice::from_raw_parts_mut(tile, (mrows - 1) * ldt + ncols) };
                f(Block { row0: rows.start, col0: cols.start, rows: mrows, cols: ncols, ld: ldt, data })
            }
            Output::Direct(..) if in_place => {}
            Output::Direct(c, ldc) => {
                for r in 0..mrows {
                    // SAFETY: this block's rows and columns of C are written by it only.
                    let dst = unsafe { c.slice((rows.start + r) * ldc + cols.start, ncols) };
                    dst.copy_from_slice(acc_row(r));
                }
            }
        }
    }
}

/// A shared output buffer that the blocks of one product write to from several threads,
/// holding the buffer's exclusive borrow for its lifetime. Each block writes a disjoint set
/// of elements, which is what makes it sound; the type only carries the pointer across
/// threads.
pub struct SharedOut<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: the wrapper hands out raw access only through `unsafe` methods whose callers
// guarantee disjoint writes; `T: Send` values may be written from other threads.
unsafe impl<T: Send> Send for SharedOut<'_, T> {}
unsafe impl<T: Send> Sync for SharedOut<'_, T> {}

impl<'a, T> SharedOut<'a, T> {
    /// Wraps `out`, borrowing it exclusively while the wrapper lives.
    pub fn new(out: &'a mut [T]) -> SharedOut<'a, T> {
        SharedOut { ptr: out.as_mut_ptr(), len: out.len(), _borrow: std::marker::PhantomData }
    }

    /// Wraps uninitialized storage that the writers through [`SharedOut::ptr`] fill, borrowing
    /// it exclusively while the wrapper lives; [`SharedOut::slice`] must not be used on
    /// elements not yet written.
    pub fn uninit(out: &'a mut [std::mem::MaybeUninit<T>]) -> SharedOut<'a, T> {
        SharedOut { ptr: out.as_mut_ptr().cast::<T>(), len: out.len(), _borrow: std::marker::PhantomData }
    }

    /// A pointer to element `start`, checking that `start..start + span` is inside the buffer.
    ///
    /// # Safety
    /// Writes through the pointer must stay inside `start..start + span` and must not overlap
    /// other live writes or references to the same elements.
    pub unsafe fn ptr(&self, start: usize, span: usize) -> *mut T {
        assert!(start + span <= self.len, "output range {start}..{} out of {}", start + span, self.len);
        self.ptr.add(start)
    }

    /// Elements `start..start + len` of the buffer.
    ///
    /// # Safety
    /// No other live slice or pointer write from this wrapper may overlap the range.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start + len <= self.len, "output range {start}..{} out of {}", start + len, self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(start), len)
    }
}

/// `C = (A - a_zp)(B - b_zp)` into a row-major `m x n` `i32` buffer (MatMulInteger's output):
/// blocks whose columns fill whole kernel panels are computed in place.
pub fn gemm_i32(g: &Gemm, c: &mut [i32], parallel: bool) {
    let n = g.b.n;
    assert!(c.len() >= g.m * n, "C of {} values is too short for {} x {n}", c.len(), g.m);
    run(g, &Output::Direct(SharedOut::new(c), n), parallel);
}
