"""ONNX node cases that were refused and now run (issue 36): zero-sized inputs are known at import (a
tensor with no elements has one value), CastLike reads only its second input's type, inputs of types
whose every value is an FP32 value (FP8, FP4, INT2/4/8/16, UINT2/4/8/16) are fed as FP32 where only a
cast to FLOAT reads them, and Abs, Less,
Greater, Equal, LessOrEqual, GreaterOrEqual (NaN unordered, as in ONNX), Max, Min run on run-time float
tensors in exact forms; a known tensor holding NaN/Inf that would enter the graph as a weight is refused at
import in one line (the run refuses it; it was a crash of the node run). Each case: FP64 reference and FP32 plan
against ONNX's expected outputs (tests/onnx_cases.py)."""
from __future__ import annotations

import pytest

from onnx_cases import cases_by_name, run_case

CASES = ("test_castlike_FLOAT_to_DOUBLE", "test_castlike_FLOAT_to_DOUBLE_expanded", "test_reduce_sum_empty_set",
         "test_reduce_log_sum_empty_set_expanded", "test_reduce_max_empty_set", "test_abs", "test_less", "test_greater",
         "test_less_equal", "test_greater_equal_expanded",
         "test_max_example", "test_min_two_inputs", "test_clip_example_expanded", "test_attention_4d_expanded",
         "test_split_zero_size_splits_opset18", "test_cast_FLOAT8E4M3FN_to_FLOAT", "test_cast_INT4_to_FLOAT",
         "test_castlike_FLOAT8E5M2_to_FLOAT_expanded", "test_cast_UINT2_to_FLOAT")


@pytest.fixture(scope="module")
def by_name():
    return cases_by_name()


@pytest.mark.parametrize("name", CASES)
def test_formerly_refused_node_cases_match_onnx(by_name, name):
    run_case(by_name[name])  # raises on a refusal or a mismatch


def test_rounding_casts_of_run_time_floats_stay_refused(by_name):
    """Cast to BFLOAT16 rounds in ONNX; the FP64 reference treats an HLIR Cast as a precision choice, and
    the exact value rounding (onnx/round_cast.py) covers float16 and FP8 only, so the importer refuses it
    rather than answering with the unrounded value."""
    from luminal_num.onnx import OnnxImportError
    with pytest.raises(OnnxImportError, match="BFLOAT16"):
        run_case(by_name["test_cast_FLOAT_to_BFLOAT16"])


def test_a_known_non_finite_tensor_entering_the_graph_is_refused_at_import(by_name):
    from luminal_num.onnx import OnnxImportError
    with pytest.raises(OnnxImportError, match="holds NaN or Inf"):
        run_case(by_name["test_attention_4d_causal_expanded"])
