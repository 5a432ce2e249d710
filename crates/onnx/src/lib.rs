//! ONNX model loading and saving.
