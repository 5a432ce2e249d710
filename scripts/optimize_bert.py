"""Makes the transformer-optimized variants of models/bert_tiny.onnx that the tests run: the
model fused by ONNX Runtime's transformer optimizer (onnxruntime.transformers.optimizer) into
ONNX Runtime's com.microsoft operators.

* bert_tiny_ort_opt.onnx: the optimizer's defaults for BERT: EmbedLayerNormalization (whose
  mask_index output holds each sequence's length), Attention (packed Q/K/V weights, 1-D
  mask_index), SkipLayerNormalization (with bias), BiasGelu.
* bert_tiny_ort_opt_mha.onnx: --use_multi_head_attention --use_raw_attention_mask
  --enable_gelu_approximation --disable_embed_layer_norm: MultiHeadAttention (Q/K/V MatMuls
  outside, 2-D 0/1 key_padding_mask), FastGelu (with bias), SkipLayerNormalization.

Both keep the source model's inputs and outputs. The optimizer runs with opt_level 0 (its
Python fusions only: ONNX Runtime's own graph optimizations would need torch) and needs
sympy, which the test venv does not have, so the models are committed rather than made by
the tests:

    python -m venv /tmp/ortopt && /tmp/ortopt/bin/pip install onnxruntime sympy
    /tmp/ortopt/bin/python scripts/optimize_bert.py models

(Made with onnxruntime 1.31.1 and sympy 1.14.0.)
"""
import os
import sys

from onnxruntime.transformers.fusion_options import FusionOptions
from onnxruntime.transformers.optimizer import optimize_model

HEADS, HIDDEN = 4, 128


def optimize(src, dst, configure):
    options = FusionOptions("bert")
    configure(options)
    model = optimize_model(src, model_type="bert", num_heads=HEADS, hidden_size=HIDDEN, optimization_options=options, opt_level=0)
    model.save_model_to_file(dst)
    ops = sorted({(n.domain, n.op_type) for n in model.model.graph.node if n.domain == "com.microsoft"})
    print(dst, ", ".join(op for _, op in ops))


def mha(options):
    options.use_multi_head_attention = True
    options.use_raw_attention_mask(True)
    options.enable_gelu_approximation = True
    options.enable_embed_layer_norm = False


def main(out_dir):
    src = os.path.join(out_dir, "bert_tiny.onnx")
    optimize(src, os.path.join(out_dir, "bert_tiny_ort_opt.onnx"), lambda options: None)
    optimize(src, os.path.join(out_dir, "bert_tiny_ort_opt_mha.onnx"), mha)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "models")
