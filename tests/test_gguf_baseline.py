"""The "GGUF source blocks kept" baseline (issue 32, item 4): a model read from GGUF offers, beside the
peer recipes, its file's own blocks held as they are (the tied embedding used as LM head too), which adds
no weight error at all. Truths: the file's tensor types and bytes read back with gguf.GGUFReader (not our
loader), gguf.quants.dequantize (llama.cpp's own decoder), an FP64 Llama written straight from the file
(gguf_reference.py), the FP32 plan on the CPU runtime, and the static FP32-arithmetic bound."""
import json

import gguf
import numpy as np
import pandas as pd
import pytest

from gguf_reference import gguf_logits
from luminal_num.cli import EXIT_OK, main
from luminal_num.codegen.llir import KernelKind
from luminal_num.compiler import compile as compile_plan
from luminal_num.error.budget import Budget
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.models.gguf import load_gguf
from luminal_num.models.llama import build_decode, build_prefill
from luminal_num.quant.stored import widened
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.recipes import (BASELINE_SOURCES, GGUF_KEPT_BASELINE, GGUF_KEPT_SOURCE, KEPT_TAGS,
                                        baseline_genomes, baselines, gguf_source_recipe)
from luminal_num.search.search import SearchOptions
from luminal_num.search.space import SearchSpace, group_of
from tiny_gguf import tiny_config, write_tiny_gguf

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")
# every matrix of the tiny file quantized by llama.cpp's quantizer: Q8_0 embedding (tied: no output.weight),
# Q4_1 attention and MLP Linears (hidden 32 / intermediate 64 are whole 32-blocks), except layer 1's ffn_down
# in Q8_0 (as Q4_K_M files mix types per layer): the two layers' group keeps each chunk's own blocks there
TYPES = {"token_embd.weight": "Q8_0",
         **{f"blk.{i}.{n}.weight": "Q4_1" for i in range(2)
            for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")},
         "blk.1.ffn_down.weight": "Q8_0"}
FORMAT_OF = {"Q8_0": "gguf_q8_0", "Q4_1": "gguf_q4_1"}  # GGML type -> the storage format holding its blocks
HF_NAME = {"token_embd": "model.embed_tokens", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
           "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf(gguf_name: str) -> str:
    """The Hugging Face name of one of TYPES' tensors (written out here, not our loader's table)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{HF_NAME[parts[2]]}.weight"
    return f"{HF_NAME[parts[0]]}.weight"


@pytest.fixture(scope="module")
def tiny_q(tmp_path_factory):
    root = tmp_path_factory.mktemp("ggufq")
    path = root / "tiny_q.gguf"
    write_tiny_gguf(path, tiny_config(max_position_embeddings=256, tie_word_embeddings=True), types=TYPES)
    reader = gguf.GGUFReader(str(path))
    in_file = {t.name: t for t in reader.tensors}
    assert {n: in_file[n].tensor_type.name for n in TYPES} == TYPES and "output.weight" not in in_file
    return root, path, load_gguf(path), in_file


def held_formats(program) -> dict[str, set]:
    """Weight name -> the storage formats of the EXTERNAL buffers of it that some kernel reads."""
    read = {i.buffer for k in program.kernels for i in k.inputs}
    out: dict[str, set] = {}
    for k in program.kernels:
        if k.kind is KernelKind.EXTERNAL and k.id in read:
            for name in k.concat or (k.external,):
                out.setdefault(name, set()).add(k.storage)
    return out


def test_the_baseline_holds_exactly_the_gguf_weights_in_their_file_blocks(tiny_q):
    _, _, model, in_file = tiny_q
    space = SearchSpace.build(build_decode(model.config, model.weights, 8).graph)
    genomes, refused = baselines(space)
    assert refused == {} and GGUF_KEPT_BASELINE in genomes and BASELINE_SOURCES[GGUF_KEPT_BASELINE] == GGUF_KEPT_SOURCE
    genome = genomes[GGUF_KEPT_BASELINE]
    assert genome and {t for _, _, t in genome} <= KEPT_TAGS  # weights' storage only: every other choice FP32
    assert "store:gguf_source" in {t for _, _, t in genome}  # ffn_down: each layer's own block type
    program = space.program(genome)
    held = held_formats(program)
    want = {hf(n): {FORMAT_OF[t]} for n, t in TYPES.items()}
    assert {n: f for n, f in held.items() if n in want} == want
    assert all(f == {None} for n, f in held.items() if n not in want)  # the F32 norms stay FP32
    # the tied embedding: one Q8_0 buffer read by the embedding gather and by the LM head Gemm
    embed = [k.id for k in program.kernels if k.kind is KernelKind.EXTERNAL and k.external == hf("token_embd.weight")
             and k.storage == "gguf_q8_0"]
    readers = {k.kind for k in program.kernels if any(i.buffer in embed for i in k.inputs)}
    assert KernelKind.GATHER in readers and any(kind.is_gemm for kind in readers), readers
    # each kept weight's stored values are llama.cpp's dequantization of the file's bytes, and the graph's
    # weight (the FP64 reference's), bit for bit: zero added weight error
    for gname, ggml in TYPES.items():
        t = in_file[gname]
        ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        ref = ref.reshape(tuple(int(d) for d in t.shape[::-1]))
        w = model.weights[hf(gname)]
        if gname.endswith(("attn_q.weight", "attn_k.weight")):  # the loader undoes llama.cpp's RoPE row order
            assert np.array_equal(np.sort(w, axis=None), np.sort(ref, axis=None))
        else:
            assert w.tobytes() == ref.tobytes(), gname
        assert widened(w, FORMAT_OF[ggml]).tobytes() == w.tobytes(), gname


def test_the_baseline_computes_the_fp32_plan_and_is_within_its_bound_of_the_file(tiny_q):
    """Prefill of 5 tokens: the kept plan's logits are the FP32 plan's bit for bit, and within the static
    FP32-arithmetic bound of an FP64 model written straight from the file (its own FP64 rounding allowed)."""
    _, path, model, _ = tiny_q
    ids = [5, 71, 120, 33, 260]
    built = build_prefill(model.config, model.weights, len(ids), len(ids))
    g = built.graph
    inputs = built.make_inputs(np.array(ids), np.arange(len(ids)))
    space = SearchSpace.build(g)
    kept = space.program(baseline_genomes(space)[GGUF_KEPT_BASELINE])
    assert any(k.storage == "gguf_q4_1" for k in kept.kernels) and any(k.storage == "gguf_q8_0" for k in kept.kernels)
    fp32 = space.program(frozenset())
    y = CpuRuntime(kept, g.weights).run(inputs).outputs["logits"]
    assert y.tobytes() == CpuRuntime(fp32, g.weights).run(inputs).outputs["logits"].tobytes()
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    bind = g.bind_symbols(inputs)
    bound, bound_fp32 = (static_bound(p, ranges, bind, g.weights).error_bounds["logits"] for p in (kept, fp32))
    assert np.all(np.isfinite(bound)) and np.all(bound <= bound_fp32)  # no storage error charged
    ref = gguf_logits(str(path), ids)
    assert np.all(np.abs(y - ref) <= bound + 1e-12 * np.max(np.abs(ref)))
    # at FP32 rounding level (a re-quantized Q4 weight would be off by ~1e-2 of the logits' scale)
    assert np.max(np.abs(y - ref)) <= 1e-5 * np.max(np.abs(ref))


def test_models_without_gguf_blocks_offer_no_such_baseline(tmp_path):
    """Random FP32 weights and a GGUF of F32 tensors (nothing quantized to keep): no baseline, nothing refused."""
    from luminal_num.models.llama import random_weights
    config = tiny_config()
    for weights in (random_weights(config), load_gguf(write_tiny_gguf(tmp_path / "f32.gguf", config) and
                                                      tmp_path / "f32.gguf").weights):
        space = SearchSpace.build(build_decode(config, weights, 8).graph)
        assert gguf_source_recipe(space) is None
        genomes, refused = baselines(space)
        assert GGUF_KEPT_BASELINE not in genomes and refused == {}


def test_a_gguf_weight_no_knob_keeps_refuses_the_baseline_with_a_reason(tiny_q):
    """Two layers (one group) where layer 1's q_proj is not from the file: no chunk of the group may keep q_proj's
    blocks, so layer 0's Q4_1 q_proj would be widened: the baseline is refused, naming that weight."""
    _, _, model, _ = tiny_q
    weights = dict(model.weights)
    name = "model.layers.1.self_attn.q_proj.weight"
    weights[name] = np.ascontiguousarray(weights[name] * np.float32(0.5))  # no longer the file's blocks
    space = SearchSpace.build(build_decode(model.config, weights, 8).graph)
    recipe = gguf_source_recipe(space)
    assert recipe is not None and any("model.layers.0.self_attn.q_proj.weight" in gap for gap in recipe.gaps)
    genomes, refused = baselines(space)
    assert GGUF_KEPT_BASELINE not in genomes
    reason = refused[GGUF_KEPT_BASELINE]
    assert "\n" not in reason and "not kept in their blocks" in reason and "q_proj" in reason
    # a compile says so in its search statistics (plan.json's search record), and evaluates no such baseline
    step = build_decode(model.config, weights, 8)
    batches = [step.make_inputs(np.array([t]), np.array([0])) for t in (42, 7)]
    result = compile_plan(step.graph, Budget.parse("atol=1e-2,rtol=1e-2"), "h200", batches,
                          SearchOptions(max_candidates=1, progress=False, workers=1))
    assert result.search.stats.record()["refused_baselines"] == {GGUF_KEPT_BASELINE: reason}
    assert GGUF_KEPT_BASELINE not in {e.label for e in result.search.evaluated}


def test_a_compile_of_a_quantized_gguf_lists_the_baseline_with_its_label_and_source(tiny_q):
    root, path, _, _ = tiny_q
    prompts = root / "prompts.txt"
    prompts.write_text("the cat sat on\nsay hi\n", encoding="utf-8")
    out = root / "report"
    assert main(["compile", "--model", str(path), "--workload", "decode:2@128", "--calibration", str(prompts),
                 "--candidates", "2", "--out", str(out), "--quiet"]) == EXIT_OK
    rows = pd.read_csv(out / "pareto.csv", keep_default_na=False)
    row = rows[rows["label"] == GGUF_KEPT_BASELINE]
    assert len(row) == 1 and row["source"].iloc[0] == GGUF_KEPT_SOURCE and row["stage"].iloc[0] == "baseline"
    assert bool(row["passes"].iloc[0])
    fp32 = rows[rows["label"] == "FP32 everywhere"]
    # the same arithmetic as FP32 on the same weights, fewer bytes read: never slower (at this size every
    # kernel is at the launch floor, so not faster either)
    assert float(row["latency_s"].iloc[0]) <= float(fp32["latency_s"].iloc[0])
    plan = json.loads((out / "plan.json").read_text())
    assert plan["search"]["baseline_sources"][GGUF_KEPT_BASELINE] == GGUF_KEPT_SOURCE
    assert "refused_baselines" not in plan["search"]


def test_the_kept_blocks_are_crossed_with_the_fastest_plans_other_changes(tiny_q):
    """The search's crossover (search.Searcher.crossover): each passing peer recipe with the fastest passing
    plan's changes on the knobs the recipe leaves FP32. The GGUF blocks kept (zero added weight error) are then
    tried with, e.g., fused attention, which no one-knob phase combines with a whole-model recipe. The child
    computes the file's function: on a batch no search saw, its logits are within the budget of the FP64
    Llama written straight from the file (gguf_reference.py)."""
    _, path, model, _ = tiny_q
    step = build_decode(model.config, model.weights, 8)
    batches = [step.make_inputs(np.array([t]), np.array([0])) for t in (42, 7)]
    result = compile_plan(step.graph, Budget.parse("atol=1e-1,rtol=1e-1"), "h200", batches,
                          SearchOptions(max_candidates=40, progress=False, workers=1))
    evaluated = result.search.evaluated
    kept = next(e for e in evaluated if e.label == GGUF_KEPT_BASELINE)
    assert kept.verdict.passed
    crossed = [e for e in evaluated if e.stage.value == "crossover"]
    assert crossed
    recipes = [e for e in evaluated if e.stage.value == "baseline" and e.genome and e.verdict.passed]
    for child in crossed:  # each: one passing recipe whole, plus changes on knobs that recipe does not set
        parent = next(r for r in recipes if child.label.startswith(r.label))
        extra = child.genome - parent.genome
        assert parent.genome < child.genome and extra
        assert not {(group_of(s), c) for s, c, _ in extra} & {(group_of(s), c) for s, c, _ in parent.genome}
    child = next(e for e in crossed if e.label.startswith(GGUF_KEPT_BASELINE))
    assert {t for _, _, t in child.genome - kept.genome} and not KEPT_TAGS & {t for _, _, t in child.genome - kept.genome}
    space = result.space
    runtime = CpuRuntime(space.program(child.genome), step.graph.weights)
    assert child.verdict.passed
    for t in (3, 11, 29):  # tokens no calibration batch held, at position 0
        ref = gguf_logits(path, [t])  # FP64 from the file
        y = np.asarray(runtime.run(step.make_inputs(np.array([t]), np.array([0]))).outputs["logits"], np.float64)
        assert np.all(np.abs(y.reshape(ref.shape) - ref) <= 0.1 + 0.1 * np.abs(ref))  # within the budget
