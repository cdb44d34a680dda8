"""SmolLM2-135M (real GGUF weights): the FP64 graph against an independent GGUF-layout numpy Llama,
the KV cache against prefill, batched prefill/decode against separate sequences, the teacher-forced
job inputs. Default-suite checks run a 2-layer truncation of the real weights; full-model checks are slow.
"""
import numpy as np
import pytest

from gguf_reference import gguf_logits
from luminal_num.error.metrics import top1_agreement
from luminal_num.hlir import evaluate
from luminal_num.models.gguf import smollm2_path
from luminal_num.models.llama import build_decode, build_prefill
from luminal_num.models.llm import Prompt, Workload, WorkloadError, decode_batches, load_llm, load_prompts
from luminal_num.models.registry import llm_job
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.space import SearchSpace

LAYERS = 2
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time"]


def rel(y, ref) -> float:
    return float(np.max(np.abs(np.asarray(y) - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def model():
    return load_llm("smollm2", LAYERS)


def test_batched_padded_prefill_matches_independent_reference(model):
    """Three prompts of different lengths right-padded into one batch: every real row equals the
    GGUF-layout reference run on that prompt alone (padding and per-sequence masks are exact)."""
    ids = [model.tokenizer.encode(p) for p in PROMPTS]
    seq = max(map(len, ids))
    graph = build_prefill(model.config, model.weights, seq, seq, batch=len(ids))
    padded = np.array([row + [model.tokenizer.eos_id] * (seq - len(row)) for row in ids])
    out = graph.sequence_logits(evaluate(graph.graph, graph.make_batch_inputs(padded, np.tile(np.arange(seq), (3, 1)))))
    for b, row in enumerate(ids):
        assert rel(out[b, :len(row)], gguf_logits(str(smollm2_path()), row, LAYERS)) <= 1e-10


def test_fp64_runner_matches_graph(model):
    """The fast FP64 runner that makes teacher-forced inputs computes the graph's function."""
    ids = model.tokenizer.encode(PROMPTS[0])
    graph = build_prefill(model.config, model.weights, len(ids), len(ids))
    out = evaluate(graph.graph, graph.make_inputs(ids, np.arange(len(ids))))
    logits, state = model.fp64.forward(ids)
    assert rel(out["logits"], logits) <= 1e-10
    assert rel(out["k_cache_out.1"], state.k[1]) <= 1e-10 and rel(out["v_cache_out.0"], state.v[0]) <= 1e-10


def test_decode_with_cache_equals_prefill_and_batched_decode_equals_separate(model):
    """Three sequences at different positions decoded in one batch == each decoded alone == the last
    row of its full prefill (the reference)."""
    ctx = 8
    seqs = [model.tokenizer.encode(p)[:n] for p, n in zip(PROMPTS, (5, 3, 4))]
    batch = build_decode(model.config, model.weights, ctx, batch=3)
    single = build_decode(model.config, model.weights, ctx)
    prev = {}
    for layer in range(LAYERS):
        for kind in "kv":
            prev[f"{kind}_cache_out.{layer}"] = np.zeros((3 * ctx, model.config.kv_dim))
    singles = []
    for b, s in enumerate(seqs):
        _, state = model.fp64.forward(s[:-1])
        one = {}
        for layer in range(LAYERS):
            for kind in "kv":
                rows = getattr(state, kind)[layer]
                prev[f"{kind}_cache_out.{layer}"][b * ctx: b * ctx + len(rows)] = rows
                one[f"{kind}_cache_out.{layer}"] = np.zeros((ctx, model.config.kv_dim))
                one[f"{kind}_cache_out.{layer}"][: len(rows)] = rows
        singles.append(evaluate(single.graph, single.make_inputs([s[-1]], [len(s) - 1], one)))
    lengths = [len(s) - 1 for s in seqs]
    out = evaluate(batch.graph, batch.make_batch_inputs([[s[-1]] for s in seqs], [[n] for n in lengths], prev, lengths))
    for b, s in enumerate(seqs):
        full = gguf_logits(str(smollm2_path()), s, LAYERS)[-1]
        assert rel(singles[b]["logits"][0], full) <= 1e-10
        assert rel(out["logits"][b], singles[b]["logits"][0]) <= 1e-10
        np.testing.assert_allclose(out["k_cache_out.1"][b * ctx:(b + 1) * ctx], singles[b]["k_cache_out.1"], rtol=1e-12)


def test_layers_share_one_group_in_batched_workloads(model):
    for graph in (build_decode(model.config.with_layers(2), model.weights, 16, batch=4),
                  build_prefill(model.config.with_layers(2), model.weights, 6, 6, batch=2)):
        space = SearchSpace.build(graph.graph)
        members = [{c.index for c in g.chunks} for g in space.part.groups]
        assert {1, 2} in members  # both decoder layers, nothing else, in one group


def test_workload_syntax():
    assert Workload.parse("decode:8@64") == Workload("decode", 8, 1, 64)
    assert Workload.parse("prefill:32") == Workload("prefill", 1, 32, 32)
    assert Workload.parse("prefill:4x16") == Workload("prefill", 4, 16, 16)
    assert str(Workload.parse("prefill:4x16")) == "prefill:4x16" and str(Workload.parse("decode:2@9")) == "decode:2@9"
    for bad in ("decode:8", "prefill:0", "decode:0@8", "serve:1", "decode:2@1"):
        with pytest.raises(WorkloadError):
            Workload.parse(bad)


def test_decode_job_is_teacher_forced_on_the_fp64_continuation(model):
    prompts = [Prompt("The capital of France is", False), Prompt("What is 2 + 2?", True)]
    job = llm_job("smollm2", "decode:2@48", calibration=prompts, heldout=prompts[:1], layers=LAYERS)
    assert len(job.calibration) == 1 and job.default_budget.startswith("atol=inf")
    inp = job.calibration[0]
    ref = evaluate(job.graph, inp)["logits"]
    for b, p in enumerate(prompts):
        ids = model.encode(p)
        assert inp["ids"][b] == ids[-1] and inp["positions"][b] == b * 48 + len(ids) - 1
        cont, _ = model.fp64.greedy(ids, 1)
        assert int(np.argmax(ref[b])) == cont[0]  # the graph's FP64 next token is FP64's greedy token


def test_multi_step_decode_feeds_the_fp64_greedy_tokens(model):
    prompt = Prompt("The capital of France is", False)
    graph = build_decode(model.config, model.weights, 16)
    steps = decode_batches(model, graph, [prompt], steps=3)
    ids = model.encode(prompt)
    cont, _ = model.fp64.greedy(ids, 3)
    assert [int(b["ids"][0]) for b in steps] == [ids[-1], cont[0], cont[1]]
    assert [int(b["positions"][0]) for b in steps] == [len(ids) - 1, len(ids), len(ids) + 1]
    assert int(np.argmax(evaluate(graph.graph, steps[2])["logits"][0])) == cont[2]


def test_prompt_longer_than_the_context_is_refused():
    with pytest.raises(ValueError, match="does not fit the workload's context of 8 rows"):
        llm_job("smollm2", "decode:1@8", calibration=[Prompt("What is 2 + 2?", True)], layers=LAYERS)


def test_prefill_job_rows_are_prompt_then_fp64_continuation(model):
    prompts = [Prompt("Hello", False)]
    job = llm_job("smollm2", "prefill:6", calibration=prompts, heldout=prompts, layers=LAYERS)
    ids = job.calibration[0]["ids"]
    prompt = model.encode(prompts[0])
    cont, _ = model.fp64.greedy(prompt, 6 - len(prompt))
    assert ids.tolist() == prompt + cont


@pytest.mark.slow
def test_full_model_matches_reference_and_says_paris():
    full = load_llm("smollm2")
    for text in PROMPTS + [load_prompts("heldout")[0].text]:
        ids = full.tokenizer.encode(text)
        graph = build_prefill(full.config, full.weights, len(ids), len(ids))
        out = evaluate(graph.graph, graph.make_inputs(ids, np.arange(len(ids))))["logits"]
        assert rel(out, gguf_logits(str(smollm2_path()), ids)) <= 1e-10
        if text == PROMPTS[0]:
            assert full.tokenizer.decode([int(out[-1].argmax())]) == " Paris"


U_FP32 = 2.0 ** -24


def _fp32_vs_fp64(job) -> tuple[float, float, int]:
    """(max |logit error| / max |logit|, top-1 agreement, longest dot product) of the FP32 plan."""
    program = SearchSpace.build(job.graph).program(frozenset())  # the empty genome: FP32 everywhere
    rt = CpuRuntime(program, job.graph.weights)
    ys, refs = [], []
    for batch in job.heldout:
        ys.append(np.asarray(rt.run(batch).outputs["logits"], dtype=np.float64))
        refs.append(evaluate(job.graph, batch)["logits"])
    y, ref = np.concatenate(ys), np.concatenate(refs)
    c = job.llm.model.config
    return (float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))), top1_agreement(y, ref),
            max(c.hidden_size, c.intermediate_size, job.llm.workload.context))


def gamma(n: int) -> float:
    return n * U_FP32 / (1 - n * U_FP32)


def test_fp32_plan_logits_within_gamma_of_the_longest_dot(model):
    prompts = load_prompts("heldout")[:2]
    job = llm_job("smollm2", "decode:2@64", calibration=prompts, heldout=prompts, layers=LAYERS)
    err, top1, longest = _fp32_vs_fp64(job)
    assert longest == 1536 and 0 < err <= gamma(longest)
    assert top1 == 1.0


@pytest.mark.slow
def test_full_model_fp32_plan_on_heldout_prompts():
    job = llm_job("smollm2", "decode:4@64")
    err, top1, longest = _fp32_vs_fp64(job)
    print(f"SmolLM2 FP32 plan on {len(job.heldout) * 4} held-out rows: top-1 agreement {top1}, "
          f"max logit error / max logit {err:.3g} (gamma_{longest} = {gamma(longest):.3g})")
    assert 0 < err <= gamma(longest) and top1 >= 11 / 12
