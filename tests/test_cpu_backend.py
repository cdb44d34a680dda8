"""The CPU backend's tables and its float32 fast path (issue 18): coverage, and differential checks of
the float32 evaluation against the float64-then-round semantics it replaces, fuzzed near FP32 limits."""
from __future__ import annotations

import numpy as np
import pytest

from luminal_num.codegen.llir import FApply, FConstV, FLoad, FRoundTo, KernelKind
from luminal_num.dtypes.formats import BF16, F16, F32, F8E4M3
from luminal_num.dtypes.rounding import Overflow, round_to
from luminal_num.dtypes.variants import GEMM_VARIANTS
from luminal_num.hlir.evaluate import EVALUATORS, evaluate
from luminal_num.hlir.ops import CUSTOM_KINDS, ELEMENTWISE_OPS, Op
from luminal_num.hlir.store import keyed
from luminal_num.hlir.weightcache import WEIGHTS, ByteLRU, WeightCache
from luminal_num.models.testnets import matmul_chain, mlp
from luminal_num.quant import QuantOverflow, compute_scales
from luminal_num.runtime import cpu, numerics
from luminal_num.runtime.cpu_compiled import KernelCache
from luminal_num.runtime.numerics import emulate_gemm, prepare_b


def test_every_kernel_kind_has_a_cpu_kernel():
    assert set(cpu.KERNELS) == set(KernelKind)


def test_every_op_has_reference_semantics():
    assert set(EVALUATORS) == set(Op)


def test_every_elementwise_op_says_whether_float32_is_correctly_rounded():
    computed = {op for op in ELEMENTWISE_OPS if op is not Op.CAST} | {Op.CUSTOM}
    assert set(cpu.CORRECTLY_ROUNDED_F32) == computed


def _edge_values(rng, n):
    """FP32 values near the format's limits: huge, tiny, subnormal, signed zeros, ties, ordinary."""
    f = np.finfo(np.float32)
    pool = np.array([0.0, -0.0, 1.0, -1.0, f.max, -f.max, f.tiny, f.smallest_subnormal, 3 * f.smallest_subnormal,
                     1 + f.eps, 1 - f.eps / 2, 65504.0, 65520.0, 448.0, 464.0, 2.0 ** 64, 2.0 ** -70], np.float32)
    x = np.where(rng.random(n) < 0.4, rng.choice(pool, n),
                 (rng.standard_normal(n) * 2.0 ** rng.integers(-40, 40, n)).astype(np.float32))
    return x.astype(np.float32)


class _State:
    """The minimum of a run's state that the body evaluators read."""

    def __init__(self, arrays):
        self.stored = dict(enumerate(arrays))
        self.bindings = {}
        self.shared = ByteLRU(cpu.SHARED_BYTES)  # values shared between the kernels of a run (cpu._Run.shared)
        self.compiled = KernelCache()


class _Kernel:
    def __init__(self, n_inputs, shape):
        from luminal_num.codegen.llir import KernelInput
        from luminal_num.hlir.shape import ShapeTracker
        self.inputs = tuple(KernelInput(i, ShapeTracker.contiguous(shape)) for i in range(n_inputs))


def _random_body(rng, depth: int, n_inputs: int):
    if depth == 0 or rng.random() < 0.2:
        return FConstV(float(rng.choice([0.5, -3.0, 1e-30, 7e37]))) if rng.random() < 0.15 else FLoad(int(rng.integers(n_inputs)))
    ops = [op for op in cpu.CORRECTLY_ROUNDED_F32 if op is not Op.CUSTOM]
    pick = rng.integers(len(ops) + 2)
    if pick == len(ops):
        return FApply(Op.CUSTOM, (_random_body(rng, depth - 1, n_inputs),), kind=str(rng.choice(sorted(CUSTOM_KINDS))))
    if pick == len(ops) + 1:
        return FRoundTo(_random_body(rng, depth - 1, n_inputs), [BF16, F16, F8E4M3][int(rng.integers(3))])
    op = ops[pick]
    return FApply(op, tuple(_random_body(rng, depth - 1, n_inputs) for _ in range(op.decl.arity)))


@pytest.mark.parametrize("seed", range(40))
def test_float32_bodies_equal_float64_then_round(seed):
    rng = np.random.default_rng(seed)
    shape = (64,)
    arrays = [_edge_values(rng, 64) for _ in range(3)]
    k, state = _Kernel(3, shape), _State(arrays)
    body = _random_body(rng, 4, 3)
    with np.errstate(all="ignore"):
        fast = np.asarray(cpu._body32(body, k, state), dtype=np.float32)
        exact = np.asarray(cpu._body64(body, k, state))
    fast, exact = np.broadcast_to(fast, shape), np.broadcast_to(exact, shape)
    assert fast.dtype == np.float32
    assert np.array_equal(fast.astype(np.float64), exact, equal_nan=True), body


def test_store32_keeps_the_store_values():
    rng = np.random.default_rng(3)
    x = _edge_values(rng, 4096)
    for fmt in (F32, BF16, F16, F8E4M3):
        with np.errstate(all="ignore"):
            assert np.array_equal(cpu.store32(x, fmt).astype(np.float64), cpu.store(x.astype(np.float64), fmt),
                                  equal_nan=True), fmt


@pytest.mark.parametrize("name", ["f8e4m3_block", "f8e4m3_channel", "int8_channel", "f16acc16", "bf16"])
def test_prepared_b_gives_the_same_gemm(name):
    rng = np.random.default_rng(1)
    variant = GEMM_VARIANTS[name]
    a, b = rng.standard_normal((1, 40, 256)).astype(np.float32), rng.standard_normal((1, 256, 72)).astype(np.float32)
    static = compute_scales(b, variant.b_format, variant.b_scale) if variant.b_scale is not None else None
    direct = emulate_gemm(a, b, variant, b_scales=static)
    prepared = emulate_gemm(a, None, variant, b_prepared=prepare_b(b, variant, static))
    assert np.array_equal(direct, prepared)
    with pytest.raises(ValueError):
        emulate_gemm(a, b, variant, b_prepared=prepare_b(b, variant, static))


def test_weight_cache_is_keyed_by_content_within_its_budget():
    cache = WeightCache(budget_bytes=1000)
    w = keyed(np.ones(10))
    calls = []
    first = cache.get(w, "k", lambda: calls.append(1) or w * 2)
    assert cache.get(w, "k", lambda: calls.append(1) or w * 3) is first and len(calls) == 1
    assert cache.get(keyed(np.ones(10)), "k", lambda: calls.append(1)) is first  # equal content, one entry
    big = keyed(np.ones(200))
    cache.get(big, "k", lambda: big.copy())  # 1600 bytes: over budget, not kept
    assert cache.get(big, "k", lambda: calls.append(1) or big) is big and len(calls) == 2
    assert cache.bytes == first.nbytes


def test_reference_weights_are_converted_once_and_read_only():
    m = mlp()
    x = m.make_inputs(0)
    before = WEIGHTS.misses
    first = evaluate(m.graph, x)["y"]
    misses = WEIGHTS.misses
    assert misses > before
    again = evaluate(m.graph, x)["y"]
    assert WEIGHTS.misses == misses and np.array_equal(first, again)


def _naive_grouped_sum(qa, qb, acc, group):
    """acc = RN_acc(acc + exact group sum), written out plainly: one group at a time over all outputs."""
    total = None
    for start in range(0, qa.shape[-1], group):
        part = np.matmul(qa[..., start:start + group].astype(np.float64), qb[..., start:start + group, :].astype(np.float64))
        total = round_to(part if total is None else total.astype(np.float64) + part, acc, Overflow.INF)
    return total


@pytest.mark.parametrize("name", ["f16acc16", "f8e4m3_block", "f8e4m3_block_nopromote", "f8e5m2_block"])
@pytest.mark.parametrize("spread", [6, 40])  # 40: tiny products (F16 subnormals) and the round_to path
def test_grouped_accumulation_equals_the_plain_loop(name, spread):
    variant = GEMM_VARIANTS[name]
    rng = np.random.default_rng(7)
    a = (rng.standard_normal((2, 70, 96)) * 2.0 ** rng.integers(-spread, spread // 2 + 1, (2, 70, 96))).astype(np.float32)
    b = rng.standard_normal((2, 96, 40)).astype(np.float32)
    qa, qb = (numerics._operand(x, f, spec, None, QuantOverflow.SATURATE).values
              for x, f, spec in ((a, variant.a_format, variant.a_scale), (b, variant.b_format, variant.b_scale)))
    got = numerics._grouped_sum(qa, qb, variant.accumulator, variant.mma_k)
    assert got.dtype == np.float32 and np.array_equal(got, _naive_grouped_sum(qa, qb, variant.accumulator, variant.mma_k))


@pytest.mark.parametrize("name", ["f16acc16", "f8e4m3_block", "f8e4m3_block_nopromote", "f8e5m2_block"])
def test_grouped_gemm_does_not_depend_on_the_output_tiling(name, monkeypatch):
    """Promotion, per-product scales and the narrow accumulator per output tile: small tiles of several
    column blocks with ragged edges (batched, K not a multiple of the promotion interval) give the
    bits of one whole-matrix tile."""
    variant = GEMM_VARIANTS[name]
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((2, 46, 300)) * 2.0 ** rng.integers(-8, 4, (2, 46, 300))).astype(np.float32)
    b = rng.standard_normal((1, 300, 40)).astype(np.float32)
    monkeypatch.setattr(numerics, "_TILE_ELEMENTS", 1 << 30)
    monkeypatch.setattr(numerics, "_BLAS_SINGLE_THREAD_MNK", 1 << 40)
    whole = numerics.emulate_gemm(a, b, variant)
    assert numerics._tiling(2, 46, 40, variant.mma_k) == (46, 40, 1)
    monkeypatch.setattr(numerics, "_TILE_ELEMENTS", 400)
    monkeypatch.setattr(numerics, "_BLAS_SINGLE_THREAD_MNK", 32 * 36)
    rows, item_cols, items = numerics._tiling(2, 46, 40, variant.mma_k)
    assert items > 1 and 46 % rows and 40 % (items * item_cols)
    tiled = numerics.emulate_gemm(a, b, variant)
    assert tiled.dtype == np.float32 and np.array_equal(tiled.view(np.uint32), whole.view(np.uint32))


def test_float16_cast_rounds_like_round_to():
    """The F16 accumulator's shortcut: numpy's float64 -> float16 cast is one RNE rounding."""
    rng = np.random.default_rng(5)
    ties = (np.arange(1, 2048) + 0.5) * 2.0 ** rng.integers(-25, 5, 2047)  # exact halfway cases
    x = np.concatenate([ties, ties * (1 + 2.0 ** -40), ties * (1 - 2.0 ** -40), [65519.0, 65520.0, 7e4, 2.0 ** -25],
                        rng.standard_normal(4096) * 2.0 ** rng.integers(-30, 17, 4096)])
    x = np.concatenate([x, -x])
    with np.errstate(over="ignore"):
        cast = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(cast, round_to(x, F16, Overflow.INF))


@pytest.mark.parametrize("scale", [0.97, 1.03])  # partial sums just under / over F16's max_finite
def test_f16_accumulation_near_overflow_equals_the_plain_loop(scale):
    """The F16 range proof (row / column L1 norms) picks the float64 rounding only where no partial sum
    can exceed 65504; either way the bits are the plain loop's (inf where it overflows)."""
    rng = np.random.default_rng(4)
    a = np.abs(rng.standard_normal((30, 256))).astype(np.float16).astype(np.float32)
    b = np.abs(rng.standard_normal((256, 20))).astype(np.float16).astype(np.float32)
    a *= np.float32(scale * 65504 / float((np.abs(a).sum(axis=1).max()) * np.abs(b).max()))
    a = a.astype(np.float16).astype(np.float32)
    ops = numerics._Operand(a, None, None), numerics._Operand(b, None, None)
    assert numerics._f16_in_range(*ops, 256, 16) == (scale < 1)
    got = numerics._grouped_sum(a, b, F16, 16)
    assert np.array_equal(got.view(np.uint32), _naive_grouped_sum(a, b, F16, 16).astype(np.float32).view(np.uint32))


def test_f16_magic_rounding_equals_round_to():
    """_round_f16_magic (float64 arithmetic) against the bit-exact round_to on ties, near-ties, F16
    subnormals and the subnormal/normal boundary, signed zeros and tiny negatives, up to 65504."""
    rng = np.random.default_rng(9)
    ties = (np.arange(1, 2048) + 0.5) * 2.0 ** rng.integers(-25, 5, 2047)
    x = np.concatenate([ties, ties * (1 + 2.0 ** -40), ties * (1 - 2.0 ** -40), [0.0, -0.0, 2.0 ** -25, 2.0 ** -26,
                        2.0 ** -14, 2.0 ** -14 * (1 - 2.0 ** -12), 65504.0, 65519.0, 1e-300, 5e-324],
                        rng.standard_normal(8192) * 2.0 ** rng.integers(-40, 15, 8192)])
    x = np.concatenate([x, -x])
    x = x[np.abs(x) <= 65504]
    out, tmp = np.empty_like(x), np.empty_like(x)
    numerics._round_f16_magic(x, out, tmp)
    want = round_to(x, F16, Overflow.INF).astype(np.float64)
    assert np.array_equal(out.view(np.uint64), want.view(np.uint64))  # bits: the sign of zero too


@pytest.mark.parametrize("acc", [BF16, F16])
def test_fast_narrow_reduction_equals_the_round_to_loop(acc):
    """emulate_reduce_sum's in-place accumulation against the plain round_to loop it replaces."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((6, 300, 5)) * 2.0 ** rng.integers(-20, 20, (6, 300, 5))).astype(np.float32)
    got = numerics.emulate_reduce_sum(x, 1, acc)
    moved = np.moveaxis(x, 1, 0).astype(np.float64)
    want = round_to(moved[0], acc, Overflow.INF)
    for row in moved[1:]:
        want = round_to(want + row, acc, Overflow.INF)
    assert np.array_equal(got, want)
    tiny = np.full((4, 3), 2.0 ** -140, np.float32)  # subnormal partial sums: the exact slow path
    assert not numerics._fast_reduction(tiny, 0, BF16)


def test_reference_matmuls_use_cached_weight_operands():
    """The FP64 reference's Gemm operands made from weights are cached, and the result is still the
    FP64 product (an independent numpy chain)."""
    m = matmul_chain()
    x = m.make_inputs(0)["x"]
    want = x @ m.graph.weights["w0"] @ m.graph.weights["w1"]
    first = evaluate(m.graph, {"x": x})["y"]
    misses = WEIGHTS.misses
    second = evaluate(m.graph, {"x": x})["y"]
    assert WEIGHTS.misses == misses and np.array_equal(first, second)
    np.testing.assert_allclose(second, want, rtol=1e-13, atol=1e-13)
