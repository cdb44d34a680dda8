"""GGUF source blocks as a storage choice (issue 13 item 1, end): a weight loaded from SmolLM2's Q4_1 /
Q8_0 blocks may be stored in those very blocks. The FP64 reference is the dequantized source, so the
choice adds no error: emulation reads exactly llama.cpp's values (gguf.quants.dequantize, the
independent reference), the static bound charges 0, and the weights file holds the original blocks."""
import dataclasses

import gguf
import numpy as np
import pytest

from luminal_num.codegen.llir import KernelKind
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import evaluate
from luminal_num.models.gguf import TensorSource, keep_source, load_gguf, smollm2_path
from luminal_num.hlir.graph import Graph
from luminal_num.hlir.tensor import index_input
from luminal_num.models.llama import EMBED, build_decode, random_weights
from luminal_num.quant import from_gguf, to_gguf
from luminal_num.quant.stored import GGUF_KEPT, convert, convert_all, source_format, storage_error, widened
from luminal_num.quant.weights_file import load_weights, save_weights
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.weight_only import stored_weight
from luminal_num.search.plan import stored_layout
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")
TYPE = {"gguf_q4_1": gguf.GGMLQuantizationType.Q4_1, "gguf_q8_0": gguf.GGMLQuantizationType.Q8_0}
MAX_CACHE = 8


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M's first layer (real Q4_1 Linears, Q8_0 tied embedding) as a decode step."""
    model = load_gguf(smollm2_path(), layers=1)
    step = build_decode(model.config, model.weights, MAX_CACHE)
    inputs = step.make_inputs(np.array([42]), np.array([0]))
    return model, step, SearchSpace.build(step.graph), inputs


def kept_program(space, extra=("gemm:f32",)):
    return space.program(pick(space, {*(f"store:{f}" for f in GGUF_KEPT), *extra}.__contains__))


def test_the_source_formats_are_registered_and_offered_for_those_weights_only(smol):
    model, step, space, _ = smol
    by_format = {f: {n for n, s in model.sources.items() if s.format == t.name and model.weights[n].ndim == 2}
                 for f, t in TYPE.items()}
    assert by_format["gguf_q8_0"] == {"model.embed_tokens.weight"} and len(by_format["gguf_q4_1"]) == 7
    for fmt, names in by_format.items():
        for n in names:
            assert source_format(model.weights[n]) == fmt
            assert source_format(model.weights[n].copy()) == fmt  # by content, not identity
    assert source_format(random_weights(model.config.with_layers(1))["model.embed_tokens.weight"]) is None
    program = kept_program(space)
    held = {n: k.storage for k in program.kernels if k.kind is KernelKind.EXTERNAL and k.storage
            for n in (k.concat or (k.external,))}  # a fused Gemm's concatenation holds its parts' kept blocks
    assert held == {n: f for f, names in by_format.items() for n in names}
    other = SearchSpace.build(build_decode(model.config, random_weights(model.config), MAX_CACHE).graph)
    assert not any(t in ("store:gguf_q4_1", "store:gguf_q8_0") for ks in other.knobs.values() for k in ks
                   for t in k.tags)


def test_a_fused_gemm_over_kept_blocks_reads_those_blocks_unchanged(smol):
    """q/k/v and gate/up held as their GGUF Q4_1 blocks, each fused into one Gemm: the concatenated stored
    tensor the GPU backend uploads is the parts' raw blocks row after row (quant/concat.py), and the
    CPU backend's concatenation is their dequantization."""
    model, step, space, inputs = smol
    program = kept_program(space)
    cats = [k for k in program.kernels if k.concat and k.storage == "gguf_q4_1"]
    assert len(cats) == 2
    for k in cats:
        q = stored_weight(k, model.weights)
        np.testing.assert_array_equal(to_gguf(q), np.concatenate([model.sources[n].raw for n in k.concat]))
        only = dataclasses.replace(program, outputs=(("cat", k.id),))
        np.testing.assert_array_equal(CpuRuntime(only, model.weights).run(inputs).outputs["cat"],
                                      np.concatenate([model.weights[n] for n in k.concat]))


def small_graph(model):
    """The first 64 rows of SmolLM2's Q8_0 embedding (their blocks kept as a source of their own: rows
    are independent blocks) and two of its Q4_1 Linears: y = (emb[ids] + x) @ up^T @ down^T."""
    rows = 64
    embed = np.ascontiguousarray(model.weights[EMBED][:rows])
    keep_source(embed, TensorSource("Q8_0", model.sources[EMBED].raw[:rows]))
    assert source_format(embed) == "gguf_q8_0"
    g = Graph()
    ids = index_input(g, "ids", (2,))
    x = g.input("x", (2, model.config.hidden_size))
    h = g.weight(EMBED, embed).gather(ids) + x
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        h = h @ g.weight(name, model.weights[name]).transpose()
    g.output(h, "y")
    return g, {"ids": np.array([7, 63]), "x": np.random.default_rng(0).standard_normal((2, model.config.hidden_size))}


def test_random_genomes_with_kept_blocks_have_sound_bounds(smol):
    """Genome fuzzing over every knob (kept GGUF blocks, re-quantized formats, Gemm variants)."""
    model, *_ = smol
    g, inputs = small_graph(model)
    space = SearchSpace.build(g)
    ref = evaluate(g, inputs)["y"]
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    rng = np.random.default_rng(11)
    kept = 0
    for _ in range(5):
        genome = frozenset((gk, k.cls, k.tags[int(rng.integers(len(k.tags)))])
                           for gk, ks in space.knobs.items() for k in ks if rng.random() < 0.8)
        program = space.program(genome)
        kept += sum(k.storage in GGUF_KEPT for k in program.kernels)
        rep = static_bound(program, ranges, g.bind_symbols(inputs), g.weights)
        if rep.overflow is None:
            y = CpuRuntime(program, g.weights).run(inputs).outputs["y"]
            assert np.all(np.abs(y - ref) <= rep.error_bounds["y"])
    assert kept > 0


def test_kept_blocks_are_llama_cpp_values_and_add_no_error(smol):
    """widened == gguf.quants.dequantize of the raw blocks == the graph's weight, bit for bit; on a graph
    of SmolLM2's own Q4_1 Linears and Q8_0 embedding, the plan keeping the blocks computes exactly what
    the FP32 plan computes, and the static bound charges no storage error (at most the FP32 bound)."""
    model, *_ = smol
    for name, src in model.sources.items():
        fmt = {"Q4_1": "gguf_q4_1", "Q8_0": "gguf_q8_0"}.get(src.format)
        if fmt is None or model.weights[name].ndim != 2:
            continue
        reference = gguf.quants.dequantize(src.raw, TYPE[fmt]).reshape(model.weights[name].shape)
        assert widened(model.weights[name], fmt).tobytes() == reference.astype(np.float32).tobytes(), name
        assert np.array_equal(model.weights[name], reference)
        assert not np.any(storage_error(model.weights[name], fmt))
    g, inputs = small_graph(model)
    space = SearchSpace.build(g)
    fp32, kept = space.program(frozenset()), kept_program(space)
    assert sorted(k.storage for k in kept.kernels if k.storage) == ["gguf_q4_1", "gguf_q4_1", "gguf_q8_0"]
    a, b = CpuRuntime(fp32, g.weights).run(inputs).outputs["y"], CpuRuntime(kept, g.weights).run(inputs).outputs["y"]
    assert a.tobytes() == b.tobytes()
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    bind = g.bind_symbols(inputs)
    bound_fp32, bound_kept = (static_bound(p, ranges, bind, g.weights).error_bounds["y"] for p in (fp32, kept))
    assert np.all(bound_kept <= bound_fp32)
    assert np.all(np.abs(b - evaluate(g, inputs)["y"]) <= bound_kept)


def test_conversion_keeps_the_source_blocks_part_by_part(smol):
    """The compile-time conversion does not quantize again: every part (codes, FP16 scales, FP16 mins)
    is the source block's, for a copy of the weight too (found by content)."""
    model, *_ = smol
    for name in ("model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"):
        src = model.sources[name]
        kept, source = convert(model.weights[name].copy(), source_format(model.weights[name])), from_gguf(src.raw, src.format)
        for part in source.fmt.parts:
            assert kept.values[part].tobytes() == source.values[part].tobytes(), (name, part)


def test_the_weights_file_holds_the_original_blocks(smol, tmp_path):
    model, step, space, _ = smol
    layout = stored_layout(kept_program(space))
    assert layout and all(fmt in GGUF_KEPT for _, fmt, _ in layout.values())
    stored = convert_all(step.graph.weights, {key: (name, fmt) for key, (name, fmt, _) in layout.items()})
    path = tmp_path / "w.safetensors"
    digest = save_weights(path, stored, "graph-hash")
    loaded = load_weights(path, "graph-hash", {k: (fmt, shape) for k, (_, fmt, shape) in layout.items()})
    assert loaded.content_hash == digest
    for key, (name, fmt, _) in layout.items():
        t = loaded.tensors[key]
        assert to_gguf(t.fmt.unpack(t)).tobytes() == np.ascontiguousarray(model.sources[name].raw).tobytes(), key


def test_blocks_that_are_not_the_weight_are_refused(smol):
    model, *_ = smol
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="do not dequantize to this"):
        keep_source(model.weights[name] * 2, model.sources[name])
    with pytest.raises(ValueError, match="not kept exactly"):
        keep_source(model.weights[name], TensorSource("Q2_K", model.sources[name].raw))
