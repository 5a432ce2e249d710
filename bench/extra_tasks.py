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


M.MODELS["ocr_rec"] = ocr_rec
T.TASKS["ocr_rec"] = OcrRec
for _name, _file in [("silero_vad_default", "silero_vad.onnx"), ("silero_vad_op18_ifless", "silero_vad_op18_ifless.onnx"),
                     ("silero_vad_half", "silero_vad_half.onnx"), ("silero_vad_openvino", "silero_vad_openvino_16k.onnx")]:
    T.TASKS[_name] = silero_export(_name, _file)
    M.MODELS[_name] = T.TASKS[_name]().model_path

if __name__ == "__main__":
    R.main(sys.argv[1:])
