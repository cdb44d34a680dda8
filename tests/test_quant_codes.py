"""quant.codes (dynamic quantization straight into float8 codes, numba) against the numpy path it
replaces: quantize_tensor's values and scales, stored by ml_dtypes' cast. Every format the codes cover,
every dynamic granularity, ragged blocks, batch matrices, and magnitudes at the formats' limits
(subnormal quotients, blocks of zeros, values that saturate through a rounded-down scale)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from luminal_num.dtypes.formats import F8E4M3, F8E5M2, INT8
from luminal_num.dtypes.jit import loops
from luminal_num.dtypes.variants import E8M0, F32, Granularity, ScaleSpec
from luminal_num.quant import quantize_tensor
from luminal_num.quant.codes import quantize_into_codes

pytestmark = pytest.mark.skipif(loops() is None, reason="numba missing or LUMINAL_NUM_JIT=0: the numpy path runs")

FORMATS = {F8E4M3: ml_dtypes.float8_e4m3fn, F8E5M2: ml_dtypes.float8_e5m2}
SPECS = {
    "block_1x128": ScaleSpec(Granularity.BLOCK, (1, 128), F32, False),
    "block_ragged_1x48": ScaleSpec(Granularity.BLOCK, (1, 48), F32, False),
    "block_2x32": ScaleSpec(Granularity.BLOCK, (2, 32), F32, False),
    "channel": ScaleSpec(Granularity.CHANNEL, (1, 0), F32, False),
    "tensor": ScaleSpec(Granularity.TENSOR, (0, 0), F32, False),
    "mx": ScaleSpec(Granularity.MX, (1, 32), E8M0, False),
    "channel_margin": ScaleSpec(Granularity.CHANNEL, (1, 0), F32, False, margin=0.75),  # clips on purpose
}


def _inputs(rng, shape, kind: str) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "wide":  # magnitudes over ~80 binades: many quotients below the format's normal range
        x *= np.exp2(rng.integers(-60, 20, shape)).astype(np.float32)
    elif kind == "zeros":  # whole blocks of zeros (scale 1) and signed zeros
        x[..., : shape[-1] // 2] = 0.0
        x[..., 0] = -0.0
    elif kind == "tiny":  # amax near float32's normal floor: the scale clamps to min_normal
        x *= np.float32(2.0 ** -130)
    elif kind == "huge":
        x *= np.float32(2.0 ** 120)
    return x


def _reference(x, fmt, spec, dtype):
    q = quantize_tensor(x, fmt, spec)
    return q.values.astype(dtype).view(np.uint8), q.scales


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("kind", ["normal", "wide", "zeros", "tiny", "huge"])
def test_codes_and_scales_are_the_numpy_paths(fmt, spec, kind):
    rng = np.random.default_rng(hash((fmt.name, spec, kind)) % 2 ** 32)
    for shape in ((3, 37, 300), (1, 64, 128), (2, 5, 1030)):
        x = _inputs(rng, shape, kind)
        out = np.empty(shape, FORMATS[fmt])
        scales = quantize_into_codes(x, fmt, SPECS[spec], out)
        codes, want_scales = _reference(x, fmt, SPECS[spec], FORMATS[fmt])
        assert scales is not None
        np.testing.assert_array_equal(scales.view(np.uint32), want_scales.view(np.uint32))
        np.testing.assert_array_equal(out.view(np.uint8), codes)


def test_exact_ties_round_to_even_and_saturate():
    """Quotients placed on the format's ties and just past max_finite, by hand: x = t * s with s the
    block's scale (amax = 448 * s for e4m3, so s is exact)."""
    fmt, spec = F8E4M3, SPECS["channel"]
    s = np.float32(2.0 ** -3)
    # 448 sets the amax; 1.0625 is a tie between 1 and 1.125 (even: 1); 17 a tie between 16 and 18 (even:
    # 16); 2^-9 * 1.5 a subnormal tie (even: 2^-8 ... e4m3's quantum is 2^-9: 1.5 quanta -> 2 quanta)
    row = np.array([448, 1.0625, 17, 1.5 * 2.0 ** -9, -1.0625, 0.75 * 2.0 ** -9], np.float32) * s
    x = np.tile(row, (1, 8, 800))[:, :, :4800]
    out = np.empty(x.shape, ml_dtypes.float8_e4m3fn)
    assert quantize_into_codes(x, fmt, spec, out) is not None
    got = out.astype(np.float32)[0, 0, :6]
    np.testing.assert_array_equal(got, [448, 1.0, 16, 2.0 ** -8, -1.0, 2.0 ** -9])


def test_declines_where_the_numpy_path_must_run():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 16, 256)).astype(np.float32)
    spec = SPECS["block_1x128"]
    bad = x.copy()
    bad[1, 3, 7] = np.nan
    assert quantize_into_codes(bad, F8E4M3, spec, np.empty(x.shape, ml_dtypes.float8_e4m3fn)) is None
    bad[1, 3, 7] = np.inf
    assert quantize_into_codes(bad, F8E4M3, spec, np.empty(x.shape, ml_dtypes.float8_e4m3fn)) is None
    assert quantize_into_codes(x, INT8, spec, np.empty(x.shape, np.int8)) is None  # not a float8 buffer
    strided = np.empty((2, 16, 512), ml_dtypes.float8_e4m3fn)[:, :, ::2]
    assert quantize_into_codes(x, F8E4M3, spec, strided) is None
    assert quantize_into_codes(x, F8E4M3, spec, np.empty((2, 256, 16), ml_dtypes.float8_e4m3fn)) is None
