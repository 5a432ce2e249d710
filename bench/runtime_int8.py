"""qforge's int8 runtime against ONNX Runtime's (CPU EP, all optimizations) on the same
quantized models, 1 and 2 threads, in one run.

    .cache/venv/bin/python bench/runtime_int8.py --qforge target/release/qforge [--formats qdq,qoperator]

Each model is quantized once by qforge per format (`quantize --format FORMAT`), calibrated on
the benchmark's cached calibration samples when present (`~/.cache/qeval/calib/quick/<model>`)
and otherwise on the one timing input. Rounds interleave the engines and thread counts; the
table shows, per model, format and thread count, the median over rounds of each round's median
latency: qforge int8, ORT int8, their ratio, and qforge's own f32 latency on the float model
with qforge int8's speed-up over it.
"""
import argparse
import json
import os
import subprocess
import tempfile

import numpy as np

from runtime_f32 import CACHE, COMMITTED, MODELS, ROOT, inputs_for, ort_median, qforge_median

CALIB = os.path.join(os.path.expanduser(os.environ.get("EVAL_CACHE", "~/.cache/qeval")), "calib", "quick")
# Benchmark models whose calibration folder has another name.
CALIB_NAME = {"silero_vad_16k_op15": "silero_vad"}


def quantize(tool, model, out, calib, fmt):
    cmd = [tool, "quantize", model, "-o", out, "--calibration-data", calib, "--json"]
    if fmt != "qdq":
        cmd += ["--format", fmt]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--qforge", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--formats", default="qdq,qoperator")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = os.path.join(ROOT if name in COMMITTED else CACHE, "models", f"{name}.onnx")
            feed = inputs_for(MODELS[name])
            files = {}
            sample = os.path.join(tmp, f"{name}_calib", "00000")
            os.makedirs(sample)
            for k, v in feed.items():
                files[k] = os.path.join(tmp, f"{name}_{k}.npy")
                np.save(files[k], v)
                np.save(os.path.join(sample, f"{k}.npy"), v)
            calib = os.path.join(CALIB, CALIB_NAME.get(name, name))
            if not os.path.isdir(calib):
                calib = os.path.dirname(sample)
            for fmt in args.formats.split(","):
                qpath = os.path.join(tmp, f"{name}.{fmt}.onnx")
                quantize(args.qforge, path, qpath, calib, fmt)
                for threads in (1, 2):
                    q, o, f = [], [], []
                    for _ in range(args.rounds):
                        q.append(qforge_median(args.qforge, qpath, files, threads, args.runs))
                        o.append(ort_median(qpath, feed, threads, args.runs))
                        f.append(qforge_median(args.qforge, path, files, threads, args.runs))
                    rows.append((name, fmt, threads, float(np.median(q)), float(np.median(o)), float(np.median(f))))
    print(f"{'model':<22} {'format':<10} {'threads':>7} {'qforge ms':>10} {'ORT ms':>9} {'ratio':>7} {'qforge f32':>11} {'int8 speed-up':>14}")
    for name, fmt, t, q, o, f in rows:
        print(f"{name:<22} {fmt:<10} {t:>7} {q:>10.2f} {o:>9.2f} {q / o:>7.2f} {f:>11.2f} {f / q:>14.2f}")
    print(json.dumps([{"model": n, "format": fmt, "threads": t, "qforge_ms": q, "ort_ms": o, "ratio": q / o, "qforge_f32_ms": f, "int8_speedup": f / q}
                      for n, fmt, t, q, o, f in rows]))


if __name__ == "__main__":
    main()
