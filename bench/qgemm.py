"""Single-thread int8 GEMM throughput of qforge against ONNX Runtime (CPU EP), in one run.

    cargo build --release -p qforge-runtime --example qgemm_bench
    .cache/venv/bin/python bench/qgemm.py [--bench target/release/examples/qgemm_bench] [--rounds 3] [--runs 20] [--conv]

For each shape (M x K x N: A is M x K uint8 activations, B is K x N int8 constant weights)
it times, on one thread:

* qforge's GEMM alone (`qgemm_bench gemm`: prepacked B, int32 C),
* qforge's MatMulInteger and QLinearMatMul kernels (a one-node model in a 1-thread Session),
* ONNX Runtime's MatMulInteger and QLinearMatMul (the same models, intra_op_num_threads=1,
  all graph optimizations).

Rounds interleave the engines; each cell is the median over rounds of each round's median
(GOP/s = 2 M N K / time). Ratios are qforge / ONNX Runtime on the same op. The peak is
measured by `qgemm_bench peak` (clock from a dependent add chain, vpdpbusd throughput from a
tight loop), and "% peak" is the best qforge number of the row over that peak. Wall-clock
times are reported; the machine is shared, so the CPU-time medians are printed too (time the
core spent on other processes does not count there).

`--conv` adds QLinearConv layers (NCHW, u8 activations, per-channel symmetric i8 weights,
int32 bias), qforge against ONNX Runtime, GOP/s counting 2 * M * (C/group) * kh * kw * OH * OW.
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (M, K, N): large products, then convolution-like ones (M = output pixels, K = C*kh*kw,
# N = output channels).
# QLinearConv layers: (C, M, H, W, kernel, stride, group); padding kernel // 2.
CONVS = [
    (32, 64, 56, 56, 3, 1, 1),
    (64, 128, 56, 56, 1, 1, 1),
    (128, 128, 28, 28, 3, 2, 1),
    (3, 32, 224, 224, 3, 2, 1),
    (64, 64, 56, 56, 3, 1, 64),
    (128, 128, 56, 56, 3, 2, 128),
]
SHAPES = [
    (1024, 1024, 1024),
    (512, 2048, 512),
    (512, 512, 2048),
    (3136, 288, 32),
    (3136, 576, 64),
    (3136, 576, 128),
    (12544, 288, 32),
]


def make_models(m, k, n, tmp):
    rng = np.random.default_rng(m * 31 + k * 7 + n)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    a_info = helper.make_tensor_value_info("A", TensorProto.UINT8, [m, k])
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(np.array(128, np.uint8), "a_zp"), numpy_helper.from_array(np.array(0, np.int8), "b_zp")]
    mi = helper.make_graph([helper.make_node("MatMulInteger", ["A", "B", "a_zp", "b_zp"], ["Y"])], "mi", [a_info],
                           [helper.make_tensor_value_info("Y", TensorProto.INT32, [m, n])], inits)
    scales = [numpy_helper.from_array(np.array(v, np.float32), name) for name, v in [("a_s", 0.02), ("b_s", 0.004), ("y_s", 0.5)]]
    qm = helper.make_graph([helper.make_node("QLinearMatMul", ["A", "a_s", "a_zp", "B", "b_s", "b_zp", "y_s", "y_zp"], ["Y"])], "qm", [a_info],
                           [helper.make_tensor_value_info("Y", TensorProto.UINT8, [m, n])],
                           inits + scales + [numpy_helper.from_array(np.array(128, np.uint8), "y_zp")])
    paths = {}
    for name, g in [("MatMulInteger", mi), ("QLinearMatMul", qm)]:
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=9)
        p = os.path.join(tmp, f"{name}_{m}x{k}x{n}.onnx")
        onnx.save(model, p)
        paths[name] = p
    return paths


def make_conv(c, m, h, w, k, stride, group, tmp):
    rng = np.random.default_rng(c * 7 + m + h + k)
    pad = k // 2
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    inits = [
        numpy_helper.from_array(np.array(0.02, np.float32), "xs"), numpy_helper.from_array(np.array(128, np.uint8), "xz"),
        numpy_helper.from_array(rng.integers(-128, 128, (m, c // group, k, k)).astype(np.int8), "W"),
        numpy_helper.from_array(rng.uniform(0.001, 0.01, (m,)).astype(np.float32), "ws"), numpy_helper.from_array(np.zeros((m,), np.int8), "wz"),
        numpy_helper.from_array(np.array(0.3, np.float32), "ys"), numpy_helper.from_array(np.array(100, np.uint8), "yz"),
        numpy_helper.from_array(rng.integers(-1000, 1000, (m,)).astype(np.int32), "bias"),
    ]
    node = helper.make_node("QLinearConv", ["A", "xs", "xz", "W", "ws", "wz", "ys", "yz", "bias"], ["Y"], pads=[pad] * 4, strides=[stride] * 2, group=group, kernel_shape=[k, k])
    g = helper.make_graph([node], "conv", [helper.make_tensor_value_info("A", TensorProto.UINT8, [1, c, h, w])],
                          [helper.make_tensor_value_info("Y", TensorProto.UINT8, [1, m, oh, ow])], inits)
    p = os.path.join(tmp, f"conv_{c}_{m}_{h}_{k}_{stride}_{group}.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=9), p)
    return p, 2.0 * m * (c // group) * k * k * oh * ow


def ort_time(path, runs):
    o = ort.SessionOptions()
    o.intra_op_num_threads = 1
    o.inter_op_num_threads = 1
    o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    s = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])
    shape = s.get_inputs()[0].shape
    feed = {"A": np.random.default_rng(1).integers(0, 256, shape).astype(np.uint8)}
    for _ in range(3):
        s.run(None, feed)
    wall, cpu = [], []
    for _ in range(runs):
        t, c = time.perf_counter(), time.process_time()
        s.run(None, feed)
        wall.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    return float(np.median(wall)), float(np.median(cpu))


def qforge_time(bench, args, runs):
    out = subprocess.run([bench, *args, "--runs", str(runs)], check=True, capture_output=True, text=True).stdout
    r = json.loads(out)
    return r["median_ms"], r["cpu_median_ms"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bench", default=os.path.join(ROOT, "target/release/examples/qgemm_bench"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--shapes", default="", help="M,K,N;M,K,N;... (default: the built-in list)")
    p.add_argument("--conv", action="store_true", help="also time QLinearConv layers")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")] if args.shapes else SHAPES
    peak = json.loads(subprocess.run([args.bench, "peak"], check=True, capture_output=True, text=True).stdout)
    engines = ["qforge gemm", "qforge MatMulInteger", "ORT MatMulInteger", "qforge QLinearMatMul", "ORT QLinearMatMul"]
    times = {(s, e): [] for s in shapes for e in engines}
    conv_times = {cv: {"qforge": [], "ORT": []} for cv in CONVS} if args.conv else {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {s: make_models(*s, tmp) for s in shapes}
        convs = {cv: make_conv(*cv, tmp) for cv in conv_times}
        for _ in range(args.rounds):
            for cv, (path, _) in convs.items():
                conv_times[cv]["ORT"].append(ort_time(path, args.runs))
                conv_times[cv]["qforge"].append(qforge_time(args.bench, ["session", path], args.runs))
            for s in shapes:
                m, k, n = s
                times[(s, "qforge gemm")].append(qforge_time(args.bench, ["gemm", str(m), str(k), str(n)], args.runs))
                for op in ["MatMulInteger", "QLinearMatMul"]:
                    times[(s, f"ORT {op}")].append(ort_time(models[s][op], args.runs))
                    times[(s, f"qforge {op}")].append(qforge_time(args.bench, ["session", models[s][op]], args.runs))
    print(f"peak: clock {peak['clock_ghz']:.2f} GHz (measured; /proc/cpuinfo says {peak['cpuinfo_mhz']} MHz), "
          f"{peak['vpdpbusd_zmm_per_cycle']:.2f} vpdpbusd zmm/cycle -> {peak['peak_gops']:.0f} GOP/s")
    print(f"single thread, GOP/s = 2MNK / median time (median of {args.rounds} rounds x {args.runs} runs); wall clock [CPU time]\n")
    head = f"{'M x K x N':>18} | {'qforge gemm':>13} | {'qf MatMulInt':>13} | {'ORT MatMulInt':>13} | {'ratio':>5} | {'qf QLinearMM':>13} | {'ORT QLinearMM':>13} | {'ratio':>5} | {'% peak':>6}"
    print(head)
    print("-" * len(head))
    for s in shapes:
        m, k, n = s
        ops = 2.0 * m * k * n
        g = {}
        for e in engines:
            wall = float(np.median([t[0] for t in times[(s, e)]]))
            cpu = float(np.median([t[1] for t in times[(s, e)]]))
            g[e] = (ops / wall / 1e6, ops / cpu / 1e6)
        cell = lambda e: f"{g[e][0]:5.0f} [{g[e][1]:5.0f}]"
        r1 = g["qforge MatMulInteger"][0] / g["ORT MatMulInteger"][0]
        r2 = g["qforge QLinearMatMul"][0] / g["ORT QLinearMatMul"][0]
        best = max(g[e][0] for e in engines if e.startswith("qforge"))
        print(f"{f'{m} x {k} x {n}':>18} | {cell('qforge gemm')} | {cell('qforge MatMulInteger')} | {cell('ORT MatMulInteger')} | {r1:5.2f} | "
              f"{cell('qforge QLinearMatMul')} | {cell('ORT QLinearMatMul')} | {r2:5.2f} | {100 * best / peak['peak_gops']:5.0f}%")
    if conv_times:
        print(f"\n{'QLinearConv C,M,HxW,k,s,group':>32} | {'qforge ms':>15} | {'ORT ms':>15} | {'qforge GOP/s':>12} | {'ratio':>5}")
        for cv, t in conv_times.items():
            ops = convs[cv][1]
            q = [float(np.median([x[i] for x in t["qforge"]])) for i in (0, 1)]
            o = [float(np.median([x[i] for x in t["ORT"]])) for i in (0, 1)]
            c, m, h, w, k, st, g = cv
            print(f"{f'{c},{m},{h}x{w},{k},{st},{g}':>32} | {q[0]:6.3f} [{q[1]:6.3f}] | {o[0]:6.3f} [{o[1]:6.3f}] | {ops / q[0] / 1e6:12.0f} | {o[0] / q[0]:5.2f}")


if __name__ == "__main__":
    main()
