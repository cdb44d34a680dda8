"""ONNX Floor, Ceil, ReduceProd, Tile, Concat and Slice with negative steps or empty results (issue 36),
each against numpy (written independently of the graph's forms) on the FP64 reference and the FP32 plan,
and ONNX's own node cases."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

from luminal_num.hlir.evaluate import evaluate
from luminal_num.onnx import OnnxImportError, import_model, load_proto

from onnx_cases import cases_by_name, fp32_plan_outputs, run_case

NODE_CASES = ("test_floor", "test_ceil_example", "test_reduce_prod_keepdims_random",
              "test_reduce_prod_default_axes_keepdims_example", "test_reduce_prod_empty_set", "test_slice_neg_steps",
              "test_slice_start_out_of_bounds", "test_tile", "test_tile_precomputed")


@pytest.mark.parametrize("name", NODE_CASES)
def test_node_cases_match_onnx(name):
    run_case(cases_by_name()[name])


def _graph(nodes, inputs, out_shape, out_elem=T.FLOAT, inits=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, e, s) for n, e, s in inputs],
                          [helper.make_tensor_value_info("y", out_elem, out_shape)], initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def _run(proto, feed, plan=True):
    model = import_model(load_proto(proto))
    fed = model.feed(feed)
    with np.errstate(all="ignore"):
        ref = model.restore(evaluate(model.graph, fed))["y"]
        return ref, (fp32_plan_outputs(model, fed)["y"] if plan else None)


@pytest.mark.parametrize("op, fn", [("Floor", np.floor), ("Ceil", np.ceil)])
def test_floor_ceil_exact_including_large_and_non_finite(op, fn):
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(300) * 10, [0.5, -0.5, 2.0, -2.0, 1e-30, -1e-30, 8388607.5, -8388607.5,
                                                     3e9, -3e9, 1e38, -1e38, 0.0]]).astype(np.float32)
    proto = _graph([helper.make_node(op, ["x"], ["y"])], [("x", T.FLOAT, x.shape)], x.shape)
    ref, f32 = _run(proto, {"x": x})
    np.testing.assert_array_equal(ref, fn(x.astype(np.float64)))
    np.testing.assert_array_equal(f32, fn(x))
    special = np.array([np.inf, -np.inf, np.nan, 1.5], np.float32)  # the FP64 reference (the runtime refuses these)
    ref, _ = _run(_graph([helper.make_node(op, ["x"], ["y"])], [("x", T.FLOAT, (4,))], (4,)), {"x": special},
                  plan=False)
    np.testing.assert_array_equal(ref, fn(special.astype(np.float64)))


def test_reduce_prod_is_the_fp32_product_chain():
    rng = np.random.default_rng(4)
    x = rng.uniform(0.5, 2.0, (3, 5, 4)).astype(np.float32)
    axes = helper.make_tensor("axes", T.INT64, (2,), [0, 2])
    proto = _graph([helper.make_node("ReduceProd", ["x", "axes"], ["y"], keepdims=0)], [("x", T.FLOAT, x.shape)],
                   (5,), inits=[axes])
    ref, f32 = _run(proto, {"x": x})
    np.testing.assert_allclose(ref, np.prod(x.astype(np.float64), axis=(0, 2)), rtol=1e-15)
    np.testing.assert_allclose(f32, ref, rtol=12 * 2.0 ** -24)  # 11 FP32 products each rounded once


@pytest.mark.parametrize("starts, ends, steps", [([-1], [-10], [-1]), ([4], [0], [-2]), ([10], [-100], [-3]),
                                                 ([2], [2], [1]), ([5], [1], [1])])
def test_slice_negative_steps_and_empty_results_as_python(starts, ends, steps):
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    want = x[slice(starts[0], ends[0], steps[0])]
    ints = [helper.make_tensor(n, T.INT64, (1,), v) for n, v in
            (("s", starts), ("e", ends), ("a", [0]), ("st", steps))]
    proto = _graph([helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"])], [("x", T.FLOAT, x.shape)],
                   want.shape, inits=ints)
    model = import_model(load_proto(proto))
    if want.size == 0:
        assert model.constant_outputs["y"].shape == want.shape
        return
    ref, f32 = _run(proto, {"x": x})
    np.testing.assert_array_equal(ref, want)
    np.testing.assert_array_equal(f32, want)


def test_tile_and_concat_of_indices_go_through_checked_integer_data():
    """Concat/Tile add padded zeros: index tensors (INT32 in the graph) are taken as integer data, so a value
    past 2^24 is refused per batch instead of being rounded by an FP32 addition."""
    reps = helper.make_tensor("r", T.INT64, (2,), [2, 3])
    proto = _graph([helper.make_node("Tile", ["x", "r"], ["t"]), helper.make_node("Concat", ["t", "t"], ["y"], axis=0)],
                   [("x", T.INT64, (2, 2))], (8, 6), out_elem=T.INT64, inits=[reps])
    x = np.array([[1, -2], [3, 2 ** 24]], np.int64)
    ref, f32 = _run(proto, {"x": x})
    want = np.concatenate([np.tile(x, (2, 3))] * 2, axis=0)
    np.testing.assert_array_equal(ref, want)
    np.testing.assert_array_equal(f32, want)
    with pytest.raises(OnnxImportError, match="beyond 16777216"):
        import_model(load_proto(proto)).feed({"x": x + 1})
