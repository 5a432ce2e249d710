//! Single-thread timings of qforge's int8 GEMM, for `bench/qgemm.py` (which runs ONNX Runtime
//! on the same shapes and prints the comparison). Prints one JSON object per invocation.
//!
//! ```text
//! qgemm_bench peak                                  # clock and vpdpbusd throughput of this core
//! qgemm_bench gemm M K N [--runs R] [--isa NAME]    # the GEMM alone: u8 A, prepacked i8 B, i32 C
//! qgemm_bench session MODEL.onnx [--runs R]         # a model in a 1-thread Session
//! ```
//!
//! Times are the median over `R` runs (after 3 warm-up runs) of wall time and of the process's
//! CPU time (which excludes time the core spent on other processes).

use std::time::Instant;

use qforge_ir::{DType, Dim, Tensor};
use qforge_runtime::qgemm::{gemm_i32, ASource, Gemm, Int8, Isa, PackedB, ZeroPoints};
use qforge_runtime::{Session, SessionOptions};

/// `struct timespec` on 64-bit Linux.
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}

#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
extern "C" {
    fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
}

/// CPU time of this process in seconds (`CLOCK_PROCESS_CPUTIME_ID`; wall time elsewhere).
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
fn cpu_time() -> f64 {
    let mut ts = Timespec { sec: 0, nsec: 0 };
    // SAFETY: `ts` is a valid `struct timespec` on 64-bit Linux; clock 2 is the process clock.
    unsafe { clock_gettime(2, &mut ts) };
    ts.sec as f64 + ts.nsec as f64 * 1e-9
}

/// Wall time in seconds since the first call (no process clock on this platform).
#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
fn cpu_time() -> f64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// Median wall and CPU milliseconds of `runs` calls of `f` after 3 warm-up calls, and the
/// fastest wall time.
fn time(runs: usize, mut f: impl FnMut()) -> (f64, f64, f64) {
    for _ in 0..3 {
        f();
    }
    let (mut wall, mut cpu) = (vec![], vec![]);
    for _ in 0..runs {
        let (t, c) = (Instant::now(), cpu_time());
        f();
        wall.push(t.elapsed().as_secs_f64() * 1e3);
        cpu.push((cpu_time() - c) * 1e3);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let min = wall.iter().cloned().fold(f64::INFINITY, f64::min);
    (med(&mut wall), med(&mut cpu), min)
}

/// The value after `name` in the arguments.
fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// `n` pseudo-random bytes from a xorshift generator seeded with `seed`.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n).map(|_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 32) as u8
    }).collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs: usize = flag(&args, "--runs").and_then(|v| v.parse().ok()).unwrap_or(20);
    match args.get(1).map(|s| s.as_str()) {
        Some("peak") => peak(),
        Some("gemm") => {
            let dim = |i: usize| -> usize { args.get(i).and_then(|v| v.parse().ok()).expect("usage: qgemm_bench gemm M K N") };
            let (m, k, n) = (dim(2), dim(3), dim(4));
            let isa = match flag(&args, "--isa").as_deref() {
                None => Isa::best(),
                Some(name) => *Isa::ALL.iter().find(|i| i.name() == name).expect("--isa avx512vnni|avx2pairs|avx2|portable"),
            };
            assert!(isa.available(), "this CPU lacks {}", isa.name());
            let a = bytes(m * k, 1);
            let b = bytes(k * n, 2);
            // The byte kernel takes weights whose pair sums fit: halved, within [-64, 63].
            let b: Vec<u8> = if isa == Isa::Avx2Pairs { b.iter().map(|&x| (x as i8 / 2) as u8).collect() } else { b };
            let pb = PackedB::pack(isa, Int8::I8, &b, k, n, n, 1);
            let g = Gemm { m, a: ASource::Rows { data: &a, lda: k }, a_type: Int8::U8, a_zp: ZeroPoints::Tensor(128), b: &pb, b_zp: ZeroPoints::Tensor(0) };
            let mut c = vec![0i32; m * n];
            let (wall, cpu, min) = time(runs, || gemm_i32(&g, &mut c, false));
            println!("{{\"isa\": \"{}\", \"median_ms\": {wall:.4}, \"cpu_median_ms\": {cpu:.4}, \"min_ms\": {min:.4}}}", pb.isa().name());
        }
        Some("session") => {
            let path = args.get(2).expect("usage: qgemm_bench session MODEL.onnx");
            let model = qforge_onnx::load(std::path::Path::new(path)).expect("the model loads");
            #[allow(clippy::needless_update)]
            let opts = SessionOptions { threads: 1, ..Default::default() };
            let session = Session::with_options(&model, opts).expect("the model plans");
            let g = &model.graph;
            let inputs: Vec<(String, Tensor)> = g.real_inputs().enumerate().map(|(i, id)| {
                let v = g.value(id).unwrap();
                let ty = v.ty.as_ref().expect("inputs are typed");
                let shape: Vec<usize> = ty.shape().expect("inputs have shapes").iter().map(|d| match d {
                    Dim::Known(k) => *k as usize,
                    _ => panic!("input {} has a dynamic dimension", v.name),
                }).collect();
                let dtype = ty.elem().unwrap_or(DType::U8);
                let n: usize = shape.iter().product();
                (v.name.clone(), Tensor::from_raw(dtype, &shape, &bytes(n * dtype.bits() / 8, 10 + i as u64)).unwrap())
            }).collect();
            let (wall, cpu, min) = time(runs, || {
                session.run(inputs.clone()).expect("the model runs");
            });
            println!("{{\"median_ms\": {wall:.4}, \"cpu_median_ms\": {cpu:.4}, \"min_ms\": {min:.4}}}");
        }
        _ => eprintln!("usage: qgemm_bench peak | gemm M K N [--runs R] [--isa NAME] | session MODEL.onnx [--runs R]"),
    }
}

/// Measures the core clock with a chain of dependent integer adds (one per cycle) and the
/// throughput of `vpdpbusd zmm` with 12 independent accumulators (enough to cover its
/// latency), both per second of this process's CPU time (so time the core spends on other
/// processes does not count), and prints both with the implied int8 peak: `2 ops x 64
/// multiply-adds x vpdpbusd/cycle x GHz`.
#[cfg(target_arch = "x86_64")]
fn peak() {
    use std::arch::asm;
    fn add_chain(iters: u64) {
        // SAFETY: plain register arithmetic.
        unsafe {
            asm!(
                "2:",
                "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
                "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
                "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
                "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
                "dec {n}",
                "jnz 2b",
                x = inout(reg) 0u64 => _, n = inout(reg) iters => _,
            );
        }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn vnni(iters: u64) {
        asm!(
            "vpxord zmm0, zmm0, zmm0", "vpxord zmm1, zmm1, zmm1", "vpxord zmm2, zmm2, zmm2", "vpxord zmm3, zmm3, zmm3",
            "vpxord zmm4, zmm4, zmm4", "vpxord zmm5, zmm5, zmm5", "vpxord zmm6, zmm6, zmm6", "vpxord zmm7, zmm7, zmm7",
            "vpxord zmm8, zmm8, zmm8", "vpxord zmm9, zmm9, zmm9", "vpxord zmm10, zmm10, zmm10", "vpxord zmm11, zmm11, zmm11",
            "vpternlogd zmm30, zmm30, zmm30, 0xff", "vpternlogd zmm31, zmm31, zmm31, 0xff",
            "2:",
            "vpdpbusd zmm0, zmm30, zmm31", "vpdpbusd zmm1, zmm30, zmm31", "vpdpbusd zmm2, zmm30, zmm31", "vpdpbusd zmm3, zmm30, zmm31",
            "vpdpbusd zmm4, zmm30, zmm31", "vpdpbusd zmm5, zmm30, zmm31", "vpdpbusd zmm6, zmm30, zmm31", "vpdpbusd zmm7, zmm30, zmm31",
            "vpdpbusd zmm8, zmm30, zmm31", "vpdpbusd zmm9, zmm30, zmm31", "vpdpbusd zmm10, zmm30, zmm31", "vpdpbusd zmm11, zmm30, zmm31",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) iters => _,
            out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
            out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _, out("zmm30") _, out("zmm31") _,
        );
    }
    if !Isa::Avx512Vnni.available() {
        println!("{{\"error\": \"this CPU lacks AVX-512 VNNI\"}}");
        return;
    }
    let (mut ghz, mut per_cycle) = (vec![], vec![]);
    for _ in 0..7 {
        let iters = 20_000_000u64;
        let t = cpu_time();
        add_chain(iters);
        let g = (iters * 16) as f64 / (cpu_time() - t) / 1e9;
        let t = cpu_time();
        // SAFETY: the CPU supports AVX-512 VNNI, checked above.
        unsafe { vnni(iters) };
        let v = (iters * 12) as f64 / (cpu_time() - t) / 1e9;
        ghz.push(g);
        per_cycle.push(v / g);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let (g, p) = (med(&mut ghz), med(&mut per_cycle));
    let mhz = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| s.lines().find(|l| l.starts_with("cpu MHz")).and_then(|l| l.split(':').nth(1)).map(|v| v.trim().to_string())).unwrap_or_default();
    println!("{{\"clock_ghz\": {g:.3}, \"cpuinfo_mhz\": \"{mhz}\", \"vpdpbusd_zmm_per_cycle\": {p:.3}, \"peak_gops\": {:.1}, \"peak_gops_at_1_per_cycle\": {:.1}}}", 128.0 * p * g, 128.0 * g);
}

#[cfg(not(target_arch = "x86_64"))]
fn peak() {
    println!("{{\"error\": \"the peak measurement needs x86-64\"}}");
}
