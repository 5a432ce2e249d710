//! Packed operand layouts shared by the micro-kernels.
//!
//! Both operands are read in groups of `kg` consecutive `k` (4 bytes per row or column and
//! group: four `u8`/`i8` for AVX-512 VNNI and AVX2 on bytes, two `i16` for AVX2 on 16-bit
//! values and the portable kernel):
//!
//! * **B** (weights, packed once): panels of `nr` columns; a panel holds every group of the
//!   padded depth, each group `nr * 4` bytes with column `c` at bytes `4c..4c + 4`. Columns
//!   past `n` and depths past `k` are zero.
//! * **A** (activations): row-major, the kernel reading 4 bytes of each row per group. The
//!   rows of a block are read in place when their bytes already are the stored form (u8
//!   activations for the byte kernels, depths inside `k`), else copied per block into a buffer with the
//!   shift or widening applied and the depth zero-padded to whole groups.
//!
//! Stored values may be shifted from the originals so that the kernel's instruction sees the
//! signedness it needs (VNNI and `vpmaddubsw` multiply `u8` by `i8`): `stored = original +
//! shift` with the shift in {-128, 0, 128}, applied as `xor 0x80`. The driver folds the shifts into the
//! zero points, so `(a - a_zp) (b - b_zp) = (a' - a_zp') (b' - b_zp')` exactly.

use super::{Int8, Isa};

/// One 64-byte line; buffers of lines are aligned for full-width vector loads.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A zeroed byte buffer aligned to 64 bytes.
#[derive(Clone, Default)]
pub(crate) struct AlignedBuf {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedBuf {
    /// Makes the buffer at least `len` bytes long, zeroing every byte.
    pub(crate) fn zeroed(&mut self, len: usize) {
        self.lines.clear();
        self.lines.resize(len.div_ceil(64), Line([0; 64]));
        self.len = len;
    }

    /// Makes the buffer at least `len` bytes long; contents are unspecified.
    pub(crate) fn reserve_len(&mut self, len: usize) {
        if self.lines.len() * 64 < len {
            self.lines.resize(len.div_ceil(64), Line([0; 64]));
        }
        self.len = len;
    }

    /// The buffer's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `Line` is 64 plain bytes without padding; `len` never exceeds the lines.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const u8, self.len) }
    }

    /// The buffer's bytes, mutable.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and the borrow is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut u8, self.len) }
    }

    /// The buffer as `i32` values (`len` must be a multiple of 4).
    pub(crate) fn i32s_mut(&mut self) -> &mut [i32] {
        debug_assert!(self.len.is_multiple_of(4));
        // SAFETY: 64-byte alignment satisfies `i32`; every bit pattern is a valid `i32`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut i32, self.len / 4) }
    }
}

/// The block shape a micro-kernel family works on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    /// Rows per full A panel (the tallest micro-kernel).
    pub mr: usize,
    /// Columns per B panel.
    pub nr: usize,
    /// Depth per group (4 bytes per row or column hold `kg` elements).
    pub kg: usize,
    /// Whether elements are stored as `i16` (else as bytes).
    pub wide: bool,
}

impl Isa {
    /// The tile and group shape of the family's kernels.
    pub(crate) fn geometry(self) -> Geometry {
        match self {
            Isa::Avx512Vnni => Geometry { mr: 12, nr: 32, kg: 4, wide: false },
            Isa::Avx2Pairs => Geometry { mr: 6, nr: 16, kg: 4, wide: false },
            Isa::Avx2 | Isa::Portable => Geometry { mr: 6, nr: 16, kg: 2, wide: true },
        }
    }

    /// The shift added to stored A values of type `t`.
    pub(crate) fn a_shift(self, t: Int8) -> i32 {
        match (self, t) {
            (Isa::Avx512Vnni | Isa::Avx2Pairs, Int8::I8) => 128,
            _ => 0,
        }
    }

    /// The shift added to stored B values of type `t`.
    pub(crate) fn b_shift(self, t: Int8) -> i32 {
        match (self, t) {
            (Isa::Avx512Vnni | Isa::Avx2Pairs, Int8::U8) => -128,
            _ => 0,
        }
    }
}

/// A weight matrix `B` (`k x n`) packed once for one micro-kernel family, with the column
/// sums of its stored values. Reused by every product with it.
#[derive(Clone)]
pub struct PackedB {
    pub(crate) isa: Isa,
    pub(crate) dtype: Int8,
    pub(crate) k: usize,
    pub(crate) n: usize,
    /// `k` rounded up to the group depth.
    pub(crate) kp: usize,
    pub(crate) data: AlignedBuf,
    /// Per column: the sum over `k` of the stored (shifted) values.
    pub(crate) col_sums: Vec<i32>,
}

impl PackedB {
    /// Packs `B` given element by element: `get(kk, j)` is the raw byte of row `kk`, column `j`
    /// (reinterpreted as `i8` when `dtype` is `I8`). Any layout (row-major, transposed, a
    /// convolution's weights in any order) packs through this one function. For
    /// [`Isa::Avx2Pairs`], B packs for [`Isa::Avx2`] instead unless its pairs fit
    /// (`pairs_fit`).
    pub fn pack_with(isa: Isa, dtype: Int8, k: usize, n: usize, get: impl Fn(usize, usize) -> u8) -> PackedB {
        let isa = if isa == Isa::Avx2Pairs && !pairs_fit(dtype, k, n, &get) { Isa::Avx2 } else { isa };
        let g = isa.geometry();
        let kp = k.div_ceil(g.kg) * g.kg;
        let panels = n.div_ceil(g.nr);
        let groups = kp / g.kg;
        let panel_bytes = groups * g.nr * 4;
        let mut data = AlignedBuf::default();
        data.zeroed(panels * panel_bytes);
        let mut col_sums = vec![0i32; n];
        let shift = isa.b_shift(dtype);
        let bytes = data.bytes_mut();
        for (j, col_sum) in col_sums.iter_mut().enumerate() {
            let (p, c) = (j / g.nr, j % g.nr);
            let base = p * panel_bytes + c * 4;
            let mut sum = 0i32;
            for kk in 0..k {
                let stored = stored_b(dtype, get(kk, j), shift);
                sum = sum.wrapping_add(stored);
                let at = base + (kk / g.kg) * g.nr * 4;
                if g.wide {
                    let off = at + (kk % g.kg) * 2;
                    bytes[off..off + 2].copy_from_slice(&(stored as i16).to_le_bytes());
                } else {
                    bytes[at + kk % g.kg] = stored as u8;
                }
            }
            *col_sum = sum;
        }
        PackedB { isa, dtype, k, n, kp, data, col_sums }
    }

    /// Packs a strided `B`: element `(kk, j)` is `b[kk * rs + j * cs]` (row-major: `rs = n`,
    /// `cs = 1`; given transposed as `n x k`: `rs = 1`, `cs = k`). Panics if `b` is too short.
    pub fn pack(isa: Isa, dtype: Int8, b: &[u8], k: usize, n: usize, rs: usize, cs: usize) -> PackedB {
        if k > 0 && n > 0 {
            assert!((k - 1) * rs + (n - 1) * cs < b.len(), "B of {} bytes is too short for {k} x {n}", b.len());
        }
        PackedB::pack_with(isa, dtype, k, n, |kk, j| b[kk * rs + j * cs])
    }

    /// Depth (rows of `B`).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Columns of `B`.
    pub fn n(&self) -> usize {
        self.n
    }

    /// The element type `B` was given in.
    pub fn dtype(&self) -> Int8 {
        self.dtype
    }

    /// The micro-kernel family the layout is for.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Bytes of panel `p` from group `g0` on.
    pub(crate) fn panel(&self, p: usize, g0: usize) -> *const u8 {
        let g = self.isa.geometry();
        let panel_bytes = (self.kp / g.kg) * g.nr * 4;
        let off = p * panel_bytes + g0 * g.nr * 4;
        assert!(off <= self.data.bytes().len(), "panel {p}, group {g0} is outside the packed B");
        // SAFETY: `off` is within the packed data (checked above).
        unsafe { self.data.bytes().as_ptr().add(off) }
    }
}

/// The stored value of a raw B byte of type `dtype`: the value plus the family's `shift`.
fn stored_b(dtype: Int8, raw: u8, shift: i32) -> i32 {
    match dtype {
        Int8::U8 => raw as i32 + shift,
        Int8::I8 => raw as i8 as i32 + shift,
    }
}

/// Whether `vpmaddubsw` is exact for `B` (`get` as in [`PackedB::pack_with`]) against any
/// stored u8 activations: in each column, the stored values (`i8`, u8 weights shifted by
/// -128) of depths `2m` and `2m + 1`, which the instruction adds into one saturating 16-bit
/// sum, have positive parts summing to at most 128 and negative parts to at most 128, so that
/// `255 · 128 = 32640` bounds the sum both ways.
pub(crate) fn pairs_fit(dtype: Int8, k: usize, n: usize, get: &impl Fn(usize, usize) -> u8) -> bool {
    let shift = Isa::Avx2Pairs.b_shift(dtype);
    let stored = |kk: usize, j: usize| stored_b(dtype, get(kk, j), shift);
    (0..n).all(|j| (0..k / 2).all(|m| {
        let (x, y) = (stored(2 * m, j), stored(2 * m + 1, j));
        x.max(0) + y.max(0) <= 128 && (-x).max(0) + (-y).max(0) <= 128
    }))
}

/// Copies one row of A into its stored form: bytes (flipped by `xor 0x80` when `flip`) or
/// `i16` values (`wide`, sign-extended when `signed`), zero-padded to `dst`'s length, and
/// returns the sum of the stored values.
#[inline(always)]
fn store_row_body(src: &[u8], dst: &mut [u8], wide: bool, signed: bool, flip: bool) -> i32 {
    if wide {
        let (head, pad) = dst.split_at_mut(src.len() * 2);
        pad.fill(0);
        let mut sum = 0i32;
        for (d, &x) in head.chunks_exact_mut(2).zip(src) {
            let v = if signed { x as i8 as i16 } else { x as i16 };
            d.copy_from_slice(&v.to_le_bytes());
            sum = sum.wrapping_add(v as i32);
        }
        sum
    } else {
        let (head, pad) = dst.split_at_mut(src.len());
        pad.fill(0);
        let mask = if flip { 0x80 } else { 0 };
        let mut sum = 0u32;
        for (d, &x) in head.iter_mut().zip(src) {
            *d = x ^ mask;
            sum = sum.wrapping_add(*d as u32);
        }
        sum as i32
    }
}

/// [`store_row_body`], compiled for the widest vectors the CPU has.
pub(crate) fn store_row(src: &[u8], dst: &mut [u8], wide: bool, signed: bool, flip: bool) -> i32 {
    debug_assert!(dst.len() >= src.len() * if wide { 2 } else { 1 });
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn avx512(src: &[u8], dst: &mut [u8], wide: bool, signed: bool, flip: bool) -> i32 {
            store_row_body(src, dst, wide, signed, flip)
        }
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(src: &[u8], dst: &mut [u8], wide: bool, signed: bool, flip: bool) -> i32 {
            store_row_body(src, dst, wide, signed, flip)
        }
        if std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU supports AVX-512 F and BW, checked just above.
            return unsafe { avx512(src, dst, wide, signed, flip) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { avx2(src, dst, wide, signed, flip) };
        }
    }
    store_row_body(src, dst, wide, signed, flip)
}

/// Adds to `sums[r]` the sum of the `len` unsigned bytes of row `r` (rows at stride `ld` in
/// `data`), compiled for the widest vectors the CPU has.
pub(crate) fn sum_rows_u8(data: &[u8], ld: usize, len: usize, sums: &mut [i32]) {
    assert!(sums.is_empty() || (sums.len() - 1) * ld + len <= data.len());
    /// The portable loop.
    #[inline(always)]
    fn body(data: &[u8], ld: usize, len: usize, sums: &mut [i32]) {
        for (r, s) in sums.iter_mut().enumerate() {
            let row = &data[r * ld..r * ld + len];
            let mut lanes = [0u32; 16];
            let mut chunks = row.chunks_exact(16);
            for c in &mut chunks {
                for (l, &x) in lanes.iter_mut().zip(c) {
                    *l += x as u32;
                }
            }
            let rest: u32 = chunks.remainder().iter().map(|&x| x as u32).sum();
            *s = s.wrapping_add((lanes.iter().sum::<u32>() + rest) as i32);
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn avx512(data: &[u8], ld: usize, len: usize, sums: &mut [i32]) {
            use std::arch::x86_64::*;
            let tail = len % 64;
            let mask: u64 = if tail == 0 { 0 } else { (1u64 << tail) - 1 };
            let zero = _mm512_setzero_si512();
            for (r, s) in sums.iter_mut().enumerate() {
                let p = data.as_ptr().add(r * ld);
                let mut acc = zero;
                let mut off = 0;
                while off + 64 <= len {
                    acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_loadu_si512(p.add(off) as *const _), zero));
                    off += 64;
                }
                if tail > 0 {
                    acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_maskz_loadu_epi8(mask, p.add(off) as *const i8), zero));
                }
                *s = s.wrapping_add(_mm512_reduce_add_epi64(acc) as i32);
            }
        }
        if std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU supports AVX-512 F and BW (checked just above), and every row
            // read lies inside `data` (asserted above).
            return unsafe { avx512(data, ld, len, sums) };
        }
    }
    body(data, ld, len, sums)
}
