"""Is an accuracy difference on the public benchmark more than noise? Re-measure it on fresh data.

The public benchmark scores its classifiers on fixed sets (ocr_cls: 600 lines, orientation: 400
pages), where one sample is 0.17 or 0.25 points. This script draws a larger evaluation set with
the benchmark's own generators and a seed of your choice (the text still comes from the
evaluation half of the corpus, never the calibration half), runs the float model and every
model given, and compares each model with a reference model sample by sample: accuracy, mean
absolute probability difference to float, the two discordant counts, and the exact two-sided
McNemar p-value (a binomial test on the discordant samples).

    PYTHONPATH=../shared .venv-bench/bin/python bench/paired_eval.py --task orientation \
        --n 4000 --seed 7 --reference qforge \
        qforge=$EVAL_CACHE/quant/full/qforge/orientation/orientation.onnx \
        ort-percentile=$EVAL_CACHE/quant/full/ort-percentile/orientation/orientation.onnx

Quantized models are typically the ones `bench.run` left in its cache.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from bench import tasks as T
from bench.common import make_session


def mcnemar_p(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p-value: P(a binomial(n, 1/2) is as unbalanced as observed)."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


def fresh_inputs(task, n: int, seed: int):
    """(input array, label) pairs drawn by the task's own generator from its evaluation text."""
    for item, label in task._data("eval", n, seed):
        yield (item if isinstance(task, T.Orientation) else task.preprocess(item)), label


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", required=True, choices=["ocr_cls", "orientation"])
    ap.add_argument("--n", type=int, default=4000, help="fresh evaluation samples")
    ap.add_argument("--seed", type=int, default=7, help="generator seed (the benchmark's own sets use 102/103)")
    ap.add_argument("--reference", required=True, help="label of the model every other one is compared with")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("models", nargs="+", metavar="LABEL=MODEL.onnx")
    args = ap.parse_args(argv)

    models = dict(m.split("=", 1) for m in args.models)
    if args.reference not in models:
        sys.exit(f"--reference {args.reference!r} is not one of the models given: {', '.join(models)}")
    task = T.TASKS[args.task]()
    models = {"float": str(task.model_path()), **models}
    sessions = {k: make_session(p, task.eval_threads) for k, p in models.items()}
    probs = {k: [] for k in models}
    labels = []
    for i, (x, label) in enumerate(fresh_inputs(task, args.n, args.seed), 1):
        labels.append(label)
        for k, s in sessions.items():
            probs[k].append(s.run(None, {s.get_inputs()[0].name: x})[0][0])
        if i % 500 == 0:
            print(f"  {i}/{args.n}", file=sys.stderr, flush=True)
    labels = np.array(labels)
    probs = {k: np.stack(v) for k, v in probs.items()}
    right = {k: p.argmax(1) == labels for k, p in probs.items()}

    ref = args.reference
    rows = []
    for k in models:
        row = {"model": k, "accuracy": float(right[k].mean()),
               "prob_mad_float": float(np.abs(probs[k] - probs["float"]).mean())}
        if k != ref:
            only_ref = int((right[ref] & ~right[k]).sum())
            only_k = int((right[k] & ~right[ref]).sum())
            row.update({f"only_{ref}_right": only_ref, "only_this_right": only_k,
                        "mcnemar_p": mcnemar_p(only_ref, only_k)})
        rows.append(row)
    if args.json:
        print(json.dumps({"task": args.task, "n": args.n, "seed": args.seed, "reference": ref, "models": rows}, indent=1))
        return
    print(f"{args.task}: {args.n} fresh samples (seed {args.seed}), each model against {ref}")
    print(f"| model | accuracy | prob. diff. to float | only {ref} right | only this right | McNemar p |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        tail = (f"{r[f'only_{ref}_right']} | {r['only_this_right']} | {r['mcnemar_p']:.3f}"
                if "mcnemar_p" in r else "– | – | –")
        print(f"| {r['model']} | {r['accuracy']:.4f} | {r['prob_mad_float']:.4f} | {tail} |")


if __name__ == "__main__":
    main()
