"""Weight storage as a plan choice: offered in the e-graph for 2-D weights, executed widened on load
(= the weight-only Gemm of runtime/weight_only.py), bounded by its exact storage error, charged its
stored bytes by the cost model."""
import warnings

import ml_dtypes
import numpy as np
import pytest

from luminal_num.codegen.llir import KernelKind
from luminal_num.codegen.serialize import program_from_data, program_to_data
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import evaluate
from luminal_num.hlir.graph import Graph
from luminal_num.models.llama import LLAMA_TINY, build_decode, random_weights
from luminal_num.models.testnets import transformer
from luminal_num.quant.stored import SEARCHED_STORAGE, storage_error
from luminal_num.quant.storage import STORAGE_FORMATS
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.latency import kernel_works
from luminal_num.runtime.weight_only import WEIGHT_ONLY_GEMMS, SumOrder, emulate_weight_only_gemm
from luminal_num.search.plan import op_table
from luminal_num.search.recipes import STORAGE_RECIPES, pick
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)
M, K, N = 4, 256, 48


def linear_graph(seed: int = 0, n: int = N, k: int = K):
    """y = x @ W^T with W stored (n, k) as a Hugging Face Linear weight."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    g = Graph()
    x = g.input("x", (M, k))
    g.output(x @ g.weight("w", w).transpose(), "y")
    return g, w, {"x": rng.standard_normal((M, k))}


# A Gemm whose weights outweigh the 1 us minimum kernel time (runtime/targets.py): 4096 x 2048 FP32 is
# 32 MiB, 7.8 us at the H200's 4.3 TB/s; int8 weights 2.0 us, int4 1.0 us. A 48 x 256 weight (48 KiB)
# runs the minimum kernel time in every format, so no stored format would save latency.
PLAN_N, PLAN_K = 4096, 2048


def storage_program(g: Graph, fmt: str, gemm: str):
    space = SearchSpace.build(g)
    genome = pick(space, {f"store:{fmt}", f"gemm:{gemm}"}.__contains__)
    return space.program(genome)


def test_storage_is_offered_for_matrix_weights_only():
    model = transformer(2)
    space = SearchSpace.build(model.graph)
    for group in space.part.groups:
        gs = space.groups[group.key].space
        chunk = group.chunks[0]
        stored_slots = {}
        for nodes in gs.classes.values():
            fmts = {n.arg("fmt") for n in nodes if n.op == "KStored"}
            for n in nodes:
                if n.op == "KStored":
                    stored_slots.setdefault(n.arg("slot"), set()).update(fmts)
        for slot, nid in enumerate(chunk.external):
            node = model.graph.nodes[nid]
            is_w = node.op.name == "INPUT" and model.graph.inputs[node.attr("name")].is_weight
            if is_w and len(node.shape) == 2:
                assert stored_slots.get(slot) == set(SEARCHED_STORAGE)
            else:
                assert slot not in stored_slots


def test_the_runtime_reads_the_conversion_cache_array_and_keeps_no_copy_of_it():
    """An FP32 reader of a stored weight reads the conversion cache's own (read-only) widened array: the
    weight cache holds no second FP32 copy of it (for a 1B model's LM head that copy was 1 GB)."""
    from luminal_num.hlir.weightcache import WEIGHTS
    from luminal_num.quant.stored import CONVERTED
    g, w, inputs = linear_graph(7, n=96)
    program = storage_program(g, "int8_channel", "f32")
    y = CpuRuntime(program, g.weights).run(inputs).outputs["y"]
    wide = CONVERTED.get(g.weights["w"], STORAGE_FORMATS["int8_channel"]).widened
    x = inputs["x"].astype(np.float32).astype(np.float64)  # the FP32 graph value the Gemm reads
    k = x.shape[-1]  # the widened values, summed in any order: FP64 truth within FP32's gamma_K of |x| |w|
    bound = k * 2.0 ** -24 / (1 - k * 2.0 ** -24) * (np.abs(x) @ np.abs(wide.astype(np.float64)).T)
    assert np.all(np.abs(y - x @ wide.astype(np.float64).T) <= bound)
    held = [v for v, _ in WEIGHTS._lru._items.values() if isinstance(v, np.ndarray)]
    # the Gemm's (K, N) operand is another layout, made from this array; a (rows, K) copy would be the waste
    assert not [v for v in held if v.shape == wide.shape and np.array_equal(v, wide) and not np.shares_memory(v, wide)]


@pytest.mark.parametrize("fmt", SEARCHED_STORAGE)
@pytest.mark.parametrize("act", ["f32", "bf16", "f16"])
def test_stored_weight_gemm_is_the_weight_only_gemm(fmt, act):
    """The CPU backend's Gemm on a stored weight = runtime/weight_only's exact emulation (BLAS order),
    and within its a-priori bound of the FP64 product with the original weight."""
    g, w, inputs = linear_graph()
    program = storage_program(g, fmt, act)
    stored = [k for k in program.kernels if k.storage is not None]
    assert [k.storage for k in stored] == [fmt]
    y = CpuRuntime(program, g.weights).run(inputs).outputs["y"]
    variant = WEIGHT_ONLY_GEMMS[f"{fmt}_a{act}"]
    q = STORAGE_FORMATS[fmt].quantize(w)
    x32 = inputs["x"].astype(np.float32)
    want = emulate_weight_only_gemm(x32, q, variant, SumOrder.BLAS)
    exact = x32.astype(np.float64) @ w.astype(np.float64).T
    bound = variant.a_priori_bound(K, np.abs(x32).astype(np.float64) @ np.abs(w).astype(np.float64).T,
                                   float(np.abs(x32).max()), float(np.abs(w).max()))
    assert np.all(np.abs(y - exact) <= bound)
    np.testing.assert_allclose(y, want, rtol=0, atol=float(np.max(bound)) * 1e-3 + 1e-6)


def test_stored_bf16_weight_reads_ml_dtypes_values():
    """Independent reference: the BF16-stored weight is ml_dtypes' bfloat16 cast of w, so an FP32
    Gemm on it is an FP32 product with those values."""
    g, w, inputs = linear_graph(1)
    y = CpuRuntime(storage_program(g, "bf16", "f32"), g.weights).run(inputs).outputs["y"]
    wb = w.astype(ml_dtypes.bfloat16).astype(np.float64)
    exact = inputs["x"].astype(np.float32).astype(np.float64) @ wb.T
    assert np.max(np.abs(y - exact)) <= 1e-5 * np.max(np.abs(exact))


@pytest.mark.parametrize("fmt", SEARCHED_STORAGE)
def test_static_bound_charges_the_storage_error(fmt):
    """Sound on a transformer with every 2-D weight stored (and the Gemms in BF16): measured <= bound."""
    model = transformer(2)
    space = SearchSpace.build(model.graph)
    program = space.program(pick(space, {f"store:{fmt}", "gemm:bf16"}.__contains__))
    assert sum(k.storage is not None for k in program.kernels) >= 8
    inputs = model.make_inputs(3)
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    rep = static_bound(program, ranges, model.graph.bind_symbols(inputs), model.graph.weights)
    out = CpuRuntime(program, model.graph.weights).run(inputs).outputs
    ref = evaluate(model.graph, inputs)
    for name in ref:
        assert np.all(np.abs(out[name] - ref[name]) <= rep.error_bounds[name]), name


def test_storage_error_in_the_bound_is_not_free():
    """A stored weight's bound is above the FP32 one by at least the storage error's effect."""
    g, w, inputs = linear_graph(2)
    ranges = {"x": Interval.point(inputs["x"])}
    b = g.bind_symbols(inputs)
    fp32 = static_bound(storage_program(g, "none", "f32"), ranges, b, g.weights).error_bounds["y"]
    int4 = static_bound(storage_program(g, "int4_g128", "f32"), ranges, b, g.weights).error_bounds["y"]
    d = STORAGE_FORMATS["int4_g128"].quantize(w).dequantize().astype(np.float64) - w
    assert np.all(int4 >= np.abs(inputs["x"] @ d.T))
    assert np.all(np.isfinite(int4)) and np.all(int4 > fp32)


@pytest.mark.parametrize("fmt", SEARCHED_STORAGE)
def test_cost_model_charges_stored_bytes(fmt):
    """The Gemm's bytes read = its activation (FP32) + the weight's stored bytes, hand-counted from the
    format's definition (codes x bits + scales/zeros at their size)."""
    g, w, inputs = linear_graph()
    program = storage_program(g, fmt, "bf16")
    b = g.bind_symbols(inputs)
    (work,) = [wk for wk, k in zip(kernel_works(program, b), program.launched()) if k.kind is KernelKind.GEMM]
    f = STORAGE_FORMATS[fmt]
    groups = {"channel": N, "g128": N * 2, "g32": N * 8, "mxfp4": N * 8, "nvfp4": N * 16}
    scale_bytes = next((n for key, n in groups.items() if key in fmt), 0) * (f.scale.itemsize if f.scale else 0)
    zero_bytes = N * 8 * 0.5 if fmt.endswith("asym") else 0
    tensor_scale = 4 if fmt == "nvfp4" else 0
    hand = N * K * f.element.bits / 8 + scale_bytes + zero_bytes + tensor_scale
    assert work.bytes_read == int(M * K * 4 + hand)


def test_gather_reads_rows_and_inplace_scatter_does_not_copy():
    model = build_decode(LLAMA_TINY, random_weights(LLAMA_TINY), 32)
    space = SearchSpace.build(model.graph)
    program = space.program(frozenset())
    inputs = model.make_inputs([1], [0])
    b = model.graph.bind_symbols(inputs)
    dtypes = program.dtypes()
    gathers = [k for k in program.launched() if k.kind is KernelKind.GATHER]
    assert gathers
    for k in gathers:
        row = int(np.prod([int(d) for d in k.inputs[0].view.shape[1:]])) * dtypes[k.inputs[0].buffer].itemsize
        idx = int(np.prod([int(d) for d in k.inputs[1].view.shape])) * dtypes[k.inputs[1].buffer].itemsize
        assert k.bytes_loaded(b, dtypes) == row * 1 + idx  # one token: one row, not the table
    for k in program.launched():
        if k.kind is KernelKind.SCATTER_NOCOPY:
            src = int(np.prod([int(d) for d in k.inputs[1].view.shape])) * k.dtype.itemsize
            assert k.bytes_stored(b) == src
            assert k.bytes_loaded(b, dtypes) < src + k.numel(b) * k.dtype.itemsize


def test_recipes_and_op_table_name_the_stored_weights():
    g, w, inputs = linear_graph()
    space = SearchSpace.build(g)
    program = space.program(pick(space, STORAGE_RECIPES["W4A16 INT4 group 128"].__contains__))
    rows = op_table(program, g.bind_symbols(inputs))
    (gemm,) = [r for r in rows if r["kind"] == "gemm"]
    assert gemm["precision"] == "bf16"
    assert gemm["weights"] == f"w:int4_g128:{STORAGE_FORMATS['int4_g128'].stored_bytes((N, K))}"
    again = program_from_data(program_to_data(program))
    assert [k.storage for k in again.kernels] == [k.storage for k in program.kernels]


# -- plans with converted weights -------------------------------------------------------------------
@pytest.fixture(scope="module")
def stored_plan():
    from luminal_num.compiler import compile as compile_plan
    from luminal_num.error.budget import Budget
    from luminal_num.search.search import SearchOptions
    g, w, inputs = linear_graph(3, PLAN_N, PLAN_K)
    calib = [{"x": np.random.default_rng(s).standard_normal((M, PLAN_K))} for s in range(2)]
    res = compile_plan(g, Budget.parse("atol=0.5,rtol=0.5"), "h200", calib, SearchOptions(seed=0, max_candidates=40,
                                                                                       progress=False))
    return g, res


def test_compiled_plan_saves_and_audits_its_converted_weights(stored_plan, tmp_path):
    from luminal_num.report.audit import audit
    from luminal_num.search.plan import Plan
    g, res = stored_plan
    assert res.plan.stored, "a loose budget on a weight-bound Gemm should pick a stored weight"
    path = res.plan.save(tmp_path / "plan.json")
    loaded = Plan.load(path)
    assert set(loaded.stored) == set(res.plan.stored)
    for key, t in loaded.stored.items():
        for part, arr in t.arrays.items():
            np.testing.assert_array_equal(arr, res.plan.stored[key].arrays[part])
    result = audit(loaded, g, [{"x": np.random.default_rng(9).standard_normal((M, PLAN_K))}])
    assert result.passed, result.reason


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing", "other_graph"])
def test_a_weights_file_that_does_not_match_its_plan_is_refused(stored_plan, tmp_path, damage):
    import json
    from luminal_num.search.plan import Plan, PlanError, weights_path
    g, res = stored_plan
    path = res.plan.save(tmp_path / "plan.json")
    wp = weights_path(path)
    raw = wp.read_bytes()
    if damage == "truncate":
        wp.write_bytes(raw[:-7])
    elif damage == "flip":
        wp.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    elif damage == "missing":
        wp.unlink()
    else:
        data = json.loads(path.read_text())
        data["graph_key"] = "0" * len(data["graph_key"])
        path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as exc:
        Plan.load(path)
    assert "\n" not in str(exc.value)


def test_smollm2_shaped_decode_bytes_match_the_hand_count_and_latency_falls():
    """Two layers of the SmolLM2-shaped step (the bench runs all 30): modelled bytes within 2% of the
    hand count per recipe, modelled H200 latency strictly decreasing FP32 > BF16 > FP8 W8A8 > W8A16 > W4A16."""
    from bench.storage_decode import SMOLLM2, measure
    df = measure(SMOLLM2.with_layers(2), 64)
    df = df[df.kv_format == "f32"]  # the KV-cache rows: tests/test_kv_storage.py
    assert list(df.genome) == ["FP32", "BF16", "FP8 W8A8", "W8A16", "W4A16"]
    assert np.all(np.abs(df.ratio - 1) <= 0.02)
    assert np.all(np.diff(df.h200_latency_ms) < 0), df.h200_latency_ms.tolist()
    assert df.kernels.nunique() == 1  # the FP8 activations are quantized in the Gemm prologue: no extra launch


@pytest.mark.parametrize("name", ["matmul_chain", "mlp", "transformer4"])
def test_random_genomes_with_storage_choices_have_sound_bounds(name):
    """Genome fuzzing where every knob (weight storage, Gemm variant, storage of activations) takes a
    random tag: measured error vs FP64 never exceeds the static bound."""
    from luminal_num.models import testnets
    model = {m.name: m for m in testnets.all_test_models()}[name]
    space = SearchSpace.build(model.graph)
    rng = np.random.default_rng(5)
    inputs = model.make_inputs(2)
    ref = evaluate(model.graph, inputs)
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    stored = 0
    for _ in range(12):
        genome = frozenset((gk, k.cls, k.tags[int(rng.integers(len(k.tags)))])
                           for gk, ks in space.knobs.items() for k in ks if rng.random() < 0.7)
        program = space.program(genome)
        stored += sum(k.storage is not None for k in program.kernels)
        rep = static_bound(program, ranges, model.graph.bind_symbols(inputs), model.graph.weights)
        if rep.overflow is not None:
            continue
        out = CpuRuntime(program, model.graph.weights).run(inputs).outputs
        for o in ref:
            assert np.all(np.abs(out[o] - ref[o]) <= rep.error_bounds[o]), o
    assert stored > 0


def test_a_bf16_checkpoint_kept_in_bf16_costs_no_error():
    """Weights that already are BF16 values (a BF16 checkpoint): BF16 storage keeps them exactly, so
    the weight's storage error is exactly zero, the stored plan's bound is no larger than the FP32 plan's
    (which charges the weight a conservative FP32 store) and the outputs are bit-identical."""
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(ml_dtypes.bfloat16).astype(np.float32)
    g = Graph()
    x = g.input("x", (M, K))
    g.output(x @ g.weight("w", w).transpose(), "y")
    inputs = {"x": rng.standard_normal((M, K))}
    ranges, b = {"x": Interval.point(inputs["x"])}, g.bind_symbols(inputs)
    plain, kept = storage_program(g, "none", "f32"), storage_program(g, "bf16", "f32")
    assert any(k.storage == "bf16" for k in kept.kernels)
    assert not np.any(storage_error(w, "bf16"))
    assert np.all(static_bound(kept, ranges, b, g.weights).error_bounds["y"]
                  <= static_bound(plain, ranges, b, g.weights).error_bounds["y"])
    np.testing.assert_array_equal(CpuRuntime(kept, g.weights).run(inputs).outputs["y"],
                                  CpuRuntime(plain, g.weights).run(inputs).outputs["y"])


def test_prologue_fp8_gemm_is_the_quantize_kernel_gemm_without_its_launch():
    """f8e4m3_channel_prologue quantizes A per token inside the Gemm: no QUANTIZE kernel, the same
    outputs bit for bit as f8e4m3_channel with its QUANTIZE launch, and its static bound holds."""
    g, w, inputs = linear_graph(6)
    inputs["x"][1] *= 40.0  # a loud token: per-token scales matter
    fused, split = storage_program(g, "none", "f8e4m3_channel_prologue"), storage_program(g, "none", "f8e4m3_channel")
    assert not any(k.kind is KernelKind.QUANTIZE for k in fused.kernels)
    assert any(k.kind is KernelKind.QUANTIZE for k in split.kernels)
    y = CpuRuntime(fused, g.weights).run(inputs).outputs["y"]
    np.testing.assert_array_equal(y, CpuRuntime(split, g.weights).run(inputs).outputs["y"])
    b = g.bind_symbols(inputs)
    bound = static_bound(fused, {"x": Interval.point(inputs["x"])}, b, g.weights).error_bounds["y"]
    exact = inputs["x"].astype(np.float32).astype(np.float64) @ w.astype(np.float64).T
    assert np.all(np.isfinite(bound)) and np.all(np.abs(y - exact) <= bound)
    assert len(kernel_works(fused, b)) == len(kernel_works(split, b)) - 1


@pytest.mark.parametrize("command", ["inspect", "audit"])
def test_the_cli_refuses_a_damaged_weights_file_with_one_line(stored_plan, tmp_path, capsys, command):
    """A truncated weights file beside a plan: one stderr line, exit 2, whatever the command."""
    from luminal_num.cli import EXIT_INPUT, main
    from luminal_num.search.plan import weights_path
    _, res = stored_plan
    path = res.plan.save(tmp_path / "plan.json")
    wp = weights_path(path)
    wp.write_bytes(wp.read_bytes()[:-7])
    capsys.readouterr()
    assert main([command, "--plan", str(path)]) == EXIT_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "weights" in err[0], err
