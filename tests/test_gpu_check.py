"""scripts/gpu_check.sh on a machine without a GPU: setup passes, the device stage says "no CUDA
device" and the script stops there with exit code 3, its logs under $OUT; the device stages' plans
are the ones the README promises, and they pass on the executing CUDA stand-in (scripts/gpu_check.py)."""
from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys
import time
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
LOAD_ALLOWANCE = 2  # the dry run must finish within 60 s; a CI machine shared by other jobs gets twice that


def load_carry_module():
    spec = importlib.util.spec_from_file_location("gpu_carry", ROOT / "scripts" / "gpu_carry.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # packs ~57 MiB of wheels and builds a venv: ~1 min, and its 60 s claim is load-sensitive
def test_dry_run_in_a_device_like_python_without_network_stops_at_the_device_within_60_s(tmp_path):
    """The dry run: a Python holding only the device image's packages (scripts/device_packages.txt; no
    CuPy, no egglog), the wheels gpu_carry packs from this machine, no network (a fresh network namespace
    when `unshare` may make one) and the no-device switch: setup unpacks the wheels, finds NVRTC, prints
    the carry list and its size, collects `pytest -m gpu`, and the script stops at the device stage with
    one line and exit code 3, within 60 s."""
    carry = load_carry_module()
    device = carry.device_packages()
    assert {"egglog", "cupy-cuda12x"}.isdisjoint(device) and "numpy" in device
    python = carry.simulate(tmp_path / "devpy", device)
    probe_egglog = subprocess.run([str(python), "-c", "import egglog"], capture_output=True, env={})
    assert probe_egglog.returncode != 0  # the stand-in lacks what the device lacks
    wheels = tmp_path / "wheels"
    names = carry.needed(device)
    assert "egglog" in names and not set(names) & device
    for name in names:
        carry.pack_wheel(name, wheels)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "OUT": str(tmp_path / "out"),
           "LUMINAL_GPU_PYTHON": str(python), "LUMINAL_WHEELHOUSE": str(wheels),
           "LUMINAL_GPU_SITE": str(tmp_path / "site"), "LUMINAL_GPU_CHECK_NO_DEVICE": "1"}
    isolate = ["unshare", "-n"] if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0 else []
    started = time.perf_counter()
    done = subprocess.run([*isolate, "bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - started
    assert done.returncode == 3, done.stdout + done.stderr
    out = done.stdout
    assert f"installed from {wheels}: " in out and "egglog" in out
    assert "missing: nothing" in out and re.search(r"carry: working tree [\d.]+ MiB \+ carried [\d.]+ MiB", out)
    assert re.search(r"^collect: \d+/\d+ tests collected", out, re.M)
    assert out.count("no CUDA device") == 3  # the one line, and the table's device and total rows
    assert "no CUDA device: LUMINAL_GPU_CHECK_NO_DEVICE is set" in out
    summary = (tmp_path / "out" / "gpu_check" / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary] == [["stage", "result"], ["setup", "ok"], ["device", "none"],
                                                      ["total", "FAIL"]]
    assert not (tmp_path / "out" / "gpu_check" / "pytest.log").exists()  # nothing after the device stage ran
    assert elapsed < 60 * LOAD_ALLOWANCE, f"the dry run took {elapsed:.0f} s"


def test_a_python_without_the_requirements_and_no_wheels_is_a_setup_failure(tmp_path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    (tmp_path / "wheels").mkdir()
    env = {**os.environ, "OUT": str(tmp_path), "LUMINAL_GPU_PYTHON": str(broken),
           "LUMINAL_WHEELHOUSE": str(tmp_path / "wheels")}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "exit 2 (setup failed)" in done.stdout, done.stdout + done.stderr
    summary = (tmp_path / "gpu_check" / "summary.txt").read_text().splitlines()
    assert summary[1].split()[:2] == ["setup", "FAIL"] and "not a Python >= 3.12" in summary[1]


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


def test_a_device_python_without_the_carried_wheels_is_a_setup_failure_naming_what_is_missing(tmp_path):
    carry = load_carry_module()
    python = carry.simulate(tmp_path / "devpy", carry.device_packages())
    (tmp_path / "wheels").mkdir()
    env = {"PATH": os.environ["PATH"], "OUT": str(tmp_path), "LUMINAL_GPU_PYTHON": str(python),
           "LUMINAL_WHEELHOUSE": str(tmp_path / "wheels"), "LUMINAL_GPU_SITE": str(tmp_path / "site")}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    lacking = re.search(r"^missing: (.*)$", done.stdout, re.M).group(1).split()
    assert "egglog" in lacking and "gguf" in lacking and "scripts/gpu_carry.py pack" in done.stdout
