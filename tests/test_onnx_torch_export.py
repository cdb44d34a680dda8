"""all-MiniLM-L6-v2 exported by PyTorch (torch.onnx.export, dynamo, opset 18) from the project's
safetensors, imported with luminal_num.onnx: (a) FP64 vs the project's own MiniLM graph, (b) the FP32
plan vs ONNX Runtime FP32 on the same file, (c) `luminal-num compile --model` under MiniLM's default
budget. The export runs in a subprocess under a Python with torch (`$LUMINAL_EXPORT_PYTHON` or this
one), so this environment never imports torch; without one every test here skips with one line.
"""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from luminal_num.cli import main
from luminal_num.hlir.evaluate import evaluate
from luminal_num.models.assets import load_sentences
from luminal_num.models.bert import BertConfig, build_bert
from luminal_num.models.registry import minilm_job
from luminal_num.onnx import OnnxImportError, import_model, load_file, load_proto
from luminal_num.onnx.bert_export import OUTPUT, onnx_inputs, save_batches, sentence_batches
from luminal_num.onnx.torch_runner import INSTALL_HINT, bert_closed_forms, export_minilm, export_python, \
    with_exact_scalars

from onnx_cases import fp32_plan_outputs

pytestmark = pytest.mark.slow
BATCH = 4


@pytest.fixture(scope="module")
def python():
    py = export_python()
    if py is None:
        pytest.skip(f"torch is not importable: {INSTALL_HINT}")
    return py


@pytest.fixture(scope="module")
def setup(python, tmp_path_factory, files, config_dict, weights, tokenizer):
    cfg = BertConfig.from_dict(config_dict)
    enc = tokenizer.encode_batch(load_sentences("calibration")[:BATCH])
    seq = enc.ids.shape[1]
    project = build_bert(cfg, weights, BATCH, seq)
    exported = export_minilm(tmp_path_factory.mktemp("torch_export") / "model.onnx", python, files)
    print(f"\nexported by torch {exported.torch}, transformers {exported.transformers}: {exported.exporter}, "
          f"opset {exported.opset}, {exported.attention} attention, {exported.size_bytes / 1e6:.1f} MB, "
          f"export {exported.export_s:.1f} s ({exported.wall_s:.1f} s with the subprocess)")
    return {"cfg": cfg, "seq": seq, "export": exported, "feeds": onnx_inputs(enc.ids, enc.attention_mask),
            "ref": evaluate(project.graph, project.make_inputs(enc))["embedding"],
            "shapes": {n: (BATCH, seq) for n in ("input_ids", "attention_mask", "token_type_ids")}}


def test_the_export_is_torchs_with_dynamic_batch_and_sequence(setup):
    proto = load_file(setup["export"].path).proto
    assert proto.producer_name == "pytorch" and setup["export"].opset == 18
    for i in proto.graph.input:
        assert [d.dim_param for d in i.type.tensor_type.shape.dim] == ["batch", "sequence"]


def test_fp64_graph_matches_the_projects_minilm_to_1e_12_with_its_fp32_scalars_recomputed_exactly(setup):
    """The export stores 1/sqrt(32) and sqrt(2) as FP32 scalars (the only two it rounds): as exported the
    FP64 graph differs from the project's by ~4e-9; with those two recomputed exactly, by <= 1e-12."""
    loaded = load_file(setup["export"].path)
    exact, replaced = with_exact_scalars(loaded.proto, bert_closed_forms(setup["cfg"].head_dim))
    assert sorted(replaced.values()) == ["1/sqrt(32)", "sqrt(2)"]
    diffs = {}
    for form, loaded_form in (("as exported", loaded), ("exact scalars", load_proto(exact))):
        m = import_model(loaded_form, setup["shapes"])
        got = m.restore(evaluate(m.graph, m.feed(setup["feeds"])))[OUTPUT]
        diffs[form] = float(np.max(np.abs(got - setup["ref"])))
    print(f"\nFP64 of the torch export vs the project's MiniLM graph: {diffs}")
    assert diffs["exact scalars"] <= 1e-12
    assert 1e-12 < diffs["as exported"] < 1e-7  # ~ 1e-8 relative scale error, far below FP32 rounding


def test_fp32_plan_matches_onnx_runtime_fp32_on_the_exported_file(setup):
    m = import_model(load_file(setup["export"].path), setup["shapes"])
    feed = m.feed(setup["feeds"])
    fp64 = m.restore(evaluate(m.graph, feed))[OUTPUT]
    plan = fp32_plan_outputs(m, feed)[OUTPUT]
    (ort_fp32,) = ort.InferenceSession(str(setup["export"].path), providers=["CPUExecutionProvider"]).run(
        None, setup["feeds"])
    fp32_tol = 16 * 2.0 ** -24  # unit-norm embeddings: a few FP32 ulps of 1
    print(f"\nFP32 plan vs ORT FP32 {np.max(np.abs(plan - ort_fp32)):.3g}; vs FP64: plan "
          f"{np.max(np.abs(plan - fp64)):.3g}, ORT {np.max(np.abs(ort_fp32 - fp64)):.3g}")
    assert np.max(np.abs(plan - ort_fp32)) <= fp32_tol
    assert np.max(np.abs(plan - fp64)) <= fp32_tol and np.max(np.abs(ort_fp32 - fp64)) <= fp32_tol


def test_transformers_default_sdpa_export_is_refused_in_one_line(python, files, tmp_path):
    """sdpa's export guards Softmax with Where(IsNaN(p), 0, p) (rows with every key masked): refused, not
    approximated. The eager export above has no such guard."""
    path = export_minilm(tmp_path / "sdpa.onnx", python, files, attention="sdpa").path
    with pytest.raises(OnnxImportError) as err:
        import_model(load_file(path), {n: (2, 8) for n in ("input_ids", "attention_mask", "token_type_ids")})
    print(f"\nsdpa export: {err.value}")
    assert "\n" not in str(err.value) and "unsupported ONNX op IsNaN" in str(err.value)


def test_compile_from_the_exported_file_under_minilms_default_budget(setup, tokenizer, tmp_path, capsys):
    job = minilm_job(BATCH)
    seq = int(job.graph.inputs["ids"].shape[1])
    cal = save_batches(sentence_batches(tokenizer, load_sentences("calibration"), BATCH, seq), tmp_path / "cal.npz")
    shape = ",".join(f"{n}={BATCH}x{seq}" for n in setup["feeds"])
    out, path = tmp_path / "report", str(setup["export"].path)
    rc = main(["compile", "--model", path, "--shape", shape, "--calibration", str(cal),
               "--budget", job.default_budget, "--candidates", "16", "--quiet", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    plan = json.loads((out / "plan.json").read_text())
    print(f"\ncompile from the torch export: error {plan['verdict']['error']:.3g} under {job.default_budget}")
    assert plan["verdict"]["passed"] and plan["source"]["sha256"] == load_file(path).sha256
    held = save_batches(sentence_batches(tokenizer, load_sentences("heldout"), BATCH, seq), tmp_path / "held.npz")
    assert main(["audit", "--plan", str(out / "plan.json"), "--model", path, "--shape", shape,
                 "--inputs", str(held)]) == 0
