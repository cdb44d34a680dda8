"""The labelled peer baselines follow the tools they name, op by op.

Truth: PyTorch's "Autocast Op Reference" (https://pytorch.org/docs/stable/amp.html#autocast-op-reference):
- CUDA, to float16/bfloat16: __matmul__, addmm, bmm, linear, matmul, mm, ... ; to float32: layer_norm,
  softmax, sum, exp, log, pow, reciprocal, rsqrt, ...; every other op runs in the widest floating type
  of its tensor inputs, 0-d tensors and Python scalars not taking part.
- CPU, to bfloat16: bmm, mm, baddbmm, addmm, linear, matmul, ...; to float32: prod, cdist, ... (neither
  softmax nor layer_norm: they run in their input's type).
- torch.set_float32_matmul_precision('high'): FP32 matmuls in TF32, nothing else changes.
The expected assignment per node is written out below from the model's own code (which user-level op
made the node, what its inputs are), independently of the recipe's dtype propagation.
"""
import numpy as np
import pytest

from luminal_num.hlir.graph import Graph
from luminal_num.models.testnets import transformer
from luminal_num.search.recipes import CPU_BF16, CUDA_BF16, CUDA_F16, autocast_recipe, tf32_recipe
from luminal_num.search.recipes import BASELINE_SOURCES, baseline_genomes
from luminal_num.search.space import SearchSpace


def assignment(space: SearchSpace, genome) -> dict[int, str]:
    """HLIR node id -> tag the genome gives it (one entry per knob it changes)."""
    return {space.groups[gk].space.class_node[c]: t for gk, c, t in genome}


def knob_nodes(space: SearchSpace) -> dict[int, tuple[str, ...]]:
    """Knobs on HLIR nodes (a weight's storage knob is on a chunk source, which no autocast list touches:
    PyTorch keeps parameters in FP32 and casts them per op)."""
    return {space.groups[gk].space.class_node[k.cls]: k.tags for gk, ks in space.knobs.items() for k in ks
            if k.cls in space.groups[gk].space.class_node}


@pytest.fixture(scope="module")
def tspace():
    return SearchSpace.build(transformer(2).graph)


@pytest.mark.parametrize("lists, gemm, store", [(CUDA_BF16, "gemm:bf16", "ew:bf16_computef32"),
                                                (CUDA_F16, "gemm:f16", "ew:f16_computef32"),
                                                (CPU_BF16, "gemm:bf16", "ew:bf16_computef32")])
def test_autocast_on_the_transformer(tspace, lists, gemm, store):
    g = tspace.graph
    got = assignment(tspace, autocast_recipe(tspace, lists).genome)
    scope = {n.id: g.op_scopes.get(n.id, (n.op.name, n.id))[0] for n in g.nodes}
    expected: dict[int, str] = {}
    for nid in knob_nodes(tspace):
        node = g.nodes[nid]
        if scope[nid] == "matmul" and nid in g.matmuls:  # mm / bmm: on both lower-precision lists
            expected[nid] = gemm
        elif scope[nid] == "gelu" and any(g.nodes[c].op.name != "OUTPUT" and scope[c] != "gelu"
                                          for c in g.consumers()[nid]):
            expected[nid] = store             # F.gelu's output, in its bf16 input's type
        elif scope[nid] == "MUL" and {g.nodes[s.node].shape for s in node.srcs} >= {()} and \
                any(scope[s.node] == "matmul" for s in node.srcs):
            expected[nid] = store             # scores * (1/sqrt(d)): a Python scalar does not promote
        # everything else: layer_norm (FP32 list / FP32 input), residual adds (bf16 + fp32 -> fp32),
        # the causal-mask add (fp32 mask tensor), softmax of an fp32 input, and the inside of each op
    assert got == expected
    assert not any(scope[n] == "layer_norm" for n in got)  # the old recipe put layer_norm in BF16
    assert autocast_recipe(tspace, lists).gaps == ()


def test_softmax_follows_the_list_per_device():
    """softmax is on the CUDA FP32 list but on no CPU list: on CPU it runs in its bf16 input's type."""
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", (8, 16))
    p = (x @ g.weight("w1", rng.standard_normal((16, 16)))).softmax(-1)
    g.output(p @ g.weight("w2", rng.standard_normal((16, 16))), "y")
    space = SearchSpace.build(g)
    sm = next(n.id for n in g.nodes if n.op.name == "SOFTMAX")
    assert sm not in assignment(space, autocast_recipe(space, CUDA_BF16).genome)
    assert assignment(space, autocast_recipe(space, CPU_BF16).genome)[sm] == "softmax:bf16"


def test_linear_bias_is_part_of_addmm_but_an_activation_add_promotes():
    rng = np.random.default_rng(1)
    g = Graph()
    x, r = g.input("x", (8, 16)), g.input("r", (8, 16))
    h = x @ g.weight("w", rng.standard_normal((16, 16))) + g.weight("b", rng.standard_normal(16))
    y = (h @ g.weight("w2", rng.standard_normal((16, 16)))) + r
    g.output(y, "y")
    space = SearchSpace.build(g)
    got = assignment(space, autocast_recipe(space, CUDA_BF16).genome)
    bias_add, res_add = (n.id for n in g.nodes if n.op.name == "ADD")
    assert got.get(bias_add) == "ew:bf16_computef32"  # addmm(b, x, W): the bias joins the bf16 Linear
    assert res_add not in got                            # bf16 + fp32 tensor -> fp32
    assert sorted(t for t in got.values() if t.startswith("gemm")) == ["gemm:bf16"] * 2


def test_tf32_flag_changes_every_matmul_and_nothing_else(tspace):
    got = assignment(tspace, tf32_recipe(tspace).genome)
    mm = {n for n, tags in knob_nodes(tspace).items() if n in set(tspace.graph.matmuls) and "gemm:tf32" in tags}
    assert set(got) == mm and set(got.values()) == {"gemm:tf32"} and len(mm) >= 8


def test_every_baseline_names_its_source(tspace):
    names = set(baseline_genomes(tspace))
    assert names <= set(BASELINE_SOURCES)
    # no KV cache in this graph, and no weight read from GGUF blocks
    assert set(BASELINE_SOURCES) - names == {"BF16 weights + FP8 KV cache", "GGUF source blocks kept"}
    assert {"BF16 autocast", "FP16 autocast", "BF16 autocast (CPU)", "TF32 flag"} <= names
    assert all("PyTorch" in BASELINE_SOURCES[n] for n in names if "autocast" in n or "TF32" in n)



def test_minilm_recipes_op_by_op():
    """all-MiniLM-L6-v2: per encoder layer 6 Linears (bf16 Gemm + bf16 bias-add output) and the 2
    attention bmm's in BF16, GELU's output and the scores' scalar scaling in their bf16 input's type;
    sentence-transformers pools with torch.sum and F.normalize (FP32 list, fp32 inputs): the graph's
    pooling matmul is no mm, so neither autocast nor the TF32 flag touches it."""
    from collections import Counter

    from luminal_num.models.bert import load_minilm
    from luminal_num.search.recipes import user_ops
    space = SearchSpace.build(load_minilm(2, 8).graph)
    ops = user_ops(space.graph)
    for lists in (CUDA_BF16, CPU_BF16):
        got = Counter((ops[n][0], t) for n, t in assignment(space, autocast_recipe(space, lists).genome).items())
        assert got == {("linear", "gemm:bf16"): 6, ("linear", "ew:bf16_computef32"): 6, ("matmul", "gemm:bf16"): 2,
                       ("gelu", "ew:bf16_computef32"): 1, ("mul", "ew:bf16_computef32"): 1}
    tf32 = Counter(ops[n][0] for n in assignment(space, tf32_recipe(space).genome))
    assert tf32 == {"linear": 6, "matmul": 2}
