"""Qwen2 (q/k/v biases) and Qwen3 (QK-norm, its own head_dim) by path (issue 31, item 2): tiny GGUF files
written with the gguf writer and real metadata keys, loaded and built as the Llama graph, checked in FP64
against an independent FP64 implementation of each architecture (tests/qwen_reference.py), and the fast
FP64 runner the LLM jobs teacher-force with agrees too."""
import numpy as np
import pytest

from luminal_num.hlir import evaluate
from luminal_num.models.gguf import GGUFError, load_gguf
from luminal_num.models.llama import build_prefill
from luminal_num.models.reference import Fp64Llama
from qwen_reference import qwen_logits
from tiny_qwen import HEAD_DIM, write_tiny_qwen

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
IDS = [5, 77, 201, 3, 150, 42, 9]


def relative(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tiny_qwen_matches_the_independent_fp64_reference(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_tiny_qwen(path, arch)
    model = load_gguf(path)
    c = model.config
    assert (c.qkv_bias, c.qk_norm, c.head_dim) == (arch == "qwen2", arch == "qwen3", HEAD_DIM[arch])
    built = build_prefill(c, model.weights, len(IDS), 16)
    got = evaluate(built.graph, built.make_inputs(IDS, np.arange(len(IDS))))["logits"]
    want = qwen_logits(path, IDS)
    assert relative(got, want) <= 1e-9
    assert relative(Fp64Llama(c, model.weights).forward(IDS)[0], want) <= 1e-9


def test_qk_norm_tensors_are_refused_outside_qwen3(tmp_path):
    path = tmp_path / "q3.gguf"
    write_tiny_qwen(path, "qwen3")
    data = path.read_bytes()
    # the same file declared qwen2 (same-length name, keys renamed alike): QK-norm is not Qwen2's
    path.write_bytes(data.replace(b"qwen3", b"qwen2"))
    with pytest.raises(GGUFError, match="QK-norm"):
        load_gguf(path)
