"""Output SQNR of qforge configurations and ONNX Runtime's quantizer on one model.

    PYTHONPATH=../shared .venv-bench/bin/python bench/sqnr_vs_ort.py MODEL.onnx CALIB.npz EVAL.npz WORKDIR \
        qf= 'qf_rr=--reduce-range' ortmm=ort:minmax ortent=ort:entropy ...

CALIB.npz and EVAL.npz hold one array per model input, stacked along a new first axis (one
feed per row). Each NAME=SPEC quantizes MODEL from CALIB (written once to WORKDIR/calib in the
public benchmark's format): `ort:METHOD` through the benchmark's ONNX Runtime worker
(`quantize_static`, QDQ, u8/s8 per channel), anything else as extra `qforge quantize` arguments
(`--qforge PATH`, default target/release/qforge). Every model runs in ONNX Runtime (CPU, 2
threads) on the EVAL feeds; printed per configuration: quantize wall time and, per float
output, the SQNR against the float model over all feeds.
"""
import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench.datasets import export_calibration

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("model")
ap.add_argument("calib")
ap.add_argument("eval")
ap.add_argument("work")
ap.add_argument("variants", nargs="+", help="NAME=SPEC: ort:METHOD or qforge arguments")
ap.add_argument("--qforge", default="target/release/qforge")
args = ap.parse_args()
model, work = Path(args.model), Path(args.work)
work.mkdir(parents=True, exist_ok=True)


def feeds(path):
    z = np.load(path)
    return [{k: z[k][i] for k in z.files} for i in range(len(z[z.files[0]]))]


if not (work / "calib").exists():
    export_calibration(feeds(args.calib), work / "calib", model.stem)
evals = feeds(args.eval)


def run(path):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in s.get_inputs()]
    return [o.name for o in s.get_outputs()], [s.run(None, {k: x[k] for k in names}) for x in evals]


outputs, floats = run(model)
for name, spec in (v.split("=", 1) for v in args.variants):
    out = work / f"{name}.onnx"
    start = time.time()
    if spec.startswith("ort:"):
        argv = [sys.executable, "-m", "bench.quantizers", "ort", "--method", spec[4:], "--input", str(model), "--output", str(out),
                "--calib-dir", str(work / "calib"), "--workdir", str(work / f"{name}.work"), "--report", str(work / f"{name}.worker.json")]
    else:
        argv = [args.qforge, "quantize", str(model), "-o", str(out), "--calibration-data", str(work / "calib")] + spec.split()
    r = subprocess.run(argv, capture_output=True, text=True)
    wall = time.time() - start
    if r.returncode != 0:
        print(f"{name}: failed: {r.stderr[-2000:]}")
        continue
    _, quants = run(out)
    sqnr = {}
    for j, o in enumerate(outputs):
        signal = sum(float(np.sum(np.square(f[j].astype(np.float64)))) for f in floats)
        noise = sum(float(np.sum(np.square(f[j].astype(np.float64) - q[j].astype(np.float64)))) for f, q in zip(floats, quants))
        sqnr[o] = round(10 * np.log10(signal / max(noise, 1e-30)), 2)
    print(f"{name:14s} {wall:6.1f} s  " + "  ".join(f"{o}: {db} dB" for o, db in sqnr.items()), flush=True)
