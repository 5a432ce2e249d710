"""Quantize time and peak memory of `qforge quantize` against ONNX Runtime's `quantize_static`
(MinMax, the public benchmark's settings), in one run, rounds alternating the two tools.

    .venv-bench/bin/python bench/quantize_time.py --qforge target/release/qforge \
        [--rounds 3] [--models bert_base] [--model NAME=MODEL.onnx:CALIB_DIR ...]

Models:
- `bert_base`: a BERT-base-sized encoder (12 layers, hidden 768, 435 MB of weights, random
  weights) exported by `scripts/export_bert.py --base` into the work dir (needs torch, which
  the bench venv has), calibrated on its 32 sample sentences of 128 tokens.
- `--model NAME=MODEL.onnx:CALIB_DIR`: any model with a calibration folder in the benchmark's
  `qeval-calib-v1` layout (for the public benchmark's models: `~/.cache/qeval/calib/full/<model>`).

ONNX Runtime runs through the public benchmark's worker (`python -m bench.quantizers ort
--method minmax`, from `--shared`, default `../shared`), whose `total_s` (pre-processing and
quantize_static) is what the benchmark compares; qforge's time is its process wall time, as in
the benchmark. Peak memory is each process's maximum resident set (`/usr/bin/time`). The table
gives, per model, the median over rounds of each tool's time and memory and their ratios.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(argv, cwd=None):
    """Runs argv under /usr/bin/time; returns (wall seconds, peak RSS in MB)."""
    with tempfile.NamedTemporaryFile(suffix=".rss") as f:
        t = time.perf_counter()
        r = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", f.name, *argv], cwd=cwd, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if r.returncode != 0:
            sys.exit(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
        return wall, int(open(f.name).read().split()[-1]) / 1024


def bert_base(work):
    """Exports bert_base.onnx and its calibration folder into `work` once."""
    model, calib = os.path.join(work, "bert_base.onnx"), os.path.join(work, "bert_base_calib")
    if not os.path.exists(model):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts/export_bert.py"), work, "--base"], check=True)
    if not os.path.exists(os.path.join(calib, "manifest.json")):
        data = np.load(os.path.join(work, "bert_base_inputs.npz"))
        names = list(data.keys())
        samples = []
        for i in range(data[names[0]].shape[0]):
            d = os.path.join(calib, f"{i:05d}")
            os.makedirs(d, exist_ok=True)
            for n in names:
                np.save(os.path.join(d, n + ".npy"), data[n][i:i + 1])
            samples.append(f"{i:05d}")
        inputs = [{"name": n, "file": n + ".npy", "dtype": str(data[n].dtype), "shape": [1, data[n].shape[1]], "shapes": None} for n in names]
        with open(os.path.join(calib, "manifest.json"), "w") as f:
            json.dump({"format": "qeval-calib-v1", "model": "bert_base", "num_samples": len(samples), "inputs": inputs, "samples": samples}, f, indent=1)
    return model, calib


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qforge", default=os.path.join(ROOT, "target/release/qforge"))
    ap.add_argument("--shared", default=os.path.join(ROOT, "../shared"), help="the public benchmark's parent folder")
    ap.add_argument("--models", default="bert_base", help="built-in models (bert_base), comma-separated; '' for none")
    ap.add_argument("--model", action="append", default=[], help="NAME=MODEL.onnx:CALIB_DIR (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/qforge-bench/quantize_time"))
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    models = {}
    for name in filter(None, args.models.split(",")):
        if name != "bert_base":
            sys.exit(f"unknown built-in model {name!r}; give other models with --model NAME=MODEL.onnx:CALIB_DIR")
        models[name] = bert_base(args.work)
    for spec in args.model:
        name, _, rest = spec.partition("=")
        path, _, calib = rest.rpartition(":")
        models[name] = (os.path.abspath(path), os.path.abspath(calib))
    if not models:
        sys.exit("no models")
    rows = []
    for name, (model, calib) in models.items():
        out = os.path.join(args.work, name)
        os.makedirs(out, exist_ok=True)
        qf, ort = [], []
        for r in range(args.rounds):
            def run_qforge():
                qf.append(timed([args.qforge, "quantize", model, "-o", os.path.join(out, "qforge.onnx"), "--calibration-data", calib]))

            def run_ort():
                report = os.path.join(out, "ort.json")
                wall, rss = timed([sys.executable, "-m", "bench.quantizers", "ort", "--method", "minmax", "--input", model,
                                   "--output", os.path.join(out, "ort.onnx"), "--calib-dir", calib,
                                   "--workdir", os.path.join(out, "ort-work"), "--report", report], cwd=args.shared)
                ort.append((json.load(open(report))["total_s"], rss, wall))

            for step in ((run_qforge, run_ort) if r % 2 == 0 else (run_ort, run_qforge)):
                step()
            print(f"{name} round {r + 1}: qforge {qf[-1][0]:.2f} s, {qf[-1][1]:.0f} MB; ORT MinMax {ort[-1][0]:.2f} s "
                  f"(process {ort[-1][2]:.2f} s), {ort[-1][1]:.0f} MB", flush=True)
        t_q, m_q = statistics.median(x[0] for x in qf), statistics.median(x[1] for x in qf)
        t_o, m_o = statistics.median(x[0] for x in ort), statistics.median(x[1] for x in ort)
        rows.append((name, t_q, t_o, t_q / t_o, m_q, m_o, m_q / m_o, [q[0] / o[0] for q, o in zip(qf, ort)]))
    print(f"\n| model | qforge s | ORT MinMax s | time ratio | qforge MB | ORT MB | memory ratio | per-round time ratios |")
    print("|---|---|---|---|---|---|---|---|")
    for name, t_q, t_o, rt, m_q, m_o, rm, per in rows:
        print(f"| {name} | {t_q:.2f} | {t_o:.2f} | {rt:.3f} | {m_q:.0f} | {m_o:.0f} | {rm:.2f} | {', '.join(f'{x:.3f}' for x in per)} |")


if __name__ == "__main__":
    main()
