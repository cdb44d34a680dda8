"""New-user faults of issue 36, run as a user runs them (a subprocess in a scratch folder): each is one
`error: ...` line on stderr, exit code 2, and nothing written."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from test_cli import cli

VOCAB = 10


def _one_line_refusal(proc, *words: str) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


@pytest.fixture(scope="module")
def gather_model(tmp_path_factory) -> Path:
    """ids (2, 3) int64 -> Gather(table (VOCAB, 4)) -> ReduceSum over the last axis: token embeddings."""
    d = tmp_path_factory.mktemp("onnx_ids")
    table = np.random.default_rng(0).standard_normal((VOCAB, 4)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], axis=0),
             helper.make_node("ReduceSum", ["e", "ax"], ["y"], keepdims=0)]
    graph = helper.make_graph(nodes, "ids", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [numpy_helper.from_array(table, "table"),
                               numpy_helper.from_array(np.array([-1], np.int64), "ax")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(d / "ids.onnx"))
    np.savez(d / "good.npz", ids=np.array([[1, 2, 3], [4, 5, 9]], np.int64))
    np.savez(d / "vocab.npz", ids=np.array([[1, 2, 3], [4, 5, VOCAB]], np.int64))
    np.savez(d / "minus.npz", ids=np.array([[1, 2, -1], [4, 5, 6]], np.int64))
    np.savez(d / "float.npz", ids=np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 0.7]]))
    return d


@pytest.mark.parametrize("batch, words", [("vocab.npz", ("'ids'", "[0, 9]")), ("minus.npz", ("'ids'", "[0, 9]")),
                                          ("float.npz", ("'ids'", "integers", "float64"))])
def test_onnx_compile_refuses_bad_token_ids(gather_model, batch, words):
    out = gather_model / f"never_{batch}"
    proc = cli("compile", "--model", str(gather_model / "ids.onnx"), "--calibration", str(gather_model / batch),
               "--target", "cpu", "--candidates", "3", "--quiet", "--out", str(out), cwd=gather_model)
    _one_line_refusal(proc, *words)
    assert not out.exists()


def test_onnx_audit_refuses_bad_token_ids(gather_model):
    out = gather_model / "report"
    args = ("--model", str(gather_model / "ids.onnx"))
    done = cli("compile", *args, "--calibration", str(gather_model / "good.npz"), "--target", "cpu",
               "--candidates", "3", "--quiet", "--out", str(out), cwd=gather_model)
    assert done.returncode == 0, done.stderr[-2000:]
    for batch, words in (("vocab.npz", ("[0, 9]",)), ("minus.npz", ("[0, 9]",)), ("float.npz", ("integers",))):
        audit_out = gather_model / f"audit_{batch}"
        proc = cli("audit", "--plan", str(out / "plan.json"), *args, "--inputs", str(gather_model / batch),
                   "--out", str(audit_out), cwd=gather_model)
        _one_line_refusal(proc, "'ids'", *words)
        assert not audit_out.exists()
