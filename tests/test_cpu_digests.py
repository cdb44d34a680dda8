"""The CPU backend's outputs are bit-identical to the backend before the numpy-speed rewrite (issue 18).

tests/data/cpu_digests.json holds sha256 digests of every output's bytes, recorded with the previous
(float64-everywhere) backend on a fixed set of programs: each test model and the Llama-tiny job under
every precision tag (each knob offering the tag set to it) plus seeded mixed genomes, and MiniLM
under every tag but the reduction ones (the old backend needed over ten minutes for MiniLM's BF16
reduction; the small models cover those tags). Regenerate only from a backend known to be right:
`PYTHONPATH=$PWD .venv/bin/python tests/test_cpu_digests.py` (prints what changed).
The FP32 Gemm digests depend on the BLAS library's summation order (numpy's bundled OpenBLAS here).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from luminal_num.models.registry import llama_tiny_job, minilm_job
from luminal_num.models.testnets import all_test_models
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.extract import BASE
from luminal_num.search.space import SearchSpace

DIGESTS = Path(__file__).parent / "data" / "cpu_digests.json"
MINILM_QUICK = ("f32", "gemm:f8e4m3_tensor", "gemm:int8_channel", "gemm:f16acc16", "ew:bf16")


# The tags the digests were recorded for. Later choices (weight storage, prologue FP8) have no previous
# backend to compare with: they are left out, and knobs offering only those are skipped without a draw,
# so the seeded mixed genomes are the ones that were recorded.
RECORDED_TAGS = frozenset(key.split("/", 1)[1] for key in json.loads(DIGESTS.read_text())) - {"mixed0", "mixed1"}


def _recorded(tags) -> list[str]:
    return [t for t in tags if t in RECORDED_TAGS]


def _tags(space: SearchSpace) -> list[str]:
    return sorted({t for ks in space.knobs.values() for k in ks for t in _recorded(k.tags)})


def _genome(space: SearchSpace, tag: str) -> frozenset:
    return frozenset((gk, k.cls, tag) for gk, ks in space.knobs.items() for k in ks if tag in k.tags and tag != BASE)


def _mixed(space: SearchSpace, seed: int) -> frozenset:
    rng = np.random.default_rng(seed)
    knobs = [(gk, k.cls, _recorded(k.tags)) for gk, ks in space.knobs.items() for k in ks]
    return frozenset((gk, cls, t) for gk, cls, tags in knobs if len(tags) > 1
                     for t in [tags[int(rng.integers(len(tags)))]] if t != BASE)


def _digest(result) -> dict[str, str]:
    out = {name: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for name, v in result.outputs.items()}
    for nid, v in sorted((result.exports or {}).items()):
        out[f"export:{nid}"] = hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
    return out


def _programs(name: str, graph, batch, tags=None, mixed: int = 2):
    """(key, program, weights, batch) for every tag of the space (or `tags`) and `mixed` random genomes."""
    space = SearchSpace.build(graph)
    for tag in tags or _tags(space):
        yield f"{name}/{tag}", space.program(_genome(space, tag)), graph.weights, batch
    for seed in range(mixed):
        yield f"{name}/mixed{seed}", space.program(_mixed(space, seed)), graph.weights, batch


def small_cases():
    for m in all_test_models():
        yield from _programs(m.name, m.graph, m.make_inputs(1))
    job = llama_tiny_job(layers=2)
    yield from _programs("llama-tiny", job.graph, job.calibration[0])


def minilm_cases(tags=None):
    job = minilm_job()
    space_tags = tags or [t for t in _tags(SearchSpace.build(job.graph)) if not t.startswith("sum:")]
    yield from _programs("minilm", job.graph, job.calibration[0], space_tags, mixed=0)


def compute(cases) -> dict[str, dict[str, str]]:
    return {key: _digest(CpuRuntime(program, weights).run(batch, keep_exports=True))
            for key, program, weights, batch in cases}


@pytest.fixture(scope="module")
def saved() -> dict:
    return json.loads(DIGESTS.read_text())


def _check(saved: dict, cases) -> None:
    got = compute(cases)
    assert got, "no programs were run"
    changed = sorted(k for k, v in got.items() if saved.get(k) != v)
    assert not changed, f"outputs differ from the saved backend on {changed}"


def test_small_models_bit_identical(saved):
    _check(saved, small_cases())


def test_minilm_quick_variants_bit_identical(saved):
    _check(saved, minilm_cases(MINILM_QUICK))


@pytest.mark.slow
def test_minilm_every_variant_bit_identical(saved):
    _check(saved, minilm_cases())


if __name__ == "__main__":
    digests = {**compute(small_cases()), **compute(minilm_cases())}
    if DIGESTS.exists():
        old = json.loads(DIGESTS.read_text())
        print("changed:", sorted(k for k in digests if old.get(k) != digests[k]), file=sys.stderr)
    DIGESTS.parent.mkdir(exist_ok=True)
    tmp = DIGESTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    tmp.replace(DIGESTS)
    print(f"{len(digests)} programs -> {DIGESTS}")
