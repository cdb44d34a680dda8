"""Measured kernel classes (runtime/kernel_classes.py) and the `h200-measured` target built from them.

Fits are checked against hand-made truth (kernels whose times follow known coefficients), the cost model
against its definition (max of roofline and class fit), and the shipped H200 fits against what the H200
recorded (reports/bench/gpu_steps.csv; the slow test rebuilds the 30-layer SmolLM2 step)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from luminal_num.models.testnets import all_test_models
from luminal_num.runtime.cost import KernelWork, kernel_latency, model_latency
from luminal_num.runtime.cpu import bind_program
from luminal_num.runtime.kernel_classes import (FEATURES, KernelClassFit, MeasuredKernels, features, fit_class,
                                                load_measured)
from luminal_num.runtime.latency import kernel_works
from luminal_num.runtime.targets import get_target
from luminal_num.search.space import SearchSpace

SMS = 132


def test_a_fit_recovers_the_coefficients_kernel_times_were_made_with():
    rng = np.random.default_rng(0)
    truth = np.array([2e-6, 3e-13, 0.0, 4e-9, 1e-12])
    rows = np.stack([features(int(b), int(f), int(t), int(k), SMS) for b, f, t, k in
                     zip(rng.integers(1e3, 1e8, 200), rng.integers(1e3, 1e10, 200), rng.integers(1, 2000, 200),
                         rng.integers(0, 4096, 200))])
    fitted = fit_class("tiled", rows, rows @ truth)
    assert fitted.median_relative_error < 1e-6
    np.testing.assert_allclose(fitted.coefficients, truth, rtol=1e-4, atol=1e-16)


def test_features_count_waves_of_blocks_over_the_sms():
    one_wave, two_waves = features(0, 1000, SMS, 64, SMS), features(0, 1000, SMS + 1, 64, SMS)
    assert one_wave[3] == 64 and two_waves[3] == 128
    assert features(0, 0, None, 10, SMS)[3] == 10  # no tile count: one wave (sized to the machine)


def test_fits_round_trip_through_json_and_refuse_what_they_cannot_mean():
    fits = MeasuredKernels("dev", "src", (KernelClassFit("rows", (1e-6, 0.0, 0.0, 1e-9, 0.0), 3, 0.1, 0.2),))
    assert MeasuredKernels.from_json(fits.to_json()) == fits
    with pytest.raises(ValueError, match="coefficients"):
        KernelClassFit("rows", (-1e-6, 0.0, 0.0, 0.0, 0.0), 1, 0.0, 0.0)
    with pytest.raises(ValueError, match="features"):
        MeasuredKernels.from_json(fits.to_json().replace('"per_byte"', '"per_bit"'))
    with pytest.raises(ValueError, match="> 0"):
        fit_class("rows", np.ones((2, len(FEATURES))), np.array([1e-6, 0.0]))


def test_a_measured_class_only_ever_adds_time_to_the_roofline():
    h200 = get_target("h200")
    slow = MeasuredKernels("dev", "src", (KernelClassFit("tiled", (50e-6, 0.0, 0.0, 0.0, 0.0), 1, 0.0, 0.0),))
    calibrated = dataclasses.replace(h200, measured_kernels=slow)
    tiled = KernelWork("k1", 1 << 20, 1 << 20, 1 << 30, implementation="tiled", tiles=1024)
    other = dataclasses.replace(tiled, implementation="rows")
    node = h200.launch.graph_node_s
    assert kernel_latency(tiled, calibrated) == pytest.approx(max(kernel_latency(tiled, h200) - node, 50e-6) + node)
    assert kernel_latency(other, calibrated) == kernel_latency(other, h200)  # no class: the roofline alone
    huge = dataclasses.replace(tiled, bytes_read=1 << 36)  # a roofline above the fit stands
    assert kernel_latency(huge, calibrated) == kernel_latency(huge, h200)


def test_the_shipped_h200_classes_cover_the_measured_model_families_and_only_add_time():
    """Every kernel a 1-layer SmolLM2 decode step (each genome) or MiniLM layer launches has a measured class;
    other kernels (an Iota of the test nets) keep the roofline; calibrated latencies never drop below it."""
    from bench.gpu_cases import genome_program, gpu_check_module, smollm2_step
    from bench.fusion import GENOMES
    measured = load_measured("h200_kernels")
    assert measured is not None and get_target("h200-measured").measured_kernels == measured
    _, weights, inputs, space = smollm2_step(layers=1, context=16)
    programs = [(genome_program(space, label), {**weights, **inputs}) for label in GENOMES]
    graph, mweights, batch = gpu_check_module().random_minilm(batch=2, seq=8, layers=1)
    programs.append((SearchSpace.build(graph).program(()), {**mweights, **batch}))
    for program, feed in programs:
        works = kernel_works(program, bind_program(program, feed))
        assert {w.implementation for w in works if measured.get(w.implementation) is None} == set()
    for model in all_test_models():
        program = SearchSpace.build(model.graph).program(())
        works = kernel_works(program, bind_program(program, {**model.graph.weights, **model.make_inputs(1)}))
        assert model_latency(works, "h200-measured").total_s >= model_latency(works, "h200").total_s


@pytest.mark.slow
def test_the_h200_measured_target_ranks_smollm2_genomes_as_the_h200_ran_them():
    """The recorded graph replays of 12 SmolLM2 decode genomes: the calibrated model within 20% of each and
    in the same order; the roofline model ranks them nearly backwards (fused attention first). The programs'
    works as recorded: the run predates the tiled Gemm's decode path (bench/gpu_cases.recorded_works)."""
    from bench.gpu_cases import genome_program, recorded_works, smollm2_step
    reports = Path(__file__).parents[1] / "reports" / "bench"
    steps = pd.read_csv(reports / "gpu_steps.csv")
    steps = steps[steps.model == "smollm2-decode"].set_index("plan")
    kernels = pd.read_csv(reports / "gpu_kernels.csv")
    _, weights, inputs, space = smollm2_step()
    modelled = {}
    for plan in steps.index:
        program = genome_program(space, plan)
        recorded = kernels[(kernels.model == "smollm2-decode") & (kernels.plan == plan)].set_index("kernel")
        works = recorded_works(program, bind_program(program, {**weights, **inputs}), recorded.implementation.to_dict())
        modelled[plan] = model_latency(works, "h200-measured").total_s * 1e6
    for plan, row in steps.iterrows():
        assert abs(modelled[plan] / row.measured_step_us - 1) <= 0.2, (plan, modelled[plan], row.measured_step_us)
    assert sorted(steps.index, key=modelled.get) == list(steps.measured_step_us.sort_values().index)


def test_the_decode_path_class_is_derived_from_the_tiled_fit_with_the_decode_paths_serial_steps():
    """tiled_decode (no device measured it): the tiled fit's coefficients, its own serial extent, hand-derived
    from the kernel (codegen/cuda_gemv.py: per row ceil(K / 16) strided products and a 4-step tree, M rows in
    turn); a measured tiled_decode fit, once a device records one, is taken instead."""
    from luminal_num.codegen.cuda_gemv import decode_serial_steps
    assert decode_serial_steps(1, 576) == 36 + 4 and decode_serial_steps(4, 1536) == 4 * (96 + 4)
    assert decode_serial_steps(3, 17) == 3 * (2 + 4)
    tiled = KernelClassFit("tiled", (1e-6, 5e-14, 1e-14, 5e-8, 5e-12), 10, 0.1, 0.3)
    fits = MeasuredKernels("dev", "src", (tiled,))
    derived = fits.get("tiled_decode")
    assert derived.coefficients == tiled.coefficients and derived.derived_from == "tiled" and derived.samples == 0
    assert MeasuredKernels.from_json(fits.to_json()) == fits  # derived classes are not stored as measured
    own = KernelClassFit("tiled_decode", (2e-6, 0.0, 0.0, 1e-7, 0.0), 5, 0.1, 0.2)
    assert MeasuredKernels("dev", "src", (tiled, own)).get("tiled_decode") == own
    assert MeasuredKernels("dev", "src", ()).get("tiled_decode") is None
    calibrated = dataclasses.replace(get_target("h200"), measured_kernels=fits)
    gemv = KernelWork("k1", 7_000_000, 4608, 2 * 576 * 3072, implementation="tiled", tiles=128, serial_extent=576)
    decode = dataclasses.replace(gemv, implementation="tiled_decode", serial_extent=decode_serial_steps(1, 576))
    node = calibrated.launch.graph_node_s
    assert kernel_latency(decode, calibrated) - node == pytest.approx(max(
        kernel_latency(gemv, get_target("h200")) - node,
        tiled.seconds(decode.bytes_moved, decode.flops, 128, 40, SMS)))
    assert kernel_latency(decode, calibrated) < kernel_latency(gemv, calibrated)


def test_the_tensor_core_class_is_derived_from_the_cublas_fit_until_a_device_measures_it():
    """tensor_core (codegen/cuda_gemm_tc.py; no device has run it): cuBLAS's coefficients, marked derived, priced
    on the same features (serial extent K); a measured tensor_core fit replaces it."""
    h200 = load_measured("h200_kernels")
    derived, cublas = h200.get("tensor_core"), h200.get("cublas")
    assert derived.coefficients == cublas.coefficients and derived.derived_from == "cublas" and derived.samples == 0
    own = KernelClassFit("tensor_core", (3e-6, 0.0, 0.0, 1e-8, 0.0), 7, 0.1, 0.2)
    assert MeasuredKernels("dev", "src", (cublas, own)).get("tensor_core") == own
    work = KernelWork("k1", 1 << 20, 1 << 18, 2 * 164 * 384 * 384, math="bf16", tensor_core=True,
                      implementation="tensor_core", tiles=60, serial_extent=384)
    node = get_target("h200-measured").launch.graph_node_s
    assert kernel_latency(work, "h200-measured") - node == pytest.approx(max(
        kernel_latency(work, "h200") - get_target("h200").launch.graph_node_s,
        cublas.seconds(work.bytes_moved, work.flops, 60, 384, SMS)))
