"""Write fresh inputs of a benchmark task as a calibration-data folder.

Draws `--n` inputs with the public benchmark's own generators and a seed of your choice, from
the evaluation half of the corpus (as `paired_eval.py` does), preprocessed as the task feeds its
model, and writes them as sample folders `OUT/00000/x.npy`, ... (the layout `qforge quantize
--calibration-data`, `qforge inspect --data` and `bench/ort_vs_exact.py` read). Inputs the
calibration never saw, to measure whether a quantized model still runs exactly in ONNX Runtime
on a CPU without VNNI:

    PYTHONPATH=../shared:bench .venv-bench/bin/python bench/fresh_samples.py ocr_det /tmp/fresh_det \\
        --n 48 --seed 7
    .venv-bench/bin/python bench/ort_vs_exact.py Q.onnx /tmp/fresh_det --qforge target/release/qforge
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from bench import tasks as T
from paired_eval import fresh_inputs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", choices=["ocr_cls", "orientation", "ocr_det"])
    ap.add_argument("out", type=Path, help="folder to create the sample folders in (must not exist)")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--seed", type=int, default=7, help="generator seed (the benchmark's own sets use 102/103/104)")
    ap.add_argument("--input", default="x", help="the model input's name (x for all three tasks)")
    args = ap.parse_args(argv)
    if args.out.exists():
        sys.exit(f"{args.out} exists; give a new folder")
    task = T.TASKS[args.task]()
    if args.task == "ocr_det":
        inputs = (task.preprocess(page.image) for page in task._pages("eval", args.n, args.seed))
    else:
        inputs = (x for x, _ in fresh_inputs(task, args.n, args.seed))
    for i, x in enumerate(inputs):
        x = np.asarray(x, np.float32)
        d = args.out / f"{i:05d}"
        d.mkdir(parents=True)
        np.save(d / f"{args.input}.npy", x if x.ndim == 4 else x[None])
    print(f"wrote {args.n} {args.task} samples to {args.out}")


if __name__ == "__main__":
    main()
