"""all-MiniLM-L6-v2 exported by PyTorch itself: `torch.onnx.export` of Hugging Face's BertModel plus the
sentence-transformers pooling (mean over the attention mask, then L2 normalize), written to an ONNX file.

This file is a script for the export environment (the `export` extra: torch, transformers, onnxscript),
run by path in a subprocess (`luminal_num.onnx.torch_runner`), so the project's own environment never
needs PyTorch: it imports nothing from luminal_num. The Hugging Face hub is not needed either: the
BertModel is built from the checkpoint's config.json and loaded from its model.safetensors (strict).

Exporter: the dynamo exporter (`dynamo=True`: torch.export, then onnxscript's torchlib), opset 18,
dynamic dims 'batch' and 'sequence' on the three int64 inputs (torch.export `Dim`s), weights in one
external data file beside the model. Attention: transformers' `eager` implementation by default (its
`sdpa` default adds torchlib's guard for fully masked rows after Softmax, Where(IsNaN(p), 0, p),
and the importer refuses IsNaN on run-time values). A JSON sidecar (`<file>.json`) records what was run.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "sentence_embedding"
OPSET = 18


class SentenceEmbedding(torch.nn.Module):
    """BertModel -> sentence-transformers Pooling(mean tokens) -> Normalize, as those modules compute it."""

    def __init__(self, bert: torch.nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask, token_type_ids):
        tokens = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=token_type_ids).last_hidden_state
        mask = attention_mask.unsqueeze(-1).expand(tokens.size()).to(tokens.dtype)
        summed = torch.sum(tokens * mask, 1)
        pooled = summed / torch.clamp(mask.sum(1), min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)


def build(config: Path, safetensors: Path, attention: str) -> SentenceEmbedding:
    cfg = transformers.BertConfig.from_dict(json.loads(config.read_text()), attn_implementation=attention)
    bert = transformers.BertModel(cfg, add_pooling_layer=False)
    state = load_file(str(safetensors))
    # the checkpoint's pooler (BertPooler, CLS + tanh) is not part of the sentence embedding
    state = {k: v for k, v in state.items() if not k.startswith("pooler.")}
    # old checkpoints persist the position_ids buffer (arange), which newer BertModels do not: check, drop
    pos = state.pop("embeddings.position_ids", None)
    if pos is not None and not torch.equal(pos.reshape(-1), torch.arange(pos.numel())):
        raise SystemExit("embeddings.position_ids in the checkpoint is not arange(max_position_embeddings)")
    bert.load_state_dict(state, strict=True)
    return SentenceEmbedding(bert).eval()


def export(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = build(args.config, args.safetensors, args.attention)
    batch, seq = args.example
    ids = torch.randint(1000, 2000, (batch, seq), dtype=torch.int64)
    mask = torch.ones((batch, seq), dtype=torch.int64)
    mask[0, seq // 2:] = 0
    example = (ids, mask, torch.zeros_like(ids))
    batch_dim, seq_dim = torch.export.Dim("batch"), torch.export.Dim("sequence", max=512)
    dyn = {n: {0: batch_dim, 1: seq_dim} for n in INPUTS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        torch.onnx.export(model, example, str(args.out), input_names=list(INPUTS), output_names=[OUTPUT],
                          dynamic_shapes=dyn, opset_version=OPSET, dynamo=True, external_data=True)
    info = {"exporter": "dynamo (torch.export + onnxscript torchlib)", "opset": OPSET, "attention": args.attention,
            "dynamic_axes": {n: {"0": "batch", "1": "sequence"} for n in INPUTS}, "example_shape": [batch, seq],
            "torch": torch.__version__, "transformers": transformers.__version__,
            "export_s": time.perf_counter() - t0, "file": str(args.out)}
    Path(str(args.out) + ".json").write_text(json.dumps(info, indent=1))
    return info


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True, help="the checkpoint's config.json")
    ap.add_argument("--safetensors", type=Path, required=True, help="the checkpoint's model.safetensors")
    ap.add_argument("--out", type=Path, required=True, help="the .onnx file to write")
    ap.add_argument("--attention", choices=("eager", "sdpa"), default="eager",
                    help="transformers' attention implementation (its own default is sdpa)")
    ap.add_argument("--example", type=int, nargs=2, default=(2, 16), metavar=("BATCH", "SEQ"))
    info = export(ap.parse_args(argv))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
