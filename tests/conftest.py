"""Fixtures shared by several test modules (loaded once per session: the MiniLM weights are 90 MB)."""
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
