"""qforge's f32 runtime against ONNX Runtime (CPU EP, all optimizations) on the real models,
1 and 2 threads, in one run.

    .cache/venv/bin/python bench/runtime_f32.py --qforge target/release/qforge [--rounds 3] [--runs 10]
    .cache/venv/bin/python bench/runtime_f32.py --qforge before=OLD --qforge after=NEW

Rounds interleave the engines (one or more qforge binaries, each `LABEL=PATH` or a path) and
thread counts; the table shows, per model, thread count and qforge binary, the median over
rounds of each round's median latency, and qforge / ORT, then the fastest single run of each
engine and their ratio (less sensitive to other load on the machine).
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

import numpy as np
import onnxruntime as ort

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("QFORGE_CACHE", os.path.join(ROOT, ".cache"))
# The shapes the bench harness in ../shared/bench times (one representative input each).
MODELS = {
    "ocr_det": {"x": (1, 3, 736, 928)},
    "ocr_rec": {"x": (1, 3, 48, 320)},
    "ocr_cls": {"x": (1, 3, 48, 192)},
    "orientation": {"x": (1, 3, 224, 224)},
    "silero_vad_16k_op15": {"input": (1, 576), "state": (2, 1, 128), "sr": 16000},
    "bert_tiny": {"input_ids": ("ids", 1, 128), "attention_mask": ("ones", 1, 128), "token_type_ids": ("zeros", 1, 128)},
}
# Models committed to the repository rather than fetched into the cache.
COMMITTED = {"bert_tiny"}


def inputs_for(spec):
    rng = np.random.default_rng(0)
    feed = {}
    for name, s in spec.items():
        if isinstance(s, int):
            feed[name] = np.array(s, dtype=np.int64)
        elif isinstance(s[0], str):
            kind, shape = s[0], s[1:]
            feed[name] = {"ids": rng.integers(1, 1000, shape), "ones": np.ones(shape), "zeros": np.zeros(shape)}[kind].astype(np.int64)
        else:
            feed[name] = rng.random(s, dtype=np.float32)
    return feed


def ort_median(path, feed, threads, runs):
    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    o.inter_op_num_threads = 1
    o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    s = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])
    for _ in range(3):
        s.run(None, feed)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        s.run(None, feed)
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times)), float(np.min(times))


def qforge_median(tool, path, files, threads, runs):
    cmd = [tool, "bench", path, "--threads", str(threads), "--runs", str(runs), "--warmup", "3", "--json"]
    for name, f in files.items():
        cmd += ["--input", f"{name}={f}"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return out["median_ms"], out["min_ms"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--qforge", required=True, action="append", help="LABEL=PATH or PATH; repeat to compare binaries")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--models", default=",".join(MODELS))
    args = p.parse_args()
    tools = [q.split("=", 1) if "=" in q else ["qforge", q] for q in args.qforge]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = os.path.join(ROOT if name in COMMITTED else CACHE, "models", f"{name}.onnx")
            feed = inputs_for(MODELS[name])
            files = {}
            for k, v in feed.items():
                files[k] = os.path.join(tmp, f"{name}_{k}.npy")
                np.save(files[k], v)
            for threads in (1, 2):
                q, o = {label: [] for label, _ in tools}, []
                for _ in range(args.rounds):
                    for label, tool in tools:
                        q[label].append(qforge_median(tool, path, files, threads, args.runs))
                    o.append(ort_median(path, feed, threads, args.runs))
                for label, _ in tools:
                    rows.append((name, threads, label, float(np.median([x[0] for x in q[label]])), float(np.median([x[0] for x in o])),
                                 min(x[1] for x in q[label]), min(x[1] for x in o)))
    print(f"{'model':<22} {'threads':>7} {'qforge':>8} {'qforge ms':>10} {'ORT ms':>9} {'ratio':>7} {'qf best':>9} {'ORT best':>9} {'ratio':>7}")
    for name, t, label, q, o, qb, ob in rows:
        print(f"{name:<22} {t:>7} {label:>8} {q:>10.2f} {o:>9.2f} {q / o:>7.2f} {qb:>9.2f} {ob:>9.2f} {qb / ob:>7.2f}")
    print(json.dumps([{"model": n, "threads": t, "qforge": label, "qforge_ms": q, "ort_ms": o, "ratio": q / o, "qforge_best_ms": qb, "ort_best_ms": ob}
                      for n, t, label, q, o, qb, ob in rows]))


if __name__ == "__main__":
    main()
