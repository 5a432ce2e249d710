"""Quantizes a model with ONNX Runtime's static quantizer (QDQ, per-channel int8 weights, uint8
activations, MinMax calibration), the reference output of `onnxruntime.quantization`.

    python scripts/oracle/ort_quantize.py MODEL.onnx CALIBRATION OUT.onnx [--reduce-range]

CALIBRATION is an .npz of stacked samples (one array per input, samples on the first axis) or
a folder of sample folders holding NAME.npy per input. Models below opset 13 are converted to
13 first (per-channel QDQ needs it), as the benchmark harness does. `--reduce-range` quantizes
the weights to 7 bits (ONNX Runtime's `reduce_range`).
"""
import os
import sys
import tempfile

import numpy as np
import onnx
from onnx import version_converter
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

model, calib, out = sys.argv[1:4]
reduce_range = "--reduce-range" in sys.argv[4:]
m = onnx.load(model)
inputs = [i.name for i in m.graph.input if i.name not in {t.name for t in m.graph.initializer}]
if calib.endswith(".npz"):
    stacked = np.load(calib)
    samples = [{k: stacked[k][i] for k in inputs} for i in range(len(stacked[inputs[0]]))]
else:
    samples = []
    for d in sorted(os.listdir(calib)):
        files = {f[:-4]: os.path.join(calib, d, f) for f in os.listdir(os.path.join(calib, d)) if f.endswith(".npy")}
        samples.append({k: np.load(files[k]) for k in inputs})


class Reader(CalibrationDataReader):
    def __init__(self):
        self.it = iter(samples)

    def get_next(self):
        return next(self.it, None)


opset = next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
with tempfile.TemporaryDirectory() as tmp:
    if opset < 13:
        model = os.path.join(tmp, "opset13.onnx")
        onnx.save(version_converter.convert_version(m, 13), model)
    quantize_static(model, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, reduce_range=reduce_range)
