"""Loads and runs float/quantized model pairs in ONNX Runtime (CPU, one thread) on ONNX
backend-test inputs, and reports each quantized model that ONNX Runtime refuses, fails to run,
or whose outputs differ from the float model's in type or shape. Sequence outputs are compared
tensor by tensor; an empty optional output must be empty in both.

    python scripts/oracle/ort_quantized_cases.py CASES.json

CASES.json: a list of {"name", "float", "quantized"} with either "data", a node test's
directory whose test_data_set_*/input_<i>.pb files feed the graph inputs in order, or "feeds",
a list of {input name: .npy path} (one feed each).
Prints {"checked": N, "float_refused": [names], "failures": [[name, reason]], "worst": [[name,
max |q - f| / max |f| over the float outputs]], largest first} as JSON. A case whose float model ONNX Runtime cannot load or run is
not a quantizer failure and is only listed.
"""
import glob
import json
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

ort.set_default_logger_severity(3)


def feeds(model_path, data_dir):
    m = onnx.load(model_path, load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    names = [i.name for i in m.graph.input if i.name not in inits]
    out = []
    for s in sorted(p for p in glob.glob(os.path.join(data_dir, "test_data_set_*")) if os.path.isdir(p)):
        feed = {}
        for i, n in enumerate(names):
            f = os.path.join(s, f"input_{i}.pb")
            if os.path.exists(f):
                t = onnx.TensorProto()
                with open(f, "rb") as fh:
                    t.ParseFromString(fh.read())
                feed[n] = numpy_helper.to_array(t)
        out.append(feed)
    return out


def tensors(outs):
    """The outputs of a run as a flat list of arrays: a sequence output gives its tensors in
    order, preceded by its length; an empty optional output gives None."""
    flat = []
    for o in outs:
        if isinstance(o, list):
            flat.append(np.asarray(len(o)))
            flat.extend(np.asarray(t) for t in o)
        else:
            flat.append(o if o is None else np.asarray(o))
    return flat


def session(path):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    result = {"checked": 0, "float_refused": [], "failures": [], "worst": []}
    for c in cases:
        try:
            sf = session(c["float"])
            if "feeds" in c:
                sets = [{k: np.load(v) for k, v in f.items()} for f in c["feeds"]]
            else:
                sets = feeds(c["float"], c["data"])
            float_outs = [tensors(sf.run(None, feed)) for feed in sets]
        except Exception:
            result["float_refused"].append(c["name"])
            continue
        result["checked"] += 1
        try:
            sq = session(c["quantized"])
        except Exception as e:
            result["failures"].append([c["name"], "ONNX Runtime refuses the quantized model: " + str(e).splitlines()[0][:300]])
            continue
        worst = 0.0
        try:
            for feed, want in zip(sets, float_outs):
                got = tensors(sq.run(None, feed))
                if len(got) != len(want) or any((a is None) != (b is None) for a, b in zip(want, got)):
                    raise ValueError("the outputs differ in sequence lengths or empty optionals from the float model's")
                for i, (a, b) in enumerate(zip(want, got)):
                    if a is None:
                        continue
                    if a.dtype != b.dtype or a.shape != b.shape:
                        raise ValueError(f"output {i}: {b.dtype}{list(b.shape)}, the float model gives {a.dtype}{list(a.shape)}")
                    if a.dtype.kind == "f" and a.size:
                        fin = np.isfinite(a) & np.isfinite(b)
                        if fin.any():
                            scale = float(np.abs(a[fin]).max()) or 1.0
                            worst = max(worst, float(np.abs(a[fin] - b[fin]).max()) / scale)
        except Exception as e:
            result["failures"].append([c["name"], "run: " + str(e).splitlines()[0][:300]])
            continue
        result["worst"].append([c["name"], worst])
    result["worst"].sort(key=lambda w: -w[1])
    print(json.dumps(result))


main()
