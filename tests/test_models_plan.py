"""The models through the compiler: MiniLM's FP32 plan against an independent FP64 implementation,
and the demo jobs end to end (the MiniLM demo is model-scale: marked slow, run by bench/)."""
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

from luminal_num.models.assets import Tokenizer, load_sentences, minilm_files
from luminal_num.models.registry import load_job
from luminal_num.models.weights import load_safetensors
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.space import SearchSpace

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from minilm_reference import minilm_embed_fp64  # noqa: E402

warnings.filterwarnings("ignore", category=RuntimeWarning)


def test_minilm_fp32_plan_matches_independent_fp64_reference():
    job = load_job("minilm")
    space = SearchSpace.build(job.graph)
    program = space.program(frozenset())  # the FP32 plan: every knob at its FP32 choice
    runtime = CpuRuntime(program, job.graph.weights)
    files = minilm_files()
    import json
    config = json.loads(files.config.read_text())
    weights = load_safetensors(files.safetensors)
    tok = Tokenizer.from_files(files)
    sentences = load_sentences("calibration")[:12]
    batch = job.calibration[0]
    got = runtime.run(batch).outputs["embedding"]
    enc = tok.encode_batch(sentences)
    ref = minilm_embed_fp64(weights, config, enc.ids, enc.attention_mask)
    cos = np.sum(got * ref, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    assert np.all(cos >= 0.99999), cos.min()
    assert np.max(np.abs(got - ref)) < 1e-5


def test_llama_tiny_demo_runs_and_passes_audit(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "luminal_num.cli", "demo", "--model", "llama-tiny", "--quiet",
                           "--out", str(tmp_path / "llama")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "audit: PASSED" in proc.stdout
    for name in ("pareto.csv", "pareto.png", "pareto.html", "plan_ops.csv", "plan.json", "audit.csv"):
        assert (tmp_path / "llama" / name).exists()


@pytest.mark.slow
def test_minilm_demo_end_to_end(tmp_path):
    """`demo --model minilm`: compile MiniLM on real sentences, report, audit held-out."""
    proc = subprocess.run([sys.executable, "-m", "luminal_num.cli", "demo", "--model", "minilm", "--quiet", "--out",
                           str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr
    assert "audit: PASSED" in proc.stdout and "Chosen plan" in proc.stdout


@pytest.mark.slow
def test_smollm2_demo_end_to_end(tmp_path):
    """The README's first command's job: SmolLM2-135M decode, 200 candidates, report, audit held-out prompts."""
    proc = subprocess.run([sys.executable, "-m", "luminal_num.cli", "demo", "--quiet", "--out", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr
    assert "audit: PASSED" in proc.stdout and "Chosen plan" in proc.stdout
    plan = json.loads((tmp_path / "s" / "plan.json").read_text())
    assert plan["job"]["model"] == "smollm2" and plan["search"]["candidates"] >= 200
