"""Runs two ONNX models in ONNX Runtime on identical inputs and checks that every output is
bit-identical (the same bytes; NaNs in the same places count as equal).

    python scripts/oracle/roundtrip_ort.py A.onnx B.onnx [--shape NAME=D0,D1,...] [--value NAME=V]

Inputs come from A's declared types: float inputs are seeded normal noise, integer inputs
zeros unless --value gives a scalar value; dynamic dimensions need --shape (else 1).
Prints a JSON summary; exits 1 if any output differs.
"""
import argparse
import json
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

p = argparse.ArgumentParser()
p.add_argument("a")
p.add_argument("b")
p.add_argument("--shape", action="append", default=[])
p.add_argument("--value", action="append", default=[])
args = p.parse_args()
shapes = {k: [int(d) for d in v.split(",")] for k, v in (s.split("=", 1) for s in args.shape)}
values = dict(s.split("=", 1) for s in args.value)

model = onnx.load(args.a, load_external_data=False)
inits = {i.name for i in model.graph.initializer}
rng = np.random.default_rng(1234)
feed = {}
for vi in model.graph.input:
    if vi.name in inits:
        continue
    t = vi.type.tensor_type
    dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
    shape = shapes.get(vi.name) or [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 for d in t.shape.dim]
    if vi.name in values:
        feed[vi.name] = np.full(shape, values[vi.name], dtype=dtype)
    elif np.issubdtype(dtype, np.floating):
        feed[vi.name] = rng.standard_normal(shape).astype(dtype)
    else:
        feed[vi.name] = np.zeros(shape, dtype=dtype)

opts = ort.SessionOptions()
opts.intra_op_num_threads = 1
outs = [ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"]).run(None, feed) for path in (args.a, args.b)]
diffs = []
for i, (x, y) in enumerate(zip(*outs)):
    x, y = np.asarray(x), np.asarray(y)
    same = x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()
    if not same and np.issubdtype(x.dtype, np.floating) and x.shape == y.shape:
        same = bool(np.array_equal(x, y, equal_nan=True))
    if not same:
        diffs.append(i)
print(json.dumps({"outputs": len(outs[0]), "differing": diffs}))
sys.exit(1 if diffs or len(outs[0]) != len(outs[1]) else 0)
