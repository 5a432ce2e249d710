"""Exports models/bert_tiny.onnx: a small BERT-class encoder (2 layers, hidden 128, 4 heads,
intermediate 512, vocab 1024, 128 positions, token types, attention mask, GELU via erf,
LayerNorm, mean-pooled sentence embedding), seeded random weights, exported by PyTorch at
opset 17, plus sample inputs in models/bert_tiny_inputs.npz.

With `--base`, exports BERT-base's dimensions instead (12 layers, hidden 768, 12 heads,
intermediate 3072, vocab 30522, 512 positions; 435 MB) as bert_base.onnx, with 32 sample
sentences of 128 tokens in bert_base_inputs.npz: the transformer of bench/quantize_time.py.

Needs torch (not part of the test venv; the bench venv has it):
    /path/to/venv-with-torch/bin/python scripts/export_bert.py models [--base]
"""
import math
import os
import sys

import numpy as np
import torch
from torch import nn

torch.manual_seed(0)
BASE = "--base" in sys.argv[2:]
NAME = "bert_base" if BASE else "bert_tiny"
VOCAB, HIDDEN, HEADS, INTER, LAYERS, POS = (30522, 768, 12, 3072, 12, 512) if BASE else (1024, 128, 4, 512, 2, 128)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.attn_out = nn.Linear(HIDDEN, HIDDEN)
        self.attn_norm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.intermediate = nn.Linear(HIDDEN, INTER)
        self.output = nn.Linear(INTER, HIDDEN)
        self.out_norm = nn.LayerNorm(HIDDEN, eps=1e-12)

    def forward(self, x, mask):
        b, t, _ = x.shape
        split = lambda y: y.view(b, t, HEADS, HIDDEN // HEADS).transpose(1, 2)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(HIDDEN // HEADS) + mask
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, HIDDEN)
        x = self.attn_norm(x + self.attn_out(ctx))
        h = nn.functional.gelu(self.intermediate(x))
        return self.out_norm(x + self.output(h))


class Bert(nn.Module):
    def __init__(self):
        super().__init__()
        self.word = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Embedding(POS, HIDDEN)
        self.token_type = nn.Embedding(2, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])

    def forward(self, input_ids, attention_mask, token_type_ids):
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device).unsqueeze(0)
        x = self.norm(self.word(input_ids) + self.position(pos) + self.token_type(token_type_ids))
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.layers:
            x = layer(x, mask)
        m = attention_mask.unsqueeze(-1).to(x.dtype)
        return x, (x * m).sum(1) / m.sum(1)


out = sys.argv[1]
model = Bert().eval()
for p in model.parameters():
    nn.init.normal_(p, std=0.05) if p.dim() > 1 else nn.init.normal_(p, std=0.02)
rng = np.random.default_rng(0)
batch, seq = (32, 128) if BASE else (2, 16)
ids = torch.tensor(rng.integers(1, VOCAB, (batch, seq)), dtype=torch.int64)
mask = torch.ones(batch, seq, dtype=torch.int64)
mask[1::2, seq * 3 // 4:] = 0
types = torch.zeros(batch, seq, dtype=torch.int64)
types[:, seq // 2:] = 1
path = os.path.join(out, f"{NAME}.onnx")
torch.onnx.export(model, (ids, mask, types), path, opset_version=17, dynamo=False,
                  input_names=["input_ids", "attention_mask", "token_type_ids"],
                  output_names=["last_hidden_state", "sentence_embedding"],
                  dynamic_axes={n: {0: "batch", 1: "sequence"} for n in ["input_ids", "attention_mask", "token_type_ids"]}
                  | {"last_hidden_state": {0: "batch", 1: "sequence"}, "sentence_embedding": {0: "batch"}})
np.savez(os.path.join(out, f"{NAME}_inputs.npz"), input_ids=ids.numpy(), attention_mask=mask.numpy(), token_type_ids=types.numpy())
print("wrote", path, os.path.getsize(path), "bytes")
