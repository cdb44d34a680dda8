"""Weights streamed through the compile, not resident (issue 29): with the memory plan's streaming on, every
whole-model reader gives a file-backed weight's pages back after its last read.

Truths: the same run with streaming off (outputs bit for bit: releasing a page never changes a value), the
kernel's own count of this process's resident pages of the checkpoint file (/proc/self/smaps: the Rss of
the mapping of model.safetensors), which without streaming is ~ the whole file after one run, and with it
stays below one layer's weights plus the largest weight; and the plan's arithmetic by hand for the
Gemma-3-4B shape (weights of a sparse file: nothing allocated).
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest

from luminal_num.error.tasks import RunTask, run_task
from luminal_num.hlir.evaluate import evaluate_chunk_batches, evaluate_nodes
from luminal_num.hlir.partition import partition
from luminal_num.hlir.store import STREAMING, release_pages, release_points
from luminal_num.hlir.weightcache import WEIGHTS
from luminal_num.memory import (GiB, KEPT_MIN, MIN_CACHE, PROCESS_BASE, TRANSIENT, MemoryBudgetError, WeightSizes, layer_of,
                                plan_memory)
from luminal_num.models.llama import LlamaConfig, build_prefill, load_weights, weight_shapes
from luminal_num.models.synthetic import write_checkpoint
from luminal_num.quant.stored import CONVERTED, widened
from luminal_num.runtime import cpu
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.cpu_pages import page_releases
from luminal_num.search.recipes import STORAGE_RECIPES, pick
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)

CONFIG = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5, max_position_embeddings=16)
PAGE = 4096
INT8 = STORAGE_RECIPES["W8A16 INT8 per-channel"]


def resident(path: Path) -> int:
    """Bytes of `path`'s pages this process has mapped and resident (every mapping of it, summed)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
                inside = len(head) >= 6 and head[5] == str(path)
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


def give_back(weights) -> None:
    """Every page of the file this process mapped, released (a clean start), and no cached form of the weights
    (an equal weight's cached view of another mapping would be read instead of this file's pages)."""
    WEIGHTS.clear()
    CONVERTED.clear()
    for w in weights.values():
        release_pages(w)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("stream") / "llama", CONFIG, seed=7)
    config, weights = load_weights(folder)
    m = build_prefill(config, weights, 4, 8)
    space = SearchSpace.build(m.graph)
    rng = np.random.default_rng(0)
    batches = [m.make_inputs(rng.integers(0, CONFIG.vocab_size, 4), np.arange(4)) for _ in range(2)]
    return folder / "model.safetensors", m, space, batches


def _held(graph) -> int:
    """One layer's weights plus the largest weight outside it (the plan's streamed floor; all file-backed)."""
    sizes = WeightSizes.of(graph.weights)
    assert sizes.mapped == sizes.total  # every weight is a view of the checkpoint
    return sizes.held


def _slack(graph) -> int:
    """Pages a weight shares with its neighbours in the file (never released: a neighbour may be read next)."""
    return 2 * PAGE * len(graph.weights)


@pytest.mark.parametrize("recipe", ["FP32", "W8A16 INT8 per-channel"])
def test_a_streaming_run_gives_the_same_bits_and_holds_one_layer_of_the_file(model, recipe, monkeypatch):
    path, m, space, batches = model
    program = space.program(frozenset() if recipe == "FP32" else pick(space, INT8.__contains__))
    size, held = path.stat().st_size, _held(m.graph)
    give_back(m.graph.weights)
    want = CpuRuntime(program, m.graph.weights).run_many(batches)
    kept = resident(path)
    # the run read every weight (the embedding by the rows it gathers; hashed whole for its key the first time)
    assert kept > 0.8 * size, (kept, size)
    give_back(m.graph.weights)
    assert resident(path) < _slack(m.graph)
    peaks, ran, released = [], [], []
    real, release = cpu.KERNELS, STREAMING.release

    def watching(fn):
        def run(rt, k, state):
            peaks.append(resident(path))
            ran.append(k.id)
            return fn(rt, k, state)
        return run

    def recording(arrays):
        arrays = list(arrays)
        released.extend((len(ran), a) for a in arrays)
        release(arrays)
    monkeypatch.setattr(cpu, "KERNELS", {kind: watching(fn) for kind, fn in real.items()})
    monkeypatch.setattr(STREAMING, "release", recording)
    with STREAMING.set_to(True):
        got = CpuRuntime(program, m.graph.weights).run_many(batches)
    monkeypatch.setattr(cpu, "KERNELS", real)
    monkeypatch.setattr(STREAMING, "release", release)
    after = resident(path)
    # never before a later kernel of the run reads the pages: every kernel reading a weight sharing bytes with a
    # released one (through any EXTERNAL made from it) had run, for every batch, when it was released
    launched = [k for k in program.kernels if k.id in set(ran)]
    for done, a in released:
        for pos, k in enumerate(launched):
            for inp in k.inputs:
                src = program.kernel(inp.buffer)
                if any(np.shares_memory(m.graph.weights[n], a) for n in src.weight_sources if n in m.graph.weights):
                    assert len(batches) * (pos + 1) <= done, (k.id, src.external)
    assert {id(w) for w in m.graph.weights.values()} <= {id(a) for _, a in released}  # every weight given back
    for w, g in zip(want, got):
        assert w.outputs.keys() == g.outputs.keys()
        for name in w.outputs:
            assert np.array_equal(w.outputs[name], g.outputs[name]), name
    assert after < held, (after, held, size)
    assert max(peaks) < held + _slack(m.graph), (max(peaks), held, size)


def test_chunk_runs_and_the_fp64_chunk_evaluation_release_each_chunks_weights(model):
    """What the per-chunk verdicts run (error/chunks.py: a chunk's program on its exact FP64 inputs through
    run_task, the FP64 rest of the model through evaluate_chunk_batches): after each chunk, this process holds
    no more of the file than one layer plus the largest weight; without streaming, all of it by the end."""
    path, m, space, batches = model
    graph, part = m.graph, partition(m.graph)
    refs = [evaluate_nodes(graph, b) for b in batches]
    bindings = [graph.bind_symbols(b) for b in batches]
    base = space.candidates(frozenset())
    held, size = _held(graph), path.stat().st_size

    def each_chunk(check):
        for c in part.chunks:
            ext = [{n: r[n] for n in c.external if graph.weight_name(n) is None} for r in refs]
            evaluate_chunk_batches(graph, c.nodes, ext, bindings)
            check(resident(path))
            task = RunTask(space.lower_chunk(c, base[c.index]),
                           tuple({f"%{n}": e[n] for n in e} for e in ext), tuple(bindings))
            run_task(task, graph.weights)
            check(resident(path))
    give_back(graph.weights)
    each_chunk(lambda rss: None)
    assert resident(path) > 0.8 * size
    give_back(graph.weights)
    seen = []
    with STREAMING.set_to(True):
        each_chunk(seen.append)
    assert max(seen) < held and resident(path) < held, (seen, held)


def test_a_streaming_compile_judges_every_candidate_as_a_resident_one_and_holds_a_layer(model):
    """The whole compile (reference, pool workers forked with the policy, chunk runs, end-to-end runs, plan) with
    the plan's streaming on: the same candidates, verdicts and chosen plan as with it off, and afterwards the
    compiling process holds less of the file than one layer plus the largest weight (off: nearly all of it)."""
    from luminal_num.compiler import compile as compile_plan
    from luminal_num.error.budget import Budget
    from luminal_num.search.search import SearchOptions
    path, m, _, batches = model
    held, size = _held(m.graph), path.stat().st_size
    runs = []
    for streaming in (False, True):
        give_back(m.graph.weights)
        plan = plan_memory(m.graph.weights, 8 * GiB, workers=2, streaming=streaming)
        assert plan.streaming is streaming and plan.workers == 2
        r = compile_plan(m.graph, Budget.parse("atol=0.3,rtol=0.3"), "h200", batches,
                         SearchOptions(max_candidates=8, progress=False, workers=2, seed=0), memory=plan)
        runs.append(([(e.genome, e.verdict) for e in r.search.evaluated], r.search.chosen.genome, resident(path)))
    (off, chosen_off, kept_off), (on, chosen_on, kept_on) = runs
    assert len(off) >= 8 and off == on and chosen_off == chosen_on
    assert kept_off > 0.8 * size and kept_on < held, (kept_off, kept_on, held, size)


def test_a_conversion_outside_a_run_gives_its_source_pages_back_when_streaming(model):
    path, m, _, _ = model
    w = m.graph.weights["model.layers.1.mlp.down_proj.weight"]
    for on in (False, True):
        give_back(m.graph.weights)
        before = STREAMING.released
        with STREAMING.set_to(on):
            widened(w, "int8_channel")
        assert (resident(path) >= w.nbytes - 2 * PAGE) is not on, on
        assert STREAMING.released - before == (w.nbytes if on else 0)


def test_the_static_bound_gives_each_weights_pages_back_after_its_last_reader(model):
    """The static analysis reads every weight (its FP64 point interval) kernel by kernel: the same bounds with
    streaming on, and afterwards less of the file held than a layer plus the largest weight (off: ~ all of it)."""
    from luminal_num.error.interval import Interval
    from luminal_num.error.static import static_bound
    path, m, space, batches = model
    program = space.program(pick(space, INT8.__contains__))
    ranges = {n: Interval.point(np.asarray(v, dtype=np.float64)) for n, v in batches[0].items()}
    reports, kept = [], []
    for on in (False, True):
        give_back(m.graph.weights)
        with STREAMING.set_to(on):
            reports.append(static_bound(program, ranges, m.graph.bind_symbols(batches[0]), m.graph.weights))
        kept.append(resident(path))
    assert reports[0].overflow is None and reports[0].error_bounds.keys() == reports[1].error_bounds.keys()
    assert all(np.array_equal(reports[0].error_bounds[n], reports[1].error_bounds[n]) for n in reports[0].error_bounds)
    assert kept[0] > 0.8 * path.stat().st_size and kept[1] < _held(m.graph), kept


def test_the_plans_static_weight_scales_give_each_weights_pages_back(model):
    """The plan stage reads every statically scaled Gemm's weight whole for its scales (outside a run): the
    same scales with streaming on, and afterwards less of the file held than a layer plus the largest weight."""
    from luminal_num.search.plan import static_weight_scales
    path, m, space, batches = model
    program = space.program(pick(space, "gemm:f8e4m3_channel".__eq__))
    scales, kept = [], []
    for on in (False, True):
        give_back(m.graph.weights)
        with STREAMING.set_to(on):
            scales.append(static_weight_scales(program, m.graph.weights, m.graph.bind_symbols(batches[0])))
        kept.append(resident(path))
    assert len(scales[0]) >= 3 * CONFIG.num_hidden_layers and scales[0].keys() == scales[1].keys()
    assert all(np.array_equal(scales[0][k], scales[1][k]) for k in scales[0])
    assert kept[0] > 0.5 * path.stat().st_size and kept[1] < _held(m.graph), kept


def test_the_release_map_keeps_a_tied_weight_until_its_last_reader(tmp_path):
    """A weight tied to another (the embedding read again as the LM head) or any array sharing its bytes keeps
    its pages until the last read of any of them; arrays in memory are never named."""
    values = np.arange(3 * 2048, dtype=np.float32).reshape(3, 2048)  # 3 tensors of 8 KB, page aligned
    (tmp_path / "w.bin").write_bytes(values.tobytes())
    mapped = np.memmap(tmp_path / "w.bin", dtype=np.float32, mode="r", shape=(3, 2048))
    arrays = {"a": mapped[0], "tied": mapped[0], "half": mapped[1, :1024], "b": mapped[1], "c": mapped[2],
              "anon": values[0]}
    got = release_points({"a": 0, "tied": 5, "half": 1, "b": 3, "c": 2, "anon": 4}, arrays)
    names = {pos: sorted(n for n, a in arrays.items() if any(a is x for x in xs)) for pos, xs in got.items()}
    assert names == {5: ["a", "tied"], 3: ["b", "half"], 2: ["c"]}

    # in a program: a tied embedding's pages go after the LM head's Gemm, not after the embedding's gather
    cfg = LlamaConfig(**{**CONFIG.__dict__, "num_hidden_layers": 1, "tie_word_embeddings": True})
    _, weights = load_weights(write_checkpoint(tmp_path / "tied", cfg, seed=1))
    m = build_prefill(cfg, weights, 2, 4)
    program = SearchSpace.build(m.graph).program(frozenset())
    after = page_releases(program, m.graph.weights).after
    position = {k.id: i for i, k in enumerate(program.kernels)}
    embed = weights["model.embed_tokens.weight"]
    at = [position[kid] for kid, arrays in after.items() if any(a is m.graph.weights["model.embed_tokens.weight"]
                                                                or np.shares_memory(a, embed) for a in arrays)]
    readers = [i for i, k in enumerate(program.kernels) for inp in k.inputs
               if program.kernel(inp.buffer).external == "model.embed_tokens.weight"]
    assert len(at) == 1 and len(readers) >= 2 and at[0] == max(readers)


# -- the plan ------------------------------------------------------------------------------------------
GEMMA3_4B = LlamaConfig(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                        num_key_value_heads=4, vocab_size=262144, tie_word_embeddings=True, attention_head_dim=256)


@pytest.fixture
def sparse_4b(tmp_path):
    """The Gemma-3-4B shape's FP32 weights as views of a sparse file (15.5 GB of holes: nothing read or held)."""
    shapes = weight_shapes(GEMMA3_4B)
    size = sum(int(np.prod(s)) * 4 for s in shapes.values())
    path = tmp_path / "gemma.bin"
    with open(path, "wb") as f:
        f.truncate(size)
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    out, offset = {}, 0
    for name, shape in shapes.items():
        count = int(np.prod(shape))
        out[name] = np.frombuffer(buf, np.float32, count, offset).reshape(shape)
        offset += 4 * count
    return out


def test_the_4b_shape_at_20g_is_refused_resident_and_planned_streaming(sparse_4b):
    sizes = WeightSizes.of(sparse_4b)
    c = GEMMA3_4B
    head = c.vocab_size * c.hidden_size * 4  # the tied embedding: the largest weight (2.68 GB)
    q, kv = c.num_attention_heads * c.head_dim, c.kv_dim
    layer = 4 * (2 * c.hidden_size * q + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
                 + 2 * c.hidden_size)
    assert (sizes.total, sizes.largest, sizes.mapped) == (sum(int(np.prod(s)) * 4 for s in weight_shapes(c).values()),
                                                          head, sizes.total)
    assert sizes.held == layer + head  # the largest layer and the largest weight outside it
    assert abs(sizes.total / 1e9 - 15.52) < 0.01 and abs(sizes.held / 1e9 - 3.06) < 0.01
    with pytest.raises(MemoryBudgetError, match=r"needs at least 30\.4 GB .*weights 15\.5 GB"):
        plan_memory(sparse_4b, 20 * GiB, streaming=False)
    plan = plan_memory(sparse_4b, 20 * GiB)
    assert plan.streaming and plan.held == sizes.held and plan.workers == 1
    assert "weights 15.5 GB streamed (3.1 GB held at once)" in plan.describe()
    floor = PROCESS_BASE + sizes.held + (MIN_CACHE + TRANSIENT) * head + 2 * KEPT_MIN
    assert PROCESS_BASE + plan.held + plan.weight_cache + plan.converted_cache + TRANSIENT * head <= plan.budget
    with pytest.raises(MemoryBudgetError) as below:
        plan_memory(sparse_4b, floor - 1)
    assert "weights streamed 3.1 GB of 15.5 GB" in str(below.value) and "\n" not in str(below.value)
    assert plan_memory(sparse_4b, floor).streaming
    resident_plan = plan_memory(sparse_4b, 40 * GiB)
    assert not resident_plan.streaming and "streamed" not in resident_plan.describe()  # it fits: nothing streams


def test_weights_in_memory_never_stream():
    shapes = {n: np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), s, [0] * len(s))
              for n, s in weight_shapes(GEMMA3_4B).items()}
    with pytest.raises(MemoryBudgetError, match=r"needs at least 30\.4 GB"):
        plan_memory(shapes, 20 * GiB)
    with pytest.raises(MemoryBudgetError, match="file-backed"):
        plan_memory(shapes, 40 * GiB, streaming=True)


def test_a_streaming_plan_sets_the_process_policy_while_applied(sparse_4b):
    assert not STREAMING.on
    plan = plan_memory(sparse_4b, 20 * GiB)
    with plan.applied():
        assert STREAMING.on
    assert not STREAMING.on
    with plan_memory(sparse_4b, 40 * GiB).applied():
        assert not STREAMING.on


def test_a_streaming_search_reserves_the_layer_its_own_runs_will_map():
    """At the search, a streaming plan keeps room for what its own runs map at once (a layer and the largest
    weight, `held`) beside the caches: the same budget leaves the caches that much less, or stops."""
    from luminal_num.memory import MemoryPlan, tree_pss
    largest, held = 10 << 20, 40 << 20
    base = MemoryPlan(tree_pss() + 300 * (1 << 20), 0, largest, 1, 300 << 20, 200 << 20, 0)
    streamed = dataclasses.replace(base, streaming=True, held=held)
    room = []
    for plan in (base, streamed):
        with plan.applied():
            plan.fit("search")
            room.append(WEIGHTS.budget_bytes + CONVERTED.budget_bytes)
    assert abs(room[0] - room[1] - held) <= 16 << 20, room  # give or take the pages the process touched meanwhile
    tight = dataclasses.replace(streamed, budget=tree_pss() + (MIN_CACHE + TRANSIENT) * largest + held // 2)
    with tight.applied(), pytest.raises(MemoryBudgetError, match=r"^stage search needs .* beside the"):
        tight.fit("search")


def test_a_budget_the_plan_accepts_passes_the_search_stage(sparse_4b, monkeypatch):
    """The plan's floor counts everything MemoryPlan.fit reserves before the search (the caches' minimum, the
    working copies, the weights read at once, the judging deviations still to keep): a 4B shape at its floor, in a
    process holding PROCESS_BASE, starts its search; 64 MB less than that is refused up front, not 20 s into the
    compile (at 18.5 GiB the search stage refused what the plan had accepted: its judging share was budget / 16)."""
    import luminal_num.memory as memory
    sizes = WeightSizes.of(sparse_4b)
    floor = PROCESS_BASE + sizes.held + (MIN_CACHE + TRANSIENT) * sizes.largest + 2 * KEPT_MIN
    monkeypatch.setattr(memory, "tree_pss", lambda: PROCESS_BASE)
    for budget in (floor, floor + GiB, int(18.5 * GiB), 20 * GiB):
        plan = plan_memory(sparse_4b, budget)
        assert KEPT_MIN <= plan.judging <= max(KEPT_MIN, budget // 16) and plan.boundary == plan.judging
        with plan.applied():
            plan.fit("search", growing=plan.judging)  # nothing of the judging share held yet: all still to come
    with pytest.raises(MemoryBudgetError, match="kept FP64 values and deviations"):
        plan_memory(sparse_4b, floor - (64 << 20))


def test_layers_are_read_from_weight_names():
    assert layer_of("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert layer_of("blk.3.attn_q.weight") == "blk.3"
    assert layer_of("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert layer_of("lm_head.weight") == "lm_head.weight"
