"""What making a large weight's forms allocates beside them: a variant's B operand is prepared a block of
columns at a time (never a full contiguous FP32 copy beside the prepared one), and a storage conversion's
finiteness check hands its widened array to the conversion instead of a second full-size dequantization.
Why: a 1B model's 1 GB LM head made such transients at once and took the compile past its memory plan.

Each test checks the values against the unblocked computation (prepare_b over the whole B, the format's own
dequantize) bit for bit, and the peak of traced allocations (numpy traces its buffers) against a bound the
old code exceeds (the control in each test)."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from luminal_num.dtypes.variants import GEMM_VARIANTS
from luminal_num.hlir.gemm import GemmLayout, contiguous, gemm_operand_b
from luminal_num.quant import storage, stored
import importlib
from luminal_num.quant.layout import Scheme
from luminal_num.quant.storage import STORAGE_FORMATS, Kind
from luminal_num.quant.stored import ConvertedWeights
from luminal_num.runtime import cpu_gemm
from luminal_num.runtime.cpu_gemm import prepared_blocks
from luminal_num.runtime.numerics import prepare_b

quantize_module = importlib.import_module("luminal_num.quant.quantize")  # the package exports a function of that name

M, K = 3, 64


def _b_full(w: np.ndarray) -> np.ndarray:
    """B over the Mul shape (M, K, N) as the runtime reads a weight (N, K): its transpose, broadcast along M."""
    return np.broadcast_to(w.T[None], (M, *w.T.shape))


def _layout(n: int) -> GemmLayout:
    return GemmLayout((M, K, n), 1, (), (0,), (2,), "batched")


def _concat(ops, axis):
    return np.concatenate([np.asarray(o) for o in ops], axis=axis)


@pytest.mark.parametrize("name", sorted(GEMM_VARIANTS))
def test_blocks_prepare_the_same_values_as_b_whole_per_part(name, monkeypatch):
    """Every variant: the blocks' prepared values (and scales) are the whole part's, bit for bit; a part alone
    and the same part inside a concatenation are cut into the same blocks."""
    variant = GEMM_VARIANTS[name]
    monkeypatch.setattr(cpu_gemm, "PREPARE_BLOCK_BYTES", 4 * K * 64)  # 64 columns a block
    rng = np.random.default_rng(7)
    parts = (96, 200)
    w = (rng.standard_normal((sum(parts), K)) * np.exp(rng.uniform(-4, 4, (sum(parts), 1)))).astype(np.float32)
    blocks = prepared_blocks(_b_full(w), _layout(sum(parts)), variant, None, parts)
    spec = variant.b_scale
    if spec is not None and not spec.varies_along(1):  # per-tensor scales from B itself: never split
        assert blocks is None
        return
    unit = 1 if spec is None else spec.block[1]
    step = max(unit, 64 // unit * unit)
    cuts = [[step] * (width // step) + ([width % step] if width % step else []) for width in parts]
    if max(parts) <= step:
        assert blocks is None
        return
    assert [b.values.shape[-1] for b in blocks] == [w for c in cuts for w in c]
    start, used = 0, 0
    for width, cut in zip(parts, cuts):  # each part prepared whole, as the unblocked code prepares a concatenation's
        mine = blocks[used:used + len(cut)]
        whole = prepare_b(np.ascontiguousarray(w[start:start + width].T)[None], variant, None)
        np.testing.assert_array_equal(_concat([b.values for b in mine], -1).view(np.uint32),
                                      np.asarray(whole.values, np.float32).view(np.uint32))
        if whole.scales is not None:
            np.testing.assert_array_equal(_concat([b.scales for b in mine], -1), whole.scales)
        single = prepared_blocks(_b_full(w[start:start + width]), _layout(width), variant, None, ())
        for a, b in zip(single or mine, mine):  # a part alone: the same blocks (None: it is one block)
            np.testing.assert_array_equal(np.asarray(a.values).view(np.uint32), np.asarray(b.values).view(np.uint32))
        start, used = start + width, used + len(cut)


def test_a_small_b_is_prepared_whole(monkeypatch):
    w = np.ones((100, K), np.float32)
    assert prepared_blocks(_b_full(w), _layout(100), GEMM_VARIANTS["bf16"], None, ()) is None  # 25 KB < 256 MB


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        kept = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    del kept
    return peak


def test_preparing_a_large_b_holds_one_block_beside_the_prepared_operand(monkeypatch):
    n, k = 4096, 512  # an 8 MB weight, 1 MB blocks
    w = np.random.default_rng(1).standard_normal((n, k)).astype(np.float32)
    lay = GemmLayout((M, k, n), 1, (), (0,), (2,), "batched")
    full = np.broadcast_to(w.T[None], (M, k, n))
    variant = GEMM_VARIANTS["bf16"]
    monkeypatch.setattr(cpu_gemm, "PREPARE_BLOCK_BYTES", 1 << 20)
    blocked = _peak(lambda: prepared_blocks(full, lay, variant, None, ()))
    whole = _peak(lambda: prepare_b(contiguous(gemm_operand_b(full, lay)), variant, None))  # the old way
    assert whole >= 2 * w.nbytes  # control: the contiguous copy and the prepared operand at once
    assert blocked <= w.nbytes + 4 * (1 << 20)


@pytest.mark.parametrize("name", sorted(n for n, f in STORAGE_FORMATS.items() if not n.startswith("gguf_")))
def test_a_conversions_first_dequantize_is_its_check_and_equals_the_formats_own(name):
    fmt = STORAGE_FORMATS[name]
    rows, k = 8, 256
    w = np.random.default_rng(2).standard_normal((rows, k)).astype(np.float32)
    w[0, :4] = [-1e-30, -0.0, 1e-30, 0.0]  # codes that round to a signed zero
    before = w.copy()
    q = fmt.quantize(w)
    np.testing.assert_array_equal(w.view(np.uint32), before.view(np.uint32))  # the input is not touched
    first, second = q.dequantize(), q.dequantize()
    if fmt.scheme is not Scheme.IEEE:  # (an IEEE format's widened values are its codes array itself)
        assert first is not second  # the check's array is handed over once; later readers get their own
    truth = fmt.dequantize(q)
    for got in (first, second):
        np.testing.assert_array_equal(np.asarray(got, np.float32).view(np.uint32),
                                      np.asarray(truth, np.float32).view(np.uint32))
    for part, v in q.values.items():
        if fmt.part_format(part).kind is Kind.INT:
            assert not np.any(np.signbit(v) & (v == 0)), part  # no -0 among integer codes


@pytest.mark.parametrize("name", ["bf16", "int8_channel", "f8e4m3_channel", "int4_g128", "mxfp4", "nvfp4"])
def test_a_conversion_holds_its_codes_widened_and_packed_forms_and_no_second_widening(name, monkeypatch):
    """Peak allocations of one conversion, in weights' bytes: the FP32 codes, the widened values, the packed
    bytes and block-sized temporaries (< 3.2). The old code held the check's dequantization beside a second
    copy of the codes, and packed 4-bit codes with ~5 bytes of temporaries per value (mxfp4: 6.0)."""
    cache = ConvertedWeights()
    monkeypatch.setattr(stored, "CONVERTED", cache)
    monkeypatch.setattr(quantize_module, "ROW_BLOCK_BYTES", 1 << 20)  # an 8 MB weight in blocks, as a 1 GB head in 32 MB
    monkeypatch.setattr(storage, "CHECK_BLOCK", 1 << 18)
    fmt = STORAGE_FORMATS[name]
    w = np.random.default_rng(4).standard_normal((2048, 1024)).astype(np.float32)  # 8 MB
    fmt.pack(fmt.quantize(w[:64]))  # JIT-compiled roundings are compiled before the measurement
    peak = _peak(lambda: cache.get(w, fmt))
    assert peak < 3.2 * w.nbytes, peak / w.nbytes
