"""ONNX's own model checker with full checking (strict shape inference) on each model.

    python scripts/oracle/onnx_check.py MODEL.onnx [MODEL.onnx ...]

Prints `ok PATH opset N` or `FAIL PATH: reason` per model; exits 1 if any model fails.
"""
import sys

import onnx

failed = False
for path in sys.argv[1:]:
    try:
        m = onnx.load(path)
        onnx.checker.check_model(m, full_check=True)
        opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), None)
        print(f"ok {path} opset {opset}")
    except Exception as e:  # noqa: BLE001 - report any checker failure per file
        failed = True
        print(f"FAIL {path}: {e}")
sys.exit(1 if failed else 0)
