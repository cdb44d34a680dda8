"""The tensor-core Gemm (codegen/cuda_gemm_tc.py, issue 35 item 1): every form (plain, bias, GELU, residual,
GLU over gate|up, q|k|v), every variant it takes (BF16, F16, TF32, FP8 per tensor / per channel / dynamic /
prologue, INT8 per channel), FP32 / BF16 / FP16 outputs, M = 1 and M = 20 (two 16-row fragments, the second
ragged), N = 18 and K = 70 (ragged against the 32 x 64 block tile and the MMA K).

Truth: the CPU backend (runtime/cpu.py), bit for bit, on activations with two nonzero powers of two per row
(tests/test_stored_gemm_forms.py's data): every product is exact and a sum of two terms rounds the same in
any order, so neither BLAS's order nor the tensor core's can matter; the kernel runs in the CUDA
interpreter, whose WMMA operations (tests/cuda_interpreter_warp.py) are written from their definition.
GELU / SiLU epilogues: within the envelope the interpreter's erf / exp and numpy's differ in.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings

import numpy as np
import pytest

from cuda_interpreter import Buffer
from cuda_interpreter_warp import Fragment, Pointer, WarpOp, execute, float_to_tf32
from test_cuda_codegen import GEMMS, needs_nvrtc, run_launches, stored_values
from luminal_num.codegen import nvrtc
from luminal_num.codegen.cuda_dispatch import (GemmImpl, gemm_implementation, kernel_implementation, library_refusal,
                                              tensor_core_refusal)
from luminal_num.codegen.cuda_kernels import SCALES_SCRATCH, render_kernel
from luminal_num.dtypes.formats import BF16, F16, F32, Kind
from luminal_num.dtypes.variants import GEMM_VARIANTS
from luminal_num.hlir.graph import Graph
from luminal_num.runtime.cpu import bind_program
from luminal_num.runtime.latency import kernel_works
from luminal_num.search.plan import op_table
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)

FORMS = ("plain", "bias", "gelu", "residual", "glu", "qkv")
TRANSCENDENTAL = ("gelu", "glu")
VARIANTS = ("bf16", "f16", "tf32", "f8e4m3_tensor", "f8e5m2_channel", "f8e4m3_channel_prologue",
            "f8e4m3_tensor_dynamic", "int8_channel")
OUTPUTS = ("f32", "bf16", "f16")
N, K = 18, 70
REFUSED = {"f32": "FP32 operands: no tensor-core type holds them exactly",
           "f16acc16": "narrow accumulator: its per-MMA-group rounding is not the hardware's FP32 accumulation",
           "f8e4m3_block": "narrow accumulator: its per-MMA-group rounding is not the hardware's FP32 accumulation",
           "f8e4m3_mx": "scales vary along K: applied inside the K loop"}


def graph(form: str, m: int, seed: int) -> Graph:
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input("x", (m, K))

    def w(rows: int, name: str):
        return g.weight(name, (rng.standard_normal((rows, K)) * 10.0 ** rng.uniform(-2, 0, (rows, 1))).astype(np.float32))

    if form == "plain":
        g.output(x @ w(N, "w").transpose(), "y")
    elif form == "bias":
        g.output(x @ w(N, "w").transpose() + g.weight("b", rng.standard_normal(N).astype(np.float32)), "y")
    elif form == "gelu":
        g.output((x @ w(N, "w").transpose() + g.weight("b", rng.standard_normal(N).astype(np.float32))).gelu(), "y")
    elif form == "residual":
        g.output(x @ w(N, "w").transpose() + g.input("r", (m, N)), "y")
    elif form == "glu":
        g.output((x @ w(N, "w").transpose()).silu() * (x @ w(N, "wu").transpose()), "y")
    else:  # q|k|v over one activation, each feeding a row max
        for name, rows in (("q", N), ("k", 8), ("v", 8)):
            g.output((x @ w(rows, f"w{name}").transpose()).max(1), name)
    return g


def inputs(form: str, m: int, seed: int) -> dict:
    """Two nonzero powers of two per row of x (every order sums the same); a random residual."""
    rng = np.random.default_rng(seed + 1)
    x = np.zeros((m, K), np.float32)
    for row in x:
        row[rng.choice(K, 2, replace=False)] = rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], 2)
    return {"x": x, **({"r": rng.standard_normal((m, N)).astype(np.float32)} if form == "residual" else {})}


@functools.cache
def cell(form: str, variant: str, out: str, m: int):
    g = graph(form, m, seed=len(form) + m)
    space = SearchSpace.build(g)
    program = space.program(pick(space, {f"gemm:{variant}"}.__contains__))
    dtype = {"f32": F32, "bf16": BF16, "f16": F16}[out]
    kernels = tuple(dataclasses.replace(k, dtype=dtype) if k.kind.is_gemm and k.dtype is not dtype else k
                    for k in program.kernels)
    return g, dataclasses.replace(program, kernels=kernels)


def gemms(program) -> list:
    return [k for k in program.launched() if k.kind.is_gemm]


def run(src, launches, program, stored: dict, bindings: dict, out: Buffer, scratch: list, scales: dict) -> None:
    """run_launches, with a QUANTIZE kernel's scales (Arg role "scales") from `scales` (its own run)."""
    from cuda_interpreter import compile_entry, entry_body, launch
    for launch_ in launches:
        fn, params = compile_entry(src.source, launch_.entry)
        args = {"dyn_dims": Buffer(np.asarray(src.dyn_values(bindings), np.float64), True)} if src.symbols.symbols else {}
        for name, arg in zip(params, launch_.args):
            args[name] = {"out": lambda: out, "scratch": lambda: scratch[arg.index], "scales": lambda: scales[arg.buffer],
                          "in": lambda: Buffer(np.array(stored[arg.buffer], np.float64).reshape(-1),
                                               program.kernel(arg.buffer).dtype.kind is Kind.INT)}[arg.role]()
        if "__syncthreads" in entry_body(src.source, launch_.entry)[1]:
            launch(fn, args, *launch_.config(bindings))
        else:  # the scale kernels: one thread runs every grid-stride iteration
            fn(**args)


def quantize_scales(program, k, stored: dict, bindings: dict) -> dict:
    """The scales each QUANTIZE kernel feeding `k` computes, by running its scale and quantize launches (its q
    must be the CPU backend's, bit for bit)."""
    out = {}
    for inp, pre in zip(k.inputs, program.quantized_inputs(k)):
        if pre:
            qk = program.kernel(inp.buffer)
            src = render_kernel(qk, program)
            q = Buffer(np.zeros(qk.numel(bindings)), False)
            scratch = [Buffer(np.zeros(s.numel(bindings)), False) for s in src.scratch]
            run_launches(src, src.launches, program, stored, bindings, q, scratch)
            assert q.values.tobytes() == stored[qk.id].reshape(-1).astype(np.float64).tobytes()
            out[qk.id] = scratch[SCALES_SCRATCH]
    return out


def check_cell(form: str, variant: str, out: str, m: int, x: np.ndarray | None = None) -> dict:
    """Run the cell's Gemms' tensor-core launches against the CPU backend; `x`: other activations. Returns
    the CPU backend's buffers."""
    g, program = cell(form, variant, out, m)
    feed = {**g.weights, **inputs(form, m, m), **({} if x is None else {"x": x})}
    bindings = bind_program(program, feed)
    stored = stored_values(program, feed)
    found = gemms(program)
    assert found and all((k.precision or "f32") == variant for k in found), (form, variant)
    if form == "glu":
        assert any(k.kind.value == "gemm_epilogue" and len(render_kernel(k, program).tensor_core) for k in found)
    for k in found:
        src = render_kernel(k, program)
        assert src.tensor_core and tensor_core_refusal(k, program) is None, (form, variant)
        out_buf = Buffer(np.zeros(k.numel(bindings)), False)
        scratch = [Buffer(np.zeros(s.numel(bindings)), False) for s in src.scratch]
        # the at-load launches first (a weight's static scales), as the runtime runs them once after the upload
        run(src, src.at_load + src.tensor_core, program, stored, bindings, out_buf, scratch,
            quantize_scales(program, k, stored, bindings))
        got, want = out_buf.values, stored[k.id].reshape(-1)
        label = (form, variant, out, m, k.id, k.label)
        if form in TRANSCENDENTAL and k.kind.value == "gemm_epilogue":
            scale = float(np.max(np.abs(want), initial=0.0)) + 1.0
            np.testing.assert_allclose(got, want, rtol=0, atol=max(2.0 ** -18, 2 * k.dtype.unit_roundoff) * scale,
                                       err_msg=str(label))
        else:
            assert got.tobytes() == want.tobytes(), (label, np.max(np.abs(got - want)))
    return stored


# the default tier: every form, variant, output and M at least once
DEFAULT_CELLS = [("plain", "bf16", "f32", 20), ("bias", "f16", "bf16", 1), ("gelu", "tf32", "f16", 20),
                 ("residual", "int8_channel", "f32", 1), ("glu", "f8e4m3_channel_prologue", "bf16", 20),
                 ("qkv", "f8e5m2_channel", "f32", 20), ("residual", "f8e4m3_tensor", "f16", 20),
                 ("bias", "f8e4m3_tensor_dynamic", "f32", 1), ("glu", "int8_channel", "f32", 20)]


@pytest.mark.parametrize("form, variant, out, m", DEFAULT_CELLS)
def test_cells_run_bit_exact_against_the_cpu_backend(form, variant, out, m):
    check_cell(form, variant, out, m)


def test_the_default_cells_cover_every_form_variant_output_and_m():
    for axis, values in enumerate((FORMS, VARIANTS, OUTPUTS, (1, 20))):
        assert {c[axis] for c in DEFAULT_CELLS} == set(values), axis


@pytest.mark.slow
@pytest.mark.parametrize("form, variant, out, m", list(itertools.product(FORMS, VARIANTS, OUTPUTS, (1, 20))))
def test_every_cell_runs_bit_exact_against_the_cpu_backend(form, variant, out, m):
    check_cell(form, variant, out, m)


def test_tf32_operands_round_to_nearest_even_on_tensor_cores():
    """Activations on TF32 ties (1 + 2^-11 between 1 and 1 + 2^-10): the kernel stages the project's RNE
    rounding (1), so cvt.rna's ties-away (1 + 2^-10) never decides; the CPU backend's bits, and not the ones
    ties-away operands would give."""
    m = 20
    x = inputs("plain", m, m)["x"]
    x[np.nonzero(x)] *= np.float32(1.0 + 2.0 ** -11)  # every nonzero a tie: (1 + 2^-11) * 2^e
    stored = check_cell("plain", "tf32", "f32", m, x)
    g, program = cell("plain", "tf32", "f32", m)
    k = gemms(program)[0]
    away = np.where(x != 0, x * np.float32(1.0 + 2.0 ** -10) / np.float32(1.0 + 2.0 ** -11), 0).astype(np.float32)
    assert not np.array_equal(stored[k.id], stored_values(program, {**g.weights, "x": away})[k.id])


# -- what stays on the tiled kernel, and what the dispatch / cost model / op table say -----------------------

@pytest.mark.parametrize("variant, reason", sorted(REFUSED.items()))
def test_variants_it_cannot_reproduce_stay_tiled_with_a_one_line_reason(variant, reason):
    _, program = cell("bias", variant, "f32", 20)
    for k in gemms(program):
        assert tensor_core_refusal(k, program) == reason
        assert render_kernel(k, program).tensor_core == ()
        assert kernel_implementation(k, program, {}) is GemmImpl.TILED
        # FP32 `+ bias` takes cuBLASLt's bias epilogue (codegen/cuda_gemm_bias.py) ahead of the kernels
        library = GemmImpl.CUBLASLT_BIAS if variant == "f32" else GemmImpl.TILED
        assert gemm_implementation(k, program, {}) is library and (library_refusal(k, program) is None) == library.library


ON_TENSOR_CORES = {"tf32", "bf16", "f16", "f8e4m3_tensor", "f8e4m3_channel", "f8e5m2_tensor", "f8e5m2_channel",
                   "int8_channel", "f8e4m3_channel_prologue", "f8e4m3_tensor_dynamic", "f8e4m3_channel_dynamic"}


def test_every_catalogue_variant_has_the_kernel_or_a_reason():
    """The variants whose accumulation is one FP32 (or INT32) sum with scales constant along K, and only those."""
    base, _ = GEMMS["batched_shared_weight"]
    for name in GEMM_VARIANTS:
        program = dataclasses.replace(base, kernels=base.kernels[:-1] + (dataclasses.replace(base.kernels[-1], precision=name),))
        k = program.kernels[-1]
        assert (tensor_core_refusal(k, program) is None) == (name in ON_TENSOR_CORES), name
        assert bool(render_kernel(k, program).tensor_core) == (name in ON_TENSOR_CORES), name


def test_a_batch_invariant_program_keeps_the_tiled_kernel():
    g = graph("bias", 20, seed=1)
    space = SearchSpace.build(g).with_batch_invariance(True)
    program = space.program(pick(space, {"gemm:bf16"}.__contains__))
    for k in gemms(program):
        assert tensor_core_refusal(k, program) == "batch-invariant program: the tiled kernel's one summation order for every M"
        assert gemm_implementation(k, program, {}) is GemmImpl.TILED


def test_dispatch_cost_model_and_op_table_name_the_tensor_core_kernel():
    """M = 20: the tensor-core kernel, priced on tensor cores in the variant's math; M = 1 keeps the tiled decode
    path where the variant has one (BF16), INT8 (no decode path) runs on tensor cores at every M."""
    for variant, m, expected in (("bf16", 20, GemmImpl.TENSOR_CORE), ("bf16", 1, GemmImpl.TILED_DECODE),
                                 ("int8_channel", 1, GemmImpl.TENSOR_CORE)):
        g, program = cell("gelu", variant, "f32", m)
        bindings = bind_program(program, {**g.weights, **inputs("gelu", m, m)})
        works = dict(zip([k.id for k in program.launched()], kernel_works(program, bindings)))
        rows = {r["kernel"]: r for r in op_table(program, bindings)}
        for k in gemms(program):
            assert gemm_implementation(k, program, bindings) is expected, (variant, m)
            assert works[k.id].implementation == rows[k.id]["implementation"] == expected.value
            assert works[k.id].tensor_core == (expected is GemmImpl.TENSOR_CORE)
            if expected is GemmImpl.TENSOR_CORE:
                assert works[k.id].math == {"bf16": "bf16", "int8_channel": "int8"}[variant]


# -- the interpreter's WMMA operations, against hand-derived values ------------------------------------------

def test_float_to_tf32_rounds_ties_away_from_zero():
    one = np.float32(1.0)
    tie = np.float32(1.0 + 2.0 ** -11)  # halfway between 1 and 1 + 2^-10
    assert float_to_tf32(tie) == np.float32(1.0 + 2.0 ** -10) and float_to_tf32(-tie) == -np.float32(1.0 + 2.0 ** -10)
    assert float_to_tf32(np.float32(1.0 + 2.0 ** -12)) == one and float_to_tf32(one) == one


def test_wmma_operations_mean_what_cuda_defines():
    rng = np.random.default_rng(0)
    a = Fragment("matrix_a", 16, 16, 16, "signed char", "row_major")
    b = Fragment("matrix_b", 16, 16, 16, "signed char", "col_major")
    c = Fragment("accumulator", 16, 16, 16, "int", None)
    mem_a = rng.integers(-128, 128, (16, 20)).astype(np.float32)  # ldm 20: four padding columns
    mem_b = rng.integers(-128, 128, (16, 16)).astype(np.float32)  # column-major: row n holds B[:, n]
    execute(WarpOp("load_matrix_sync", (a, Pointer(mem_a, 0), 20)))
    execute(WarpOp("load_matrix_sync", (b, Pointer(mem_b, 0), 16)))
    execute(WarpOp("fill_fragment", (c, 2 ** 31 - 1)))
    execute(WarpOp("mma_sync", (c, a, b, c)))
    exact = (2 ** 31 - 1) + mem_a[:, :16].astype(np.int64) @ mem_b.T.astype(np.int64)
    np.testing.assert_array_equal(c.values, (exact + 2 ** 31) % 2 ** 32 - 2 ** 31)  # the int32 accumulator wraps
    out = np.zeros(16 * 24, np.int64)
    execute(WarpOp("store_matrix_sync", (Pointer(out, 8), c, 24, "mem_row_major")))
    np.testing.assert_array_equal(out[8 + np.arange(16)[:, None] * 24 + np.arange(16)[None, :]], c.values)
    half = Fragment("matrix_a", 16, 16, 16, "__half", "row_major")
    with pytest.raises(ValueError, match="not __half values"):  # a value the kernel did not round to F16
        execute(WarpOp("load_matrix_sync", (half, Pointer(np.full(256, 1.0 + 2.0 ** -12, np.float32), 0), 16)))
    # FP32 accumulation in K order: 2^24 + 1 + 1 rounds twice to 2^24, where an exact sum gives 2^24 + 2
    fa = Fragment("matrix_a", 16, 16, 16, "__half", "row_major")
    fb = Fragment("matrix_b", 16, 16, 16, "__half", "col_major")
    fc = Fragment("accumulator", 16, 16, 16, "float", None)
    ones = np.zeros((16, 16), np.float32)
    ones[:, :2] = 1.0
    execute(WarpOp("load_matrix_sync", (fa, Pointer(ones, 0), 16)))
    execute(WarpOp("load_matrix_sync", (fb, Pointer(np.ones((16, 16), np.float32), 0), 16)))
    execute(WarpOp("fill_fragment", (fc, 2.0 ** 24)))
    execute(WarpOp("mma_sync", (fc, fa, fb, fc)))
    assert np.all(fc.values == 2.0 ** 24)


# -- NVRTC ---------------------------------------------------------------------------------------------------

def compile_cells(cells, tmp_path, monkeypatch) -> None:
    """Each cell's sources (M = 20) with their tensor-core entry compile to an sm_90 CUBIN (ptxas checks the
    wmma instructions), every entry present and the tensor-core one issuing wmma load / mma / store."""
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path))
    sources = {}
    for form, variant, out in cells:
        _, program = cell(form, variant, out, 20)
        for k in gemms(program):
            src = render_kernel(k, program)
            assert src.tensor_core, (form, variant, out)
            sources[src.name] = src
    for src in sources.values():
        compiled = nvrtc.compile_cuda(src.source, src.name, "sm_90")
        assert compiled.cubin and all(f".entry {entry}(" in compiled.ptx for entry in src.entries)
        tc_entry = src.tensor_core[-1].entry
        body = compiled.ptx.split(f".entry {tc_entry}(")[1].split(".entry ")[0]
        assert "wmma.mma.sync" in body and "wmma.load.a.sync" in body and "wmma.store.d.sync" in body


@needs_nvrtc
def test_each_wmma_type_and_form_compiles_for_sm_90(tmp_path, monkeypatch):
    """Every variant once (each WMMA type: bf16, f16 for F16 and FP8, tf32, s8), every form and output once."""
    cells = [(form, variant, OUTPUTS[i % 3]) for i, (form, variant) in
             enumerate(zip(FORMS * 2, ("bf16", "f16", "tf32", "int8_channel", "f8e4m3_channel_prologue", "f8e5m2_channel",
                                       "f8e4m3_tensor", "f8e4m3_tensor_dynamic")))]
    assert {c[1] for c in cells} == set(VARIANTS) and {c[0] for c in cells} == set(FORMS)
    compile_cells(cells, tmp_path, monkeypatch)


@needs_nvrtc
@pytest.mark.slow
def test_every_tensor_core_kernel_compiles_for_sm_90(tmp_path, monkeypatch):
    compile_cells(itertools.product(FORMS, VARIANTS, OUTPUTS), tmp_path, monkeypatch)
