"""The ONNX importer on hand-written models: graph form, FP32 plan vs ONNX Runtime, external data, the
CLI (compile, audit, the plan's file hash, ORT peer rows) and its refusals (one line, exit 2, nothing
written). The node-level semantics are checked by ONNX's own cases in test_onnx_backend.py.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pandas as pd
import pytest
from onnx import TensorProto, helper, numpy_helper

from luminal_num.cli import main
from luminal_num.hlir.evaluate import evaluate
from luminal_num.hlir.graph import Graph
from luminal_num.hlir.ops import Op
from luminal_num.onnx import OnnxImportError, import_model, load_file, load_proto, parse_shapes
from luminal_num.onnx.job import read_batches
from luminal_num.onnx.ops import OPS
from luminal_num.onnx.peers import PEER_FP16, PEER_FP32

from onnx_cases import fp32_plan_outputs

# The op set the issue names for exported transformer encoders and decoders.
ISSUE_OPS = ("MatMul Gemm Add Sub Mul Div Pow Sqrt Reciprocal Exp Log Tanh Erf Relu Sigmoid Softmax "
             "LayerNormalization SimplifiedLayerNormalization RMSNormalization ReduceMean ReduceSum ReduceMax "
             "Gather Reshape Transpose Unsqueeze Squeeze Concat Slice Expand Where Cast Constant "
             "ConstantOfShape Split Identity Shape").split()


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "m", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _f(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def mlp_model() -> onnx.ModelProto:
    """x (batch, 16) -> MatMul + Add -> Relu -> Gemm(transB) -> Softmax: dynamic batch."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.3).astype(np.float32), "W1"),
             numpy_helper.from_array(np.full(32, 0.1, np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((8, 32)) * 0.3).astype(np.float32), "W2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("Gemm", ["r", "W2"], ["o"], transB=1),
             helper.make_node("Softmax", ["o"], ["y"], axis=-1)]
    return _model(nodes, [_f("x", ["batch", 16])], [_f("y", ["batch", 8])], inits)


def test_op_table_covers_the_issue_ops_and_names_real_onnx_ops():
    assert not [op for op in ISSUE_OPS if op not in OPS]
    contrib = {"SimplifiedLayerNormalization"}  # ONNX Runtime's contrib op in the default domain
    assert not [op for op in OPS if op not in contrib and not onnx.defs.has(op)]
    for op, spec in OPS.items():  # a handler or fold-only; static slots only on handled ops
        assert spec.fn is not None or spec.exact, op


def test_matmul_stays_mul_plus_sum_reduce_and_weights_are_views():
    m = import_model(load_proto(mlp_model()), {"x": (4, 16)})
    g = m.graph
    assert g.count(Op.MUL) >= 2 and g.count(Op.SUM_REDUCE) >= 2  # two matmuls (plus none hidden elsewhere)
    assert sorted(n for n, i in g.inputs.items() if i.is_weight) == ["W1", "W2", "b1"]
    # Gemm(transB=1) reads W2 in its stored (8, 32) layout through a transposed view, not a copy
    assert g.weights["W2"].shape == (8, 32)
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    (want,) = _ort(mlp_model(), {"x": x})
    got = m.restore(evaluate(g, m.feed({"x": x})))["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_int_inputs_cast_masks_and_runtime_gather_match_onnx_runtime():
    """ids -> Gather(table); mask int64 -> Cast float -> (1 - m) * -1e4 added; Where on a comparison-free
    bool input; the FP32 plan and the FP64 reference both match ORT."""
    rng = np.random.default_rng(2)
    table = rng.standard_normal((10, 6)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], axis=0),
             helper.make_node("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mf", "ax"], ["mu"]),
             helper.make_node("Sub", ["one", "mu"], ["inv"]), helper.make_node("Mul", ["inv", "big"], ["bias"]),
             helper.make_node("Add", ["e", "bias"], ["s"]),
             helper.make_node("Where", ["keep", "s", "zero"], ["w"]),
             helper.make_node("ReduceMax", ["w", "ax"], ["y"], keepdims=0)]
    inits = [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.array([-1], np.int64), "ax"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(-1e4, np.float32), "big"),
             numpy_helper.from_array(np.zeros(6, np.float32), "zero")]
    model = _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [3, 5]),
                           helper.make_tensor_value_info("mask", TensorProto.INT64, [3, 5]),
                           helper.make_tensor_value_info("keep", TensorProto.BOOL, [3, 5, 6])],
                   [_f("y", [3, 5])], inits, opset=18)
    feeds = {"ids": rng.integers(0, 10, (3, 5)), "mask": (rng.random((3, 5)) < 0.7).astype(np.int64),
             "keep": rng.random((3, 5, 6)) < 0.5}
    (want,) = _ort(model, feeds)
    m = import_model(load_proto(model))
    feed = m.feed(feeds)
    np.testing.assert_allclose(m.restore(evaluate(m.graph, feed))["y"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fp32_plan_outputs(m, feed)["y"], want, rtol=1e-6, atol=1e-6)


def test_the_dynamo_exporters_mask_forms_match_onnx_runtime():
    """transformers' padding mask as torch.onnx.export (dynamo) writes it: int64 mask -> Cast(BOOL) ->
    GatherND with known index tuples -> And with a known bool -> Where(mask, 0, finfo.min) added to the
    scores; plus Or/Not/Xor on the run-time mask. Mask values include negatives and int32's extremes
    (nonzero = True); an int64 value outside int32 (the graph's index type) is refused at feed."""
    b, s = 3, 5
    grid = np.stack(np.meshgrid(np.arange(b), np.arange(s), indexing="ij"), -1)[:, None, None, :, :]
    nodes = [helper.make_node("Cast", ["mask"], ["mb"], to=TensorProto.BOOL),
             helper.make_node("GatherND", ["mb", "idx"], ["g"]),
             helper.make_node("And", ["g", "causal"], ["keep"]),
             helper.make_node("Where", ["keep", "zero", "lowest"], ["bias"]),
             helper.make_node("Add", ["scores", "bias"], ["y"]),
             helper.make_node("Not", ["mb"], ["nm"]), helper.make_node("Or", ["nm", "flag"], ["o"]),
             helper.make_node("Xor", ["o", "mb"], ["z"])]
    inits = [numpy_helper.from_array(grid.astype(np.int64), "idx"),
             numpy_helper.from_array(np.array(True), "causal"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "lowest")]
    i64 = lambda n, shape, t=TensorProto.INT64: helper.make_tensor_value_info(n, t, shape)  # noqa: E731
    model = _model(nodes, [i64("mask", [b, s]), _f("scores", [b, 2, s, s]), i64("flag", [b, s], TensorProto.BOOL)],
                   [_f("y", [b, 2, s, s]), i64("z", [b, s], TensorProto.BOOL)], inits, opset=18)
    rng = np.random.default_rng(7)
    feeds = {"mask": np.array([[1, 1, 0, -3, 2 ** 31 - 1], [1, 0, 0, 0, 0], [-2 ** 31, 1, 1, 1, 0]], np.int64),
             "scores": rng.standard_normal((b, 2, s, s)).astype(np.float32), "flag": rng.random((b, s)) < 0.5}
    want_y, want_z = _ort(model, feeds)
    m = import_model(load_proto(model))
    feed = m.feed(feeds)
    for got in (m.restore(evaluate(m.graph, feed)), fp32_plan_outputs(m, feed)):
        np.testing.assert_array_equal(got["y"], want_y)
        np.testing.assert_array_equal(got["z"], want_z)
    with pytest.raises(OnnxImportError, match="outside int32"):
        m.feed({**feeds, "mask": np.full((b, s), 2 ** 40, np.int64)})


@pytest.mark.parametrize("idx", [[[2, -1], [0, 3]], [[[1], [0]], [[2], [2]]], [1, 2, 4], [[0, 1, 2], [2, 3, 0]]])
def test_gather_nd_with_known_indices_matches_numpy_indexing(idx):
    """Index tuples of length k pick data[i0, ..., ik-1, ...] (negative indices count from the end)."""
    idx = np.array(idx, np.int64)
    out_shape = list(idx.shape[:-1]) + [3, 4, 5][idx.shape[-1]:]
    model = _model([helper.make_node("GatherND", ["x", "i"], ["y"])], [_f("x", [3, 4, 5])], [_f("y", out_shape)],
                   [numpy_helper.from_array(idx, "i")], opset=13)
    x = np.random.default_rng(9).standard_normal((3, 4, 5)).astype(np.float32)
    want = x[tuple(np.moveaxis(idx, -1, 0))]
    m = import_model(load_proto(model))
    np.testing.assert_array_equal(m.restore(evaluate(m.graph, m.feed({"x": x})))["y"], want)
    np.testing.assert_array_equal(fp32_plan_outputs(m, m.feed({"x": x}))["y"], want)


def test_gather_with_known_indices_on_a_runtime_tensor():
    """Known indices: one index is a slice view (the axis drops), several become an int weight."""
    nodes = [helper.make_node("Gather", ["x", "many"], ["a"], axis=1), helper.make_node("Gather", ["x", "one"], ["b"], axis=2)]
    inits = [numpy_helper.from_array(np.array([[2, -4], [0, 1]], np.int64), "many"),
             numpy_helper.from_array(np.array(-1, np.int64), "one")]
    model = _model(nodes, [_f("x", [2, 4, 3])], [_f("a", [2, 2, 2, 3]), _f("b", [2, 4])], inits)
    x = np.random.default_rng(5).standard_normal((2, 4, 3)).astype(np.float32)
    m = import_model(load_proto(model))
    got = m.restore(evaluate(m.graph, m.feed({"x": x})))
    np.testing.assert_array_equal(got["a"], np.take(x, [[2, 0], [0, 1]], axis=1))
    np.testing.assert_array_equal(got["b"], x[:, :, -1])
    np.testing.assert_array_equal(fp32_plan_outputs(m, m.feed({"x": x}))["a"], np.take(x, [[2, 0], [0, 1]], axis=1))


def test_ort_simplified_layer_norm_matches_onnx_runtime():
    """ORT's contrib RMS norm (no ONNX node case exists): FP64 reference and FP32 plan against ORT."""
    rng = np.random.default_rng(6)
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y"], axis=-1, epsilon=1e-6)
    model = _model([node], [_f("x", [3, 4, 16])], [_f("y", [3, 4, 16])],
                   [numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "w")])
    x = (rng.standard_normal((3, 4, 16)) * 3).astype(np.float32)
    (want,) = _ort(model, {"x": x})
    m = import_model(load_proto(model))
    np.testing.assert_allclose(m.restore(evaluate(m.graph, m.feed({"x": x})))["y"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fp32_plan_outputs(m, m.feed({"x": x}))["y"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("e", [2.0, 3.0, -1.0, -2.0, 0.5, -0.5, 1.7, 0.0])
def test_pow_with_one_constant_exponent_matches_numpy(e):
    """Integer exponents as products, +-0.5 as (r)sqrt, others as exp2(e*log2 x): NaN for x < 0 as numpy."""
    model = _model([helper.make_node("Pow", ["x", "e"], ["y"])], [_f("x", [3, 4])], [_f("y", [3, 4])],
                   [numpy_helper.from_array(np.array(e, np.float32), "e")])
    x = np.random.default_rng(7).uniform(-3, 3, (3, 4)).astype(np.float32)
    m = import_model(load_proto(model))
    with np.errstate(all="ignore"):
        want = np.power(x.astype(np.float64), float(np.float32(e)))  # the file stores e in FP32
    np.testing.assert_allclose(m.restore(evaluate(m.graph, m.feed({"x": x})))["y"], want, rtol=1e-12)


def test_matrix_vector_matmul_matches_numpy():
    """A 1-D right operand: Mul + SumReduce with no N axis (gemm_operand_b once mistook it for A)."""
    g = Graph()
    a, b = g.input("a", (2, 4, 3, 2)), g.input("b", (2,))
    g.output(a @ b.reshape(2, 1), "y")
    rng = np.random.default_rng(3)
    x = {"a": rng.standard_normal((2, 4, 3, 2)), "b": rng.standard_normal(2)}
    np.testing.assert_allclose(evaluate(g, x)["y"][..., 0], x["a"] @ x["b"], rtol=1e-14)


def test_shape_subgraph_folds_and_symbolic_dims_bind_from_shapes():
    """Reshape target = Concat(Shape(x)[0], [-1]): folded for the bound batch, no Shape node survives."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
             helper.make_node("Unsqueeze", ["b", "a0"], ["bu"]), helper.make_node("Concat", ["bu", "m1"], ["t"], axis=0),
             helper.make_node("Reshape", ["x", "t"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "i0"), numpy_helper.from_array(np.array([0], np.int64), "a0"),
             numpy_helper.from_array(np.array([-1], np.int64), "m1")]
    model = _model(nodes, [_f("x", ["batch", 3, 4])], [_f("y", ["batch", 12])], inits)
    m = import_model(load_proto(model), parse_shapes("x=5x3x4"))
    assert [o.shape for o in m.outputs] == [(5, 12)]
    assert len(m.graph) == 2  # Input + Output: the reshape is a view
    x = np.arange(60, dtype=np.float32).reshape(5, 3, 4)
    np.testing.assert_array_equal(m.restore(evaluate(m.graph, m.feed({"x": x})))["y"], x.reshape(5, 12))


def test_external_data_is_loaded_and_hashed(tmp_path):
    model = mlp_model()
    path = tmp_path / "mlp.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="mlp.onnx.data", size_threshold=0)
    data = tmp_path / "mlp.onnx.data"
    assert data.stat().st_size > 16 * 32 * 4
    loaded = load_file(path)
    assert loaded.proto.graph.initializer[0].data_location == TensorProto.DEFAULT  # read in
    before = loaded.sha256
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))
    assert load_file(path).sha256 != before  # the hash covers the weights, not only the graph
    data.unlink()
    with pytest.raises(OnnxImportError, match="external data"):
        load_file(path)


def test_calibration_npz_conventions(tmp_path):
    x0, x1 = np.zeros((2, 16), np.float32), np.ones((2, 16), np.float32)
    np.savez(tmp_path / "one.npz", x=x0)
    np.savez(tmp_path / "two.npz", **{"x:0": x0, "x:1": x1})
    np.savez(tmp_path / "mixed.npz", **{"x": x0, "x:1": x1})
    assert [b["x"].sum() for b in read_batches(tmp_path / "one.npz")] == [0.0]
    assert [b["x"].sum() for b in read_batches(tmp_path / "two.npz")] == [0.0, 32.0]
    with pytest.raises(OnnxImportError, match="mixes"):
        read_batches(tmp_path / "mixed.npz")


# -- the CLI ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlp_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx_cli")
    onnx.save(mlp_model(), str(d / "mlp.onnx"))
    rng = np.random.default_rng(4)
    np.savez(d / "cal.npz", **{f"x:{i}": rng.standard_normal((4, 16)).astype(np.float32) for i in range(2)})
    return d


def _refuse(capsys, args, out):
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("error: ") and "\n" not in err
    assert not out.exists()
    return err


def test_cli_compile_records_the_file_hash_and_ort_peers_then_audit_checks_it(mlp_files, capsys):
    out = mlp_files / "report"
    args = ["--model", str(mlp_files / "mlp.onnx"), "--shape", "x=4x16", "--calibration", str(mlp_files / "cal.npz")]
    assert main(["compile", *args, "--target", "cpu", "--candidates", "6", "--quiet", "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["source"] == {"format": "onnx", "file": "mlp.onnx", "sha256": load_file(mlp_files / "mlp.onnx").sha256}
    rows = pd.read_csv(out / "pareto.csv")
    peers = rows[rows.stage == "peer"].set_index("label")
    assert set(peers.index) == {PEER_FP32, PEER_FP16}
    assert peers.loc[PEER_FP32, "passes"] and peers.loc[PEER_FP32, "allclose_ratio"] < peers.loc[PEER_FP16, "allclose_ratio"]
    capsys.readouterr()
    assert main(["audit", "--plan", str(out / "plan.json"), *args]) == 0
    other = mlp_files / "other.onnx"
    changed = mlp_model()
    changed.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.full(32, 0.2, np.float32), "b1"))
    onnx.save(changed, str(other))
    capsys.readouterr()
    assert main(["audit", "--plan", str(out / "plan.json"), "--model", str(other), "--shape", "x=4x16",
                 "--calibration", str(mlp_files / "cal.npz"), "--out", str(mlp_files / "a2")]) == 2
    assert "model file mismatch" in capsys.readouterr().err


def test_cli_refuses_unsupported_op_dynamic_shape_and_malformed_file(mlp_files, capsys, tmp_path):
    cal = str(mlp_files / "cal.npz")
    out = tmp_path / "never"
    sin = _model([helper.make_node("Sin", ["x"], ["y"], name="the_sin")], [_f("x", [4, 16])], [_f("y", [4, 16])])
    onnx.save(sin, str(tmp_path / "sin.onnx"))
    err = _refuse(capsys, ["compile", "--model", str(tmp_path / "sin.onnx"), "--calibration", cal, "--out", str(out)], out)
    assert "unsupported ONNX op Sin" in err and "the_sin" in err
    err = _refuse(capsys, ["compile", "--model", str(mlp_files / "mlp.onnx"), "--calibration", cal, "--out", str(out)], out)
    assert "dynamic dim 'batch'" in err and "--shape x=" in err
    (tmp_path / "bad.onnx").write_bytes(b"\x08\x07garbage, not a protobuf")
    err = _refuse(capsys, ["compile", "--model", str(tmp_path / "bad.onnx"), "--calibration", cal, "--out", str(out)], out)
    assert "bad.onnx" in err
    err = _refuse(capsys, ["compile", "--model", str(mlp_files / "mlp.onnx"), "--shape", "x=4x16", "--out", str(out)], out)
    assert "--calibration" in err


def test_unsupported_attribute_and_runtime_only_ops_are_refused_not_approximated():
    cast = _model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT, round_mode="up")],
                  [_f("x", [2, 3])], [_f("y", [2, 3])], opset=onnx.defs.get_schema("Cast").since_version)
    with pytest.raises(OnnxImportError, match=r"unsupported attribute\(s\) \['round_mode'\]"):
        import_model(load_proto(cast))
    nonzero = _model([helper.make_node("NonZero", ["x"], ["y"])], [_f("x", [2, 3])],
                     [helper.make_tensor_value_info("y", TensorProto.INT64, [2, None])])  # its shape is the values'
    with pytest.raises(OnnxImportError, match="only on values known at import"):
        import_model(load_proto(nonzero))
