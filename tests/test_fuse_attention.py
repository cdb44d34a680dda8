"""Attention as one kernel, derived by rewrite (issue 16, item 3): the rule fires on every model's
attention; the CPU emulation equals a slow plain-Python online softmax bit for bit; fused and unfused
agree up to the roundings fusion removes; the static bound holds under genome fuzzing with fusion on;
the CUDA kernel compiles (NVRTC, sm_90) and the interpreter runs it bit for bit like the CPU backend."""
from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_cuda_codegen import interpret, needs_nvrtc, stored_values
from luminal_num.codegen import cuda_source, nvrtc
from luminal_num.codegen import cuda_attention
from luminal_num.codegen.attention import ATTENTION_VARIANTS, DECODE_SPLITS, AttentionSpec, key_ranges
from luminal_num.codegen.cuda_kernels import clear_render_cache, render_kernel
from luminal_num.codegen.llir import KernelKind
from luminal_num.dtypes.formats import BF16, F32
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import Graph, evaluate
from luminal_num.hlir.symbolic import evaluate as eval_dim
from luminal_num.models.bert import BertConfig, build_bert
from luminal_num.models.llama import LLAMA_TINY, LlamaConfig, build_decode, build_prefill, random_weights
from luminal_num.models.testnets import transformer
from luminal_num.runtime.cpu import CpuRuntime, bind_program
from luminal_num.runtime.cpu_attention import online_softmax_pv, scores
from luminal_num.runtime.latency import kernel_works
from luminal_num.search.choice import random_candidate
from luminal_num.search.lower import lower_program
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace
from test_bert import random_weights as bert_weights, tiny_config

warnings.filterwarnings("ignore", category=RuntimeWarning)
FUSED = "attn:flash_f32"


def _tag(tag):
    return lambda t: t == tag


def _attention_classes(space: SearchSpace) -> int:
    """E-classes (over all chunks) holding a KAttention alternative."""
    total = 0
    for g in space.part.groups:
        gs = space.groups[g.key].space
        per_chunk = sum(1 for nodes in gs.classes.values() if any(n.op == "KAttention" and n.arg("dt") == "f32"
                                                                  for n in nodes))
        total += per_chunk * len(g.chunks)
    return total


def _per_layer(program, chunks) -> dict[int, dict[str, int]]:
    out: dict[int, dict[str, int]] = {}
    for k in program.launched():
        if k.chunk in chunks:
            out.setdefault(k.chunk, {}).setdefault(k.kind.value, 0)
            out[k.chunk][k.kind.value] += 1
    return out


def _llama(seq: int | None):
    w = random_weights(LLAMA_TINY)
    return (build_decode(LLAMA_TINY, w, 16) if seq is None else build_prefill(LLAMA_TINY, w, seq, 16)).graph


def _bert():
    config = tiny_config(2, heads=2)
    return build_bert(BertConfig.from_dict(config), bert_weights(config, np.random.default_rng(0)), 2, 5).graph


MODELS = {"llama_decode": lambda: _llama(None), "llama_prefill": lambda: _llama(4), "minilm_tiny": _bert,
          "transformer": lambda: transformer(2).graph}
# SmolLM2-135M's attention shapes (hidden 576, 9 query heads over 3 KV heads, head dim 64), two layers,
# a small vocabulary: only the rule's firing is checked on these
SMOLLM2_SHAPED = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                             num_key_value_heads=3, vocab_size=256, rms_norm_eps=1e-5, max_position_embeddings=256)
FIRING = {**MODELS,
          "smollm2_decode": lambda: build_decode(SMOLLM2_SHAPED, random_weights(SMOLLM2_SHAPED), 256).graph,
          "smollm2_prefill": lambda: build_prefill(SMOLLM2_SHAPED, random_weights(SMOLLM2_SHAPED), 16, 256).graph}


# -- the rule fires ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(FIRING))
def test_rule_fires_once_per_attention_and_replaces_four_launches(name):
    """One attention per layer (2 layers each): QK^T Gemm, scale CONST, Softmax, PV Gemm -> one kernel;
    a one-query (decode) kernel splits its keys (flash decoding), a prefill kernel does not."""
    graph = FIRING[name]()
    space = SearchSpace.build(graph)
    assert _attention_classes(space) == 2
    assert _attention_classes(SearchSpace.build(graph, fusion=False)) == 0
    base, fused = space.program(pick(space, _tag("f32"))), space.program(pick(space, _tag(FUSED)))
    fused_kernels = [k for k in fused.launched() if k.kind is KernelKind.ATTENTION]
    layers = {k.chunk for k in fused_kernels}
    assert len(layers) == 2
    assert {k.value.splits for k in fused_kernels} == ({DECODE_SPLITS} if "decode" in name else {1})
    before, after = _per_layer(base, layers), _per_layer(fused, layers)
    for c in layers:
        assert after[c]["attention"] == 1 and "softmax" not in after[c]
        gemms = lambda kinds: sum(n for kind, n in kinds.items() if KernelKind(kind).is_gemm)  # noqa: E731 (epilogues too)
        assert gemms(after[c]) == gemms(before[c]) - 2
        assert sum(after[c].values()) <= sum(before[c].values()) - 2  # (row fusion already folds the scale constant)
    print(name, "kernels per layer before", {c: sum(v.values()) for c, v in before.items()},
          "after", {c: sum(v.values()) for c, v in after.items()})


def test_fusion_off_is_todays_space():
    graph = transformer(2).graph
    off, on = SearchSpace.build(graph, fusion=False), SearchSpace.build(graph)
    # fused attention is a knob choice: the FP32 base extraction (whatever other fusions it takes) has none
    assert not any(k.kind is KernelKind.ATTENTION for k in on.program(frozenset()).kernels)
    assert any(t.startswith("attn:") for ks in on.knobs.values() for k in ks for t in k.tags)
    assert all(not t.startswith("attn:") for ks in off.knobs.values() for k in ks for t in k.tags)


# -- emulation == slow reference, bit for bit ----------------------------------------------------------------
def _slow_round(x: float, fmt) -> float:
    if fmt is F32:
        return x
    return float(ml_dtypes.bfloat16(x)) if fmt is BF16 else float(np.float16(x))


def _slow_exp(x):
    return np.float32(math.exp(float(x))) if x != -math.inf else np.float32(0.0)


def slow_attention(q, k, bias, v, spec: AttentionSpec, fmt):
    """Plain Python loops over one row at a time: the online softmax with numpy float32 scalars."""
    n, t, d = q.shape
    out = np.zeros((n, v.shape[1]), dtype=np.float32)
    f32 = np.float32
    for r in range(n):
        s = []
        for j in range(t):
            acc = f32(0.0)
            for x in range(d):
                acc = f32(acc + f32(_slow_round(q[r, j, x], fmt)) * f32(_slow_round(k[r, j, x], fmt)))
            s.append(f32(f32(acc * f32(spec.scale)) + f32(bias[r, j])))
        for c in range(v.shape[1]):
            parts = []
            for tiles in key_ranges(t, spec):
                m, l, o = f32(-np.inf), f32(0.0), f32(0.0)
                for a, b in tiles:
                    mn = max(m, max(s[a:b]))
                    alpha = _slow_exp(f32(m - mn)) if mn != -np.inf else f32(0.0)
                    l, o = f32(l * alpha), f32(o * alpha)
                    for j in range(a, b):
                        p = _slow_exp(f32(s[j] - mn))
                        l = f32(l + p)
                        o = f32(o + f32(f32(_slow_round(p, fmt)) * f32(_slow_round(v[r, c, j], fmt))))
                    m = mn
                parts.append((m, l, o))
            big = max(p[0] for p in parts)
            tl, to = f32(0.0), f32(0.0)
            for m, l, o in parts:
                w = _slow_exp(f32(m - big)) if m != -np.inf else f32(0.0)
                tl, to = f32(tl + f32(l * w)), f32(to + f32(o * w))
            out[r, c] = f32(to / tl)
    return out


@settings(deadline=None, max_examples=12, derandomize=True)
@given(t=st.integers(1, 40), splits=st.sampled_from([1, 2, 4]), tile=st.sampled_from([4, 16]),
       variant=st.sampled_from(sorted(ATTENTION_VARIANTS)), masked=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_emulation_equals_the_slow_reference_bit_for_bit(t, splits, tile, variant, masked, seed):
    rng = np.random.default_rng(seed)
    n, d, dv = 3, 5, 4
    q, k = (rng.standard_normal((n, t, d)).astype(np.float32) * 3 for _ in range(2))
    v = rng.standard_normal((n, dv, t)).astype(np.float32)
    bias = np.where(rng.random((n, t)) < 0.3, -1e9, 0.0).astype(np.float32) if masked else np.zeros((n, t), np.float32)
    bias[:, 0] = 0.0
    spec, fmt = AttentionSpec(0.37, tile, splits), ATTENTION_VARIANTS[variant].qk
    got = online_softmax_pv(scores(q, k, bias, spec.scale, fmt), v, spec, fmt)
    want = slow_attention(q, k, bias, v, spec, fmt)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# -- fused vs unfused, static soundness ----------------------------------------------------------------------
def _inputs(graph, seed, scale=1.0):
    """Random activations for every non-weight input of a graph (index inputs at valid positions)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, info in graph.inputs.items():
        if info.is_weight:
            continue
        shape = tuple(info.shape)
        if info.dtype.kind.name == "INT":
            out[name] = np.arange(int(np.prod(shape))).reshape(shape) % 4
        elif info.value_range is not None and info.value_range[0] <= -1e8:  # an attention bias: 0 or masked
            out[name] = np.where(rng.random(shape) < 0.3, info.value_range[0], 0.0)
            out[name][..., 0] = 0.0
        else:
            out[name] = scale * rng.uniform(-1, 1, shape)
    return out


def test_fused_fp32_differs_from_unfused_only_by_the_online_roundings():
    """With every unfused store FP32 the removed roundings are FP32 stores of FP32 values (exact): the
    two programs differ only by the order of the softmax's operations, a few FP32 ulps of the output."""
    graph = transformer(2).graph
    space = SearchSpace.build(graph)
    x = {"x": np.random.default_rng(1).standard_normal((8, 32))}
    ref = evaluate(graph, x)["y"]
    a = CpuRuntime(space.program(pick(space, _tag("f32"))), graph.weights).run(x).outputs["y"]
    b = CpuRuntime(space.program(pick(space, _tag(FUSED))), graph.weights).run(x).outputs["y"]
    assert np.max(np.abs(a - b)) <= 64 * 2.0 ** -24 * np.max(np.abs(ref))
    assert np.max(np.abs(b - ref)) <= 4 * max(np.max(np.abs(a - ref)), 2.0 ** -24 * np.max(np.abs(ref)))


def _attention_only(bias_value: float, scale: float, s: int, v_scale: float) -> tuple[Graph, dict]:
    rng = np.random.default_rng(3)
    g = Graph()
    d = 16
    x = g.input("x", (s, d), value_range=(-1.0, 1.0))
    q, k = (x @ g.weight(f"w_{n}", scale * rng.standard_normal((d, d)) / np.sqrt(d)) for n in "qk")
    v = x @ g.weight("w_v", v_scale * rng.standard_normal((d, d)) / np.sqrt(d))
    mask = np.where(rng.random((s, s)) < 0.4, bias_value, 0.0)
    np.fill_diagonal(mask, 0.0)
    g.output(((q @ k.transpose()) * (1.0 / np.sqrt(d)) + g.weight("mask", mask)).softmax(-1) @ v, "y")
    return g, {"x": Interval(np.full((s, d), -1.0), np.full((s, d), 1.0))}


@pytest.mark.parametrize("bias_value,scale,keys,v_scale", [
    (-1e9, 1.0, 24, 1.0), (-1e4, 8.0, 24, 1.0), (-1e30, 2.0, 24, 1.0), (0.0, 30.0, 24, 1.0),
    (-1e9, 1.0, 160, 1.0), (0.0, 1.0, 24, 3e4), (0.0, 4.0, 24, 1e-6)])
def test_every_fused_variant_is_bounded_at_points_and_over_the_range(bias_value, scale, keys, v_scale):
    """Masks at -1e9 / -1e30 (inputs must be finite: -inf is refused at the input), large scores (exp
    near underflow), 160 keys in 16-key tiles, V near FP16's max (its rounding may overflow: the bound
    is then infinite) and near FP16's subnormals."""
    g, declared = _attention_only(bias_value, scale, keys, v_scale)
    space = SearchSpace.build(g)
    rng = np.random.default_rng(0)
    for tag in sorted(ATTENTION_VARIANTS):
        program = space.program(pick(space, _tag("attn:" + tag)))
        assert any(k.kind is KernelKind.ATTENTION for k in program.kernels)
        over_range = static_bound(program, declared, {}, g.weights).max_bound("y")
        for edge in (False, True):
            x = rng.choice([-1.0, 1.0], (keys, 16)) if edge else rng.uniform(-1, 1, (keys, 16))
            err = np.abs(CpuRuntime(program, g.weights).run({"x": x}).outputs["y"] - evaluate(g, {"x": x})["y"])
            at_point = static_bound(program, {"x": Interval.point(x)}, {}, g.weights).error_bounds["y"]
            assert np.all((err <= at_point) | np.isinf(at_point)), tag
            assert np.all((err <= over_range) | np.isinf(over_range)), tag
            if v_scale == 1.0:  # an informative bound where nothing overflows
                assert np.all(np.isfinite(at_point)), tag


@pytest.mark.parametrize("name", sorted(MODELS))
def test_genome_fuzzing_with_fusion_on_stays_within_bounds(name):
    """Random candidates over the whole space, fused attention forced into half of them: measured
    error vs FP64 never exceeds the static bound (inputs near the declared limits)."""
    graph = MODELS[name]()
    space = SearchSpace.build(graph)
    rng = np.random.default_rng(7)
    fused_seen = 0
    for trial in range(6):
        inputs = _inputs(graph, trial, scale=1.0 if trial % 2 else 4.0)
        ref = evaluate(graph, inputs)
        ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
        choices = {}
        for g in space.part.groups:
            gs = space.groups[g.key].space
            cand = random_candidate(gs, rng)
            if trial % 2 == 0:  # force a fused variant on every attention class reachable from this draw
                forced = dict(cand.choices)
                for cid, nodes in gs.classes.items():
                    idx = [i for i, n in enumerate(nodes) if n.op == "KAttention"]
                    if idx:
                        forced[cid] = idx[int(rng.integers(len(idx)))]
                cand = type(cand)(tuple(sorted(forced.items())))
            for c in g.chunks:
                choices[c.index] = cand
        program = lower_program(graph, space.part, space.groups, choices)
        fused_seen += sum(k.kind is KernelKind.ATTENTION for k in program.kernels)
        rep = static_bound(program, ranges, graph.bind_symbols(inputs), graph.weights)
        if rep.overflow is not None:
            continue
        out = CpuRuntime(program, graph.weights).run(inputs).outputs
        for out_name in ref:
            assert np.all(np.abs(out[out_name] - ref[out_name]) <= rep.error_bounds[out_name]), out_name
    assert fused_seen > 0


# -- CUDA: NVRTC compiles it, the interpreter runs it like the CPU backend ------------------------------------
def _fused_programs():
    graph = transformer(1, s=5).graph
    space = SearchSpace.build(graph)
    feed = {**graph.weights, "x": np.random.default_rng(2).standard_normal((5, 32))}
    yield space, feed, [space.program(pick(space, _tag("attn:" + t))) for t in sorted(ATTENTION_VARIANTS)]
    g = _llama(None)
    space = SearchSpace.build(g)
    yield space, {**g.weights, **_inputs(g, 0)}, [space.program(pick(space, _tag(FUSED)))]


def test_cuda_kernel_runs_bit_for_bit_like_the_cpu_backend():
    checked = 0
    for _, feed, programs in _fused_programs():
        for program in programs:
            bindings, stored = bind_program(program, feed), stored_values(program, feed)
            for k in program.launched():
                if k.kind is KernelKind.ATTENTION:
                    got = interpret(program, k, stored, bindings)
                    want = stored[k.id].reshape([eval_dim(d, bindings) for d in k.shape])
                    np.testing.assert_array_equal(got, want)
                    checked += 1
    assert checked >= 4  # three variants in prefill, the split-K decode form


@needs_nvrtc
def test_cuda_attention_compiles_for_sm90():
    sources = {}
    for _, _, programs in _fused_programs():
        for program in programs:
            for k in program.launched():
                if k.kind is KernelKind.ATTENTION:
                    src = render_kernel(k, program)
                    sources[src.name] = src.source
    for name, source in sources.items():
        assert nvrtc.compile_cuda(source, name, "sm_90") is not None
    assert len(sources) >= 4


# -- cost model: one launch, Q K V read once (cache at its stored bytes), O written, no scores --------------
def test_cost_counts_one_launch_and_no_score_traffic():
    g = _llama(None)
    space = SearchSpace.build(g)
    base, fused = space.program(pick(space, _tag("f32"))), space.program(pick(space, _tag(FUSED)))
    bindings = bind_program(base, {**g.weights, **_inputs(g, 0)})
    att = next(k for k in fused.launched() if k.kind is KernelKind.ATTENTION)
    work = next(w for w in kernel_works(fused, bindings) if w.name.startswith(f"k{att.id}:"))
    heads, kv, cache, dh = LLAMA_TINY.num_attention_heads, LLAMA_TINY.num_key_value_heads, 16, LLAMA_TINY.head_dim
    # Q once per head, K and V once per KV head (GQA: stride 0 over the group), the bias row once
    assert work.bytes_read == 4 * (heads * dh + 2 * kv * cache * dh + cache)
    assert work.bytes_written == 4 * heads * dh
    # QK^T, softmax and PV -> one kernel (the scale constant no longer launches: row fusion folds it)
    assert len(fused.launched()) == len(base.launched()) - 2 * LLAMA_TINY.num_hidden_layers


def test_cuda_kernel_covers_outputs_past_the_grid_cap(monkeypatch):
    """The grid is capped at MAX_GRID blocks; the kernel loops grid-stride over its score rows, so every
    output is written when there are more rows than blocks (MAX_GRID cut to 1 and 2: the real cap is past
    what the interpreter can run), with the chunk as long as shared memory holds and cut to one tile,
    in prefill and in the split-K decode form (tests/test_cuda_attention_chunks.py: rows of many chunks)."""
    checked = set()
    for _, feed, programs in _fused_programs():
        program = programs[0]
        bindings, stored = bind_program(program, feed), stored_values(program, feed)
        att = next(k for k in program.launched() if k.kind is KernelKind.ATTENTION)
        want = stored[att.id].reshape([eval_dim(d, bindings) for d in att.shape])
        assert want.size // want.shape[-1] > 2  # more score rows than the capped grid
        for long_rows in (False, True):
            if long_rows:
                monkeypatch.setattr(cuda_attention, "MAX_ROW_KEYS", 16)
            clear_render_cache()  # render with this chunk, not a cached render with another
            for cap in (1, 2):
                monkeypatch.setattr(cuda_source, "MAX_GRID", cap)
                assert render_kernel(att, program).launches[0].config(bindings)[0][0] == cap
                np.testing.assert_array_equal(interpret(program, att, stored, bindings), want)
            monkeypatch.undo()
            clear_render_cache()
        checked.add(att.value.splits)
    assert 1 in checked and max(checked) > 1
