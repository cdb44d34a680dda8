"""scripts/gpu_check.sh on a machine without a GPU: setup passes, the device stage says "no CUDA
device" and the script stops there with exit code 3, its logs under $OUT; the device stages' plans
are the ones the README promises (scripts/gpu_check.py)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from luminal_num.models.testnets import transformer
from luminal_num.runtime.cuda_device import cuda_available
from luminal_num.search.space import SearchSpace

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def load_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(cuda_available(), reason="a CUDA device is present: the script would run the device stages")
def test_without_a_device_the_script_stops_cleanly_with_exit_code_3(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "LUMINAL_GPU_PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "no CUDA device" in done.stdout and "exit 3 (no CUDA device)" in done.stdout
    logs = tmp_path / "gpu_check"
    summary = (logs / "summary.txt").read_text()
    assert summary.splitlines()[0].startswith("setup   ok") and "device  none" in summary
    assert "no CUDA device" in (logs / "device.log").read_text()
    assert not (logs / "pytest.log").exists()  # nothing after the device stage ran


@pytest.mark.skipif(cuda_available(), reason="a CUDA device is present")
def test_the_device_stages_alone_also_say_no_device():
    check = load_check_module()
    for stage in ("e2e", "graph", "timing"):
        assert check.main([stage]) == check.NO_DEVICE


def test_the_checked_plans_are_fp32_tf32_bf16_and_cublaslt_fp8():
    check = load_check_module()
    space = SearchSpace.build(transformer(4).graph)
    genomes = {plan: check.plan_genome(space, plan) for plan in check.PLANS}
    assert genomes["fp32"] == frozenset()
    gemms = {(g, c) for g, c, tag in space.all_changes() if tag.startswith("gemm:")}
    for plan in ("tf32", "bf16", "fp8"):
        assert genomes[plan] and {c[2] for c in genomes[plan]} == {check.PLANS[plan]}
        assert {(g, c) for g, c, _ in genomes[plan]} <= gemms
    assert set(check.TIMED_PLANS) == {"fp32", "bf16", "fp8"}
