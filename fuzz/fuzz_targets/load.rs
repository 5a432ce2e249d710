//! Fuzzes the model loader: any bytes must give a model or an error, never a panic, and a
//! consistent loaded model saves to bytes that reload and save to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(model) = qforge_onnx::load_bytes(data, None) {
        if model.graph.check().is_ok() {
            if let Ok(bytes) = qforge_onnx::to_bytes(&model) {
                let again = qforge_onnx::load_bytes(&bytes, None).expect("a saved model reloads");
                assert!(qforge_onnx::to_bytes(&again).ok() == Some(bytes), "saving is not a fixpoint");
            }
        }
    }
});
