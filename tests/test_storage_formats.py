"""Storage formats, differentially: each format against a reference written here from its definition
(ml_dtypes casts for fp8/fp4/int4, per-group loops with numpy's float16, llama.cpp's blocks through the
gguf package and the real SmolLM2 GGUF tensors), 4-bit packing against hand-derived bytes, stored
bytes against hand counts, and the a-priori element bounds fuzzed near each format's limits."""
from __future__ import annotations

import math

import gguf
import ml_dtypes
import numpy as np
from kept_blocks import kept_sample
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.dtypes import F4E2M1, INT4, UINT4
from luminal_num.quant import (STORAGE_FORMATS, Layout, Part, Quantized, QuantOverflowError, Scheme, StoredTensor,
                               from_gguf, storage_format, to_gguf)
from luminal_num.quant.pack import decode_4bit, encode_4bit, pack_nibbles, unpack_nibbles
from luminal_num.quant.storage import CODECS

GGUF_TYPES = {"gguf_q4_1": gguf.GGMLQuantizationType.Q4_1, "gguf_q8_0": gguf.GGMLQuantizationType.Q8_0}


def weights(rows: int, k: int, seed: int, spread: float = 3.0) -> np.ndarray:
    """Gaussian rows whose magnitudes differ by up to 10^spread, with an all-zero and a constant row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)) * 10.0 ** rng.uniform(-spread, 0, (rows, 1))
    x[0] = 0.0
    x[1, : min(k, 40)] = 0.75
    return x.astype(np.float32)


def k_for(fmt) -> int:
    return 192 if fmt.scheme in (Scheme.GGUF_Q4_1, Scheme.GGUF_Q8_0) else 200  # 200: ragged groups and tiles


# ---------------------------------------------------------------- catalogue


def test_every_scheme_has_a_codec_and_the_catalogue_has_every_format_of_issue_13():
    assert set(CODECS) == set(Scheme)
    assert set(STORAGE_FORMATS) == {
        "f32", "bf16", "f16", "f8e4m3_channel", "f8e4m3_block128", "f8e5m2_channel", "f8e5m2_block128",
        "int8_channel", "int4_g32", "int4_g64", "int4_g128", "int4_g32_asym", "int4_g64_asym", "int4_g128_asym",
        "mxfp4", "nvfp4", "gguf_q4_1", "gguf_q8_0",
        "gguf_q4_0", "gguf_q5_0", "gguf_q5_1", "gguf_q4_k", "gguf_q5_k", "gguf_q6_k",  # kept GGUF blocks (issue 31)
        "f8e4m3_g16", "f8e4m3_g32", "f8e4m3_g64", "f8e4m3_g128"}  # per-group FP8: per-head KV-cache rows
    assert all(f.name == name for name, f in STORAGE_FORMATS.items())
    assert storage_format("nvfp4") is STORAGE_FORMATS["nvfp4"]
    with pytest.raises(KeyError, match="unknown storage format 'int3'"):
        storage_format("int3")


def test_stored_bytes_match_hand_counts():
    shape = (576, 1536)  # SmolLM2's ffn_down: 884736 weights
    n = 576 * 1536
    hand = {"f32": 4 * n, "bf16": 2 * n, "f8e4m3_channel": n + 576 * 4,
            "f8e4m3_block128": n + 5 * 12 * 4,  # ceil(576 / 128) x 1536 / 128 tiles
            "int8_channel": n + 576 * 4,
            "int4_g128": n // 2 + 576 * 12 * 2, "int4_g32_asym": n // 2 + 576 * 48 * 2 + 576 * 24,
            "mxfp4": n // 2 + 576 * 48, "nvfp4": n // 2 + 576 * 96 + 4,
            "gguf_q4_1": 576 * 48 * 20, "gguf_q8_0": 576 * 48 * 34}
    for name, count in hand.items():
        assert STORAGE_FORMATS[name].stored_bytes(shape) == count, name
    assert STORAGE_FORMATS["gguf_q4_1"].bits_per_weight(shape) == 5.0
    assert STORAGE_FORMATS["int4_g128"].bits_per_weight(shape) == 4.125
    # ragged: K = 576 in groups of 128 is 5 groups; odd K packs a half-empty last byte
    assert STORAGE_FORMATS["int4_g128"].stored_bytes((1, 576)) == 288 + 5 * 2
    assert STORAGE_FORMATS["int4_g32_asym"].stored_bytes((3, 33)) == 3 * 17 + 3 * 2 * 2 + 3 * 1


@pytest.mark.parametrize("name", list(STORAGE_FORMATS))
def test_pack_unpack_is_lossless_and_stored_bytes_are_the_containers(name):
    fmt = STORAGE_FORMATS[name]
    x = weights(7, k_for(fmt), seed=3)
    q = kept_sample(fmt, 7, x.shape[1], seed=3) if fmt.keeps_only else fmt.quantize(x)
    stored = fmt.pack(q)
    assert stored.nbytes == fmt.stored_bytes(q.shape)
    back = fmt.unpack(stored)
    for part in fmt.parts:
        assert back.values[part].tobytes() == q.values[part].tobytes(), part  # bit for bit, -0 included
    assert np.array_equal(back.dequantize(), q.dequantize())


# ---------------------------------------------------------------- 4-bit codes and packing


def test_packing_against_hand_derived_bytes():
    codes = encode_4bit(np.array([-8, -1, 0, 7, 3], np.float32), INT4)
    assert codes.tolist() == [0x8, 0xF, 0x0, 0x7, 0x3]
    assert pack_nibbles(codes).tolist() == [0xF8, 0x70, 0x03]  # element 2i low nibble, 2i+1 high, odd K padded
    fp4 = encode_4bit(np.array([0.5, -6.0, 1.5, -0.0], np.float32), F4E2M1)
    assert fp4.tolist() == [0b0001, 0b1111, 0b0011, 0b1000]
    assert pack_nibbles(fp4).tolist() == [0xF1, 0x83]
    rows = pack_nibbles(np.array([[1, 2, 3], [15, 0, 9]], np.uint8))
    assert rows.tolist() == [[0x21, 0x03], [0x0F, 0x09]]  # each row packed on its own
    assert unpack_nibbles(rows, 3).tolist() == [[1, 2, 3], [15, 0, 9]]


def test_4bit_codes_agree_with_ml_dtypes_for_every_code():
    for fmt, dtype in ((INT4, ml_dtypes.int4), (UINT4, ml_dtypes.uint4), (F4E2M1, ml_dtypes.float4_e2m1fn)):
        codes = np.arange(16, dtype=np.uint8)
        values = decode_4bit(codes, fmt)
        assert values.tobytes() == codes.view(dtype).astype(np.float32).tobytes(), fmt
        assert np.array_equal(encode_4bit(values, fmt), codes), fmt  # -0 is code 8 and back
        assert np.array_equal(values.astype(dtype).view(np.uint8) & 0xF, codes), fmt


def test_4bit_refusals():
    with pytest.raises(ValueError, match="not representable in int4"):
        encode_4bit(np.array([8.0]), INT4)
    with pytest.raises(ValueError, match="not representable in f4e2m1"):
        encode_4bit(np.array([2.5]), F4E2M1)
    with pytest.raises(ValueError, match="pack into 2 bytes"):
        unpack_nibbles(np.zeros((2, 3), np.uint8), 4)


# ---------------------------------------------------------------- each format against its definition


def test_plain_formats_are_ml_dtypes_casts_and_overflow_is_refused():
    x = weights(4, 64, seed=1, spread=8)
    for name, dtype in (("bf16", ml_dtypes.bfloat16), ("f16", np.float16)):
        q = STORAGE_FORMATS[name].quantize(x)
        assert q.values[Part.Q].tobytes() == x.astype(dtype).astype(np.float32).tobytes()
    assert STORAGE_FORMATS["f32"].quantize(x).dequantize().tobytes() == x.tobytes()
    checkpoint = x.astype(ml_dtypes.bfloat16).astype(np.float32)  # a BF16 checkpoint kept as bf16: no error
    assert STORAGE_FORMATS["bf16"].quantize(checkpoint).dequantize().tobytes() == checkpoint.tobytes()
    with pytest.raises(QuantOverflowError, match="overflow f16"):
        STORAGE_FORMATS["f16"].quantize(np.array([[1.0, 70000.0]], np.float32))


def _tile_reference(x, rows: int, cols: int, code_of, scale_of):
    """Per-tile loops: scale from the tile's amax, codes from the scale; returns (codes, scales)."""
    codes = np.zeros_like(x)
    scales = np.zeros((-(-x.shape[0] // rows), -(-x.shape[1] // cols)), np.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = x[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            s = scale_of(float(np.abs(tile).max()))
            scales[i, j] = s
            codes[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = code_of(tile, s)
    return codes, scales


def _fp8_code(dtype, top):
    return lambda tile, s: np.clip(tile / np.float32(s), -top, top).astype(dtype).astype(np.float32)


def _amax_scale(top):
    return lambda amax: np.float32(amax / top) if amax > 0 else np.float32(1.0)


@pytest.mark.parametrize("name,rows,cols,dtype,top", [
    ("f8e4m3_channel", 1, 10**9, ml_dtypes.float8_e4m3fn, 448.0),
    ("f8e5m2_channel", 1, 10**9, ml_dtypes.float8_e5m2, 57344.0),
    ("f8e4m3_block128", 128, 128, ml_dtypes.float8_e4m3fn, 448.0),
    ("f8e5m2_block128", 128, 128, ml_dtypes.float8_e5m2, 57344.0),
    ("f8e4m3_g16", 1, 16, ml_dtypes.float8_e4m3fn, 448.0),
    ("f8e4m3_g64", 1, 64, ml_dtypes.float8_e4m3fn, 448.0)])
def test_fp8_formats_against_ml_dtypes(name, rows, cols, dtype, top):
    x = weights(150, 200, seed=5)
    fmt = STORAGE_FORMATS[name]
    q = fmt.quantize(x)
    codes, scales = _tile_reference(x, rows, min(cols, 200), _fp8_code(dtype, top), _amax_scale(top))
    assert np.array_equal(q.values[Part.SCALE], scales)
    assert np.array_equal(q.values[Part.Q], codes)
    expanded = np.repeat(np.repeat(scales, rows, 0)[:150], min(cols, 200), 1)[:, :200]
    assert np.array_equal(q.dequantize(), codes * expanded)


def test_int8_channel_against_its_definition():
    x = weights(9, 77, seed=6)
    q = STORAGE_FORMATS["int8_channel"].quantize(x)
    codes, scales = _tile_reference(x, 1, 77, lambda t, s: np.clip(np.rint(t / np.float32(s)), -128, 127),
                                    _amax_scale(127.0))
    assert np.array_equal(q.values[Part.SCALE], scales) and np.array_equal(q.values[Part.Q], codes)


def _group_loop(x, g, per_group):
    """Apply per_group(values) -> (codes, *per-group params) to every group of every row."""
    rows, k = x.shape
    codes = np.zeros_like(x)
    params = []
    for r in range(rows):
        row = []
        for start in range(0, k, g):
            c, *p = per_group(x[r, start:start + g])
            codes[r, start:start + g] = c
            row.append(p)
        params.append(row)
    return codes, np.array(params, np.float32)


def _f16_floor(v):
    return max(np.float32(np.float16(v)), np.float32(2.0 ** -14))


@pytest.mark.parametrize("g", [32, 64, 128])
def test_int4_symmetric_against_a_group_loop(g):
    x = weights(6, 200, seed=7, spread=6)

    def group(v):
        s = _f16_floor(np.float32(np.abs(v).max()) / np.float32(7))
        return np.clip(np.rint(v / s), -8, 7).astype(ml_dtypes.int4).astype(np.float32), s

    codes, params = _group_loop(x, g, group)
    q = STORAGE_FORMATS[f"int4_g{g}"].quantize(x)
    assert np.array_equal(q.values[Part.Q], codes) and np.array_equal(q.values[Part.SCALE], params[..., 0])
    assert np.array_equal(q.dequantize(), codes * np.repeat(params[..., 0], g, 1)[:, :200])


@pytest.mark.parametrize("g", [32, 64, 128])
def test_int4_asymmetric_against_a_gptq_style_group_loop(g):
    x = weights(6, 200, seed=8, spread=6) + np.float32(0.01)  # shifted: the range is not symmetric

    def group(v):
        lo, hi = min(np.float32(v.min()), np.float32(0)), max(np.float32(v.max()), np.float32(0))
        s = _f16_floor(np.float32(hi - lo) / np.float32(15))
        z = float(np.clip(np.rint(-lo / s), 0, 15))
        return np.clip(np.rint(v / s) + z, 0, 15), s, z

    codes, params = _group_loop(x, g, group)
    q = STORAGE_FORMATS[f"int4_g{g}_asym"].quantize(x)
    assert np.array_equal(q.values[Part.Q], codes)
    assert np.array_equal(q.values[Part.SCALE], params[..., 0]) and np.array_equal(q.values[Part.ZERO], params[..., 1])
    expand = lambda p: np.repeat(p, g, 1)[:, :200]  # noqa: E731
    assert np.array_equal(q.dequantize(), (codes - expand(params[..., 1])) * expand(params[..., 0]))


def test_mxfp4_against_ml_dtypes():
    x = weights(5, 200, seed=9, spread=10)

    def group(v):
        amax = float(np.abs(v).max())
        if amax == 0:
            return np.zeros_like(v), 1.0
        mantissa, exponent = math.frexp(amax / 6.0)  # 2^ceil(log2(amax / 6)): amax / s <= 6, nothing clips
        s = math.ldexp(1.0, exponent - 1 if mantissa == 0.5 else exponent)
        return (v / np.float32(s)).astype(ml_dtypes.float4_e2m1fn).astype(np.float32), s

    codes, params = _group_loop(x, 32, group)
    q = STORAGE_FORMATS["mxfp4"].quantize(x)
    assert np.array_equal(q.values[Part.Q], codes) and np.array_equal(q.values[Part.SCALE], params[..., 0])
    stored = STORAGE_FORMATS["mxfp4"].pack(q).arrays[Part.SCALE]
    assert np.array_equal(stored.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), params[..., 0])  # E8M0 bytes


def test_nvfp4_against_ml_dtypes():
    x = weights(5, 200, seed=10, spread=7)
    tensor = max(np.float32(np.abs(x).max()) / np.float32(2688.0), np.float32(2.0 ** -117))

    def group(v):
        ratio = np.float32(np.float32(np.abs(v).max()) / np.float32(6.0)) / tensor
        s = max(np.float32(min(ratio, np.float32(448.0))).astype(ml_dtypes.float8_e4m3fn).astype(np.float32),
                np.float32(2.0 ** -6))
        y = v / np.float32(s * tensor)
        return np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32), s

    codes, params = _group_loop(x, 16, group)
    q = STORAGE_FORMATS["nvfp4"].quantize(x)
    assert q.values[Part.TENSOR_SCALE] == tensor
    assert np.array_equal(q.values[Part.Q], codes) and np.array_equal(q.values[Part.SCALE], params[..., 0])
    assert np.array_equal(q.dequantize(), (codes * np.repeat(params[..., 0], 16, 1)[:, :200]) * tensor)


# ---------------------------------------------------------------- GGUF: llama.cpp's own blocks


@pytest.mark.parametrize("name", list(GGUF_TYPES))
def test_gguf_blocks_match_the_gguf_package(name):
    fmt, qtype = STORAGE_FORMATS[name], GGUF_TYPES[name]
    x = weights(33, 256, seed=11, spread=5)
    x[2, 32:64] = -0.3  # a constant block: d = 0
    x[3, :32] = np.linspace(-1, 1, 32)
    theirs = gguf.quants.quantize(x, qtype)
    ours = fmt.quantize(x)
    assert np.array_equal(to_gguf(ours), theirs)
    assert np.array_equal(ours.dequantize(), gguf.quants.dequantize(theirs, qtype))
    kept = from_gguf(theirs, qtype.name)
    assert kept.fmt is fmt and all(np.array_equal(kept.values[p], ours.values[p]) for p in fmt.parts)


def test_smollm2_gguf_tensors_are_kept_exactly(smollm2_gguf):
    reader = smollm2_gguf
    by_type = {}
    for tensor in reader.tensors:
        by_type.setdefault(tensor.tensor_type.name, tensor)
    assert {"Q4_1", "Q8_0"} <= set(by_type)
    for type_name in ("Q4_1", "Q8_0"):
        tensor = by_type[type_name]
        raw = np.asarray(tensor.data)
        kept = from_gguf(raw, type_name)
        theirs = gguf.quants.dequantize(raw, tensor.tensor_type)
        assert kept.shape == theirs.shape
        assert np.array_equal(kept.dequantize(), theirs)  # zero added error: the source's own values
        stored = kept.fmt.pack(kept)
        assert stored.nbytes == raw.nbytes  # Q4_1: 5 bits per weight, Q8_0: 8.5, as in the file
        assert np.array_equal(to_gguf(kept.fmt.unpack(stored)), raw)
    with pytest.raises(ValueError, match="GGUF type 'Q2_K' is not kept exactly"):
        from_gguf(np.zeros((1, 84), np.uint8), "Q2_K")


# ---------------------------------------------------------------- a-priori element bounds, fuzzed


@st.composite
def weight_tensors(draw):
    """Rows of magnitudes spread over many binades near the format limits: huge, tiny, subnormal."""
    rows, k = draw(st.integers(1, 4)), draw(st.sampled_from([16, 32, 50, 64, 96, 130]))
    top = draw(st.one_of(st.floats(-130, 20), st.floats(20, 127)))  # log2 of the largest magnitude
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    exponents = top - rng.uniform(0, draw(st.floats(0, 60)), (rows, k))
    x = np.exp2(exponents) * rng.choice([-1.0, 1.0], (rows, k)) * rng.uniform(1, 2, (rows, k))
    x[rng.random((rows, k)) < 0.1] = 0.0
    return x.astype(np.float32)


def _fits(fmt, x) -> bool:
    """Whether quantize accepts x (f16 / fp16-scale ranges); out-of-range weights are refused, not bounded."""
    try:
        fmt.quantize(x)
        return True
    except ValueError:
        return False


@settings(max_examples=60, deadline=None)
@given(x=weight_tensors(), name=st.sampled_from(sorted(n for n, f in STORAGE_FORMATS.items() if not f.keeps_only)))
def test_element_error_bound_is_sound(x, name):
    fmt = STORAGE_FORMATS[name]
    if fmt.scheme in (Scheme.GGUF_Q4_1, Scheme.GGUF_Q8_0):
        x = np.pad(x, [(0, 0), (0, -x.shape[1] % 32)])
    if not _fits(fmt, x):
        amax = float(np.abs(x).max())
        assert amax > 6e4, (name, amax)  # beyond f16 (the value or its scale): refused, never mis-stored
        return
    rel, absolute = fmt.element_error(float(np.abs(x).max()))
    err = np.abs(fmt.quantize(x).dequantize().astype(np.float64) - x)
    assert np.all(err <= rel * np.abs(x.astype(np.float64)) + absolute), name


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match="weights must be finite"):
        STORAGE_FORMATS["int4_g32"].quantize(np.array([[1.0, np.nan]], np.float32))
    with pytest.raises(ValueError, match="llama.cpp blocks are 32 wide"):
        STORAGE_FORMATS["gguf_q4_1"].quantize(np.ones((2, 48), np.float32))
    with pytest.raises(ValueError, match="groups need an f16 scale"):
        STORAGE_FORMATS["int4_g32"].quantize(np.full((1, 32), 1e6, np.float32))
    with pytest.raises(ValueError, match=r"stores \(rows, K\) matrices"):
        STORAGE_FORMATS["nvfp4"].quantize(np.ones(16, np.float32))
    fmt = STORAGE_FORMATS["int4_g32"]
    q = fmt.quantize(np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match="part 'scale' of a"):
        StoredTensor(fmt, (2, 64), {Part.Q: fmt.pack(q).arrays[Part.Q], Part.SCALE: np.ones((2, 3), np.float16)})
    with pytest.raises(ValueError, match="has parts"):
        Quantized(fmt, (2, 64), {Part.Q: q.values[Part.Q]})
    assert fmt.layout is Layout.GROUP and fmt.bits == 4
