"""The ops ONNX Runtime's CPU provider runs for a model, after its default graph optimizations.

    python scripts/oracle/ort_fused_ops.py MODEL.onnx

Prints JSON mapping each node name of the optimized main graph to its op type (`domain::op`
outside the default domain), e.g. a MatMul that ONNX Runtime fused with the DequantizeLinear of
its weight into `com.microsoft::MatMulNBits`.
"""
import json
import os
import sys
import tempfile

import onnx
import onnxruntime as ort


def main():
    with tempfile.TemporaryDirectory() as tmp:
        optimized = os.path.join(tmp, "optimized.onnx")
        opts = ort.SessionOptions()
        opts.optimized_model_filepath = optimized
        opts.log_severity_level = 3
        ort.InferenceSession(sys.argv[1], opts, providers=["CPUExecutionProvider"])
        graph = onnx.load(optimized).graph
    ops = {n.name: (n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}") for n in graph.node}
    print(json.dumps(ops))


if __name__ == "__main__":
    main()
