"""The choice space of a Gemma 3 whose matrices are llama.cpp's Q4_K_M mix (issue 31): every storage tag
the e-graph offers can be ranked by the search (a K-quant's 256-wide blocks fit no 128 x 128 probe: the
23-minute demo failure), and every candidate drawn from the space lowers, verifies, is priced and runs:
a storage format is only offered where each chunk's weight can be held in it."""
import numpy as np
import pytest

from luminal_num.models.gemma import build_gemma
from luminal_num.models.gemma_gguf import load_gemma_gguf
from luminal_num.quant.storage import STORAGE_FORMATS
from luminal_num.quant.stored import convert
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.latency import modelled_latency
from luminal_num.search.extract import BASE
from luminal_num.search.plan import stored_layout
from luminal_num.search.variants import variant_classes
from luminal_num.search.space import SearchSpace
from luminal_num.search.tags import Tag, TagKind
from tiny_gemma import kquant_layer_types, write_kquant_gemma

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def kquant_gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("kq") / "kquant-gemma3.gguf"
    write_kquant_gemma(path)
    model = load_gemma_gguf(path)
    step = build_gemma(model.config, model.weights, 1, 8)
    space = SearchSpace.build(step.graph)
    return model, step, space, step.make_inputs([42], np.array([3]))


def test_every_storage_format_is_ranked_by_the_search():
    tags = [str(Tag(TagKind.STORE, name)) for name in STORAGE_FORMATS if name != "f32"]
    ranked = [t for cls in variant_classes(tags, "h200") for t in cls]
    assert sorted(ranked) == sorted(tags)
    bits = {name: f.nominal_bits_per_weight for name, f in STORAGE_FORMATS.items()}
    assert (bits["gguf_q4_k"], bits["gguf_q5_k"], bits["gguf_q6_k"], bits["int4_g128"]) == (4.5, 5.5, 6.5625, 4.125)


def test_the_spaces_own_tags_are_ranked(kquant_gemma):
    _, _, space, _ = kquant_gemma
    for ks in space.knobs.values():
        for k in ks:
            assert sorted(t for cls in variant_classes(k.tags, "h200") for t in cls) == sorted(k.tags[1:])


def _random_genome(space: SearchSpace, rng: np.random.Generator):
    """Group-wide tags on a random half of the knobs, then per-chunk overrides on a random few."""
    genome = set()
    for gk, ks in space.knobs.items():
        for k in ks:
            if rng.random() < 0.5:
                genome.add((gk, k.cls, k.tags[rng.integers(len(k.tags))]))
    genome = {c for c in genome if c[2] != BASE}
    for g in space.part.groups:
        if len(g.chunks) < 2:
            continue
        for c in g.chunks:
            ks = space.knobs[g.key]
            picks = {ks[i] for i in rng.choice(len(ks), size=min(3, len(ks)), replace=False)}
            genome = set(space.per_chunk(genome, c.index, [(k.cls, k.tags[rng.integers(len(k.tags))]) for k in picks]))
    return frozenset(genome)


def test_every_candidate_drawn_from_the_space_lowers_and_runs(kquant_gemma):
    """30 random genomes (group-wide and per-chunk choices) and each storage tag on every weight offering
    it: each lowers and verifies, every weight it
    stores converts to its format (a kept format only where the weight came in those blocks), the cost
    model prices it; every 10th runs on the CPU backend to finite logits."""
    _, step, space, inputs = kquant_gemma
    rng = np.random.default_rng(31)
    bind = step.graph.bind_symbols(inputs)
    held = set()
    store_tags = sorted({t for ks in space.knobs.values() for k in ks for t in k.tags if t.startswith("store:")})
    every_knob_takes = [frozenset((gk, k.cls, tag) for gk, ks in space.knobs.items() for k in ks if tag in k.tags)
                        for tag in store_tags]  # and each storage tag once wherever it is offered
    for i, genome in enumerate([_random_genome(space, rng) for _ in range(30)] + every_knob_takes):
        program = space.program(genome)
        for name, fmt, shape in stored_layout(program).values():
            assert convert(step.graph.weights[name], fmt).shape == shape
            held.add(fmt)
        assert modelled_latency(program, "h200", bind).total_s > 0
        if i % 10 == 0:
            logits = CpuRuntime(program, step.graph.weights).run(inputs).outputs["logits"]
            assert np.all(np.isfinite(logits))
    assert {"gguf_q4_k", "gguf_q5_0", "gguf_q5_1", "gguf_q8_0"} <= held


# -- keeping each chunk's own blocks where the layers of a group differ --------------------------------------
def _keep_all(space):
    from luminal_num.quant.stored import GGUF_KEPT, SOURCE_BLOCKS
    from luminal_num.search.recipes import pick
    return pick(space, {*(f"store:{f}" for f in GGUF_KEPT + (SOURCE_BLOCKS,)), "gemm:f32"}.__contains__)


def test_layers_of_one_group_in_different_blocks_each_keep_their_own(kquant_gemma, tmp_path):
    """attn_v (Q8_0 / Q5_0) and ffn_down (Q6_K / Q4_K) alternate over the three layers of one group: the
    plan keeping every block holds each layer's matrices in that layer's own file format, computes the FP32
    plan's logits bit for bit (the FP32 plan reads the dequantized file), its static bound charges no
    storage error, and its weights file holds exactly the file's bytes."""
    from luminal_num.error.interval import Interval
    from luminal_num.error.static import static_bound
    from luminal_num.quant import to_gguf
    from luminal_num.quant.gguf_blocks import format_name
    from luminal_num.quant.stored import convert_all
    from luminal_num.quant.weights_file import load_weights, save_weights
    model, step, space, inputs = kquant_gemma
    assert [len(g.chunks) for g in space.part.groups] == [1, 3, 1]
    mixed = [k for ks in space.knobs.values() for k in ks if "store:gguf_source" in k.tags]
    assert len(mixed) == 2  # attn_v and ffn_down
    fp32, kept = space.program(frozenset()), space.program(_keep_all(space))
    held = {name: fmt for name, fmt, _ in stored_layout(kept).values()}  # a fused Gemm's parts each by name
    matrices = {n for n, src in model.sources.items() if src.format != "F32" and model.weights[n].ndim == 2}
    assert held == {n: format_name(model.sources[n].format) for n in matrices}
    assert {held["blk.0.ffn_down.weight"], held["blk.1.ffn_down.weight"]} == {"gguf_q6_k", "gguf_q4_k"}
    a = CpuRuntime(fp32, step.graph.weights).run(inputs).outputs["logits"]
    b = CpuRuntime(kept, step.graph.weights).run(inputs).outputs["logits"]
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    bind = step.graph.bind_symbols(inputs)
    bounds = [static_bound(p, ranges, bind, step.graph.weights).error_bounds["logits"] for p in (fp32, kept)]
    assert np.all(bounds[1] <= bounds[0])
    layout = stored_layout(kept)
    path = tmp_path / "w.safetensors"
    save_weights(path, convert_all(step.graph.weights, {k: (n, f) for k, (n, f, _) in layout.items()}), "g")
    loaded = load_weights(path, "g", {k: (f, shape) for k, (_, f, shape) in layout.items()}).tensors
    for key, (name, _, _) in layout.items():
        assert to_gguf(loaded[key].fmt.unpack(loaded[key])).tobytes() == \
            np.ascontiguousarray(model.sources[name].raw).tobytes(), key


def test_keeping_the_source_blocks_is_a_per_chunk_choice(kquant_gemma):
    """`store:gguf_source` for layer 1 only: that layer's attn_v and ffn_down are held in its blocks (Q5_0,
    Q4_K), the other layers read FP32; for the whole group: every layer in its own blocks."""
    from luminal_num.quant.gguf_blocks import format_name
    from luminal_num.search.space import ChunkSite
    _, _, space, _ = kquant_gemma
    group = space.part.groups[1]
    mixed = [k.cls for k in space.knobs[group.key] if "store:gguf_source" in k.tags]

    def held(genome):
        return {k.external: k.storage for k in space.program(genome).kernels if k.storage}

    def own(layers):
        return {f"blk.{i}.{n}.weight": format_name(kquant_layer_types(i)[n]) for i in layers for n in ("attn_v", "ffn_down")}
    assert held(frozenset((ChunkSite(group.key, group.chunks[1].index), c, "store:gguf_source") for c in mixed)) == own([1])
    assert held(frozenset((group.key, c, "store:gguf_source") for c in mixed)) == own([0, 1, 2])


def test_source_blocks_are_refused_for_a_weight_without_them():
    from luminal_num.quant.stored import SOURCE_BLOCKS, held_format
    assert held_format(SOURCE_BLOCKS, "gguf_q6_k") == "gguf_q6_k" and held_format("bf16", "gguf_q6_k") == "bf16"
    with pytest.raises(ValueError, match="this weight has none"):
        held_format(SOURCE_BLOCKS, None)
