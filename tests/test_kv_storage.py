"""KV-cache storage as a per-layer plan choice (issue 13 item 3): BF16 / FP16 / FP8 E4M3 per-token and
per-head caches. Offered in the e-graph for cache inputs only; the in-place Scatter writes rows
converted and attention reads them widened (checked bit for bit against ml_dtypes casts and a per-row
loop written from the format's definition); the static bound charges the cache's rounding (sound on
genome fuzzing with the KV choices); the cost model counts the cache at its stored bytes."""
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from luminal_num.codegen.llir import KernelKind, ProgramError, verify
from luminal_num.codegen.serialize import program_from_data, program_to_data
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import evaluate
from luminal_num.models.llama import LLAMA_TINY, build_prefill, cache_input_name, cache_output_name, random_weights
from luminal_num.models.testnets import transformer
from luminal_num.quant.kv import KV_TOKEN_FORMATS, cache_error, cache_values, kv_formats
from luminal_num.quant.storage import STORAGE_FORMATS
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.plan import stored_layout
from luminal_num.search.recipes import STORAGE_RECIPES, pick, recipe_genomes
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)
MAX_CACHE, HEAD = 16, LLAMA_TINY.head_dim
FORMATS = kv_formats(HEAD)


@pytest.fixture(scope="module")
def llama():
    """A 2-layer Llama prefill of 3 tokens at rows 4..6 of caches already holding rows 0..3 (FP32 step)."""
    weights = random_weights(LLAMA_TINY, seed=1)
    first = build_prefill(LLAMA_TINY, weights, 4, MAX_CACHE)
    step0 = evaluate(first.graph, first.make_inputs(np.array([5, 6, 7, 8]), np.arange(4)))
    model = build_prefill(LLAMA_TINY, weights, 3, MAX_CACHE)
    inputs = model.make_inputs(np.array([9, 10, 11]), np.arange(4, 7), previous=step0)
    return model, SearchSpace.build(model.graph), inputs


def kv_program(space, fmt: str, extra=frozenset()):
    return space.program(pick(space, ({f"kv:{fmt}"} | set(extra)).__contains__))


# -- independent references, from the formats' definitions ----------------------------------------
def reference_rows(x: np.ndarray, fmt: str) -> np.ndarray:
    """The cache as the format holds it: ml_dtypes casts, or a per-row (per-head) loop: s = amax / 448 in
    FP32 (1 for an all-zero block), q = e4m3(clip(x / s, +-448)), value = q * s in FP32."""
    x = np.asarray(x, np.float32)
    if fmt == "bf16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    if fmt == "f16":
        return x.astype(np.float16).astype(np.float32)
    group = x.shape[1] if fmt == "f8e4m3_channel" else int(fmt.split("_g")[1])
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], group):
            block = x[r, c:c + group]
            amax = float(np.abs(block).max())
            s = np.float32(amax / 448.0) if amax > 0 else np.float32(1.0)
            q = np.clip(block / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            out[r, c:c + group] = q * s
    return out


def test_kv_formats_are_offered_for_the_cache_inputs_only(llama):
    model, space, _ = llama
    caches = {cache_input_name(kind, layer) for kind in "kv" for layer in range(LLAMA_TINY.num_hidden_layers)}
    assert FORMATS == ("bf16", "f16", "f8e4m3_channel", f"f8e4m3_g{HEAD}")
    seen = 0
    for group in space.part.groups:
        gs = space.groups[group.key].space
        offered = {}
        for nodes in gs.classes.values():
            for n in nodes:
                if n.op == "KCacheStored":
                    offered.setdefault(n.arg("slot"), set()).add(n.arg("fmt"))
        for chunk in group.chunks:
            for slot, nid in enumerate(chunk.external):
                node = model.graph.nodes[nid]
                name = node.attr("name") if node.op.name == "INPUT" else None
                if name in caches:
                    assert offered.get(slot) == set(FORMATS), name
                    seen += 1
                else:
                    assert slot not in offered, name
    assert seen == len(caches)
    assert not any(t.startswith("kv:") for ks in SearchSpace.build(transformer(1).graph).knobs.values()
                   for k in ks for t in k.tags)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_cache_holds_exactly_the_format_rows(llama, fmt):
    """Layer 0's K/V rows do not depend on any cache: the KV program's caches are bit for bit the FP32
    program's caches held in the format (old rows on entry, new rows as the Scatter writes them)."""
    model, space, inputs = llama
    fp32 = CpuRuntime(space.program(frozenset()), model.graph.weights).run(inputs).outputs
    program = kv_program(space, fmt)
    held = [k for k in program.kernels if k.storage is not None]
    assert {k.kind for k in held} == {KernelKind.EXTERNAL, KernelKind.SCATTER_NOCOPY}
    assert len(held) == 4 * LLAMA_TINY.num_hidden_layers and {k.storage for k in held} == {fmt}
    out = CpuRuntime(program, model.graph.weights).run(inputs).outputs
    for kind in "kv":
        got, want = out[cache_output_name(kind, 0)], reference_rows(fp32[cache_output_name(kind, 0)], fmt)
        assert got.astype(np.float32).tobytes() == want.tobytes(), kind
    assert np.array_equal(program_from_data(program_to_data(program)).kernels, program.kernels)


@pytest.mark.parametrize("fmt", FORMATS)
def test_static_bound_charges_the_cache_rounding(llama, fmt):
    """Measured vs FP64 <= the static bound for every output, and the bound grows over the FP32 cache's."""
    model, space, inputs = llama
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    b = model.graph.bind_symbols(inputs)
    ref = evaluate(model.graph, inputs)
    program = kv_program(space, fmt)
    rep = static_bound(program, ranges, b, model.graph.weights)
    assert rep.overflow is None
    out = CpuRuntime(program, model.graph.weights).run(inputs).outputs
    for name in ref:
        assert np.all(np.abs(out[name] - ref[name]) <= rep.error_bounds[name]), name
    fp32 = static_bound(space.program(frozenset()), ranges, b, model.graph.weights)
    cache = cache_output_name("k", 0)
    assert np.max(rep.error_bounds[cache]) > 2 * np.max(fp32.error_bounds[cache])


def test_random_genomes_with_kv_choices_have_sound_bounds(llama):
    """Genome fuzzing over every knob (KV formats, weight storage, Gemm variants, activation storage):
    measured error vs FP64 never exceeds the static bound."""
    model, space, inputs = llama
    rng = np.random.default_rng(13)
    ref = evaluate(model.graph, inputs)
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    b = model.graph.bind_symbols(inputs)
    kv_seen = set()
    for _ in range(8):
        genome = frozenset((gk, k.cls, k.tags[int(rng.integers(len(k.tags)))])
                           for gk, ks in space.knobs.items() for k in ks if rng.random() < 0.6)
        program = space.program(genome)
        kv_seen |= {k.storage for k in program.kernels if k.kind is KernelKind.SCATTER_NOCOPY} - {None}
        rep = static_bound(program, ranges, b, model.graph.weights)
        if rep.overflow is not None:
            continue
        out = CpuRuntime(program, model.graph.weights).run(inputs).outputs
        for o in ref:
            assert np.all(np.abs(out[o] - ref[o]) <= rep.error_bounds[o]), o
    assert len(kv_seen) >= 2, kv_seen


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 31), fmt=st.sampled_from(FORMATS), scale=st.sampled_from([1e-30, 1e-6, 1.0, 300.0]))
def test_cache_error_bounds_the_row_conversion_near_the_format_limits(seed, fmt, scale):
    """|cache_values(x) - x| <= cache_error(|x|), rows spanning 10 decades down to subnormals."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((5, 4 * HEAD)) * scale * 10.0 ** rng.uniform(-10, 0, (5, 4 * HEAD))).astype(np.float32)
    x[0] = 0.0
    got = cache_values(x, fmt).astype(np.float64)
    assert np.all(np.abs(got - x) <= cache_error(np.abs(x), fmt))
    assert got.astype(np.float32).tobytes() == reference_rows(x, fmt).tobytes()


def test_cache_error_is_infinite_where_the_format_cannot_hold_the_cache():
    assert np.all(np.isinf(cache_error(np.array([1.0, 7e4]), "f16")))
    assert np.all(np.isfinite(cache_error(np.array([1.0, 7e4]), "f8e4m3_channel")))  # a scale per row
    with pytest.raises(ValueError, match="not a KV-cache format"):
        cache_values(np.ones((2, 8)), "int4_g32")


def test_cost_model_counts_the_cache_at_its_stored_bytes(llama):
    """The attention Gemms read each cache at its format's bytes (codes + scales); the Scatter writes
    its rows at them; hand count from the format definitions."""
    model, space, inputs = llama
    b = model.graph.bind_symbols(inputs)
    rows, width, kv_heads = MAX_CACHE, LLAMA_TINY.kv_dim, LLAMA_TINY.num_key_value_heads
    per_row = {"f32": 4 * width, "bf16": 2 * width, "f16": 2 * width, "f8e4m3_channel": width + 4,
               f"f8e4m3_g{HEAD}": width + 4 * kv_heads}
    for fmt, row_bytes in per_row.items():
        program = kv_program(space, fmt) if fmt != "f32" else space.program(frozenset())
        dtypes, eb = program.dtypes(), program.element_bytes(b)
        scatters = [k for k in program.kernels if k.kind.in_place]  # FP32: RoPE fused with the k write
        assert len(scatters) == 2 * LLAMA_TINY.num_hidden_layers
        for s in scatters:
            assert s.bytes_stored(b) == 3 * row_bytes, fmt  # three new rows
            readers = [k for k in program.kernels if any(i.buffer == s.id for i in k.inputs)
                       and k.kind.is_gemm]  # a plain Gemm or one with an epilogue (Q K^T * scale)
            assert readers
            for g in readers:
                other = g.inputs[0] if g.inputs[1].buffer == s.id else g.inputs[1]
                alone = g.bytes_loaded(b, dtypes, {**eb, s.id: 0.0})
                assert g.bytes_loaded(b, dtypes, eb) - alone == rows * row_bytes, (fmt, other)
        if fmt != "f32":
            assert STORAGE_FORMATS[fmt].stored_bytes((rows, width)) == rows * row_bytes
    assert stored_layout(kv_program(space, "f8e4m3_channel")) == {}  # caches are inputs, not the weights file


def test_the_bf16_weights_fp8_kv_recipe(llama):
    model, space, _ = llama
    genomes = recipe_genomes(space)
    program = space.program(genomes["BF16 weights + FP8 KV cache"])
    formats = {(k.kind, k.storage) for k in program.kernels if k.storage is not None}
    assert formats == {(KernelKind.EXTERNAL, "bf16"), (KernelKind.EXTERNAL, "f8e4m3_channel"),
                       (KernelKind.SCATTER_NOCOPY, "f8e4m3_channel")}
    assert "kv:f8e4m3_channel" in STORAGE_RECIPES["BF16 weights + FP8 KV cache"]
    assert "BF16 weights + FP8 KV cache" not in recipe_genomes(SearchSpace.build(transformer(1).graph))


def test_verify_refuses_a_scatter_that_disagrees_with_its_cache(llama):
    import dataclasses
    _, space, _ = llama
    program = kv_program(space, "bf16")
    s = next(k for k in program.kernels if k.kind is KernelKind.SCATTER_NOCOPY)
    kernels = list(program.kernels)
    kernels[s.id] = dataclasses.replace(s, storage="f16")
    with pytest.raises(ProgramError, match="writes rows as 'f16' into a buffer held as 'bf16'"):
        verify(dataclasses.replace(program, kernels=tuple(kernels)))
    gemm = next(k for k in program.kernels if k.kind is KernelKind.GEMM)
    kernels = list(program.kernels)
    kernels[gemm.id] = dataclasses.replace(gemm, storage="bf16")
    with pytest.raises(ProgramError, match="only weights and KV caches"):
        verify(dataclasses.replace(program, kernels=tuple(kernels)))


def test_kv_token_formats_are_per_token_whatever_the_heads():
    assert KV_TOKEN_FORMATS == kv_formats(0) and kv_formats(48) == KV_TOKEN_FORMATS


def test_smollm2_shaped_decode_counts_the_kv_formats():
    """Two layers of the SmolLM2-shaped step: modelled bytes within 2% of the hand count for each KV
    format, and a smaller cache is a faster step (BF16 weights throughout). At 16384 cache rows: below a
    few thousand, one layer's cache reads of a batch-1 step take less than the 1 us minimum kernel time
    (runtime/targets.py), so every KV format costs the same there."""
    import dataclasses
    from bench.storage_decode import SMOLLM2, measure
    long = dataclasses.replace(SMOLLM2.with_layers(2), max_position_embeddings=16384)
    df = measure(long, 16384).set_index("genome")
    assert np.all(np.abs(df.ratio - 1) <= 0.02)
    lat = df.h200_latency_ms
    assert lat["BF16"] > lat["BF16 + BF16 KV"] == lat["BF16 + FP16 KV"] > lat["BF16 + FP8 KV per-token"]
    assert df.kv_format["BF16 + FP8 KV per-head"] == "f8e4m3_g64"
    assert df.kv_bytes["BF16 + FP8 KV per-head"] > df.kv_bytes["BF16 + FP8 KV per-token"]


# -- CUDA: the in-place scatter writes rows as the cache holds them ------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_cache_scatter_matches_the_cpu_backend_and_compiles(llama, fmt, tmp_path, monkeypatch):
    """The generated in-place Scatter (BF16/FP16: each value rounded; FP8: a block per row or head takes
    its amax, then writes q * s), run by the CUDA interpreter, writes what the CPU backend writes (bit for
    bit); NVRTC compiles it for sm_90 where the toolchain is installed."""
    from test_cuda_codegen import check_against_cpu

    from luminal_num.codegen import nvrtc
    from luminal_num.codegen.cuda_kernels import render_kernel
    model, space, inputs = llama
    program = kv_program(space, fmt)
    scatters = [k for k in program.kernels if k.kind is KernelKind.SCATTER_NOCOPY]
    assert check_against_cpu(program, {**model.graph.weights, **inputs}, scatters) == len(scatters)
    src = render_kernel(scatters[0], program)
    assert ("ln_round_format(" in src.source) == (fmt in ("bf16", "f16"))
    assert ("ln_block_reduce<LnMax>" in src.source) == fmt.startswith("f8")
    if nvrtc.nvrtc_available() and nvrtc.toolchain().include_dirs:
        monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path))
        compiled = nvrtc.compile_cuda(src.source, src.name, "sm_90")
        assert all(f".entry {entry}(" in compiled.ptx for entry in src.entries)


def test_a_plan_with_kv_formats_saves_loads_and_audits_from_its_file(llama, tmp_path):
    """The recipe's plan (BF16 weights in the weights file, FP8 caches converted on entry) round-trips
    through plan.json + its weights file and passes `audit` on new inputs; the file holds no cache."""
    from luminal_num.compiler import calibration_ranges
    from luminal_num.error.budget import Budget
    from luminal_num.error.judge import Judge
    from luminal_num.error.reference import references
    from luminal_num.report.audit import audit
    from luminal_num.runtime.latency import modelled_latency
    from luminal_num.search.plan import Plan
    model, space, inputs = llama
    genome = recipe_genomes(space)["BF16 weights + FP8 KV cache"]
    program = space.program(genome)
    budget = Budget.parse("atol=0.5,rtol=0.5")
    judge = Judge(model.graph, budget, [inputs])
    verdict = judge.confirm(program)
    assert verdict.passed, verdict.reason
    bind = model.graph.bind_symbols(inputs)
    plan = Plan.create(space, genome, program, budget, "h200", 0, verdict, modelled_latency(program, "h200", bind),
                       bind, {}, calibration_ranges(model.graph, space.part, references(model.graph, [inputs])),
                       model.graph.weights)
    assert plan.stored and all(t.fmt.name == "bf16" for t in plan.stored.values())
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    again, _ = loaded.program(model.graph)
    assert {k.storage for k in again.kernels if k.kind is KernelKind.SCATTER_NOCOPY} == {"f8e4m3_channel"}
    other = model.make_inputs(np.array([1, 2, 3]), np.arange(4, 7), previous=None, cached_rows=4)
    result = audit(loaded, model.graph, [inputs, {**other, **{k: v for k, v in inputs.items() if "cache" in k}}])
    assert result.passed, result.reason


# -- run-time rows that overflow or carry NaN ----------------------------------------------------------
def _cuda_scatter_reference(row: np.ndarray, group: int) -> list[float]:
    """Element by element, what the generated FP8 scatter writes (its source's semantics, written out
    here independently): amax over the group's finite |x|, s = fl32(max(amax / 448, 2^-126)) (1 for
    amax 0), q = RN_e4m3 with satfinite (inf -> +-448, NaN stays NaN) of fl32(x / s), then fl32(q * s)."""
    out = []
    for c0 in range(0, len(row), group):
        part = [float(x) for x in row[c0:c0 + group]]
        amax = max([abs(x) for x in part if np.isfinite(x)], default=0.0)
        s = np.float32(max(amax / 448.0, 2.0 ** -126)) if amax > 0 else np.float32(1.0)
        for x in part:
            if np.isnan(x):
                out.append(float("nan"))
                continue
            ratio = np.float32(np.float32(x) / s) if np.isfinite(x) else np.float32(np.copysign(np.inf, x))
            q = float(np.clip(ratio, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)) if np.isfinite(ratio) \
                else float(np.copysign(448.0, ratio))
            out.append(float(np.float32(np.float32(q) * s)))
    return out


@pytest.mark.parametrize("fmt,group", [("f8e4m3_channel", 8), ("f8e4m3_g16", 16)])
def test_non_finite_rows_are_written_as_the_cuda_scatter_writes_them(fmt, group):
    """An activation that overflowed upstream reaches the cache: the row converts instead of raising."""
    rng = np.random.default_rng(7)
    width = 8 if fmt.endswith("channel") else 32
    rows = rng.standard_normal((3, width)).astype(np.float32) * 50
    rows[0, 1], rows[0, 2], rows[1, 3], rows[2, :] = np.inf, -np.inf, np.nan, np.nan
    got = cache_values(rows, fmt)
    want = np.array([_cuda_scatter_reference(r, width if fmt.endswith("channel") else group) for r in rows])
    np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("fmt,limit", [("bf16", ml_dtypes.bfloat16), ("f16", np.float16)])
def test_unscaled_cache_rows_overflow_to_inf(fmt, limit):
    rows = np.array([[3.4e38, -1e6, np.nan, 1.5, 65520.0, np.inf]], np.float32)
    with np.errstate(over="ignore"):
        want = rows.astype(limit).astype(np.float32)  # ml_dtypes / numpy: RNE, inf past the range
    np.testing.assert_array_equal(cache_values(rows, fmt), want)
