"""ONNX integer data, narrow-float data and DOUBLE outputs (issue 36): exact, or refused in one line.

Integer data (int8 .. uint64, and int32/int64 used as numbers) is held in FP32, exact while every value
stays within +-2^24 and its ONNX type (OnnxModel.feed checks the fed batch's ranges); narrow floats
(float16, FP8, FP4, int2/int4) are FP32 values, so selections, comparisons and casts that change no value
are exact; double data is computed in double by the FP64 reference and its model refused for plans
(which would run it at FP32). Truths: ONNX's own node cases (expected outputs from
ONNX's numpy code) and numpy integer arithmetic; each checked on the FP64 reference and the FP32 plan.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

from luminal_num.hlir.evaluate import evaluate
from luminal_num.onnx import OnnxImportError, import_model, load_proto

from onnx_cases import cases_by_name, fp32_plan_outputs, run_case

CASES = (
    # integer data: arithmetic, comparisons, selections, casts
    "test_add_uint8", "test_sub_int16", "test_mul_uint64", "test_div_uint32", "test_div_int32_trunc",
    "test_mod_mixed_sign_int8", "test_mod_uint16", "test_mod_int64_fmod", "test_mod_broadcast", "test_equal_uint32",
    "test_equal", "test_greater_equal_int8_expanded", "test_less_uint64", "test_max_int64", "test_min_uint8",
    "test_where_long_example", "test_clip_default_int8_min_expanded", "test_gathernd_example_int32",
    # narrow floats and casts that change no value
    "test_max_float16", "test_min_float16", "test_mod_mixed_sign_float16", "test_mod_mixed_sign_float32",
    "test_cast_FLOAT8E4M3FN_to_FLOAT16", "test_cast_INT4_to_INT8", "test_castlike_UINT2_to_FLOAT16_expanded",
    "test_cast_FLOAT16_to_DOUBLE", "test_castlike_FLOAT4E2M1_to_FLOAT16",
)


@pytest.fixture(scope="module")
def by_name():
    return cases_by_name()


@pytest.mark.parametrize("name", CASES)
def test_typed_node_cases_match_onnx(by_name, name):
    with np.errstate(all="ignore"):
        run_case(by_name[name])  # raises on a refusal or a mismatch (FP64 reference and FP32 plan)


def _model(op: str, elem: int, out_elem: int | None = None, n_in: int = 2, shape=(64,), **attrs) -> onnx.ModelProto:
    names = "abc"[:n_in]
    node = helper.make_node(op, list(names), ["y"], **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, elem, shape) for n in names],
                          [helper.make_tensor_value_info("y", out_elem or elem, shape)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def _both(proto: onnx.ModelProto, feed: dict) -> tuple[np.ndarray, np.ndarray]:
    model = import_model(load_proto(proto))
    fed = model.feed(feed)
    return model.restore(evaluate(model.graph, fed))["y"], fp32_plan_outputs(model, fed)["y"]


def _trunc_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    q = np.abs(a) // np.abs(b)  # numpy's own integer arithmetic, written separately from the graph's form
    return np.where((a < 0) != (b < 0), -q, q)


def test_integer_division_is_exact_up_to_its_limit():
    """Div of integers (truncation toward zero) against numpy's integers, dividends up to 2^21."""
    rng = np.random.default_rng(36)
    a = np.concatenate([rng.integers(-2 ** 21, 2 ** 21 + 1, 4000), np.arange(-40, 41), [2 ** 21, -2 ** 21, 0]])
    b = np.concatenate([rng.integers(1, 5000, 4000) * rng.choice([-1, 1], 4000), rng.integers(1, 9, 81) *
                        rng.choice([-1, 1], 81), [3, -7, 5]])
    a, b = a.astype(np.int32), b.astype(np.int32)
    ref, f32 = _both(_model("Div", T.INT32, shape=a.shape), {"a": a, "b": b})
    np.testing.assert_array_equal(ref, _trunc_div(a.astype(np.int64), b.astype(np.int64)))
    np.testing.assert_array_equal(f32, ref)
    assert ref.dtype == np.int32


@pytest.mark.parametrize("fmod", [0, 1])
def test_integer_mod_follows_onnx_signs(fmod):
    rng = np.random.default_rng(7)
    a = rng.integers(-10 ** 6, 10 ** 6, 3000).astype(np.int64)
    b = (rng.integers(1, 10 ** 4, 3000) * rng.choice([-1, 1], 3000)).astype(np.int64)
    ref, f32 = _both(_model("Mod", T.INT64, fmod=fmod, shape=a.shape), {"a": a, "b": b})
    want = np.fmod(a, b) if fmod else np.mod(a, b)  # C remainder / Python's floor-mod on int64
    np.testing.assert_array_equal(ref, want)
    np.testing.assert_array_equal(f32, want)


def test_integer_products_exact_to_2_24():
    """Ranges are per tensor (the batch's min and max): |a| <= 2^12 and |b| <= 2^12 bound every product by 2^24."""
    a = np.array([4095, -4095, 1, 0, 2 ** 12], np.int32)
    b = np.array([4096, 4095, 4093, 5, 2 ** 12], np.int32)
    ref, f32 = _both(_model("Mul", T.INT32, shape=a.shape), {"a": a, "b": b})
    np.testing.assert_array_equal(ref, a.astype(np.int64) * b)
    np.testing.assert_array_equal(f32, ref)


@pytest.mark.parametrize("op, elem, a, b, match", [
    ("Add", T.UINT8, [200], [100], "outside uint8's range"),        # ONNX wraps to 44
    ("Sub", T.UINT16, [1], [2], "outside uint16's range"),          # ONNX wraps to 65535
    ("Mul", T.INT32, [5000], [4000], "beyond 16777216"),            # 2e7 > 2^24: FP32 would round
    ("Add", T.INT64, [2 ** 24], [1], "beyond 16777216"),
    ("Div", T.INT32, [7], [0], "divisor may be 0"),
    ("Div", T.INT32, [2 ** 21 + 1], [3], "beyond 2097152"),         # the exact division's limit
    ("Add", T.UINT64, [2 ** 40], [1], "beyond 2\\^24"),              # refused as fed
])
def test_batches_that_would_leave_an_exact_range_are_refused_in_one_line(op, elem, a, b, match):
    dt = helper.tensor_dtype_to_np_dtype(elem)
    model = import_model(load_proto(_model(op, elem, shape=(1,))))
    with pytest.raises(OnnxImportError, match=match) as err:
        model.feed({"a": np.array(a, dt), "b": np.array(b, dt)})
    assert "\n" not in str(err.value)


def test_index_input_cast_to_a_narrower_integer_is_checked_per_batch():
    model = import_model(load_proto(_model("Cast", T.INT64, T.INT8, n_in=1, shape=(3,), to=T.INT8)))
    out = model.restore(evaluate(model.graph, model.feed({"a": np.array([-128, 0, 127])})))["y"]
    np.testing.assert_array_equal(out, np.array([-128, 0, 127], np.int8))
    assert out.dtype == np.int8
    with pytest.raises(OnnxImportError, match="outside int8's range"):
        model.feed({"a": np.array([0, 128, 1])})


def test_double_is_honoured_or_refused(tmp_path):
    """Double data (a DOUBLE input, or arithmetic after a Cast to DOUBLE) is computed in double by the FP64
    reference, as ONNX does, and the model is FP64-only: compile refuses it in one line (every plan would
    run it at FP32). A Cast to DOUBLE that only exact ops follow stays a plan like any other."""
    from luminal_num.onnx.job import onnx_job
    cast = helper.make_node("Cast", ["a"], ["d"], to=T.DOUBLE)
    add = helper.make_node("Add", ["d", "d3"], ["y"])
    third = helper.make_tensor("d3", T.DOUBLE, (), [1.0 / 3.0])
    g = helper.make_graph([cast, add], "g", [helper.make_tensor_value_info("a", T.FLOAT, (4,))],
                          [helper.make_tensor_value_info("y", T.DOUBLE, (4,))], initializer=[third])
    a = np.array([1.5, -2.25, 3e-8, 7.0], np.float32)
    doubles = {"a": a.astype(np.float64) + 0.1, "b": np.full(4, 1 / 3)}
    for proto, feed in ((helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), {"a": a}),
                        (_model("Add", T.DOUBLE, shape=(4,)), doubles)):
        model = import_model(load_proto(proto))
        assert model.fp64_only
        out = model.restore(evaluate(model.graph, model.feed(feed)))["y"]
        want = (a.astype(np.float64) + 1.0 / 3.0) if "b" not in feed else feed["a"] + feed["b"]
        assert out.dtype == np.float64
        np.testing.assert_array_equal(out, want)  # double arithmetic: not the FP32 sum
        path = tmp_path / "m.onnx"
        onnx.save(proto, path)
        np.savez(tmp_path / "cal.npz", **feed)
        with pytest.raises(OnnxImportError, match="only the FP64 reference does") as err:
            onnx_job(str(path), None, str(tmp_path / "cal.npz"))
        assert "\n" not in str(err.value)
    mx = helper.make_node("Max", ["d", "d"], ["y"])
    g = helper.make_graph([cast, mx], "g", [helper.make_tensor_value_info("a", T.FLOAT, (4,))],
                          [helper.make_tensor_value_info("y", T.DOUBLE, (4,))])
    model = import_model(load_proto(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])))
    assert not model.fp64_only
    fed = model.feed({"a": a})
    for out in (model.restore(evaluate(model.graph, fed))["y"], fp32_plan_outputs(model, fed)["y"]):
        assert out.dtype == np.float64
        np.testing.assert_array_equal(out, a.astype(np.float64))
    with pytest.raises(OnnxImportError, match="float64 tensor to FLOAT is not supported"):  # double -> float rounds
        import_model(load_proto(_double_then_float()))


def _double_then_float() -> onnx.ModelProto:
    """A DOUBLE input used as data, then cast to FLOAT (a rounding the graph does not express)."""
    nodes = [helper.make_node("Neg", ["a"], ["n"]), helper.make_node("Cast", ["n"], ["y"], to=T.FLOAT)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", T.DOUBLE, (4,))],
                          [helper.make_tensor_value_info("y", T.FLOAT, (4,))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def test_narrow_float_arithmetic_is_refused():
    """ONNX rounds a float16 sum to float16; the graph would not: refused, not approximated."""
    with pytest.raises(OnnxImportError, match="holds float16 values; this op takes float"):
        import_model(load_proto(_model("Add", T.FLOAT16, shape=(4,))))
