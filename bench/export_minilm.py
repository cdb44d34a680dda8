"""all-MiniLM-L6-v2 exported by PyTorch itself (torch.onnx.export, dynamo, opset 18, dynamic batch and
sequence) from the project's safetensors, then imported and checked in the project's environment:
(a) FP64 vs the project's MiniLM graph (as exported, and with the exporter's FP32-rounded closed-form
scalars recomputed exactly), (b) the FP32 plan vs ONNX Runtime FP32, (c) `luminal-num compile --model`
under MiniLM's default budget, beside the ORT peers. transformers' default sdpa attention is exported too
and its refusal recorded.

The export runs in a subprocess under `$LUMINAL_EXPORT_PYTHON` (or this Python if it has the `export`
extra); without one this prints why and writes nothing. Writes reports/bench/export_minilm.csv and
reports/bench/export_minilm/ (the .onnx file itself stays in a temporary folder).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd
from onnx import TensorProto, numpy_helper

from luminal_num.onnx import OnnxImportError, import_model, load_file, load_proto
from luminal_num.onnx.torch_runner import INSTALL_HINT, bert_closed_forms, export_minilm, export_python, \
    with_exact_scalars

from .onnx_minilm import BATCH, compile_file, measure_file, minilm_setup, run_cli
from .summary import write_csv

OUT = Path("reports/bench/export_minilm")


def fp32_scalars(loaded) -> dict[str, float]:
    """Every FP32 scalar initializer of the file (what the exporter chose to store as FP32 constants)."""
    return {t.name: float(numpy_helper.to_array(t)) for t in loaded.proto.graph.initializer
            if t.data_type == TensorProto.FLOAT and len(t.dims) == 0}


def run(candidates: int = 24, batch: int = BATCH) -> dict:
    python = export_python()
    if python is None:
        print(f"skipped: torch is not importable: {INSTALL_HINT}")
        return {}
    files, cfg, _, job, cal, ref = minilm_setup(batch)
    head, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        exported = export_minilm(Path(tmp) / "eager" / "model.onnx", python, files)
        head.update({"exporter": exported.exporter, "opset": exported.opset, "attention": exported.attention,
                     "torch": exported.torch, "transformers": exported.transformers,
                     "export s (torch.onnx.export)": exported.export_s, "export s (subprocess)": exported.wall_s,
                     "file MB (with external data)": exported.size_bytes / 1e6})
        loaded = load_file(exported.path)
        head["FP32 scalars stored"] = " ".join(f"{v:.9g}" for v in sorted(set(fp32_scalars(loaded).values())))
        exact, replaced = with_exact_scalars(loaded.proto, bert_closed_forms(cfg.head_dim))
        head["recomputed exactly"] = ", ".join(sorted(set(replaced.values())))
        for form, model in (("as exported", loaded), ("exact scalars", load_proto(exact))):
            rows.append({"form": form, **measure_file(exported.path, model, cal, ref)})
        head.update(compile_file(exported.path, cal, job, candidates, Path(tmp), OUT))
        sdpa = export_minilm(Path(tmp) / "sdpa" / "model.onnx", python, files, attention="sdpa")
        try:
            import_model(load_file(sdpa.path), {n: a.shape for n, a in cal[0].items()})
            head["sdpa export"] = "imported"
        except OnnxImportError as exc:
            head["sdpa export"] = f"refused: {exc}"
    write_csv(pd.DataFrame(rows), "export_minilm.csv")
    for r in rows:
        for k in ("fp64_vs_project_max_abs", "fp32_plan_vs_ort_fp32_max_abs", "ort_fp32_vs_fp64_max_abs", "import_s"):
            head[f"{r['form']}: {k}"] = r[k]
    return head


def main(argv=None) -> dict:
    return run_cli(run, __doc__, argv)


if __name__ == "__main__":
    main()
