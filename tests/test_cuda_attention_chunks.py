"""The CUDA attention kernel's chunked row path (issue 35, item 3) runs bit for bit like the CPU backend.

The chunk (MAX_ROW_KEYS keys, whole tiles) is cut to a few tiles so a few hundred keys make several chunks;
hand-built kernels read GQA (K/V stride 0 along a query group) and a KV cache (a slice of a longer buffer,
V transposed) through their views; the key length leaves a ragged last tile and a ragged last chunk; the
bias masks a prefix longer than a chunk and a suffix with -inf (and, in prefill, one whole row: NaN both
ways). Each variant runs with one split, DECODE_SPLITS equal runs that straddle chunk boundaries, and the
batch-invariant fixed split size (several splits per chunk, more splits than lanes); the interpreter runs the
block's threads in lock step between __syncthreads, MAX_GRID cut so blocks loop over rows."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from test_cuda_codegen import interpret, needs_nvrtc, stored_values
from luminal_num.codegen import cuda_attention, cuda_source, nvrtc
from luminal_num.codegen.attention import (ATTENTION_VARIANTS, DECODE_SPLITS, INVARIANT_SPLIT_KEYS, KEY_TILE,
                                           AttentionSpec, check_attention, key_ranges)
from luminal_num.codegen.cuda_attention import attention_plan
from luminal_num.codegen.cuda_kernels import clear_render_cache, render_kernel
from luminal_num.codegen.llir import FApply, FLoad, Kernel, KernelInput, KernelKind, Program
from luminal_num.dtypes.formats import F32
from luminal_num.hlir.ops import Op
from luminal_num.hlir.shape import ShapeTracker
from luminal_num.hlir.symbolic import sym
from luminal_num.runtime.cpu import CpuRuntime

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")  # log2(0) = -inf: the mask
SCALE = 0.35


def attention_program(kv_heads: int, group: int, queries: int, keys: int, depth: int, dv: int, cache: int,
                      start: int, variant: str, spec: AttentionSpec) -> Program:
    """One ATTENTION kernel over scores (kv_heads, group, queries, keys): q (kv_heads, group, queries, depth);
    K and V rows [start, start + keys) of caches (kv_heads, cache, depth / dv), shared by the group (stride 0);
    the bias (queries, keys) = log2(`visible`), shared by every head: an elementwise kernel, so that a
    masked key (visible 0) is -inf, which no graph input may hold."""
    scores = (kv_heads, group, queries, keys)
    q = ShapeTracker.contiguous((kv_heads, group, queries, depth)).expand_dim(3, keys)
    k = ShapeTracker.contiguous((kv_heads, cache, depth)).slice([(0, kv_heads), (start, start + keys)])
    k = k.expand_dim(1, group).expand_dim(2, queries)
    bias = ShapeTracker.contiguous((queries, keys)).expand_dim(0, kv_heads).expand_dim(1, group)
    v = ShapeTracker.contiguous((kv_heads, cache, dv)).slice([(0, kv_heads), (start, start + keys)])
    v = v.permute((0, 2, 1)).expand_dim(1, group).expand_dim(2, queries)
    externals = [("q", (kv_heads, group, queries, depth)), ("k", (kv_heads, cache, depth)),
                 ("visible", (queries, keys)), ("v", (kv_heads, cache, dv))]
    ks = [Kernel(id=i, kind=KernelKind.EXTERNAL, inputs=(), shape=shape, dtype=F32, external=name)
          for i, (name, shape) in enumerate(externals)]
    ks.append(Kernel(id=4, kind=KernelKind.ELEMENTWISE, inputs=(KernelInput(2, ShapeTracker.contiguous((queries, keys))),),
                     shape=(queries, keys), dtype=F32, body_shape=(queries, keys), body=FApply(Op.LOG2, (FLoad(0),))))
    ks.append(Kernel(id=5, kind=KernelKind.ATTENTION, shape=scores[:-1] + (dv,), dtype=F32, body_shape=scores, axis=3,
                     precision=variant, value=spec,
                     inputs=tuple(KernelInput(b, view) for b, view in zip((0, 1, 4, 3), (q, k, bias, v)))))
    assert check_attention(ks[-1]) == ""
    return Program(tuple(ks), tuple((name, i) for i, (name, _) in enumerate(externals)), (("y", 5),))


def feed(program: Program, masked: dict[int, tuple[int, int]], seed: int) -> dict:
    """Normal q, k, v (q and k doubled so scores spread over several units); `visible` in [0.5, 2] (a bias in
    [-1, 1]) except 0 (a bias of -inf) on each masked query's first `pre` and last `post` keys (`masked`:
    query -> (pre, post))."""
    rng = np.random.default_rng(seed)
    shapes = {k.external: k.shape for k in program.kernels if k.kind is KernelKind.EXTERNAL}
    out = {name: rng.standard_normal(shapes[name]) * (2.0 if name in ("q", "k") else 1.0) for name in ("q", "k", "v")}
    queries, keys = shapes["visible"]
    visible = rng.uniform(0.5, 2.0, (queries, keys))
    for query, (pre, post) in masked.items():
        visible[query, :pre] = 0.0
        visible[query, keys - post:] = 0.0
    out["visible"] = visible
    return out


@pytest.fixture(autouse=True)
def fresh_renders():
    """Renders are cached by kernel structure: none made under another test's cut chunk is reused."""
    clear_render_cache()
    yield
    clear_render_cache()


def check(program, data: dict, chunk_keys: int, monkeypatch, grid_cap: int | None = None,
          partials: str | None = None) -> np.ndarray:
    """The interpreter's output of the kernel with chunks of `chunk_keys` keys, equal to the CPU backend's;
    `partials` "shared" / "scratch": where the kernel must keep them (SHARED_PARTIALS cut to 0 for "scratch")."""
    monkeypatch.setattr(cuda_attention, "MAX_ROW_KEYS", chunk_keys)
    if grid_cap is not None:
        monkeypatch.setattr(cuda_source, "MAX_GRID", grid_cap)
    if partials == "scratch":
        monkeypatch.setattr(cuda_attention, "SHARED_PARTIALS", 0)
    att = program.kernels[-1]
    plan = attention_plan(att)
    assert plan.chunk_tiles * KEY_TILE == chunk_keys  # the chunk the kernel is rendered with
    assert partials is None or plan.shared_partials == (partials == "shared")
    assert bool(render_kernel(att, program).scratch) != plan.shared_partials
    with np.errstate(divide="ignore", invalid="ignore"):
        want = CpuRuntime(program).run(data).outputs["y"]
        stored = stored_values(program, data)
    assert np.isneginf(stored[4]).any() or not (data["visible"] == 0).any()
    got = interpret(program, att, stored, {})
    np.testing.assert_array_equal(got, want)
    return want


# 150 keys: 10 tiles, the last of 6 keys; 32-key chunks: 5 chunks, the last of 22 keys
KEYS, CHUNK = 150, 2 * KEY_TILE
SPECS = {"one split": AttentionSpec(SCALE), "equal splits": AttentionSpec(SCALE, splits=DECODE_SPLITS),
         "fixed split size": AttentionSpec(SCALE, splits=-(-KEYS // INVARIANT_SPLIT_KEYS),
                                           split_keys=INVARIANT_SPLIT_KEYS)}


@pytest.mark.parametrize("partials", ["shared", "scratch"])
@pytest.mark.parametrize("variant", sorted(ATTENTION_VARIANTS))
@pytest.mark.parametrize("form", sorted(SPECS))
def test_chunked_decode_is_bit_for_bit_the_cpu_backend(variant, form, partials, monkeypatch):
    """Decode (one query per head), GQA (2 KV heads x 2 queries) over a cache slice: a 40-key -inf prefix
    (the first chunk all -inf) and a 20-key -inf suffix on the one query row; the partials in shared memory
    and in the scratch region."""
    spec = SPECS[form]
    program = attention_program(2, 2, 1, KEYS, 4, 8, cache=KEYS + 9, start=5, variant=variant, spec=spec)
    chunks, splits = -(-KEYS // CHUNK), key_ranges(KEYS, spec)
    assert chunks == 5 and KEYS % KEY_TILE and KEYS % CHUNK  # ragged last tile and chunk
    if spec.splits > 1:  # some split straddles a chunk boundary
        assert any(r[0][0] // CHUNK != (r[-1][1] - 1) // CHUNK for r in splits if r)
    want = check(program, feed(program, {0: (40, 20)}, seed=1), CHUNK, monkeypatch, grid_cap=3, partials=partials)
    assert np.all(np.isfinite(want))


def test_prefill_rows_with_a_fully_masked_row_and_two_column_groups(monkeypatch):
    """Prefill (3 queries, one split): a masked prefix of two chunks, a query with every key masked (NaN in
    both backends), and a V width of 36 (two groups of 32 columns, the second ragged)."""
    program = attention_program(1, 2, 3, KEYS, 3, 36, cache=KEYS, start=0, variant="flash_bf16",
                                spec=AttentionSpec(SCALE))
    want = check(program, feed(program, {0: (70, 0), 1: (KEYS, 0), 2: (0, 31)}, seed=2), CHUNK, monkeypatch,
                 grid_cap=4)
    assert np.isnan(want[:, :, 1]).all() and np.isfinite(want[:, :, 0]).all() and np.isfinite(want[:, :, 2]).all()


def test_fixed_split_size_with_more_splits_than_lanes_and_several_per_chunk(monkeypatch):
    """300 keys at the fixed 64-key split size: 5 splits (more than the kernel's lanes), 128-key chunks hold two
    whole splits each and the third chunk a ragged split."""
    keys = 300
    spec = AttentionSpec(SCALE, splits=-(-keys // INVARIANT_SPLIT_KEYS), split_keys=INVARIANT_SPLIT_KEYS)
    program = attention_program(1, 3, 1, keys, 4, 6, cache=keys + 16, start=16, variant="flash_f16", spec=spec)
    plan = attention_plan(program.kernels[-1])
    assert plan.splits == 5 > plan.lanes and plan.threads == cuda_attention.COLUMN_THREADS * plan.lanes
    check(program, feed(program, {0: (130, 0)}, seed=3), 128, monkeypatch)


def test_a_known_short_row_takes_a_chunk_of_its_own_length():
    """20 keys: two tiles of shared scores, not MAX_ROW_KEYS (the block's shared memory follows the row)."""
    program = attention_program(1, 1, 1, 20, 2, 2, cache=20, start=0, variant="flash_f32", spec=AttentionSpec(1.0))
    assert attention_plan(program.kernels[-1]).chunk_tiles == 2
    assert "float sc[32];" in render_kernel(program.kernels[-1], program).source


def test_a_chunk_smaller_than_a_tile_a_symbolic_v_width_and_a_fixed_split_of_unknown_keys_are_refused(monkeypatch):
    program = attention_program(1, 1, 1, 20, 2, 2, cache=20, start=0, variant="flash_f32", spec=AttentionSpec(1.0))
    monkeypatch.setattr(cuda_attention, "MAX_ROW_KEYS", KEY_TILE - 1)
    with pytest.raises(ValueError, match="does not fit"):
        render_kernel(program.kernels[-1], program)
    monkeypatch.undo()
    att = program.kernels[-1]
    with pytest.raises(ValueError, match="compile-time constant"):
        attention_plan(dataclasses.replace(att, shape=att.shape[:-1] + (sym("w"),)))
    fixed = AttentionSpec(1.0, splits=1, split_keys=INVARIANT_SPLIT_KEYS)
    with pytest.raises(ValueError, match="known key length"):
        attention_plan(dataclasses.replace(att, value=fixed, body_shape=att.body_shape[:-1] + (sym("t"),)))


@needs_nvrtc
def test_chunked_kernels_compile_for_sm90():
    """Every variant and split form at a long row (8192 keys: two full chunks), and at a fixed split size."""
    sources = {}
    for variant in sorted(ATTENTION_VARIANTS):
        for spec in (AttentionSpec(SCALE), AttentionSpec(SCALE, splits=DECODE_SPLITS),
                     AttentionSpec(SCALE, splits=128, split_keys=INVARIANT_SPLIT_KEYS)):
            program = attention_program(2, 4, 1, 8192, 64, 64, cache=8192, start=0, variant=variant, spec=spec)
            src = render_kernel(program.kernels[-1], program)
            assert bool(src.scratch) == bool(spec.split_keys) and src.launches[0].block[0] <= 128
            sources[src.name] = src.source
    for name, source in sources.items():
        assert nvrtc.compile_cuda(source, name, "sm_90") is not None
    assert len(sources) == 9


def test_a_row_past_the_real_chunk_size(monkeypatch):
    """The real MAX_ROW_KEYS: 4096 + 150 keys (a second, ragged chunk), f32, equal splits, one KV head of two
    queries, the first chunk all -inf."""
    keys = cuda_attention.MAX_ROW_KEYS + KEYS
    program = attention_program(1, 2, 1, keys, 2, 2, cache=keys, start=0, variant="flash_f32",
                                spec=AttentionSpec(SCALE, splits=DECODE_SPLITS))
    check(program, feed(program, {0: (4100, 9)}, seed=4), cuda_attention.MAX_ROW_KEYS, monkeypatch)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """The executing CUDA stand-in (tests/fake_cuda.py): the CUDA runtime's launches run in the interpreter."""
    from fake_cuda import executing_stand_in
    yield from executing_stand_in(monkeypatch, tmp_path)


@needs_nvrtc
@pytest.mark.parametrize("partials", ["shared", "scratch"])
def test_the_cuda_runtime_runs_the_chunked_kernel_like_the_cpu_backend(fake, partials, monkeypatch):
    """Through the CUDA runtime (its buffer slots, the scratch region it allocates and passes, the bias kernel
    before): several chunks at a fixed split size, the partials in shared memory and in scratch."""
    from luminal_num.runtime.cuda import CudaRuntime
    monkeypatch.setattr(cuda_attention, "MAX_ROW_KEYS", CHUNK)
    if partials == "scratch":
        monkeypatch.setattr(cuda_attention, "SHARED_PARTIALS", 0)
    program = attention_program(2, 2, 1, KEYS, 4, 8, cache=KEYS + 9, start=5, variant="flash_bf16",
                                spec=SPECS["fixed split size"])
    assert bool(render_kernel(program.kernels[-1], program).scratch) == (partials == "scratch")
    data = feed(program, {0: (40, 20)}, seed=6)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = CpuRuntime(program).run(data).outputs["y"]
    got = CudaRuntime(program).run(data).outputs["y"]
    assert got.astype(np.float32).tobytes() == want.astype(np.float32).tobytes()
    assert fake.ops("launch")


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(ATTENTION_VARIANTS))
@pytest.mark.parametrize("form", sorted(SPECS))
def test_two_real_chunks_every_variant_and_split_form(variant, form, monkeypatch):
    """4096 + 150 keys at the real chunk size (the second chunk ragged), GQA over a cache slice, V width 33
    (two column groups, the second of one column), the first chunk and a 9-key suffix -inf, blocks looping
    over rows (MAX_GRID 1)."""
    keys = cuda_attention.MAX_ROW_KEYS + KEYS
    spec = SPECS[form]
    if spec.split_keys:
        spec = AttentionSpec(SCALE, splits=math.ceil(keys / INVARIANT_SPLIT_KEYS), split_keys=INVARIANT_SPLIT_KEYS)
    program = attention_program(1, 2, 1, keys, 3, 33, cache=keys + 7, start=7, variant=variant, spec=spec)
    check(program, feed(program, {0: (4100, 9)}, seed=5), cuda_attention.MAX_ROW_KEYS, monkeypatch, grid_cap=1)


def test_the_cost_models_serial_extent_is_the_chunked_kernels_walk():
    """Hand-derived from the kernel: 1000 keys, head dim 64, V width 64 (two 32-column groups); the score dots
    and p_j (65 steps per key) shared by the block's threads, then per column group the keys a thread walks
    (its lane's splits) and the combine (2 steps per split)."""
    from luminal_num.codegen.cuda_attention import serial_steps
    assert serial_steps(AttentionSpec(1.0, splits=4), 1000, 64, 64) == 508 + 2 * (250 + 8)  # 128 threads, 4 lanes
    assert serial_steps(AttentionSpec(1.0), 1000, 64, 64) == 2032 + 2 * (1000 + 2)  # 32 threads, one lane
    # a fixed 64-key split size: 63 tiles -> 16 splits over 4 lanes
    assert serial_steps(AttentionSpec(1.0, splits=16, split_keys=64), 1000, 64, 64) == 508 + 2 * (250 + 32)
