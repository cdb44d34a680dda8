"""scripts/gpu_check.sh on a machine without a GPU: setup passes, the device stage says "no CUDA
device" and the script stops there with exit code 3, its logs under $OUT; the device stages' plans
are the ones the README promises, and they pass on the executing CUDA stand-in (scripts/gpu_check.py)."""
from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import luminal_num.runtime.cuda as cuda_module
from fake_cuda import Recorder, install
from luminal_num.codegen import nvrtc
from luminal_num.models.testnets import transformer
from luminal_num.runtime import cuda_device
from luminal_num.runtime.cuda import CudaRuntime
from luminal_num.runtime.cuda_device import cuda_available
from luminal_num.search.space import SearchSpace
from test_cuda_codegen import needs_nvrtc

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


def test_a_python_without_the_requirements_and_no_wheels_is_a_setup_failure(tmp_path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    (tmp_path / "wheels").mkdir()
    env = {**os.environ, "OUT": str(tmp_path), "LUMINAL_GPU_PYTHON": str(broken),
           "LUMINAL_WHEELHOUSE": str(tmp_path / "wheels")}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "exit 2 (setup failed)" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "gpu_check" / "summary.txt").read_text().startswith("setup   FAIL")


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


@pytest.fixture
def executing_device(monkeypatch, tmp_path):
    """The executing CUDA stand-in (tests/fake_cuda.py)."""
    rec = Recorder(execute=True)
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path / "kernels"))
    install(monkeypatch, rec, cuda_module, cuda_device)
    yield rec, CudaRuntime
    cuda_device.probe.cache_clear()


@needs_nvrtc
def test_the_device_stages_pass_on_the_executing_stand_in(executing_device, tmp_path, monkeypatch, capsys):
    """e2e, graph and timing on the test MLP (the script's stages, small enough for the interpreter), run
    through the stand-in: the script's own checks pass, and the timing stage writes one row per plan with
    modelled/measured = modelled / measured."""
    rec, runtime = executing_device
    check = load_check_module()
    assert check.stage_e2e(runtime, names=("mlp",))
    assert check.stage_graph(runtime, names=("mlp",))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    report = tmp_path / "bench" / "gpu_latency.csv"
    assert check.stage_timing(runtime, "Fake H200", name="mlp", report=report, n=1, warmup=0)
    printed = capsys.readouterr().out
    assert "FAIL" not in printed and printed.count("ok   e2e mlp") == len(check.PLANS)
    rows = list(csv.DictReader(report.open()))
    assert [r["plan"] for r in rows] == list(check.TIMED_PLANS)
    assert (tmp_path / "out" / "gpu_latency.csv").read_text() == report.read_text()
    for row in rows:
        assert float(row["measured_s"]) == pytest.approx(0.5e-3)  # the stand-in's event time
        assert float(row["modelled_over_measured"]) == pytest.approx(float(row["modelled_s"]) / 0.5e-3, rel=1e-3)
    assert rec.ops("graph_launch")
