"""Does ONNX Runtime, on this CPU, compute what a quantized model's integers give?

Runs a quantized ONNX model on every sample of a calibration-data folder (sample folders of
`<input>.npy`) in ONNX Runtime (CPU provider, all optimizations, so its QDQ fusions into integer
kernels) and in qforge's runtime (`qforge run`, which executes the ONNX semantics exactly), and
counts the samples whose first outputs differ by more than `--tol`. On x86 CPUs without VNNI,
ONNX Runtime's u8 x s8 kernels add pairs of products into saturating 16-bit sums, so a model
whose weights allow it can differ there; on a CPU with VNNI both agree.

    .venv-bench/bin/python bench/ort_vs_exact.py Q.onnx ~/.cache/qeval/calib/full/ocr_det \\
        --qforge target/release/qforge [--limit N]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("data", type=Path, help="a folder of sample folders of <input>.npy")
    ap.add_argument("--qforge", type=Path, default=Path("target/release/qforge"))
    ap.add_argument("--limit", type=int, default=None, help="only the first N samples")
    ap.add_argument("--tol", type=float, default=1e-5, help="largest absolute difference counted as equal")
    args = ap.parse_args(argv)

    session = ort.InferenceSession(str(args.model), providers=["CPUExecutionProvider"])
    samples = sorted(d for d in args.data.iterdir() if d.is_dir())[: args.limit]
    if not samples:
        sys.exit(f"{args.data}: no sample folders")
    worst, differ = 0.0, 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.npz"
        for d in samples:
            feed = {f.stem: np.load(f) for f in sorted(d.glob("*.npy"))}
            theirs = session.run(None, feed)[0]
            cmd = [str(args.qforge), "run", str(args.model), "-o", str(out)]
            for name in feed:
                cmd += ["--input", f"{name}={d / (name + '.npy')}"]
            subprocess.run(cmd, check=True, capture_output=True)
            with np.load(out) as z:
                ours = z[session.get_outputs()[0].name]
            diff = float(np.abs(theirs.astype(np.float64) - ours.astype(np.float64)).max())
            worst = max(worst, diff)
            differ += diff > args.tol
    print(f"{args.model.name}: ONNX Runtime differs from the exact outputs on {differ} of {len(samples)} samples "
          f"(largest difference {worst:.3g})")


if __name__ == "__main__":
    main()
