"""Every frontend op against an independent numpy formula in FP64 (relative error <= 1e-12)."""
import math

import numpy as np
import pytest
import scipy.special

from luminal_num.hlir import Graph, Op, concat, evaluate, index_input

RNG = np.random.default_rng(1234)
A = RNG.standard_normal((3, 5))
B = RNG.standard_normal((3, 5))
POS = RNG.uniform(0.5, 4.0, (3, 5))


def rel_err(y, ref):
    ref = np.asarray(ref, dtype=np.float64)
    return np.linalg.norm(np.asarray(y) - ref) / max(np.linalg.norm(ref), 1e-300)


def run(build, **arrays):
    g = Graph()
    ts = {k: g.input(k, v.shape) for k, v in arrays.items()}
    g.output(build(**ts), "y")
    return evaluate(g, arrays)["y"], g


CASES = {
    "add": (lambda a, b: a + b, lambda a, b: a + b, dict(a=A, b=B)),
    "sub": (lambda a, b: a - b, lambda a, b: a - b, dict(a=A, b=B)),
    "mul": (lambda a, b: a * b, lambda a, b: a * b, dict(a=A, b=B)),
    "div": (lambda a, b: a / b, lambda a, b: a / b, dict(a=A, b=POS)),
    "rdiv": (lambda a: 2.0 / a, lambda a: 2.0 / a, dict(a=POS)),
    "neg": (lambda a: -a, lambda a: -a, dict(a=A)),
    "scalar": (lambda a: 3.0 * a + 1.5, lambda a: 3.0 * a + 1.5, dict(a=A)),
    "mod": (lambda a, b: a % b, lambda a, b: np.fmod(a, b), dict(a=A * 5, b=POS)),
    "lt": (lambda a, b: a < b, lambda a, b: (a < b).astype(float), dict(a=A, b=B)),
    "gt": (lambda a, b: a > b, lambda a, b: (a > b).astype(float), dict(a=A, b=B)),
    "exp2": (lambda a: a.exp2(), lambda a: 2.0 ** a, dict(a=A)),
    "log2": (lambda a: a.log2(), lambda a: np.log(a) / np.log(2.0), dict(a=POS)),
    "sin": (lambda a: a.sin(), np.sin, dict(a=A)),
    "cos": (lambda a: a.cos(), np.cos, dict(a=A)),
    "recip": (lambda a: a.recip(), lambda a: 1.0 / a, dict(a=POS)),
    "sqrt": (lambda a: a.sqrt(), lambda a: a ** 0.5, dict(a=POS)),
    "rsqrt": (lambda a: a.rsqrt(), lambda a: a ** -0.5, dict(a=POS)),
    "exp": (lambda a: a.exp(), lambda a: np.e ** a, dict(a=A)),
    "log": (lambda a: a.log(), np.log, dict(a=POS)),
    "sigmoid": (lambda a: a.sigmoid(), lambda a: 1 / (1 + np.exp(-a)), dict(a=A)),
    "tanh": (lambda a: a.tanh(), np.tanh, dict(a=A)),
    "relu": (lambda a: a.relu(), lambda a: np.where(a > 0, a, 0.0), dict(a=A)),
    "maximum": (lambda a, b: a.maximum(b), np.maximum, dict(a=A, b=B)),
    "erf": (lambda a: a.erf(), scipy.special.erf, dict(a=A)),
    "sum_last": (lambda a: a.sum(-1), lambda a: a.sum(-1), dict(a=A)),
    "sum_first_keep": (lambda a: a.sum(0, keepdim=True), lambda a: a.sum(0, keepdims=True), dict(a=A)),
    "sum_all": (lambda a: a.sum(None), lambda a: a.sum(), dict(a=A)),
    "max": (lambda a: a.max(1), lambda a: a.max(1), dict(a=A)),
    "mean": (lambda a: a.mean((0, 1)), lambda a: a.mean(), dict(a=A)),
    "softmax": (lambda a: a.softmax(-1), lambda a: np.exp(a) / np.exp(a).sum(-1, keepdims=True), dict(a=A)),
    "softmax0": (lambda a: a.softmax(0), lambda a: np.exp(a) / np.exp(a).sum(0, keepdims=True), dict(a=A)),
    "matmul": (lambda a, b: a @ b.transpose(), lambda a, b: np.einsum("ik,jk->ij", a, b), dict(a=A, b=B)),
    "layer_norm": (lambda a: a.layer_norm(eps=1e-5),
                   lambda a: (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-5), dict(a=A)),
    "rms_norm": (lambda a: a.rms_norm(eps=1e-6), lambda a: a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6),
                 dict(a=A)),
    "gelu_tanh": (lambda a: a.gelu("tanh"),
                  lambda a: 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3))), dict(a=A)),
    "gelu_erf": (lambda a: a.gelu("none"), lambda a: 0.5 * a * (1 + scipy.special.erf(a / np.sqrt(2))), dict(a=A)),
    "silu": (lambda a: a.silu(), lambda a: a / (1 + np.exp(-a)), dict(a=A)),
    "permute_reshape": (lambda a: a.transpose().reshape(5, 3) * 2.0, lambda a: a.T.reshape(5, 3) * 2.0, dict(a=A)),
    "slice_pad": (lambda a: a.slice((1, 3), (0, 4)).pad((1, 0), (0, 2)) + 0.0,
                  lambda a: np.pad(a[1:3, 0:4], ((1, 0), (0, 2))), dict(a=A)),
    "concat": (lambda a, b: concat([a, b.slice((0, 2))], 0), lambda a, b: np.concatenate([a, b[:2]], 0), dict(a=A, b=B)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_numpy(name):
    build, ref, arrays = CASES[name]
    y, _ = run(build, **arrays)
    assert rel_err(y, ref(*arrays.values())) <= 1e-12


def test_batched_matmul_broadcasts():
    a, b = RNG.standard_normal((2, 3, 4, 5)), RNG.standard_normal((3, 5, 6))
    y, g = run(lambda a, b: a @ b, a=a, b=b)
    assert rel_err(y, np.matmul(a, b)) <= 1e-12
    assert g.count(Op.MUL) == 1 and g.count(Op.SUM_REDUCE) == 1


def test_matmul_is_five_nodes():
    g = Graph()
    g.output(g.input("a", (4, 8)) @ g.input("b", (8, 3)), "y")
    assert len(g) == 5
    assert [n.op for n in g.nodes] == [Op.INPUT, Op.INPUT, Op.MUL, Op.SUM_REDUCE, Op.OUTPUT]


def test_views_create_no_nodes():
    g = Graph()
    a = g.input("a", (4, 6))
    before = len(g)
    a.transpose().reshape(2, 12).slice((0, 1)).pad((1, 1)).expand_dim(0, 3)
    assert len(g) == before


def test_embedding_scatter_arange():
    g = Graph()
    table = g.input("table", (10, 4))
    ids = index_input(g, "ids", (3,))
    g.output(table.gather(ids), "emb")
    dest, src = g.input("dest", (6, 4)), g.input("src", (2, 4))
    pos = index_input(g, "pos", (2,))
    g.output(dest.scatter(src, pos), "kv")
    g.output(g.arange(5) * 2.0, "ar")
    t, d, s = RNG.standard_normal((10, 4)), RNG.standard_normal((6, 4)), RNG.standard_normal((2, 4))
    out = evaluate(g, {"table": t, "ids": np.array([3, 0, 9]), "dest": d, "src": s, "pos": np.array([4, 1])})
    np.testing.assert_array_equal(out["emb"], t[[3, 0, 9]])
    want = d.copy(); want[[4, 1]] = s
    np.testing.assert_array_equal(out["kv"], want)
    np.testing.assert_array_equal(out["ar"], np.arange(5) * 2.0)
    with pytest.raises(IndexError):
        evaluate(g, {"table": t, "ids": np.array([10, 0, 0]), "dest": d, "src": s, "pos": np.array([4, 1])})


def test_symbolic_mean_and_shapes():
    g = Graph()
    x = g.input("x", ("s", 4))
    g.output(x.mean(0), "m")
    for s in (2, 7):
        xs = RNG.standard_normal((s, 4))
        assert rel_err(evaluate(g, {"x": xs})["m"], xs.mean(0)) <= 1e-12
    with pytest.raises(ValueError, match="expected shape"):
        evaluate(g, {"x": RNG.standard_normal((3, 5))})


def test_frontend_errors():
    g = Graph()
    a, b = g.input("a", (2, 3)), g.input("b", (4, 3))
    with pytest.raises(ValueError, match="broadcast"):
        a + b
    with pytest.raises(ValueError, match="inner dims"):
        a @ a
    with pytest.raises(ValueError, match="already exists"):
        g.input("a", (1,))
    with pytest.raises(ValueError, match="approximate"):
        a.gelu("fast")
    other = Graph().input("c", (2, 3))
    with pytest.raises(ValueError, match="different graphs"):
        a + other


def test_structural_key_ignores_names_not_structure():
    def build(name, d):
        g = Graph()
        g.output(g.input(name, (4, d)).exp(), "out_" + name)
        return g.structural_key()
    assert build("a", 3) == build("zzz", 3)
    assert build("a", 3) != build("a", 5)
    assert math.isfinite(float(int(build("a", 3), 16) % 7))


def test_two_layer_transformer_fp32_error_within_gamma_n_of_longest_dot():
    """FP64 and FP32 evaluation of a 2-layer block; FP32's error, relative to the output's magnitude,
    stays within gamma_n(u_fp32) for n the longest dot product in the block (the MLP's hidden width)."""
    from luminal_num.models.testnets import transformer
    model = transformer(2, d=32, hidden=64)
    x = model.make_inputs(3)
    y64 = evaluate(model.graph, x, precision="f64")["y"]
    y32 = evaluate(model.graph, x, precision="f32")["y"]
    n, u = 64, 2.0 ** -24
    gamma_n = n * u / (1 - n * u)
    err = np.max(np.abs(y32 - y64)) / np.max(np.abs(y64))
    assert 0 < err <= gamma_n


def test_cast_of_integers_to_float_computes_on_floats_in_the_reference():
    """An INT32 input cast to F32 then divided: the FP64 reference divides floats (numpy's reciprocal of an
    int64 array would be an integer division: 1/2 -> 0), as the CPU runtime's FP32 buffers do."""
    from luminal_num.dtypes.formats import F32, INT32
    from luminal_num.runtime.cpu import CpuRuntime
    from luminal_num.search.space import SearchSpace
    g = Graph()
    a = g.input("a", (4,), INT32)
    b = g.input("b", (4,), INT32)
    g.output(a.cast(F32) / b.cast(F32), "q")
    feed = {"a": np.array([1, 3, -7, 8]), "b": np.array([2, 4, 2, -3])}
    want = np.array([0.5, 0.75, -3.5, -8 / 3])
    np.testing.assert_allclose(evaluate(g, feed)["q"], want, rtol=1e-15)
    program = SearchSpace.build(g, with_precision=False).program(frozenset())
    np.testing.assert_allclose(CpuRuntime(program).run(feed).outputs["q"], want, rtol=2 ** -23)
