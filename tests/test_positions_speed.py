"""The faster teacher-forced positions pass keeps every bit: the steps' inputs, FP64 logits and targets equal
the per-sequence construction written here (the code before the change), the FP64 pass kept for the next pass
changes nothing, a KV-cache scatter copied as it lies equals the float64 round trip, and a run's float64
outputs read late are its own even after the runtime ran again in their buffers."""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import numpy as np
import pytest

from luminal_num.codegen.llir import KernelKind
from luminal_num.error.pooled import STEPS_TOGETHER
from luminal_num.hlir.partition import partition
from luminal_num.models import llm_positions
from luminal_num.models.llm import Prompt, prefix_caches, stacked_caches
from luminal_num.models.reference import Fp64State
from luminal_num.models.registry import llm_job
from luminal_num.runtime import cpu
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.recipes import baseline_genomes
from luminal_num.search.space import SearchSpace
from tiny_gguf import tiny_config, write_tiny_gguf

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PROMPTS = ("the cat sat on", "a dog ran", "the end of the")
GENOMES = ("FP32 everywhere", "BF16 autocast", "BF16 weights + FP8 KV cache")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    model = tmp_path_factory.mktemp("speed") / "tiny.gguf"
    write_tiny_gguf(model, tiny_config(max_position_embeddings=256))
    return llm_job(str(model), "decode:2@16", [Prompt(p, False) for p in PROMPTS], [Prompt("a cat", False)],
                   positions_minimum=40)


@pytest.fixture(scope="module")
def space(job):
    return SearchSpace.saturated(job.graph, partition(job.graph))


def _bits(a) -> tuple:
    a = np.ascontiguousarray(a)
    return a.dtype.str, a.shape, a.tobytes()


def _same(x: dict, y: dict) -> None:
    assert sorted(x) == sorted(y)
    for name in x:
        assert _bits(x[name]) == _bits(y[name]), name


@dataclass(frozen=True)
class _Config:
    num_hidden_layers: int
    kv_dim: int


@dataclass(frozen=True)
class _Ring:
    """What stacked_caches reads of a built model: layer 1 a ring of 4 rows (a Gemma local layer)."""
    config: _Config
    batch: int

    def cache_rows(self, layer: int) -> int:
        return 6 if layer == 0 else 4


@pytest.mark.parametrize("length", [0, 1, 3, 4, 5, 6, 9])
def test_prefix_caches_are_the_per_sequence_stacked_caches(length):
    rng = np.random.default_rng(length)
    graph = _Ring(_Config(2, 3), batch=3)
    k = [rng.standard_normal((3, 9, 3)) for _ in range(2)]
    v = [rng.standard_normal((3, 9, 3)) for _ in range(2)]
    states = [Fp64State(tuple(layer[i, :length] for layer in k), tuple(layer[i, :length] for layer in v))
              for i in range(3)]
    _same(prefix_caches(k, v, length, graph), stacked_caches(states, graph))


def _old_steps(source) -> list:
    """The steps as models/llm_positions.py made them before (each sequence's prefix state per step)."""
    fp64, built, b, out = source.model.fp64, source.built, source.built.batch, []
    for start in range(0, len(source.windows), b):
        group = list(source.windows[start:start + b])
        real = len(group)
        group += [group[i % real] for i in range(b - real)]
        ran = fp64.hidden_many([list(w) for w in group])
        for s in range(len(group[0])):
            states = [Fp64State(tuple(k[:s] for k in st.k), tuple(v[:s] for v in st.v)) for _, st in ran]
            positions = [s] * len(group)
            inputs = built.make_batch_inputs(np.array([w[s] for w in group])[:, None], np.array(positions)[:, None],
                                             stacked_caches(states, built), positions)
            reference = fp64.head(np.stack([x[s] for x, _ in ran]))
            targets = np.array([w[s + 1] if s + 1 < len(w) else int(np.argmax(reference[j]))
                                for j, w in enumerate(group)])
            out.append((inputs, reference, targets, real))
    return out


def _check_steps(source, want) -> None:
    got = list(source.batches())
    assert len(got) == len(want)
    for batch, (inputs, reference, targets, real) in zip(got, want):
        _same(batch.inputs, inputs)
        assert _bits(batch.reference) == _bits(reference) and _bits(batch.targets) == _bits(targets)
        assert batch.rows == real


@pytest.mark.parametrize("rows", [2, 4])
def test_steps_are_the_old_steps_bit_for_bit_held_or_not(job, rows, monkeypatch):
    source = job.llm.positions.widened(rows)
    want = _old_steps(source)
    assert len(want) == 16 * -(-3 // rows)  # 3 windows of 16 positions, `rows` a step
    _check_steps(source, want)  # made now, and kept
    assert (0, rows) in source._made["fp64"]
    _check_steps(source, want)  # from the kept pass
    monkeypatch.setattr(llm_positions, "FP64_HELD_BYTES", 0)
    fresh = llm_positions.TeacherForcedWindows(source.model, source.built, source.prompts, source.minimum, source.cut)
    _check_steps(fresh, want)  # nothing kept: made for every pass
    assert not fresh._made["fp64"]


def _generic_scatter(k, src, state, index_slot=1, _rows=cpu._scatter_rows):
    """The scatter through its float64 copy of dest (the path before the change), whatever the dtypes."""
    out, state.out = state.out, None
    try:
        return _rows(k, src, state, index_slot)
    finally:
        state.out = out


def _run_all(program, weights, source) -> list[dict]:
    rt, steps, out = CpuRuntime(program, weights), [b.inputs for b in source.batches()], []
    for i in range(0, len(steps), STEPS_TOGETHER):
        out += [dict(r.outputs) for r in rt.run_many(steps[i:i + STEPS_TOGETHER])]
    return out


@pytest.mark.parametrize("genome", GENOMES)
def test_a_scatter_copied_as_stored_equals_its_float64_round_trip(job, space, genome, monkeypatch):
    program = space.program(baseline_genomes(space)[genome])
    scatters = [k for k in program.kernels if k.kind in (KernelKind.SCATTER, KernelKind.SCATTER_NOCOPY,
                                                           KernelKind.SCATTER_EW)]
    assert any(program.kernel(k.inputs[0].buffer).dtype.storage == k.dtype.storage for k in scatters)  # the copy runs
    source = job.llm.positions
    fast = _run_all(program, job.graph.weights, source)
    monkeypatch.setattr(cpu, "_scatter_rows", _generic_scatter)
    slow = _run_all(program, job.graph.weights, source)
    assert len(fast) == len(slow) == 32 and len(fast[0]) == 1 + 2 * 2  # logits and 2 layers' K and V caches
    for f, s in zip(fast, slow):
        _same(f, s)


def test_outputs_read_late_are_their_own_runs(job, space):
    program = space.program(baseline_genomes(space)["BF16 autocast"])
    steps = [b.inputs for b in job.llm.positions.batches()][:5]
    want = [dict(CpuRuntime(program, job.graph.weights).run(s).outputs) for s in steps]  # each read at once
    rt = CpuRuntime(program, job.graph.weights)
    late = [rt.run(s) for s in steps[:2]] + rt.run_many(steps[2:])  # every run after the first takes the buffers
    assert any(not np.array_equal(want[0][n], want[1][n]) for n in want[0])  # a reused buffer would show
    for result, expected in zip(late, want):
        assert len(result.outputs) == len(expected) and "logits" in result.outputs
        _same(dict(result.outputs), expected)
        _same(pickle.loads(pickle.dumps(result.outputs)), expected)
        assert type(pickle.loads(pickle.dumps(result.outputs))) is dict


@pytest.mark.parametrize("genome", ["FP32 everywhere", "BF16 autocast"])
def test_float64_inputs_stored_into_their_slots_are_stored_as_before(job, space, genome, monkeypatch):
    """A KV cache stored straight into its slot: the same values as the fresh copy before (an overflow to inf
    included), and a NaN is refused naming its input, either way."""
    program = space.program(baseline_genomes(space)[genome])
    steps = [dict(b.inputs) for b in job.llm.positions.batches()][3:7]
    name = next(n for n in steps[0] if n.startswith("k_cache"))
    steps[1][name] = steps[1][name].copy()
    steps[1][name][0, 0] = 1e300  # finite, beyond FP32: stored as inf
    taken = []
    into = cpu.f32_into

    def spy(k, val, out):
        taken.append(into(k, val, out))
        return taken[-1]
    monkeypatch.setattr(cpu, "f32_into", spy)
    fast = [dict(r.outputs) for r in CpuRuntime(program, job.graph.weights).run_many(steps)]
    assert sum(taken) >= 4 * 4  # every step's 4 caches went straight into their slots
    monkeypatch.setattr(cpu, "f32_into", lambda k, val, out: False)
    slow = [dict(r.outputs) for r in CpuRuntime(program, job.graph.weights).run_many(steps)]
    assert np.isinf(slow[1][name.replace("k_cache", "k_cache_out")]).sum() == 1  # stored as inf, carried to the output
    for f, s in zip(fast, slow):
        _same(f, s)
    steps[2][name] = steps[2][name].copy()
    steps[2][name][1, 1] = np.nan
    for check in (spy, lambda k, val, out: False):
        monkeypatch.setattr(cpu, "f32_into", check)
        with pytest.raises(ValueError, match=f"input '{name}' contains NaN or Inf"):
            CpuRuntime(program, job.graph.weights).run(steps[2])
