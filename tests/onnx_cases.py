"""The ONNX node-case harness for the tests (it lives in luminal_num/onnx/node_cases.py, shared with
bench/onnx_node_coverage.py)."""
from luminal_num.onnx.node_cases import (CaseRefused, CaseResult, as_array, claimed_cases, fp32_plan_outputs,  # noqa: F401
                                         run_case)
