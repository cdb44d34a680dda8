"""Roofline cost model against hand-computed values from the published datasheet numbers.

The expected values below are written out from the datasheets (typed here independently of the target
table), so a mistyped number in targets.py fails a test.
"""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.runtime.cost import (KernelWork, Latency, MeasuredOnlyTarget, UnsupportedOnTarget,
                                      kernel_latency, model_latency, peak_rate)
from luminal_num.runtime.targets import TARGET_NAMES, get_target

TERA = 1e12
# Achievable fractions from the H200 measurement in notes/toolchain.md (carried over to H100 / A100).
BANDWIDTH_EFFICIENCY = 4.3 / 4.8
COMPUTE_EFFICIENCY = 790.0 / 989.4
# Launch constants of issue 33, typed from their sources (runtime/targets.py cites them): 1.3 us per CUDA
# graph node (Hazy Research, H100), a 1.0 us minimum kernel time (sglang #24733, H100), 4 us plain launch.
GRAPH_LAUNCH_S = 1.3e-6
PLAIN_LAUNCH_S = 4e-6
MIN_KERNEL_S = 1.0e-6
SMS = 132
N = 4096


def gemm(math_mode: str, tensor_core: bool, itemsize: int) -> KernelWork:
    """C = A @ B, all N x N, every operand in `itemsize`-byte storage."""
    return KernelWork(name=f"gemm_{math_mode}", bytes_read=2 * N * N * itemsize, bytes_written=N * N * itemsize,
                      flops=2 * N ** 3, math=math_mode, tensor_core=tensor_core)


def test_memory_bound_elementwise_is_bytes_over_bandwidth():
    elements = 1 << 26
    add = KernelWork(name="add", bytes_read=2 * 4 * elements, bytes_written=4 * elements, flops=elements)
    expected = 12 * elements / (3.35 * TERA * BANDWIDTH_EFFICIENCY) + GRAPH_LAUNCH_S
    assert kernel_latency(add, "h100") == pytest.approx(expected, rel=1e-12)
    # the compute term is far below the memory term: the kernel is memory bound
    assert elements / (67 * TERA * COMPUTE_EFFICIENCY) < expected / 100
    # the same kernel on the H200 is faster exactly by the bandwidth ratio
    h200_body = kernel_latency(add, "h200") - GRAPH_LAUNCH_S
    assert (expected - GRAPH_LAUNCH_S) / h200_body == pytest.approx(4.8 / 3.35, rel=1e-12)


@pytest.mark.parametrize("math_mode, tensor_core, itemsize, peak", [
    ("bf16", True, 2, 989.4 * TERA),
    ("fp8", True, 1, 1978.9 * TERA),
    ("tf32", True, 4, 494.7 * TERA),
    ("fp32", False, 4, 67 * TERA),
    ("int8", True, 1, 1978.9 * TERA),
])
def test_gemm_4096_is_compute_bound_at_the_datasheet_peak(math_mode, tensor_core, itemsize, peak):
    work = gemm(math_mode, tensor_core, itemsize)
    expected = 2 * N ** 3 / (peak * COMPUTE_EFFICIENCY) + GRAPH_LAUNCH_S
    assert kernel_latency(work, "h100") == pytest.approx(expected, rel=1e-12)
    assert work.bytes_moved / (3.35 * TERA * BANDWIDTH_EFFICIENCY) < expected


def test_gemm_latency_ratios_follow_the_peaks():
    body = {mode: kernel_latency(gemm(mode, tc, size), "h100") - GRAPH_LAUNCH_S
            for mode, tc, size in (("bf16", True, 2), ("fp8", True, 1), ("fp32", False, 4))}
    assert body["bf16"] / body["fp8"] == pytest.approx(1978.9 / 989.4, rel=1e-9)
    assert body["fp32"] / body["bf16"] == pytest.approx(989.4 / 67, rel=1e-9)


def test_model_reproduces_the_measured_h200_bf16_gemm_rate():
    body = kernel_latency(gemm("bf16", True, 2), "h200") - GRAPH_LAUNCH_S
    assert 2 * N ** 3 / body == pytest.approx(790.0 * TERA, rel=1e-12)


def test_simt_rates_native_or_fp32_fallback():
    def work(mode):
        return KernelWork("k", 0, 0, 1, math=mode, tensor_core=False)
    assert peak_rate(work("fp16"), "h100") == 133.8 * TERA  # packed half2 on CUDA cores
    assert peak_rate(work("bf16"), "a100") == 39 * TERA
    assert peak_rate(work("fp64"), "a100") == 9.7 * TERA
    assert peak_rate(work("tf32"), "h100") == 67 * TERA  # no SIMT tf32: widened to fp32
    assert peak_rate(work("fp8"), "h200") == 67 * TERA
    assert peak_rate(KernelWork("k", 0, 0, 1, math="fp64", tensor_core=True), "h100") == 67 * TERA


def test_launch_overhead_with_and_without_cuda_graph():
    empty = KernelWork(name="noop", bytes_read=0, bytes_written=0, flops=0)
    assert kernel_latency(empty, "h100", cuda_graph=True) == pytest.approx(MIN_KERNEL_S + GRAPH_LAUNCH_S, rel=1e-12)
    assert kernel_latency(empty, "h100", cuda_graph=False) == pytest.approx(MIN_KERNEL_S + PLAIN_LAUNCH_S, rel=1e-12)
    works = [KernelWork(name=f"k{i}", bytes_read=4096 * i, bytes_written=4096, flops=1024 * i) for i in range(10)]
    graphed = model_latency(works, "a100", cuda_graph=True)
    plain = model_latency(works, "a100", cuda_graph=False)
    assert plain.total_s - graphed.total_s == pytest.approx(10 * (PLAIN_LAUNCH_S - GRAPH_LAUNCH_S), rel=1e-9)
    assert (graphed.cuda_graph, plain.cuda_graph) == (True, False)


def test_model_latency_record():
    works = [gemm("bf16", True, 2), KernelWork(name="relu", bytes_read=4 * N * N, bytes_written=4 * N * N, flops=N * N)]
    latency = model_latency(works, get_target("h200"))
    assert isinstance(latency, Latency)
    assert [name for name, _ in latency.per_kernel] == ["gemm_bf16", "relu"]
    assert latency.total_s == math.fsum(seconds for _, seconds in latency.per_kernel)
    assert latency.per_kernel[1][1] == pytest.approx(
        8 * N * N / (4.8 * TERA * BANDWIDTH_EFFICIENCY) + GRAPH_LAUNCH_S, rel=1e-12)
    assert (latency.source, latency.target) == ("modelled", "h200")
    with pytest.raises(ValueError, match="source"):
        Latency(total_s=1.0, per_kernel=(), source="guessed", target="h100", cuda_graph=True)


@pytest.mark.parametrize("tensor_core", [True, False])
def test_fp8_on_a100_is_unsupported(tensor_core):
    with pytest.raises(UnsupportedOnTarget, match="a100") as raised:
        model_latency([gemm("fp8", tensor_core, 1)], "a100")
    assert raised.value.math.startswith("fp8") and raised.value.target == "a100"
    assert get_target("a100").tensor_cores.fp8 is None


def test_tensor_core_request_for_a_simt_only_mode_is_unsupported():
    with pytest.raises(UnsupportedOnTarget, match="tensor-core"):
        kernel_latency(KernelWork("k", 0, 0, 1, math="fp32", tensor_core=True), "h100")


def test_unknown_target_lists_the_known_names():
    with pytest.raises(KeyError) as raised:
        get_target("v100")
    for name in ("h100", "h200", "a100", "cpu"):
        assert name in str(raised.value)
    assert set(TARGET_NAMES) == {"h100", "h200", "h200-measured", "a100", "cpu"}
    assert get_target("H100").name == "h100"


def test_cpu_target_is_measured_only():
    assert get_target("cpu").measured_only
    with pytest.raises(MeasuredOnlyTarget):
        model_latency([gemm("fp32", False, 4)], "cpu")


def test_kernel_work_validation():
    with pytest.raises(ValueError, match="math"):
        KernelWork("k", 0, 0, 0, math="fp4")
    with pytest.raises(ValueError, match="bytes_read"):
        KernelWork("k", -1, 0, 0)
    with pytest.raises(ValueError, match="fused_ops"):
        KernelWork("k", 0, 0, 0, fused_ops=0)


@settings(deadline=None, max_examples=60)
@given(bytes_moved=st.integers(0, 1 << 40), flops=st.integers(0, 1 << 50),
       target=st.sampled_from(["h100", "h200", "a100"]),
       mode=st.sampled_from(["bf16", "fp16", "tf32", "int8"]))
def test_latency_is_the_larger_roofline_term_and_monotone(bytes_moved, flops, target, mode):
    resolved = get_target(target)
    work = KernelWork("k", bytes_moved, 0, flops, math=mode, tensor_core=True)
    memory_s = bytes_moved / (resolved.hbm_bandwidth * BANDWIDTH_EFFICIENCY)
    compute_s = flops / (resolved.tensor_cores.rate(mode) * COMPUTE_EFFICIENCY)
    latency = kernel_latency(work, target)
    assert latency == pytest.approx(max(memory_s, compute_s, MIN_KERNEL_S) + GRAPH_LAUNCH_S, rel=1e-12)
    bigger = KernelWork("k", bytes_moved + 1, 0, flops + 1, math=mode, tensor_core=True)
    assert kernel_latency(bigger, target) >= latency


def test_a_kernel_runs_at_least_the_minimum_kernel_time():
    """4 KiB moved: 4096 / (4.8 TB/s * 4.3/4.8) = 0.95 ns, far under 1 us: the minimum applies."""
    tiny = KernelWork("tiny", 2048, 2048, 1024)
    assert 4096 / (4.8 * TERA * BANDWIDTH_EFFICIENCY) < MIN_KERNEL_S / 1000
    assert kernel_latency(tiny, "h200") == pytest.approx(MIN_KERNEL_S + GRAPH_LAUNCH_S, rel=1e-12)


@pytest.mark.parametrize("tiles, waves", [(1, 1), (66, 1), (132, 1), (133, 2), (264, 2), (265, 3)])
def test_wave_quantization_divides_by_the_busy_fraction(tiles, waves):
    """T tiles on 132 SMs take ceil(T / 132) waves: the roofline time over T / (waves * 132)."""
    elements = 1 << 26
    work = KernelWork("add", 8 * elements, 4 * elements, elements, tiles=tiles)
    memory_s = 12 * elements / (4.8 * TERA * BANDWIDTH_EFFICIENCY)
    expected = memory_s * (waves * SMS) / tiles + GRAPH_LAUNCH_S
    assert kernel_latency(work, "h200") == pytest.approx(expected, rel=1e-12)


def test_legacy_constants_reproduce_the_model_before_issue_33():
    """1 us per graph node, no minimum, no waves: the old formula max(bytes, flops) + 1e-6."""
    from luminal_num.runtime.targets import LEGACY_LAUNCH
    tiny = KernelWork("tiny", 2048, 2048, 1024, tiles=1)
    assert kernel_latency(tiny, "h200", launch=LEGACY_LAUNCH) == pytest.approx(
        4096 / (4.8 * TERA * BANDWIDTH_EFFICIENCY) + 1e-6, rel=1e-12)
    assert get_target("h200").launch.source.startswith("graph node 1.3 us")
