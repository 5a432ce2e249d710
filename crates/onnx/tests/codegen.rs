//! The committed protobuf bindings (`src/generated/onnx.rs`) are exactly what prost-build
//! generates from the vendored `proto/onnx-ml.proto` and `proto/onnx-data.proto` (onnx 1.23,
//! IR version 14; `onnx-data.proto` imports `onnx-ml.proto` from its own folder).
//! Regenerate with `QFORGE_REGENERATE=1 cargo test -p qforge-onnx --test codegen`.

use std::path::Path;

#[test]
fn generated_bindings_are_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fds = protox::compile(["onnx-ml.proto", "onnx-data.proto"], [root.join("proto")]).expect("the vendored proto compiles");
    let out = std::env::temp_dir().join(format!("qforge-codegen-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    // Tensor bytes decode as slices of the model file's buffer and encode from tensors' own
    // storage, without a copy.
    prost_build::Config::new().out_dir(&out).bytes([".onnx.TensorProto.raw_data"]).compile_fds(fds).expect("prost-build runs");
    let fresh = std::fs::read_to_string(out.join("onnx.rs")).unwrap();
    std::fs::remove_dir_all(&out).unwrap();
    let committed_path = root.join("src/generated/onnx.rs");
    if std::env::var_os("QFORGE_REGENERATE").is_some() {
        std::fs::write(&committed_path, &fresh).unwrap();
    }
    let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
    assert!(committed == fresh, "src/generated/onnx.rs is stale; rerun with QFORGE_REGENERATE=1");
}
