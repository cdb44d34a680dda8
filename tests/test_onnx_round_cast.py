"""ONNX Cast of run-time floats to float16 and the FP8 types (issue 36): a value rounding the FP64 reference
computes exactly (onnx/round_cast.py), checked against ml_dtypes' casts (the oracle, written independently)
on every value of each format, every midpoint between neighbours (ties to even) and the FP32 values next
to them, in the FP64 reference and in the FP32 plan; non-finite inputs on the FP64 reference (the runtime
refuses them); and ONNX's own node cases. Casts the graph cannot round exactly stay refused.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

from luminal_num.hlir.evaluate import evaluate
from luminal_num.onnx import OnnxImportError, import_model, load_proto

from onnx_cases import cases_by_name, fp32_plan_outputs, run_case

TARGETS = {T.FLOAT16: np.float16, T.FLOAT8E4M3FN: ml_dtypes.float8_e4m3fn, T.FLOAT8E4M3FNUZ: ml_dtypes.float8_e4m3fnuz,
           T.FLOAT8E5M2: ml_dtypes.float8_e5m2, T.FLOAT8E5M2FNUZ: ml_dtypes.float8_e5m2fnuz}


def _cast_model(to: int, saturate: int, n: int, src: int = T.FLOAT) -> onnx.ModelProto:
    node = helper.make_node("Cast", ["x"], ["y"], to=to, saturate=saturate)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", src, (n,))],
                          [helper.make_tensor_value_info("y", to, (n,))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])


def _probe_values(dt, rng) -> np.ndarray:
    """Every finite value of the format (a sample of float16's), the midpoints between neighbours, the FP32
    values on each side of them, values past the largest, and random ones across the range."""
    f16_bits = np.concatenate([np.arange(0, 65536, 37), np.arange(0x7B00, 0x7C00), np.arange(0, 0x0400)])
    bits = np.arange(256, dtype=np.uint8) if np.dtype(dt).itemsize == 1 else np.unique(f16_bits).astype(np.uint16)
    grid = np.unique(bits.view(dt).astype(np.float64))
    grid = grid[np.isfinite(grid)]
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    top = float(ml_dtypes.finfo(dt).max)
    return np.concatenate([grid, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
                           rng.standard_normal(500) * top / 3, [top * 1.04, top * 1.2, 1e6, -1e6, 1e-9, -1e-9, 0.0]]
                          ).astype(np.float32)


def _oracle(x: np.ndarray, dt, saturate: int) -> np.ndarray:
    """ONNX's Cast as its node cases compute it: FP8 with saturate clamps to the largest finite value first."""
    with np.errstate(all="ignore"):
        return onnx.numpy_helper.saturate_cast(x, dt) if saturate and dt is not np.float16 else x.astype(dt)


@pytest.mark.parametrize("saturate", [1, 0])
@pytest.mark.parametrize("to", list(TARGETS), ids=lambda t: T.DataType.Name(t))
def test_rounding_cast_equals_ml_dtypes_on_fp64_and_fp32_plan(to, saturate):
    dt = TARGETS[to]
    x = _probe_values(dt, np.random.default_rng(to))
    model = import_model(load_proto(_cast_model(to, saturate, len(x))))
    fed = model.feed({"x": x})
    want = _oracle(x, dt, saturate).astype(np.float64)
    with np.errstate(all="ignore"):
        ref = model.restore(evaluate(model.graph, fed))["y"]
        f32 = fp32_plan_outputs(model, fed)["y"]
    assert ref.dtype == np.dtype(dt) and f32.dtype == np.dtype(dt)
    np.testing.assert_array_equal(ref.astype(np.float64), want)
    np.testing.assert_array_equal(f32.astype(np.float64), want)


@pytest.mark.parametrize("saturate", [1, 0])
@pytest.mark.parametrize("to", list(TARGETS), ids=lambda t: T.DataType.Name(t))
def test_rounding_cast_of_nan_and_inf_on_the_fp64_reference(to, saturate):
    dt = TARGETS[to]
    x = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    model = import_model(load_proto(_cast_model(to, saturate, len(x))))
    with np.errstate(all="ignore"):
        ref = model.restore(evaluate(model.graph, model.feed({"x": x})))["y"]
    np.testing.assert_array_equal(ref.astype(np.float64), _oracle(x, dt, saturate).astype(np.float64))


NODE_CASES = ("test_cast_FLOAT_to_FLOAT16", "test_castlike_FLOAT_to_FLOAT8E4M3FN_expanded",
              "test_cast_FLOAT16_to_FLOAT8E5M2FNUZ", "test_cast_no_saturate_FLOAT_to_FLOAT8E5M2",
              "test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FNUZ")


@pytest.fixture(scope="module")
def by_name():
    return cases_by_name()


@pytest.mark.parametrize("name", NODE_CASES)
def test_rounding_cast_node_cases_match_onnx(by_name, name):
    with np.errstate(all="ignore"):
        run_case(by_name[name])


@pytest.mark.parametrize("to, why", [(T.BFLOAT16, "BFLOAT16"), (T.INT4, "INT4"), (T.FLOAT4E2M1, "FLOAT4E2M1")])
def test_casts_the_graph_does_not_round_stay_refused(to, why):
    with pytest.raises(OnnxImportError, match=f"to {why} is not supported"):
        import_model(load_proto(_cast_model(to, 1, 4)))
