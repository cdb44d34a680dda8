"""The faults a new user hits with a GGUF file (issue 36): a cut file is named truncated in one line,
and an unsupported architecture is refused from the header's first key, before anything else is read."""
import gguf
import numpy as np
import pytest

from luminal_num.models.gguf import GGUFError, load_gguf, smollm2_path
from luminal_num.models.gguf_header import GGUFTruncated, read_header

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _cut(tmp_path, size: int):
    data = smollm2_path().read_bytes()[:size]
    out = tmp_path / f"cut{size}.gguf"
    out.write_bytes(data)
    return out


@pytest.mark.parametrize("size, what", [(2_000, "metadata"), (40_000_000, "tensor 'blk.")])
def test_a_cut_file_is_named_truncated(tmp_path, size, what):
    with pytest.raises(GGUFTruncated) as info:
        load_gguf(_cut(tmp_path, size))
    message = str(info.value)
    assert "is truncated" in message and what in message and f"the file has {size} bytes" in message
    assert "\n" not in message


def test_the_whole_file_passes_the_header_check():
    header = read_header(smollm2_path())
    assert header.scalars["general.architecture"] == "llama" and len(header.tensors) == 272
    end = max(t.start + t.nbytes for t in header.tensors)
    assert end <= header.file_size < end + 64  # the last tensor ends the file (up to alignment)
    reader = gguf.GGUFReader(smollm2_path())  # extents agree with the gguf package's own reader
    theirs = {t.name: (int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
    assert {t.name: (t.start, t.nbytes) for t in header.tensors} == theirs


def _unsupported(path, arch="mamba", cut: int | None = None, vocab: int = 0):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if vocab:
        w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if cut is not None:
        path.write_bytes(path.read_bytes()[:cut])
    return path


def test_unsupported_architecture_is_refused_from_the_first_key(tmp_path):
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        load_gguf(_unsupported(tmp_path / "m.gguf"))
    # cut right after general.architecture: the refusal names the architecture, not the truncation,
    # so nothing past that key was read
    cut = 4 + 4 + 8 + 8 + 8 + len("general.architecture") + 4 + 8 + len("mamba")
    with pytest.raises(GGUFError, match="architecture 'mamba'"):
        load_gguf(_unsupported(tmp_path / "cut.gguf", cut=cut))
    with pytest.raises(GGUFTruncated):
        load_gguf(_unsupported(tmp_path / "cut1.gguf", cut=cut - 1))


def test_refusal_comes_before_the_gguf_reader(tmp_path, monkeypatch):
    """The gguf package's reader (which parses the whole vocabulary first) is never started."""
    def no_reader(*args, **kwargs):
        raise AssertionError("the gguf reader was started before the architecture was checked")
    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    with pytest.raises(GGUFError, match="architecture 'mamba'"):
        load_gguf(_unsupported(tmp_path / "big.gguf", vocab=300_000))


def test_header_skips_arrays(tmp_path):
    header = read_header(_unsupported(tmp_path / "v.gguf", arch="llama", vocab=1000))
    assert header.scalars["llama.block_count"] == 1 and "tokenizer.ggml.tokens" not in header.scalars
