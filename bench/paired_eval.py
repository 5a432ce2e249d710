"""Is an accuracy difference on the public benchmark more than noise? Re-measure it on fresh data.

The public benchmark scores its models on fixed sets (ocr_cls: 600 lines, orientation: 400
pages, ocr_det: 100 pages of about 20 text boxes), where one sample is 0.17 or 0.25 points and
a few boxes move the detector's F1 by 0.005. This script draws a larger evaluation set with
the benchmark's own generators and a seed of your choice (the text still comes from the
evaluation half of the corpus, never the calibration half), runs the float model and every
model given, and compares each model with a reference model sample by sample:

- classifiers (`ocr_cls`, `orientation`): accuracy, mean absolute probability difference to
  float, the two discordant counts, and the exact two-sided McNemar p-value (a binomial test on
  the discordant samples);
- `ocr_det`: F1 of the benchmark's post-processed boxes against the ground truth and against
  the float model's boxes (pooled over pages, as the benchmark pools them), the F1 difference
  to the reference with a 95 % page-bootstrap interval, and the two-sided p-value of a paired
  randomization test (each page's counts swapped between the two models at random, 10000
  times).

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
    ap.add_argument("--task", required=True, choices=["ocr_cls", "orientation", "ocr_det"])
    ap.add_argument("--n", type=int, default=4000, help="fresh evaluation samples")
    ap.add_argument("--seed", type=int, default=7, help="generator seed (the benchmark's own sets use 102/103/104)")
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
    if isinstance(task, T.OcrDet):
        return detector(task, sessions, args)
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
    emit(args, rows, {}, f"{args.n} fresh samples (seed {args.seed})",
         ["model", "accuracy", "prob. diff. to float", f"only {ref} right", "only this right", "McNemar p"],
         lambda r: [r["model"], f"{r['accuracy']:.4f}", f"{r['prob_mad_float']:.4f}"]
         + ([str(r[f"only_{ref}_right"]), str(r["only_this_right"]), f"{r['mcnemar_p']:.3f}"] if "mcnemar_p" in r else ["–"] * 3))


def emit(args, rows, extra, what, columns, cells):
    """Prints the rows as JSON (with `extra` fields) or as a Markdown table of `cells(row)`."""
    if args.json:
        print(json.dumps({"task": args.task, "n": args.n, "seed": args.seed, "reference": args.reference, **extra,
                          "models": rows}, indent=1))
        return
    print(f"{args.task}: {what}, each model against {args.reference}")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(cells(r)) + " |")


def f1(tp, nd, ng):
    """The benchmark's F1 from pooled counts (0 where there is nothing to match)."""
    return np.where(nd + ng > 0, 2.0 * tp / np.maximum(nd + ng, 1), 0.0)


def detector(task, sessions, args):
    """ocr_det on fresh pages: pooled F1 per model, and each model's F1 difference to the reference
    with a page-bootstrap interval and a paired randomization test."""
    from bench import datasets as D

    rng = np.random.default_rng(args.seed)
    sents = D.split_corpus("eval")
    counts = {k: [] for k in sessions}  # per page: (tp vs truth, detections, tp vs float's boxes, float's count)
    n_gt = []
    for i in range(1, args.n + 1):
        page = D.render_page(rng, sents)
        x = task.preprocess(page.image)
        truth = [T._box_to_quad(g) for g in page.boxes]
        dets = {}
        for k, s in sessions.items():
            dets[k] = task.postprocess(s.run(None, {s.get_inputs()[0].name: x})[0], page.image.shape[:2])
        for k in sessions:
            tp, nd, ng = T.match_f1(dets[k], truth)
            ftp, _, fng = T.match_f1(dets[k], dets["float"])
            counts[k].append((tp, nd, ftp, fng))
        n_gt.append(len(truth))
        if i % 100 == 0:
            print(f"  {i}/{args.n}", file=sys.stderr, flush=True)
    ng = np.array(n_gt, np.float64)
    c = {k: np.array(v, np.float64) for k, v in counts.items()}
    ref = args.reference
    draws = np.random.default_rng(0)
    swap = draws.random((10000, args.n)) < 0.5
    boot = draws.integers(0, args.n, (10000, args.n))
    rows = []
    for k in sessions:
        tp, nd, ftp, fng = c[k].T
        row = {"model": k, "f1": float(f1(tp.sum(), nd.sum(), ng.sum())),
               "precision": float(tp.sum() / max(nd.sum(), 1)), "recall": float(tp.sum() / max(ng.sum(), 1)),
               "f1_vs_float": float(f1(ftp.sum(), nd.sum(), fng.sum()))}
        if k != ref:
            rtp, rnd = c[ref][:, 0], c[ref][:, 1]
            row["f1_minus_reference"] = row["f1"] - float(f1(rtp.sum(), rnd.sum(), ng.sum()))
            a_tp = np.where(swap, rtp, tp).sum(1)
            a_nd = np.where(swap, rnd, nd).sum(1)
            b_tp = tp.sum() + rtp.sum() - a_tp
            b_nd = nd.sum() + rnd.sum() - a_nd
            perm = f1(a_tp, a_nd, ng.sum()) - f1(b_tp, b_nd, ng.sum())
            extreme = int((np.abs(perm) >= abs(row["f1_minus_reference"]) - 1e-12).sum())
            row["randomization_p"] = (extreme + 1) / (len(perm) + 1)
            diff = f1(tp[boot].sum(1), nd[boot].sum(1), ng[boot].sum(1)) - \
                f1(rtp[boot].sum(1), rnd[boot].sum(1), ng[boot].sum(1))
            row["ci95"] = [float(np.percentile(diff, 2.5)), float(np.percentile(diff, 97.5))]
        rows.append(row)
    emit(args, rows, {"boxes": int(ng.sum())}, f"{args.n} fresh pages (seed {args.seed}, {int(ng.sum())} boxes)",
         ["model", "F1", "precision", "recall", "F1 vs float's boxes", f"F1 - {ref} (95 % CI)", "randomization p"],
         lambda r: [r["model"]] + [f"{r[k]:.4f}" for k in ("f1", "precision", "recall", "f1_vs_float")]
         + ([f"{r['f1_minus_reference']:+.4f} ({r['ci95'][0]:+.4f}, {r['ci95'][1]:+.4f})", f"{r['randomization_p']:.3f}"]
            if "ci95" in r else ["–"] * 2))


if __name__ == "__main__":
    main()
