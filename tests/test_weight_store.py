"""Weights by content key, read from their files when needed (issue: a streaming, memory-lean compile).

- a weight changed in its file gets a new key, so the verdict cache of the old weights is not reused;
- safetensors weights are memory-mapped views of the file (nothing copied up front), read-only;
- the streamed writer produces the same bytes as the in-memory writer, and nothing on failure;
- a synthetic checkpoint is deterministic and loads as a Llama folder;
- the FP64 reference keeps chunk-boundary values only, equal to the full evaluation's;
- the FP64 Llama holds no FP64 copy of its weights and computes what a plain float64 model does.
"""
from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest

from luminal_num.error.budget import Budget
from luminal_num.error.reference import Fp64Reference, boundary_nodes
from luminal_num.error.verdict_store import context_key
from luminal_num.hlir.evaluate import evaluate_nodes
from luminal_num.hlir.partition import partition
from luminal_num.hlir.store import WeightArray, keyed
from luminal_num.hlir.weightcache import WEIGHTS
from luminal_num.models.llama import LlamaConfig, build_prefill, load_weights, weight_shapes
from luminal_num.models.reference import Fp64Llama
from luminal_num.models.synthetic import write_checkpoint
from luminal_num.models.weights import load_safetensors, save_safetensors, save_safetensors_streamed

CONFIG = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5, max_position_embeddings=32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("synthetic") / "tiny", CONFIG, seed=3)


def _memmapped(a: np.ndarray) -> bool:
    while a is not None:
        if isinstance(a, np.memmap):
            return True
        a = a.base
    return False


def test_safetensors_weights_are_read_only_views_of_the_file(checkpoint):
    arrays = load_safetensors(checkpoint / "model.safetensors")
    assert set(arrays) == set(weight_shapes(CONFIG))
    for a in arrays.values():
        assert _memmapped(a) and not a.flags.writeable


def test_the_streamed_writer_writes_what_the_in_memory_writer_does(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"b": rng.standard_normal((7, 5)).astype(np.float32), "a": rng.standard_normal(3).astype(np.float64),
               "c": rng.integers(0, 9, (4, 2, 3)).astype(np.int32)}
    save_safetensors(tmp_path / "ref.safetensors", tensors)
    shapes = {n: (t.shape, t.dtype) for n, t in tensors.items()}
    save_safetensors_streamed(tmp_path / "streamed.safetensors", shapes,
                              lambda n: (tensors[n][i:i + 2] for i in range(0, len(tensors[n]), 2)))
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()

    def short(n):
        yield tensors[n][:1]
    with pytest.raises(ValueError, match="fill wrote"):
        save_safetensors_streamed(tmp_path / "bad.safetensors", shapes, short)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.safetensors", "streamed.safetensors"]  # nothing left


def test_a_synthetic_checkpoint_is_deterministic_and_loads_as_a_llama_folder(checkpoint, tmp_path):
    again = write_checkpoint(tmp_path / "again", CONFIG, seed=3)
    assert (again / "model.safetensors").read_bytes() == (checkpoint / "model.safetensors").read_bytes()
    other = write_checkpoint(tmp_path / "other", CONFIG, seed=4)
    assert (other / "model.safetensors").read_bytes() != (checkpoint / "model.safetensors").read_bytes()
    config, weights = load_weights(checkpoint)
    assert config == CONFIG and json.loads((checkpoint / "config.json").read_text())["synthetic_seed"] == 3
    w = weights["model.layers.0.mlp.up_proj.weight"]
    assert abs(float(np.std(w)) - 1 / np.sqrt(CONFIG.hidden_size)) < 0.02  # N(0, 1/fan_in) as written
    with pytest.raises(ValueError, match="at least 256"):
        write_checkpoint(tmp_path / "small", LlamaConfig(**{**CONFIG.__dict__, "vocab_size": 100}))


def test_a_synthetic_llm_has_a_realistic_logit_spread_and_an_old_init_is_rewritten(tmp_path):
    """Tied as the LM head, the embedding sets the logits' spread: at N(0, 0.02^2) the FP64 model's logits
    (an independent numpy forward pass, models/reference.py) have std ~0.02 sqrt(hidden) and the softmax is
    not one-hot; at N(0, 1), the old init, the top token took all the mass and every plan's KL underflowed.
    A folder stamped by another init is written again, not reused."""
    from luminal_num.models.llm import Prompt, load_llm
    from luminal_num.models.synthetic import EMBED_STD, INIT
    config = LlamaConfig(**{**CONFIG.__dict__, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 2048,
                            "tie_word_embeddings": True})
    folder = write_checkpoint(tmp_path / "tied", config)
    model = load_llm(str(folder))
    (logits, _), = model.fp64.forward_many([model.encode(Prompt("The capital of France is", False))])
    last = np.asarray(logits[-1], np.float64)
    assert 0.5 * EMBED_STD * np.sqrt(256) < last.std() < 2.0 * EMBED_STD * np.sqrt(256)
    p = np.exp(last - last.max())
    assert p.max() / p.sum() < 0.5  # not one-hot
    stamp = json.loads((folder / "config.json").read_text())
    assert stamp["synthetic_init"] == INIT
    before = (folder / "model.safetensors").stat().st_mtime_ns
    (folder / "config.json").write_text(json.dumps({**stamp, "synthetic_init": "embed-std-1"}))
    write_checkpoint(folder, config)
    assert json.loads((folder / "config.json").read_text())["synthetic_init"] == INIT
    assert (folder / "model.safetensors").stat().st_mtime_ns != before


def test_a_weight_changed_in_its_file_invalidates_the_verdict_cache(checkpoint, tmp_path):
    def key_of(folder):
        config, weights = load_weights(folder)
        model = build_prefill(config, weights, 4, 4, 1)
        batch = model.make_batch_inputs(np.zeros((1, 4), np.int64), np.arange(4)[None, :])
        b = Budget.parse("atol=1e-3,rtol=0")
        return context_key(model.graph, [batch], b, b)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in checkpoint.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert key_of(copy) == key_of(checkpoint)  # another file, the same contents: the same key
    raw = bytearray((copy / "model.safetensors").read_bytes())
    raw[-4:] = np.float32(0.123).tobytes()  # one value of the last tensor
    (copy / "model.safetensors").write_bytes(bytes(raw))
    assert key_of(copy) != key_of(checkpoint)


def test_the_reference_keeps_chunk_boundaries_equal_to_the_full_evaluation(checkpoint):
    config, weights = load_weights(checkpoint)
    model = build_prefill(config, weights, 3, 6, 2)
    rng = np.random.default_rng(1)
    batch = model.make_batch_inputs(rng.integers(0, 256, (2, 3)), np.tile(np.arange(3), (2, 1)))
    part = partition(model.graph)
    keep = boundary_nodes(model.graph, part)
    ref = Fp64Reference.of(model.graph, batch, keep)
    full = evaluate_nodes(model.graph, batch)
    assert set(ref.values) == {n for n in keep if n in full} and len(ref.values) < len(full) / 4
    assert not any(model.graph.weight_name(n) for n in ref.values)  # weights are the cache's, not pinned here
    for n, v in ref.values.items():
        assert np.array_equal(v, full[n]) and isinstance(v, WeightArray)
    for name, v in ref.outputs(model.graph).items():
        assert np.array_equal(v, full[model.graph.outputs[name]])


class _PlainFp64(dict):
    """Every weight converted to float64 up front (what the FP64 Llama did before): the independent model."""

    @contextlib.contextmanager
    def layer(self):
        yield

    def rows(self, name, ids):
        return self[name][ids]

    def times_transposed(self, x, name):
        return x @ self[name].T


def _plain(config, weights) -> Fp64Llama:
    plain = Fp64Llama.__new__(Fp64Llama)
    plain.config, plain.w = config, _PlainFp64({n: np.asarray(a, dtype=np.float64) for n, a in weights.items()})
    return plain


def test_the_fp64_llama_holds_no_fp64_copy_and_computes_the_float64_model(checkpoint):
    config, weights = load_weights(checkpoint)
    ids = [5, 17, 200, 3]
    model = Fp64Llama(config, weights)
    assert not model.w.streaming  # a small model: its FP64 weights are cached
    assert not any(isinstance(v, np.ndarray) and v.dtype == np.float64 for v in vars(model).values())
    logits, state = model.forward(ids)
    want, want_state = _plain(config, weights).forward(ids)
    assert np.array_equal(logits, want) and all(np.array_equal(a, b) for a, b in zip(state.k, want_state.k))
    before = WEIGHTS.misses
    model.forward(ids)
    assert WEIGHTS.misses == before  # converted once per process, then read from the weight cache


def test_a_streamed_fp64_llama_converts_each_layer_once_per_pass_and_caches_nothing(checkpoint, monkeypatch):
    """A model whose FP64 weights do not fit half the weight cache runs all sequences through one layer
    at a time (their rows stacked): each sequence's values as alone in the plain float64 model, nothing cached."""
    config, weights = load_weights(checkpoint)
    old = WEIGHTS.budget_bytes
    WEIGHTS.resize(1000)  # read by the constructor only
    try:
        model = Fp64Llama(config, weights)
    finally:
        WEIGHTS.resize(old)
    assert model.w.streaming
    monkeypatch.setattr("luminal_num.models.reference.HEAD_BLOCK_BYTES", 8 * CONFIG.hidden_size * 37)  # 7 blocks
    plain = _plain(config, weights)
    seqs = [[5, 17, 200, 3], [9], [250, 1, 2]]
    converted = []
    real = np.asarray
    matrices = {s for n, s in weight_shapes(CONFIG).items() if n.endswith("proj.weight")}

    def counting(a, dtype=None, *args, **kw):
        if dtype is np.float64 and isinstance(a, WeightArray) and a.shape in matrices:  # not rows, not head blocks
            converted.append(a.shape)
        return real(a, dtype, *args, **kw)
    monkeypatch.setattr("luminal_num.models.reference.np.asarray", counting)
    before = (WEIGHTS.misses, WEIGHTS.hits)
    got = model.forward_many(seqs)
    monkeypatch.undo()
    assert (WEIGHTS.misses, WEIGHTS.hits) == before  # nothing read from or put into the process cache
    per_layer = sum(1 for n in weight_shapes(CONFIG) if n.startswith("model.layers.0.") and n.endswith("proj.weight"))
    assert len(converted) == CONFIG.num_hidden_layers * per_layer  # each layer's matrices once, not once per sequence
    for ids, (logits, state) in zip(seqs, got):
        want, want_state = plain.forward(ids)
        assert np.allclose(logits, want, rtol=1e-13, atol=1e-13)
        # stacked rows go through BLAS as one matrix: equal up to FP64 rounding, not bit for bit
        assert all(np.allclose(a, b, rtol=1e-13, atol=1e-13) for a, b in zip(state.k + state.v, want_state.k + want_state.v))
    again, _ = model.forward_many([[3]], [got[0][1]])[0]
    assert np.allclose(again, plain.forward([3], plain.forward(seqs[0])[1])[0], rtol=1e-13, atol=1e-13)
    cont, rows = model.greedy(seqs[0], 3)
    want_cont, want_rows = plain.greedy(seqs[0], 3)
    assert cont == want_cont and np.allclose(rows, want_rows, rtol=1e-13, atol=1e-13)


def test_a_file_backed_weight_holds_the_same_values_in_a_map_and_leaves_no_file(tmp_path, monkeypatch):
    import os
    from luminal_num.hlir.store import SCRATCH_ENV, file_backed
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path))
    values = np.random.default_rng(2).standard_normal((300, 70)).astype(np.float32)
    held = keyed(file_backed(values))
    assert np.array_equal(held, values) and held.dtype == values.dtype and not held.flags.writeable
    assert _memmapped(held) and held.content_key == keyed(values.copy()).content_key
    assert os.listdir(tmp_path) == []  # unlinked from the start: nothing to clean up, whatever the exit
    pid = os.fork()  # a forked worker reads the same pages
    if pid == 0:
        os._exit(0 if np.array_equal(held, values) else 1)
    assert os.waitpid(pid, 0)[1] == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_narrow_checkpoint_loads_as_file_backed_fp32_and_streams(checkpoint, tmp_path, monkeypatch, dtype):
    """Real checkpoints ship BF16/F16: loading widens each weight into a mapped scratch file, a block of rows at a
    time (store.file_backed), never into anonymous memory, so the memory plan streams it like an FP32 checkpoint.
    Values: exactly ml_dtypes' widening of the file's own values; nothing is left on disk."""
    import os
    import shutil
    import ml_dtypes
    import luminal_num.hlir.store as store
    from luminal_num.hlir.store import SCRATCH_ENV, is_file_backed
    from luminal_num.memory import WeightSizes, plan_memory
    from luminal_num.models.llm import load_llm
    narrow = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    folder = tmp_path / "narrow"
    shutil.copytree(checkpoint, folder)
    source = {k: np.asarray(v).astype(narrow) for k, v in load_safetensors(checkpoint / "model.safetensors").items()}
    save_safetensors(folder / "model.safetensors", source)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv(SCRATCH_ENV, str(scratch))
    monkeypatch.setattr(store, "WRITE_BLOCK", 1000)  # several blocks a weight: the rows' seams are exercised
    model = load_llm(str(folder))
    for name, w in model.weights.items():
        assert w.dtype == np.float32 and is_file_backed(w) and not w.flags.writeable, name
        np.testing.assert_array_equal(np.asarray(w), source[name].astype(np.float64).astype(np.float32), err_msg=name)
    assert os.listdir(scratch) == []
    sizes = WeightSizes.of(model.weights)
    assert sizes.mapped == sizes.total  # every weight can be given back and read again
    streamed = plan_memory(model.weights, 64 << 30, streaming=True)  # refused for weights held in memory
    assert streamed.streaming and streamed.held == sizes.held


def test_gguf_weights_are_file_backed_dequantizations(tmp_path):
    import gguf
    from tests.tiny_gguf import write_tiny_gguf
    from luminal_num.models.gguf import load_gguf
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    model = load_gguf(path)
    reader = gguf.GGUFReader(path)
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    want = gguf.quants.dequantize(embed.data, embed.tensor_type).reshape(model.weights["model.embed_tokens.weight"].shape)
    for name, w in model.weights.items():
        assert _memmapped(w) and not w.flags.writeable, name
    assert np.array_equal(model.weights["model.embed_tokens.weight"], want)


def test_a_streamed_fp64_evaluation_computes_the_cached_one_without_fp64_weight_copies(checkpoint, monkeypatch):
    """The graph's FP64 evaluation of a model whose FP64 weights exceed half the weight cache keeps its
    weights FP32 and widens what each op reads (Gemm B by column blocks, Gather by rows): the same
    values as with every weight's FP64 copy, and no copy put in the cache."""
    import importlib
    ev = importlib.import_module("luminal_num.hlir.evaluate")  # the module (the package exports a function of that name)
    from luminal_num.hlir.evaluate import evaluate_chunk
    config, weights = load_weights(checkpoint)
    model = build_prefill(config, weights, 3, 6, 2)
    rng = np.random.default_rng(5)
    batch = model.make_batch_inputs(rng.integers(0, 256, (2, 3)), np.tile(np.arange(3), (2, 1)))
    assert not ev.streams(model.graph)
    want = evaluate_nodes(model.graph, batch)
    part = partition(model.graph)
    chunk = part.chunks[1]
    ext = {n: want[n] for n in chunk.external if model.graph.weight_name(n) is None}
    want_chunk = evaluate_chunk(model.graph, chunk.nodes, ext, model.graph.bind_symbols(batch))
    monkeypatch.setattr(ev, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(ev, "GEMM_BLOCK_BYTES", 8 * 32 * 5)  # 5 columns of a K=32 operand at a time
    old = WEIGHTS.budget_bytes
    WEIGHTS.resize(1000)
    try:
        assert ev.streams(model.graph)
        before = WEIGHTS.misses
        got = evaluate_nodes(model.graph, batch)
        got_chunk = evaluate_chunk(model.graph, chunk.nodes, ext, model.graph.bind_symbols(batch))
        assert WEIGHTS.misses == before  # no weight was converted into the cache
    finally:
        WEIGHTS.resize(old)
    def close(a, b):  # FP64 rounding apart: BLAS may sum a block of columns in another order
        return np.all(np.abs(a - b) <= 1e-13 * max(np.abs(b).max(initial=0.0), 1e-300))
    for n, v in want.items():
        if model.graph.weight_name(n) is None:
            assert got[n].dtype == v.dtype and close(got[n], v), n
    for n, v in want_chunk.items():
        assert close(got_chunk[n], v), n


def test_released_pages_of_a_mapped_weight_leave_the_resident_set_and_read_back_the_same(tmp_path):
    from luminal_num.hlir.store import release_pages
    values = np.random.default_rng(4).standard_normal((2048, 1024)).astype(np.float32)  # 8 MB
    save_safetensors(tmp_path / "w.safetensors", {"w": values})
    w = load_safetensors(tmp_path / "w.safetensors")["w"]

    def resident_kb():
        return int(next(line for line in open("/proc/self/status") if line.startswith("RssFile:")).split()[1])
    before = resident_kb()
    assert float(np.sum(w, dtype=np.float64)) == float(np.sum(values, dtype=np.float64))  # touched: mapped in
    touched = resident_kb()
    assert release_pages(w) and touched - resident_kb() > 6 * 1024  # the pages left the resident set
    assert resident_kb() - before < 2 * 1024
    assert np.array_equal(w, values)  # and read back when touched again
    assert not release_pages(values)  # an array in memory: nothing to release


def test_batches_evaluated_together_are_each_evaluated_alone_and_widen_a_streamed_weight_once(checkpoint, monkeypatch):
    """evaluate_chunk_batches (the FP64 rest of the model a chunk's deviation is injected into, once for every
    calibration batch): each batch's values are bit for bit the ones its own evaluate_chunk gives, streamed
    or not, and a streamed weight's column blocks are widened once for all the batches, not once per batch."""
    import importlib
    ev = importlib.import_module("luminal_num.hlir.evaluate")
    from luminal_num.hlir.evaluate import evaluate_chunk, evaluate_chunk_batches
    config, weights = load_weights(checkpoint)
    model = build_prefill(config, weights, 3, 6, 2)
    rng = np.random.default_rng(11)
    batches = [model.make_batch_inputs(rng.integers(0, 256, (2, 3)), np.tile(np.arange(3), (2, 1))) for _ in range(3)]
    part = partition(model.graph)
    chunk = part.chunks[1]
    bindings = [model.graph.bind_symbols(b) for b in batches]
    exts = []
    for b in batches:
        full = evaluate_nodes(model.graph, b)
        exts.append({n: full[n] for n in chunk.external if model.graph.weight_name(n) is None})
    plain_alone = [evaluate_chunk(model.graph, chunk.nodes, e, bd) for e, bd in zip(exts, bindings)]
    plain_together = evaluate_chunk_batches(model.graph, chunk.nodes, exts, bindings)
    monkeypatch.setattr(ev, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(ev, "GEMM_BLOCK_BYTES", 8 * 32 * 5)  # 5 columns of a K=32 operand at a time
    widened = []
    real_wide = ev.np.asarray

    def counting(a, dtype=None, *args, **kw):
        if dtype is np.float64 and getattr(a, "dtype", None) == np.float32 and a.ndim == 3:  # a block of B
            widened.append(a.shape)
        return real_wide(a, dtype, *args, **kw)
    old = WEIGHTS.budget_bytes
    WEIGHTS.resize(1000)
    try:
        assert ev.streams(model.graph)
        monkeypatch.setattr(ev.np, "asarray", counting)
        streamed_together = evaluate_chunk_batches(model.graph, chunk.nodes, exts, bindings)
        once = len(widened)
        streamed_alone = [evaluate_chunk(model.graph, chunk.nodes, e, bd) for e, bd in zip(exts, bindings)]
        monkeypatch.setattr(ev.np, "asarray", real_wide)
    finally:
        WEIGHTS.resize(old)
    assert once > 0 and len(widened) == 4 * once  # alone: once per batch (3), together: once for all
    for together, alone in ((plain_together, plain_alone), (streamed_together, streamed_alone)):
        assert len(together) == len(alone) == 3
        for t, a in zip(together, alone):
            assert t.keys() == a.keys()
            for n in t:
                np.testing.assert_array_equal(t[n], a[n])
    with pytest.raises(ValueError, match="3 batches of external values but 2 of bindings"):
        evaluate_chunk_batches(model.graph, chunk.nodes, exts, bindings[:2])
