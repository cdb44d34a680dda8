"""LLMs on the command line: a model of one's own by path (.gguf), workloads, prompt calibration, audit,
generate, and one-line refusals (exit 2) of what the graph does not implement."""
import json

import numpy as np
import pytest

from luminal_num.cli import EXIT_CONTRACT, EXIT_INPUT, EXIT_OK, main
from luminal_num.hlir import evaluate
from luminal_num.models.gguf import load_gguf
from luminal_num.models.llama import build_prefill
from luminal_num.models.llm import Prompt, load_llm
from luminal_num.models.weights import save_safetensors
from test_llama import reference_logits
from tiny_gguf import tiny_config, write_tiny_gguf
from test_cuda_fakes import fake  # noqa: F401 - the CUDA stand-in fixture

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
WORKLOAD = "decode:2@128"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm")
    path = root / "tiny.gguf"
    weights = write_tiny_gguf(path, tiny_config(max_position_embeddings=256))
    prompts = root / "prompts.txt"
    prompts.write_text("# two prompts\nthe cat sat on\nchat: say hi\n", encoding="utf-8")
    return root, path, weights, prompts


def test_gguf_written_like_llama_cpp_loads_back_exactly(tiny):
    _, path, weights, _ = tiny
    model = load_gguf(path)
    # GGUF stores the epsilon as float32, and llama.cpp computes with that value: so do we
    assert model.config == tiny_config(max_position_embeddings=256, rms_norm_eps=float(np.float32(1e-5)))
    for name, array in weights.items():  # the Q/K permutation is undone exactly
        np.testing.assert_array_equal(model.weights[name], array)
    ids = model.tokenizer.encode("the theme")
    # merges "Ġ t", "h e", "Ġt he": 'the' has no 't he' merge, ' theme' gets 'Ġthe' then bytes
    assert [model.tokenizer.token(i) for i in ids] == ["t", "he", "Ġthe", "m", "e"]
    graph = build_prefill(model.config, model.weights, len(ids), len(ids))
    logits = evaluate(graph.graph, graph.make_inputs(ids, np.arange(len(ids))))["logits"]
    ref = reference_logits(model.config, weights, ids)
    assert np.max(np.abs(logits - ref)) <= 1e-10 * np.max(np.abs(ref))


@pytest.fixture(scope="module")
def ordinary(tiny):
    """An ordinary (not batch-invariant) plan of the tiny model: (its folder, compile's exit code)."""
    root, path, _, prompts = tiny
    out = root / "report"
    rc = main(["compile", "--model", str(path), "--workload", WORKLOAD, "--calibration", str(prompts),
               "--candidates", "2", "--out", str(out), "--quiet"])
    return out, rc


def test_compile_audit_generate_a_gguf_by_path(tiny, ordinary, capsys):
    root, path, _, prompts = tiny
    out, rc = ordinary
    assert rc == EXIT_OK
    plan = json.loads((out / "plan.json").read_text())
    assert plan["job"] == {"model": str(path), "workload": WORKLOAD, "layers": None}
    assert {m["name"] for m in plan["budget"]["metrics"]} == {"top1_agreement", "kl_logits", "kl_max"}
    assert main(["audit", "--plan", str(out / "plan.json"), "--calibration", str(prompts)]) == EXIT_OK
    assert "top1_agreement" in capsys.readouterr().out
    assert main(["generate", "--plan", str(out / "plan.json"), "--prompt", "the cat", "--tokens", "3"]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("prompt (") and lines[1].startswith("FP64: ") and lines[2].startswith("plan: ")
    assert "FP32" not in lines[3] and ("reproduces all 3" in lines[3] or "agrees with FP64 for" in lines[3])


@pytest.mark.parametrize("args, message", [
    (["--workload", "decode:2"], "bad workload"),
    (["--workload", "decode:1@8"], "does not fit the workload's context"),
    (["--calibration", "missing.txt"], "does not exist"),
])
def test_bad_llm_inputs_exit_2(tiny, capsys, args, message):
    _, path, _, prompts = tiny
    base = ["compile", "--model", str(path), "--calibration", str(prompts), "--quiet"]
    assert main(base + args) == EXIT_INPUT
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_refused_models_exit_2_naming_the_setting(tiny, capsys):
    root, _, _, prompts = tiny
    gemma = root / "gemma.gguf"
    write_tiny_gguf(gemma, arch="gemma")
    biased = root / "biased.gguf"
    write_tiny_gguf(biased, extra_tensors={"blk.0.attn_q.bias": np.zeros(32)})
    for model, message in ((gemma, "architecture 'gemma'"), (biased, "biases"), (root / "nope", "unknown model"),
                           (root / "nope.gguf", "does not exist")):
        assert main(["compile", "--model", str(model), "--calibration", str(prompts), "--quiet"]) == EXIT_INPUT
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert main(["compile", "--model", "transformer", "--workload", "decode:1@8"]) == EXIT_INPUT
    assert "--workload applies to LLMs" in capsys.readouterr().err
    assert main(["compile", "--model", "transformer", "--layers", "99"]) == EXIT_INPUT
    assert "--layers applies to LLMs" in capsys.readouterr().err
    assert main(["compile", "--model", "gpt-17"]) == EXIT_INPUT
    assert "unknown model 'gpt-17'" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_demo_end_to_end(tmp_path, capsys):
    """`luminal-num demo --model smollm2` on a 2-layer truncation: compile under the LLM budget, audit held out."""
    rc = main(["demo", "--model", "smollm2", "--layers", "2", "--candidates", "1", "--out", str(tmp_path), "--quiet"])
    assert rc == EXIT_OK
    assert "auditing the plan on the held-out inputs" in capsys.readouterr().out


def test_hugging_face_folder_by_path(tiny, tmp_path, capsys):
    """The same tiny model as an HF folder (config.json, safetensors, tokenizer.json, chat template)."""
    _, path, weights, prompts = tiny
    model = load_gguf(path)
    save_safetensors(tmp_path / "model.safetensors", weights)
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    model.tokenizer.save(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": model.chat_template.source}))
    hf = load_llm(str(tmp_path))
    assert hf.config == model.config and hf.encode(Prompt("say hi", True)) == load_llm(str(path)).encode(Prompt("say hi", True))
    rc = main(["compile", "--model", str(tmp_path), "--workload", WORKLOAD, "--calibration", str(prompts),
               "--candidates", "1", "--out", str(tmp_path / "report"), "--quiet"])
    assert rc == EXIT_OK
    capsys.readouterr()
    layers = model.config.num_hidden_layers
    rc = main(["compile", "--model", str(tmp_path), "--layers", str(layers + 97), "--workload", WORKLOAD,
               "--calibration", str(prompts), "--candidates", "1", "--out", str(tmp_path / "never"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == EXIT_INPUT and f"layers must lie in [1, {layers}], got {layers + 97}" in err and err.count("\n") == 1
    assert not (tmp_path / "never").exists()


def test_generate_backend_cuda_without_a_device_is_one_line_exit_2(tiny, capsys):
    root, path, _, prompts = tiny
    out = root / "report_backend"
    assert main(["compile", "--model", str(path), "--workload", WORKLOAD, "--calibration", str(prompts),
                 "--candidates", "1", "--out", str(out), "--quiet"]) == EXIT_OK
    capsys.readouterr()
    assert main(["generate", "--plan", str(out / "plan.json"), "--prompt", "the cat", "--tokens", "2",
                 "--backend", "cuda"]) == EXIT_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--backend cuda" in err[0]
    assert main(["generate", "--plan", str(out / "plan.json"), "--prompt", "the cat", "--tokens", "2"]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == "the plan ran on the cpu backend" and lines[-1].startswith("speed ")  # auto, no device here


def test_generate_on_the_cuda_stand_in_gives_the_cpu_backends_tokens(tiny, fake):
    """The CUDA path of generate (kernels run by the CUDA interpreter, cuBLAS computed from its definition)
    produces the same greedy tokens as the CPU emulation backend on the same plan."""
    from luminal_num.report.generate import generate
    from luminal_num.search.plan import Plan
    from test_cuda_fakes import execute
    root, path, _, prompts = tiny
    out = root / "report_standin"
    assert main(["compile", "--model", str(path), "--workload", WORKLOAD, "--calibration", str(prompts),
                 "--candidates", "1", "--out", str(out), "--quiet"]) == EXIT_OK
    plan = Plan.load(out / "plan.json")
    cpu = generate(plan, str(path), WORKLOAD, None, "the cat", False, 2, backend="cpu")
    execute(fake[0])
    cuda = generate(plan, str(path), WORKLOAD, None, "the cat", False, 2, backend="cuda")
    assert (cpu.backend, cuda.backend) == ("cpu", "cuda")
    assert cuda.plan == cpu.plan and cuda.fp64 == cpu.fp64


def test_batch_invariant_compile_and_check_invariance(tiny, ordinary, capsys, monkeypatch):
    """`compile --batch-invariant` records the requirement and the price of invariance (plan.json and one
    line); `audit --check-invariance` finds every position bit-identical and exits 0. An ordinary plan has
    neither field, and its check only reports (exit 0: it promised no invariance), saying it is not required."""
    root, path, _, prompts = tiny
    base = ["--model", str(path), "--workload", WORKLOAD, "--calibration", str(prompts), "--candidates", "2",
            "--quiet"]
    out = root / "invariant"
    assert main(["compile", *base, "--batch-invariant", "--out", str(out)]) == EXIT_OK
    printed = capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    assert plan["requirements"] == {"batch_invariant": True} and plan["llir"]["batch_invariant"] is True
    price = plan["invariance_price"]
    assert price["invariant_s"] > 0 and price["plain_s"] > 0 and price["target"] == plan["target"]
    assert price["ratio"] == pytest.approx(price["invariant_s"] / price["plain_s"])
    assert price["invariant_s"] == pytest.approx(plan["latency"]["total_s"])
    assert "price of batch invariance:" in printed
    page = (out / "pareto.html").read_text()
    assert f"price of batch invariance: {price['invariant_s'] * 1e6:.1f} us invariant" in page  # beside the front
    assert main(["audit", "--plan", str(out / "plan.json"), "--calibration", str(prompts),
                 "--check-invariance"]) == EXIT_OK
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("invariance: ") and "requires batch invariance: INVARIANT;" in line, line
    assert (out / "invariance.csv").is_file()
    folder, rc = ordinary
    assert rc == EXIT_OK
    plain = json.loads((folder / "plan.json").read_text())
    assert "requirements" not in plain and "invariance_price" not in plain
    assert "price of batch invariance" not in (folder / "pareto.html").read_text()
    assert main(["audit", "--plan", str(folder / "plan.json"), "--calibration", str(prompts),
                 "--check-invariance", "--out", str(root / "ordinary_check")]) == EXIT_OK
    line = capsys.readouterr().out.splitlines()[-1]
    assert "does not require batch invariance: " in line
    assert ": INVARIANT;" in line or "NOT INVARIANT (not required by this plan" in line, line
    # a batch-invariant plan found not invariant breaks its contract: exit 1 (one position made to differ)
    import luminal_num.report.invariance as invariance
    check = invariance.check_invariance

    def one_differs(*args, **kwargs):
        result = check(*args, **kwargs)
        rows = result.rows.copy()
        rows.loc[0, "identical"] = False
        return invariance.InvarianceResult(rows, result.batch_invariant)
    monkeypatch.setattr(invariance, "check_invariance", one_differs)
    assert main(["audit", "--plan", str(out / "plan.json"), "--calibration", str(prompts), "--check-invariance",
                 "--out", str(root / "invariant_check")]) == EXIT_CONTRACT
    assert "requires batch invariance: NOT INVARIANT;" in capsys.readouterr().out
