"""Streams audio through a silero-vad model in ONNX Runtime the way silero's `OnnxWrapper`
does at 16 kHz: 512-sample chunks, each prefixed with the previous 64 samples of context, the
recurrent state carried from chunk to chunk.

    python scripts/oracle/silero_stream.py MODEL.onnx AUDIO.npy -o PROBS.npy
"""
import argparse

import numpy as np
import onnxruntime as ort

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("audio")
p.add_argument("-o", "--output", required=True)
args = p.parse_args()
opts = ort.SessionOptions()
opts.intra_op_num_threads = 1
opts.inter_op_num_threads = 1
sess = ort.InferenceSession(args.model, opts, providers=["CPUExecutionProvider"])
audio = np.load(args.audio).astype(np.float32)
state = np.zeros((2, 1, 128), dtype=np.float32)
context = np.zeros((1, 64), dtype=np.float32)
sr = np.array(16000, dtype=np.int64)
probs = []
for start in range(0, len(audio) - 511, 512):
    chunk = audio[start:start + 512][None, :]
    x = np.concatenate([context, chunk], axis=1)
    out, state = sess.run(None, {"input": x, "state": state, "sr": sr})
    context = x[:, -64:]
    probs.append(float(out[0, 0]))
np.save(args.output, np.array(probs, dtype=np.float32))
