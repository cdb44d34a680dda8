"""Every Gemm form on a weight held in a storage format reads the weight's stored parts on CUDA (issue 35,
item 2): plain, epilogue (bias, GELU, residual), GLU over gate|up, horizontal q|k|v, the FP8 prologue
variant; every storage format; FP32 / BF16 / FP16 outputs; M = 1 (the decode path) and M = 5 (the tiles).

Truths, run in the CUDA interpreter (tests/cuda_interpreter.py):
- the same kernel rendered to read the CPU backend's widened FP32 buffer instead (random data): the stored
  parts, dequantized on load, must give the same bits, so every rounding point after the load is the one
  the widened kernel (and the CPU emulation it follows) has;
- the CPU backend itself, bit for bit, on activations with two nonzero powers of two per row: every
  product is exact and a sum of two terms rounds the same in any order, so BLAS's order cannot matter
  (GELU and SiLU epilogues: within the last bits the interpreter's erf / exp and numpy's differ in);
- the dedicated dequantize-on-load kernel (a plain Gemm, FP32 output): runtime/weight_only.py's
  sequential emulation.
The cost model (runtime/latency.py) charges each such Gemm the stored bytes its launches read.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import numpy as np
import pytest

from test_cuda_codegen import interpret, needs_nvrtc, stored_parts, stored_values
from luminal_num.codegen import nvrtc
from luminal_num.codegen.cuda_dispatch import GemmImpl, gemm_implementation
from luminal_num.codegen.cuda_kernels import _render_structure, _rebind, _structure, input_formats, render_kernel
from luminal_num.codegen.cuda_weight_only import stored_operand, weight_only_gemm
from luminal_num.codegen.llir import Program
from luminal_num.dtypes.formats import BF16, F16, F32
from luminal_num.hlir.graph import Graph
from luminal_num.quant.concat import concat_refusal
from luminal_num.quant.storage import STORAGE_FORMATS
from luminal_num.runtime.cpu import CpuRuntime, bind_program
from luminal_num.runtime.latency import kernel_works
from luminal_num.runtime.weight_only import WEIGHT_ONLY_GEMMS, SumOrder, emulate_weight_only_gemm, stored_weight
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)

FORMATS = sorted(n for n in STORAGE_FORMATS if n != "f32")
FORMS = ("plain", "bias", "gelu", "residual", "glu", "qkv", "kn")
TRANSCENDENTAL = ("gelu", "glu")  # epilogues whose erf / exp the interpreter and numpy round apart
KN_WIDTH = 32  # "kn": x @ W with W held (K, N) (an ONNX MatMul initializer), N a whole llama.cpp block
VARIANTS = ("f32", "bf16", "f16", "f8e4m3_channel_prologue")
OUTPUTS = (F32, BF16, F16)
N = 18  # two 16-column blocks, the second ragged


def k_for(fmt: str) -> int:
    """K ragged against the tile (32) and the group where the format allows it; GGUF needs whole blocks."""
    f = STORAGE_FORMATS[fmt]
    if f.scheme.value.startswith("gguf"):
        return max(64, f.block)
    return 70


def _kept(w: np.ndarray, fmt: str, rng) -> np.ndarray:
    """A weight loaded from random GGUF blocks of a kept type (the format keeps them exactly)."""
    from luminal_num.models.gguf import TensorSource, keep_source
    from luminal_num.quant.gguf_blocks import block_type, random_blocks
    import gguf
    t = block_type(fmt)
    raw = random_blocks(t, *w.shape, rng)
    kept = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t.ggml]).astype(np.float32).reshape(w.shape)
    keep_source(kept, TensorSource(t.ggml, raw))
    return kept


def weight(fmt: str, rows: int, k: int, rng) -> np.ndarray:
    w = (rng.standard_normal((rows, k)) * 10.0 ** rng.uniform(-2, 0, (rows, 1))).astype(np.float32)
    return _kept(w, fmt, rng) if STORAGE_FORMATS[fmt].keeps_only else w


def graph(form: str, fmt: str, m: int, seed: int) -> Graph:
    rng = np.random.default_rng(seed)
    k = k_for(fmt)
    g = Graph()
    x = g.input("x", (m, k))
    if form == "kn":
        g.output(x @ g.weight("w", weight(fmt, k, KN_WIDTH, rng)), "y")
        return g
    w = g.weight("w", weight(fmt, N, k, rng)).transpose()
    if form == "plain":
        g.output(x @ w, "y")
    elif form == "bias":
        g.output(x @ w + g.weight("b", rng.standard_normal(N).astype(np.float32)), "y")
    elif form == "gelu":
        g.output((x @ w + g.weight("b", rng.standard_normal(N).astype(np.float32))).gelu(), "y")
    elif form == "residual":
        g.output(x @ w + g.input("r", (m, N)), "y")
    elif form == "glu":
        up = g.weight("wu", weight(fmt, N, k, rng)).transpose()
        g.output((x @ w).silu() * (x @ up), "y")
    else:  # q|k|v: three Gemms over one activation, one over the concatenated stored weights (a part that
        # is a graph output stays apart, one with an elementwise consumer takes it as its epilogue: each
        # feeds a row max here)
        g.output((x @ w).max(1), "q")
        g.output((x @ g.weight("wk", weight(fmt, 8, k, rng)).transpose()).max(1), "k")
        g.output((x @ g.weight("wv", weight(fmt, 8, k, rng)).transpose()).max(1), "v")
    return g


def inputs(form: str, fmt: str, m: int, seed: int, exact: bool) -> dict:
    """Random activations, or (exact) two nonzero powers of two per row of x."""
    rng = np.random.default_rng(seed + 1)
    k = k_for(fmt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    if exact:
        x = np.zeros((m, k), np.float32)
        for row in x:
            row[rng.choice(k, 2, replace=False)] = rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], 2)
    return {"x": x, **({"r": rng.standard_normal((m, N)).astype(np.float32)} if form == "residual" else {})}


@functools.cache
def cell(form: str, fmt: str, variant: str, out: str, m: int) -> tuple[Graph, Program] | None:
    """The program of one cell: every weight in `fmt`, every Gemm in `variant`, the Gemm reading the weight
    storing `out` (its output is a graph output: the store is the kernel's last rounding); None where the
    search would never build it (a concatenation the format refuses: the parts stay separate Gemms)."""
    if form == "kn":
        try:  # a K-quant's whole 256-wide blocks along N = 32: K-quant weights come from GGUF files, held (N, K)
            STORAGE_FORMATS[fmt].check_shape((k_for(fmt), KN_WIDTH))
        except ValueError:
            return None
    g = graph(form, fmt, m, seed=len(form) + len(fmt) + m)
    space = SearchSpace.build(g)
    base = pick(space, {"store:int8_channel", f"gemm:{variant}"}.__contains__)
    program = space.program(base)
    kernels = []
    for k in program.kernels:
        if k.storage is not None:
            if k.concat and concat_refusal(fmt, [tuple(g.weights[n].shape) for n in k.concat], k.concat_axis):
                return None
            k = dataclasses.replace(k, storage=fmt)
        elif k.kind.is_gemm and STORAGE_FORMATS.get(program.kernel(k.inputs[1].buffer).storage or "") is not None:
            k = dataclasses.replace(k, dtype={"f32": F32, "bf16": BF16, "f16": F16}[out])
        kernels.append(k)
    return g, dataclasses.replace(program, kernels=tuple(kernels))


def stored_gemms(program: Program) -> list:
    return [k for k in program.launched() if stored_operand(k, program) is not None]


def widened_twin(kernel, program: Program):
    """The same kernel's source reading B's widened FP32 buffer (what ran before stored parts)."""
    src = _render_structure(_structure(kernel), input_formats(kernel, program), program.quantized_inputs(kernel),
                            program.batch_invariant, None)
    return _rebind(src, kernel)


def run_cell(form, fmt, variant, out, m):
    built = cell(form, fmt, variant, out, m)
    if built is None:
        pytest.skip(f"{fmt}: no {form} Gemm on it (a concatenation refused, or blocks wider than N)")
    g, program = built
    gemms = stored_gemms(program)
    assert gemms and all(tuple(k.shape)[0] == m and (k.precision or "f32") == variant for k in gemms)
    if form in ("glu", "qkv"):
        assert len(gemms) == 1 and program.kernel(gemms[0].inputs[1].buffer).concat  # one Gemm, parts joined
    for exact in (False, True):
        feed = {**g.weights, **inputs(form, fmt, m, len(fmt), exact)}
        bindings = bind_program(program, feed)
        stored, parts = stored_values(program, feed, g.weights), stored_parts(program, feed)
        for k in gemms:
            check_kernel(program, k, feed, bindings, stored, parts, exact, (form, fmt, variant, out, m))


def check_kernel(program, k, feed, bindings, stored, parts, exact: bool, label) -> None:
    impl = gemm_implementation(k, program, bindings)
    assert impl.reads_stored, (label, impl)
    if impl is GemmImpl.WEIGHT_ONLY:  # the dedicated kernel: the sequential emulation, any data
        got = _interpret_weight_only(program, k, stored, parts)
        variant = WEIGHT_ONLY_GEMMS[f"{program.kernel(k.inputs[1].buffer).storage}_a{k.precision or 'f32'}"]
        w = stored_weight(program.kernel(k.inputs[1].buffer), feed)
        a = stored[k.inputs[0].buffer].astype(np.float32)
        np.testing.assert_array_equal(got, emulate_weight_only_gemm(a, w, variant, SumOrder.SEQUENTIAL), str(label))
    else:
        tc = impl is GemmImpl.TENSOR_CORE_STORED  # the tensor-core kernel staging B from the stored parts
        assert tc == (bool(render_kernel(k, program).tensor_core) and impl is not GemmImpl.TILED_STORED_DECODE), label
        got = interpret(program, k, stored, bindings, parts, tensor_core=tc)
        if not exact:  # the same kernel reading the widened buffer: the same bits
            twin = interpret(program, k, stored, bindings, src=widened_twin(k, program), tensor_core=tc)
            assert got.tobytes() == twin.tobytes(), label
    if exact:  # the CPU backend: sums of two exact products, any order
        want = stored[k.id].reshape(got.shape)
        if label[0] in TRANSCENDENTAL:  # the interpreter's erff / exp2f against numpy's: last bits, the
            # envelope tests/test_cuda_codegen.tolerance gives a non-exact body (or one unit of the output format)
            scale = float(np.max(np.abs(want), initial=0.0)) + 1.0
            tol = max(2.0 ** -18, 2 * k.dtype.unit_roundoff) * scale
            np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=str(label))
        else:
            assert got.tobytes() == want.tobytes(), (label, np.max(np.abs(got - want)))


def _interpret_weight_only(program, k, stored, parts) -> np.ndarray:
    from cuda_interpreter import Buffer, compile_entry, launch
    src = weight_only_gemm(k, program)
    fn, params = compile_entry(src.source, src.name)
    m, n = (int(d) for d in k.shape)
    out = Buffer(np.zeros(m * n), False)
    args = {"out": out, "a": Buffer(np.asarray(stored[k.inputs[0].buffer], np.float64).reshape(-1), False)}
    args.update(zip(params[2:], parts[k.inputs[1].buffer]))
    launch(fn, args, src.grid, src.block)
    return out.values.reshape(m, n)


# the default tier: every form, variant, output and M at least once, on formats of each family (int4
# symmetric / asymmetric, int8 and fp8 per channel, nvfp4, mxfp4, llama.cpp Q4_1 and kept Q5_0 blocks)
DEFAULT_CELLS = [("plain", "int4_g128", "bf16", "bf16", 1), ("bias", "int8_channel", "bf16", "f32", 5),
                 ("gelu", "nvfp4", "f16", "f16", 1), ("residual", "f8e4m3_channel", "f8e4m3_channel_prologue", "bf16", 1),
                 ("residual", "int4_g128", "bf16", "f32", 5), ("glu", "int4_g32_asym", "f32", "f32", 1),
                 ("qkv", "mxfp4", "f8e4m3_channel_prologue", "f16", 1), ("qkv", "gguf_q5_0", "bf16", "f32", 1),
                 ("glu", "gguf_q4_1", "bf16", "bf16", 1), ("kn", "int4_g32", "bf16", "f32", 1)]


def every_cell() -> list[tuple]:
    """Every form x format, its variant, output and M rotating (162 cells)."""
    return [(form, fmt, VARIANTS[(i + j) % len(VARIANTS)], ("f32", "bf16", "f16")[(i + 2 * j) % 3], (1, 5)[(i + j) % 2])
            for i, fmt in enumerate(FORMATS) for j, form in enumerate(FORMS)]


@pytest.mark.parametrize("form,fmt,variant,out,m", DEFAULT_CELLS)
def test_cells_read_stored_parts_bit_for_bit(form, fmt, variant, out, m):
    run_cell(form, fmt, variant, out, m)


def test_the_cells_cover_every_form_variant_output_and_m():
    for cells in (DEFAULT_CELLS, every_cell()):
        for i, values in enumerate((FORMS, None, VARIANTS, ("f32", "bf16", "f16"), (1, 5))):
            if values is not None:
                assert {c[i] for c in cells} == set(values), i
    assert {c[1] for c in every_cell()} == set(FORMATS) and {c[:2] for c in every_cell()} == {
        (form, fmt) for form in FORMS for fmt in FORMATS}


def test_the_default_cells_run_each_kernel_on_stored_parts():
    """The default tier runs the tiled kernel, its decode path and the tensor-core kernel on stored parts (the
    dedicated dequantize-on-load kernel too): M = 5 BF16 and FP16 Gemms take tensor cores."""
    seen = set()
    for cell_ in DEFAULT_CELLS:
        built = cell(*cell_)
        if built is not None:
            program = built[1]
            seen |= {gemm_implementation(k, program, {}) for k in stored_gemms(program)}
    assert {GemmImpl.TENSOR_CORE_STORED, GemmImpl.TILED_STORED_DECODE, GemmImpl.WEIGHT_ONLY} <= seen, seen


@pytest.mark.slow
@pytest.mark.parametrize("form,fmt,variant,out,m", every_cell())
def test_every_form_and_format_reads_stored_parts_bit_for_bit(form, fmt, variant, out, m):
    run_cell(form, fmt, variant, out, m)


# -- NVRTC: every new source compiles for sm_90 ---------------------------------------------------------
def _sources(cells) -> dict[str, str]:
    out = {}
    for c in cells:
        built = cell(*c)
        if built is None:
            continue
        _, program = built
        for k in stored_gemms(program):
            src = weight_only_gemm(k, program) or render_kernel(k, program)
            out[src.name] = src.source
    return out


def _compile(cells, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path))
    for name, source in _sources(cells).items():
        assert f".entry {name}(" in nvrtc.compile_cuda(source, name, "sm_90").ptx


@needs_nvrtc
def test_the_cells_compile_for_sm_90(tmp_path, monkeypatch):
    _compile(DEFAULT_CELLS, tmp_path, monkeypatch)


@pytest.mark.slow
@needs_nvrtc
def test_every_cell_compiles_for_sm_90(tmp_path, monkeypatch):
    _compile(every_cell(), tmp_path, monkeypatch)


# -- the cost model charges what the launches read ------------------------------------------------------
def _hand_bytes(form: str, program: Program, k, feed, m: int) -> float:
    """Bytes the Gemm's main launch reads, counted from what the runtime hands it: A (m x K, its buffer's
    dtype; twice under an A-prologue variant: its amax pass), the bias (N FP32) or residual (m x N), and
    the weight's stored parts as uploaded (their arrays' bytes)."""
    a = program.kernel(k.inputs[0].buffer)
    kk = int(k.layout.k)
    a_bytes = m * kk * a.dtype.itemsize * (2 if (k.precision or "").endswith("_prologue") else 1)
    extra = {"bias": N * 4, "gelu": N * 4, "residual": m * N * program.kernel(k.inputs[-1].buffer).dtype.itemsize}
    fmt = stored_operand(k, program).fmt
    stored = fmt.pack(stored_weight(program.kernel(k.inputs[1].buffer), feed))
    return a_bytes + extra.get(form, 0) + sum(np.asarray(arr).nbytes for arr in stored.arrays.values())


@pytest.mark.parametrize("form,fmt,variant,out,m", DEFAULT_CELLS)
def test_the_cost_model_charges_the_stored_bytes_the_launch_reads(form, fmt, variant, out, m):
    g, program = cell(form, fmt, variant, out, m)
    feed = {**g.weights, **inputs(form, fmt, m, 0, exact=False)}
    bindings = bind_program(program, feed)
    works = dict(zip((k.id for k in program.launched()), kernel_works(program, bindings)))
    for k in stored_gemms(program):
        work = works[k.id]
        assert GemmImpl(work.implementation).reads_stored
        assert work.bytes_read == round(_hand_bytes(form, program, k, feed, m)), (form, fmt, variant)


# -- the CUDA runtime (executing stand-in): stored parts uploaded, no widened weight ---------------------
@pytest.fixture
def fake(monkeypatch, tmp_path):
    """tests/fake_cuda.py executing: launches run in the interpreter, uploads are recorded."""
    from fake_cuda import executing_stand_in
    yield from executing_stand_in(monkeypatch, tmp_path)


@needs_nvrtc
@pytest.mark.parametrize("form,fmt,variant,out,m", [("residual", "int4_g128", "bf16", "f32", 5),
                                                     ("glu", "int8_channel", "bf16", "bf16", 1)])
def test_the_cuda_runtime_uploads_stored_parts_only_and_matches_the_cpu_backend(fake, form, fmt, variant, out, m):
    """W4A16's o-proj/down form (residual epilogue) and W8A16's gate|up GLU: the runtime uploads the weights'
    stored parts and no FP32 copy of them, launches the tiled kernel on the parts, and computes the CPU
    backend's outputs bit for bit (exact data)."""
    from luminal_num.runtime.cuda import CudaRuntime
    g, program = cell(form, fmt, variant, out, m)
    feed = inputs(form, fmt, m, 3, exact=True)
    got = CudaRuntime(program, g.weights).run(feed).outputs
    want = CpuRuntime(program, g.weights).run(feed).outputs
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    uploads = [e["nbytes"] for e in fake.ops("upload")]
    (k,) = stored_gemms(program)
    wk = program.kernel(k.inputs[1].buffer)
    stored = STORAGE_FORMATS[fmt].pack(stored_weight(wk, g.weights))
    assert sorted(np.asarray(a).nbytes for a in stored.arrays.values()) == sorted(
        u for u in uploads if u in {np.asarray(a).nbytes for a in stored.arrays.values()})
    widened_bytes = int(np.prod([int(d) for d in wk.shape])) * 4
    assert widened_bytes not in uploads and all(g.weights[n].nbytes not in uploads for n in (wk.concat or ("w",)))
