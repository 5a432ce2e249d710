"""Runs a model in ONNX Runtime (CPU EP) and saves its outputs.

    python scripts/oracle/ort_run.py MODEL.onnx -o OUT.npz --input NAME=FILE.npy ... [--threads N] [--no-opt]
        [--ops OPS.txt]

Outputs are saved under their graph output names, a sequence's items as NAME[0], NAME[1], ...
(an empty optional is left out). --no-opt disables graph optimizations. --ops writes the op type
of every node of the graph ONNX Runtime runs after its fusions, one per line (which QDQ groups
became integer kernels).
"""
import argparse
import os
import tempfile

import numpy as np
import onnxruntime as ort

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("-o", "--output", required=True)
p.add_argument("--input", action="append", default=[])
p.add_argument("--threads", type=int, default=1)
p.add_argument("--no-opt", action="store_true")
p.add_argument("--ops")
args = p.parse_args()
opts = ort.SessionOptions()
opts.intra_op_num_threads = args.threads
if args.no_opt:
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
optimized = None
if args.ops:
    # Extended: every QDQ fusion, without the layout transforms tied to this CPU.
    if not args.no_opt:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    optimized = os.path.join(tempfile.mkdtemp(), "optimized.onnx")
    opts.optimized_model_filepath = optimized
sess = ort.InferenceSession(args.model, opts, providers=["CPUExecutionProvider"])
if optimized:
    import onnx

    with open(args.ops, "w") as f:
        f.writelines(n.op_type + "\n" for n in onnx.load(optimized).graph.node)
feed = {k: np.load(v) for k, v in (s.split("=", 1) for s in args.input)}
names = [o.name for o in sess.get_outputs()]
outs = sess.run(names, feed)
arrays = {}
for name, out in zip(names, outs):
    if isinstance(out, list):  # a sequence: its items as name[0], name[1], ...
        arrays.update({f"{name}[{i}]": item for i, item in enumerate(out)})
    elif out is not None:  # None: an empty optional
        arrays[name] = out
np.savez(args.output, **arrays)
