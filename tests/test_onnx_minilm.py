"""all-MiniLM-L6-v2 as an ONNX file (written in the TorchScript exporter's op forms from the safetensors;
PyTorch is not installed), imported and checked against the project's own MiniLM graph and ONNX Runtime.
"""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from luminal_num.cli import main
from luminal_num.hlir.evaluate import evaluate
from luminal_num.hlir.partition import partition
from luminal_num.models.assets import load_sentences
from luminal_num.models.bert import BertConfig, build_bert
from luminal_num.onnx import import_model, load_file
from luminal_num.onnx.bert_export import OUTPUT, minilm_onnx, onnx_inputs, save_batches, save_with_external_data, \
    sentence_batches

from onnx_cases import fp32_plan_outputs

BATCH = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory, config_dict, weights, tokenizer):
    cfg = BertConfig.from_dict(config_dict)
    enc = tokenizer.encode_batch(load_sentences("calibration")[:BATCH])
    seq = enc.ids.shape[1]
    project = build_bert(cfg, weights, BATCH, seq)
    ref = evaluate(project.graph, project.make_inputs(enc))["embedding"]
    d = tmp_path_factory.mktemp("minilm_onnx")
    paths = {exact: save_with_external_data(minilm_onnx(cfg, weights, exact), d / str(exact) / "model.onnx")
             for exact in (False, True)}
    return {"cfg": cfg, "seq": seq, "ref": ref, "paths": paths, "feeds": onnx_inputs(enc.ids, enc.attention_mask),
            "project": project}


def _import(setup, exact: bool):
    return import_model(load_file(setup["paths"][exact]), {n: (BATCH, setup["seq"]) for n in setup["feeds"]})


def test_fp64_graph_matches_the_projects_minilm_to_1e_12(setup):
    """Exact scalars (sqrt(32), sqrt(2) as Sqrt nodes): every other op maps onto the same function."""
    m = _import(setup, exact=True)
    got = m.restore(evaluate(m.graph, m.feed(setup["feeds"])))[OUTPUT]
    assert np.max(np.abs(got - setup["ref"])) <= 1e-12


def test_exported_form_differs_only_by_its_fp32_scalars_and_fp32_plan_matches_ort(setup):
    """The exporter stores 1/sqrt-type scales as FP32 scalars: the FP64 graph then differs from the
    project's (FP64 constants) by ~1e-9, far below FP32 rounding; the FP32 plan matches ORT FP32."""
    m = _import(setup, exact=False)
    feed = m.feed(setup["feeds"])
    got = m.restore(evaluate(m.graph, feed))[OUTPUT]
    diff = float(np.max(np.abs(got - setup["ref"])))
    print(f"\nexported form FP64 vs project graph: max abs {diff:.3g}")
    assert 0 < diff < 1e-7
    (ort_fp32,) = ort.InferenceSession(str(setup["paths"][False]), providers=["CPUExecutionProvider"]).run(
        None, setup["feeds"])
    plan = fp32_plan_outputs(m, feed)[OUTPUT]
    fp32_tol = 16 * 2.0 ** -24  # unit-norm embeddings: a few FP32 ulps of 1
    print(f"FP32 plan vs ORT FP32 {np.max(np.abs(plan - ort_fp32)):.3g}, vs FP64 {np.max(np.abs(plan - got)):.3g}")
    assert np.max(np.abs(plan - ort_fp32)) <= fp32_tol
    assert np.max(np.abs(plan - got)) <= fp32_tol and np.max(np.abs(ort_fp32 - got)) <= fp32_tol


def test_layers_fall_into_shared_chunks(setup):
    """A chunk starts at every LayerNormalization, so the 6 attention and 6 FFN blocks form 2 groups."""
    part = partition(_import(setup, exact=False).graph)
    sizes = sorted(len(g.chunks) for g in part.groups)
    assert sizes[-2:] == [setup["cfg"].num_hidden_layers] * 2


@pytest.mark.slow
def test_compile_from_the_onnx_file_under_minilms_default_budget(setup, tokenizer, tmp_path, capsys):
    from luminal_num.models.registry import minilm_job
    job = minilm_job(BATCH)
    seq = int(job.graph.inputs["ids"].shape[1])
    cal = save_batches(sentence_batches(tokenizer, load_sentences("calibration"), BATCH, seq), tmp_path / "cal.npz")
    shape = ",".join(f"{n}={BATCH}x{seq}" for n in setup["feeds"])
    out = tmp_path / "report"
    rc = main(["compile", "--model", str(setup["paths"][False]), "--shape", shape, "--calibration", str(cal),
               "--budget", job.default_budget, "--candidates", "16", "--quiet", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    plan = json.loads((out / "plan.json").read_text())
    assert plan["verdict"]["passed"] and plan["source"]["sha256"] == load_file(setup["paths"][False]).sha256
    held = save_batches(sentence_batches(tokenizer, load_sentences("heldout"), BATCH, seq), tmp_path / "held.npz")
    assert main(["audit", "--plan", str(out / "plan.json"), "--model", str(setup["paths"][False]), "--shape", shape,
                 "--inputs", str(held)]) == 0
