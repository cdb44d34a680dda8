"""all-MiniLM-L6-v2 from an ONNX file, end to end: import, FP64 vs the project's own graph, FP32 plan vs
ONNX Runtime, the ORT peers, and `luminal-num compile --model model.onnx` under MiniLM's default budget.

The ONNX file is written by luminal_num.onnx.bert_export from the safetensors in the op forms the
TorchScript exporter emits (PyTorch is not installed); both the FP32-constant form (as exported) and the
exact-scalar form are measured. Writes reports/bench/onnx_minilm.csv and reports/bench/onnx_minilm/.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import onnxruntime as ort

from luminal_num.cli import main as cli_main
from luminal_num.error.budget import Budget
from luminal_num.hlir.evaluate import evaluate
from luminal_num.models.assets import Tokenizer, load_config, load_sentences, minilm_files
from luminal_num.models.bert import BertConfig, build_bert
from luminal_num.models.registry import minilm_job
from luminal_num.models.weights import load_safetensors
from luminal_num.onnx import LoadedModel, import_model, load_file
from luminal_num.onnx.bert_export import OUTPUT, minilm_onnx, save_batches, save_with_external_data, sentence_batches
from luminal_num.onnx.peers import run_peers
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.plan import Plan
from luminal_num.search.space import SearchSpace

from .summary import write_csv

BATCH = 12
OUT = Path("reports/bench/onnx_minilm")


def measure_file(path: Path, loaded: LoadedModel, cal: list[dict], ref: np.ndarray) -> dict:
    """Import `loaded` (the file at `path`, or a rewrite of it) for the first batch's shapes: FP64 vs the project's graph,
    the FP32 plan vs ONNX Runtime FP32 on `path`, and ORT vs FP64."""
    t0 = time.perf_counter()
    model = import_model(loaded, {n: a.shape for n, a in cal[0].items()})
    import_s = time.perf_counter() - t0
    feed = model.feed(cal[0])
    got = model.restore(evaluate(model.graph, feed))[OUTPUT]
    onnx_ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, cal[0])[0]
    program = SearchSpace.build(model.graph, with_precision=False).program(frozenset())
    f32 = model.restore(CpuRuntime(program, model.graph.weights).run(feed).outputs)[OUTPUT]
    return {"hlir_nodes": len(model.graph), "import_s": import_s,
            "fp64_vs_project_max_abs": float(np.max(np.abs(got - ref))),
            "fp32_plan_vs_ort_fp32_max_abs": float(np.max(np.abs(f32 - onnx_ref))),
            "ort_fp32_vs_fp64_max_abs": float(np.max(np.abs(onnx_ref - got)))}


def compile_file(path: Path, cal: list[dict], job, candidates: int, tmp: Path, out: Path) -> dict:
    """The ORT peers under the job's default budget, then `luminal-num compile --model path` end to end."""
    loaded, budget = load_file(path), Budget.parse(job.default_budget)
    head = {}
    model = import_model(loaded, {n: a.shape for n, a in cal[0].items()})
    refs = [model.restore(evaluate(model.graph, model.feed(b))) for b in cal]
    for p in run_peers(loaded.proto, cal, refs, budget):
        head[f"{p.label} allclose ratio under {job.default_budget}"] = p.error
        head[f"{p.label} passes"] = p.passes
    cal_path = save_batches(cal, tmp / "calibration.npz")
    shape = ",".join(f"{n}={'x'.join(map(str, a.shape))}" for n, a in cal[0].items())
    t0 = time.perf_counter()
    rc = cli_main(["compile", "--model", str(path), "--shape", shape, "--calibration", str(cal_path),
                   "--budget", job.default_budget, "--candidates", str(candidates), "--quiet", "--out", str(out)])
    head["compile from ONNX: exit code"] = rc
    head["compile from ONNX: seconds"] = time.perf_counter() - t0
    if rc == 0:
        plan = Plan.load(out / "plan.json").data
        head["compile from ONNX: chosen error"] = plan["verdict"]["error"]
        head["compile from ONNX: modelled latency s"] = plan["latency"]["total_s"]
    return head


def minilm_setup(batch: int):
    """The MiniLM job (graph, default budget), its calibration batches as ONNX inputs, and the project
    graph's FP64 embedding of the first batch."""
    files = minilm_files()
    cfg, weights = BertConfig.from_dict(load_config(files.config)), load_safetensors(files.safetensors)
    job = minilm_job(batch)  # the project's own graph, sentences and default budget
    seq = int(job.graph.inputs["ids"].shape[1])
    cal = sentence_batches(Tokenizer.from_files(files), load_sentences("calibration"), batch, seq)
    ref = evaluate(build_bert(cfg, weights, batch, seq).graph, job.calibration[0])["embedding"]
    return files, cfg, weights, job, cal, ref


def run(candidates: int = 24, batch: int = BATCH) -> dict:
    _, cfg, weights, job, cal, ref = minilm_setup(batch)
    rows, head = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for form, exact in (("exported (fp32 scalars)", False), ("exact scalars", True)):
            path = save_with_external_data(minilm_onnx(cfg, weights, exact), Path(tmp) / form.split()[0] / "model.onnx")
            rows.append({"form": form, **measure_file(path, load_file(path), cal, ref)})
            if not exact:
                head.update(compile_file(path, cal, job, candidates, Path(tmp), OUT))
    write_csv(pd.DataFrame(rows), "onnx_minilm.csv")
    for r in rows:
        for k in ("fp64_vs_project_max_abs", "fp32_plan_vs_ort_fp32_max_abs"):
            head[f"{r['form']}: {k}"] = r[k]
    return head


def run_cli(run_fn, doc: str, argv=None) -> dict:
    """`--candidates N`, then print the headline figures (shared by the MiniLM ONNX benches)."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--candidates", type=int, default=24)
    head = run_fn(ap.parse_args(argv).candidates)
    for k, v in head.items():
        print(f"{k}: {v}")
    return head


def main(argv=None) -> dict:
    return run_cli(run, __doc__, argv)


if __name__ == "__main__":
    main()
