"""The ONNX node-case harness for the tests (it lives in luminal_num/onnx/node_cases.py, shared with
bench/onnx_node_coverage.py)."""
from luminal_num.onnx.node_cases import (CaseRefused, CaseResult, as_array, cases_by_name, claimed_cases,  # noqa: F401
                                         fp32_plan_outputs, run_case)
