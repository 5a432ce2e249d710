"""Reference entropy (KL) calibration thresholds from ONNX Runtime's quantizer.

    python scripts/oracle/ort_entropy.py CASES.json

CASES.json is a list of {"counts": [...], "threshold": t, "min": m, "max": M,
"num_quantized_bins": n}: a histogram over [-t, t] with uniform bins. Prints a JSON list of
[lo, hi] as `HistogramCollector.get_entropy_threshold` chooses them.
"""
import json
import sys

import numpy as np
from onnxruntime.quantization.calibrate import HistogramCollector

out = []
for case in json.load(open(sys.argv[1])):
    hist = np.array(case["counts"], dtype=np.int64)
    t = np.float32(case["threshold"])
    edges = np.linspace(-t, t, hist.size + 1, dtype=np.float32)
    histogram = (hist, edges, np.float32(case["min"]), np.float32(case["max"]), t)
    lo, hi = HistogramCollector.get_entropy_threshold(None, histogram, case["num_quantized_bins"])
    out.append([float(lo), float(hi)])
print(json.dumps(out))
