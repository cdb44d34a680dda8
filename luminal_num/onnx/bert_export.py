"""all-MiniLM-L6-v2 (BERT + sentence-transformers mean pooling + L2 normalize) written as an ONNX file.

PyTorch is not a dependency, so this is not torch.onnx.export's output: it writes, from the model's
safetensors, the graph in the op forms that the TorchScript exporter emits at opset 17 for Hugging
Face's BertModel with dynamic (batch, sequence) axes: Linear as MatMul with a pre-transposed
initializer plus Add, Reshape targets built by Shape/Gather/Unsqueeze/Concat chains, position ids as
a Slice of the `position_ids` buffer bounded by Shape, the extended attention mask as
Unsqueeze/Cast/Sub/Mul, LayerNormalization, GELU as Div/Erf/Add/Mul/Mul, then the pooling module as
Unsqueeze/Expand/Cast/Mul/ReduceSum/Clip/Div and normalize as ReduceL2/Clip/Expand/Div.

`exact_scalars=True` writes the two irrational scale constants (sqrt(head_dim) and sqrt(2)) as Sqrt
nodes on exact constants instead of FP32 scalars, so the FP64 evaluation can be compared with the
project's own MiniLM graph (which uses the FP64 constants) bit for bit up to summation order.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..models.bert import MASKED_KEY_BIAS, BertConfig

OPSET = 17
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "sentence_embedding"


class _Writer:
    """Appends nodes with unique names and keeps the initializers."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs) -> list[str] | str:
        self.count += 1
        outs = [f"/{op_type}_{self.count}_output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=f"/{op_type}_{self.count}", **attrs))
        return outs[0] if n_out == 1 else outs

    def init(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def const(self, value, dtype=np.float32) -> str:
        arr = np.asarray(value, dtype=dtype)
        self.count += 1
        name = f"/Constant_{self.count}_output_0"
        self.nodes.append(helper.make_node("Constant", [], [name], name=f"/Constant_{self.count}",
                                           value=numpy_helper.from_array(arr)))
        return name

    def dim(self, x: str, axis: int) -> str:
        """Unsqueeze(Gather(Shape(x), axis)): one dim as a 1-element int64 tensor, as the exporter does."""
        d = self.op("Gather", [self.op("Shape", [x]), self.const(axis, np.int64)], axis=0)
        return self.op("Unsqueeze", [d, self.const([0], np.int64)])


def _linear(w: _Writer, x: str, weights: Mapping[str, np.ndarray], prefix: str) -> str:
    wt = w.init(f"onnx::MatMul_{prefix}", np.asarray(weights[f"{prefix}.weight"], np.float32).T)
    return w.op("Add", [w.init(f"{prefix}.bias", np.asarray(weights[f"{prefix}.bias"], np.float32)),
                        w.op("MatMul", [x, wt])])


def _layer_norm(w: _Writer, x: str, weights, prefix: str, eps: float) -> str:
    return w.op("LayerNormalization", [x, w.init(f"{prefix}.weight", weights[f"{prefix}.weight"]),
                                       w.init(f"{prefix}.bias", weights[f"{prefix}.bias"])], axis=-1, epsilon=eps)


def _scalar(w: _Writer, value: float, exact_of: float | None) -> str:
    """A float scale: an FP32 Constant (the exporter's form) or Sqrt(exact_of) computed in the graph."""
    return w.op("Sqrt", [w.const(exact_of)]) if exact_of is not None else w.const(value)


def _attention(w: _Writer, x: str, mask_bias: str, weights, prefix: str, cfg: BertConfig, exact: bool) -> str:
    heads, hd = cfg.num_attention_heads, cfg.head_dim
    b, s = w.dim(x, 0), w.dim(x, 1)
    split = w.op("Concat", [b, s, w.const([heads], np.int64), w.const([hd], np.int64)], axis=0)

    def heads_of(name: str, perm) -> str:
        return w.op("Transpose", [w.op("Reshape", [_linear(w, x, weights, f"{prefix}.self.{name}"), split])], perm=perm)

    q, k, v = heads_of("query", [0, 2, 1, 3]), heads_of("key", [0, 2, 3, 1]), heads_of("value", [0, 2, 1, 3])
    scale = _scalar(w, math.sqrt(hd), float(hd) if exact else None)
    scores = w.op("Add", [w.op("Div", [w.op("MatMul", [q, k]), scale]), mask_bias])
    ctx = w.op("Transpose", [w.op("MatMul", [w.op("Softmax", [scores], axis=-1), v])], perm=[0, 2, 1, 3])
    merged = w.op("Reshape", [ctx, w.op("Concat", [b, s, w.const([cfg.hidden_size], np.int64)], axis=0)])
    out = w.op("Add", [_linear(w, merged, weights, f"{prefix}.output.dense"), x])
    return _layer_norm(w, out, weights, f"{prefix}.output.LayerNorm", cfg.layer_norm_eps)


def _gelu(w: _Writer, x: str, exact: bool) -> str:
    inner = w.op("Erf", [w.op("Div", [x, _scalar(w, math.sqrt(2.0), 2.0 if exact else None)])])
    return w.op("Mul", [w.op("Mul", [x, w.op("Add", [inner, w.const(1.0)])]), w.const(0.5)])


def minilm_onnx(config: BertConfig, weights: Mapping[str, np.ndarray], exact_scalars: bool = False) -> onnx.ModelProto:
    """The sentence-embedding model with dynamic ('batch', 'sequence') inputs."""
    cfg, w = config, _Writer()
    ids, mask, types = INPUTS
    # the extended attention mask first, as BertModel.forward computes it before the embeddings
    ext = w.op("Cast", [w.op("Unsqueeze", [w.op("Unsqueeze", [mask, w.const([1], np.int64)]),
                                           w.const([2], np.int64)])], to=TensorProto.FLOAT)
    mask_bias = w.op("Mul", [w.op("Sub", [w.const(1.0), ext]), w.const(MASKED_KEY_BIAS)])
    words = w.op("Gather", [w.init("embeddings.word_embeddings.weight", weights["embeddings.word_embeddings.weight"]),
                            ids], axis=0)
    pos_buffer = w.init("embeddings.position_ids", np.arange(cfg.max_position_embeddings, dtype=np.int64)[None])
    pos_ids = w.op("Slice", [pos_buffer, w.const([0], np.int64), w.dim(ids, 1), w.const([1], np.int64),
                             w.const([1], np.int64)])
    pos = w.op("Gather", [w.init("embeddings.position_embeddings.weight",
                                 weights["embeddings.position_embeddings.weight"]), pos_ids], axis=0)
    tok = w.op("Gather", [w.init("embeddings.token_type_embeddings.weight",
                                 weights["embeddings.token_type_embeddings.weight"]), types], axis=0)
    x = _layer_norm(w, w.op("Add", [w.op("Add", [words, tok]), pos]), weights, "embeddings.LayerNorm",
                    cfg.layer_norm_eps)
    for i in range(cfg.num_hidden_layers):
        p = f"encoder.layer.{i}"
        x = _attention(w, x, mask_bias, weights, f"{p}.attention", cfg, exact_scalars)
        h = _gelu(w, _linear(w, x, weights, f"{p}.intermediate.dense"), exact_scalars)
        x = _layer_norm(w, w.op("Add", [_linear(w, h, weights, f"{p}.output.dense"), x]), weights,
                        f"{p}.output.LayerNorm", cfg.layer_norm_eps)
    # sentence-transformers Pooling(mean) then Normalize
    m = w.op("Cast", [w.op("Expand", [w.op("Unsqueeze", [mask, w.const([-1], np.int64)]), w.op("Shape", [x])])],
             to=TensorProto.FLOAT)
    summed = w.op("ReduceSum", [w.op("Mul", [x, m]), w.const([1], np.int64)], keepdims=0)
    counts = w.op("Clip", [w.op("ReduceSum", [m, w.const([1], np.int64)], keepdims=0), w.const(1e-9)])
    pooled = w.op("Div", [summed, counts])
    norm = w.op("Clip", [w.op("ReduceL2", [pooled], axes=[1], keepdims=1), w.const(1e-12)])
    w.nodes.append(helper.make_node("Div", [pooled, w.op("Expand", [norm, w.op("Shape", [pooled])])], [OUTPUT],
                                    name="/Div_normalize"))
    dyn = ["batch", "sequence"]
    graph = helper.make_graph(
        w.nodes, "all-MiniLM-L6-v2",
        [helper.make_tensor_value_info(n, TensorProto.INT64, dyn) for n in INPUTS],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch", cfg.hidden_size])], w.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="luminal_num",
                             ir_version=8)


def save_with_external_data(model: onnx.ModelProto, path: str | Path) -> Path:
    """model.onnx + model.onnx.data beside it (the layout exporters use for large models)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    return path


def onnx_inputs(ids: np.ndarray, attention_mask: np.ndarray) -> dict[str, np.ndarray]:
    """The exported model's inputs for a padded batch (one segment: token types all 0)."""
    return {"input_ids": ids.astype(np.int64), "attention_mask": attention_mask.astype(np.int64),
            "token_type_ids": np.zeros_like(ids, dtype=np.int64)}


def sentence_batches(tokenizer, sentences: list[str], batch: int, seq: int) -> list[dict[str, np.ndarray]]:
    """The exported model's input batches for sentences, as the registry's MiniLM job builds them:
    batches of `batch` (a short last batch refilled from its start), right-padded to `seq`."""
    out = []
    for start in range(0, len(sentences), batch):
        chunk = sentences[start:start + batch]
        chunk = chunk + chunk[: batch - len(chunk)] if len(chunk) < batch else chunk
        enc = tokenizer.encode_batch(chunk)
        pad = ((0, 0), (0, seq - enc.ids.shape[1]))
        out.append(onnx_inputs(np.pad(enc.ids, pad, constant_values=tokenizer.pad_id), np.pad(enc.attention_mask, pad)))
    return out


def save_batches(batches: list[dict[str, np.ndarray]], path: str | Path) -> Path:
    """An .npz in the CLI's calibration convention (`name:i` for batch i)."""
    np.savez(path, **{f"{k}:{i}": v for i, b in enumerate(batches) for k, v in b.items()})
    return Path(path)
