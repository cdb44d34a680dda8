"""Run generated CUDA C on the CPU, one thread at a time: a differential oracle for codegen without a GPU.

The generated kernels use a small C subset (declarations, assignments, for/if, grid-stride loops,
ternaries, intrinsics). This module parses an entry's body into Python source and executes it with
blockIdx = threadIdx = 0, blockDim = gridDim = 1, so every grid-stride loop runs all its iterations
in one thread and a block reduction is the identity. Intrinsics are given their IEEE meaning with
numpy float32 / float64 arithmetic and luminal_num.dtypes.rounding (the independent rounding
oracle); ln_round_format is re-derived from its specification in Python. Kernels whose threads cooperate
(the tiled Gemm's __syncthreads, the tensor-core Gemm's warp-collective WMMA calls) run through `launch`,
which tests/cuda_interpreter_warp.py drives in lock step and where the WMMA operations get their meaning.
"""
from __future__ import annotations

import math
import re
import types
from dataclasses import dataclass

import numpy as np

from cuda_interpreter_warp import Dim3, Pointer, WarpOp, float_to_tf32, fragment, launch
from luminal_num.dtypes.formats import BF16, F8E4M3, F8E5M2, F16
from luminal_num.dtypes.rounding import Overflow, round_to

__all__ = ["Buffer", "compile_entry", "entry_body", "eval_expr", "launch", "round_format", "tokenize"]

_TOKEN = re.compile(r"""
    (?P<float>0x[0-9a-fA-F]+(?:\.[0-9a-fA-F]*)?p[+-]?\d+f?|\d+\.\d*(?:e[+-]?\d+)?f?)
  | (?P<int>0x[0-9a-fA-F]+(?:ULL|LL|u|U)?|\d+(?:ULL|LL|u|U)?)
  | (?P<name>[A-Za-z_]\w*)
  | (?P<op><<|>>|<=|>=|==|!=|&&|\|\||\+=|-=|\+\+|--|::|[-+*/%<>=!?:;,(){}\[\].&|~^])
  | (?P<space>\s+)""", re.VERBOSE)
_FLOAT = re.compile(r"0x[0-9a-fA-F]+(?:\.[0-9a-fA-F]*)?p[+-]?\d+f?|\d+\.\d*(?:e[+-]?\d+)?f?")
TYPES = {"long", "int", "float", "double", "unsigned", "const", "static", "char", "signed"}
TEMPLATED = {"static_cast", "ln_fp8_from_bits", "ln_block_reduce"}
BINARY = [("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", "<=", ">", ">="), ("<<", ">>"), ("+", "-"),
          ("*", "/", "%")]  # C precedence, lowest first


def tokenize(code: str) -> list[str]:
    code = re.sub(r"//[^\n]*", "", code)
    out, pos = [], 0
    while pos < len(code):
        m = _TOKEN.match(code, pos)
        if m is None:
            raise SyntaxError(f"cannot tokenize {code[pos:pos + 30]!r}")
        if m.lastgroup != "space":
            out.append(m.group())
        pos = m.end()
    return out


class _Parser:
    """C subset -> Python source lines."""

    def __init__(self, tokens: list[str]):
        self.t, self.i, self.lines, self.depth = tokens, 0, [], 0

    def peek(self, k: int = 0) -> str:
        return self.t[self.i + k] if self.i + k < len(self.t) else ""

    def take(self, expected: str | None = None) -> str:
        tok = self.t[self.i]
        if expected is not None and tok != expected:
            raise SyntaxError(f"expected {expected!r}, got {tok!r} near {' '.join(self.t[self.i - 5:self.i + 5])}")
        self.i += 1
        return tok

    def emit(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    # -- expressions ------------------------------------------------------------------------------
    def expr(self) -> str:
        cond = self.binary(0)
        if self.peek() == "?":
            self.take()
            a = self.expr()
            self.take(":")
            return f"({a} if _truth({cond}) else {self.expr()})"
        return cond

    def binary(self, level: int) -> str:
        if level == len(BINARY):
            return self.unary()
        left = self.binary(level + 1)
        while self.peek() in BINARY[level]:
            op = self.take()
            left = f"_bin({op!r}, {left}, {self.binary(level + 1)})"
        return left

    def unary(self) -> str:
        if self.peek() in ("-", "!", "&"):
            op = self.take()
            operand = self.unary()
            return {"-": f"_neg({operand})", "!": f"int(not _truth({operand}))", "&": operand}[op]
        return self.postfix(self.primary())

    def postfix(self, value: str) -> str:
        while self.peek() in ("[", "."):
            if self.take() == "[":
                value = f"_at({value}, {self.expr()})"
                self.take("]")
            else:
                value = f"{value}.{self.take()}"
        return value

    def primary(self) -> str:
        tok = self.take()
        if tok == "(":
            if self.peek() in TYPES:  # a C cast: (long long)x
                kind = self.type_name()
                self.take(")")
                return f"_cast({kind!r}, {self.unary()})"
            inner = self.expr()
            self.take(")")
            return inner
        if _FLOAT.fullmatch(tok):
            return f"_float_lit({tok!r})"
        if tok[0].isdigit():
            return repr(int(tok.rstrip("uUL"), 0))
        if tok in ("true", "false"):  # C++ boolean literals (an empty mask folds to `false`)
            return "1" if tok == "true" else "0"
        name = tok
        if self.peek() == "::":
            self.take()
            name = f"{name}_{self.take()}"
        template = None
        if name in TEMPLATED and self.peek() == "<":
            self.take()
            words = []
            while self.peek() != ">":
                words.append(self.take())
            self.take(">")
            template = " ".join(words)
        if self.peek() == "(":
            self.take()
            args = []
            while self.peek() != ")":
                args.append(self.expr())
                if self.peek() == ",":
                    self.take()
            self.take(")")
            if name == "static_cast":
                return f"_cast({template!r}, {args[0]})"
            return f"_N.{name}({', '.join(args)})"
        return name if name not in NAMED_CONSTANTS else f"_N.{name}"

    def type_name(self) -> str:
        words = []
        while self.peek() in TYPES or self.peek().startswith("__nv") or self.peek() in ("__half",):
            words.append(self.take())
        while self.peek() == "*":
            self.take()
        return " ".join(w for w in words if w not in ("const", "static"))

    # -- statements -------------------------------------------------------------------------------
    def statement(self) -> None:
        tok = self.peek()
        if tok == "{":
            self.take()
            while self.peek() != "}":
                self.statement()
            self.take("}")
            self.emit("pass")
        elif tok == "for":
            self.for_loop()
        elif tok == "LN_GRID_STRIDE_LOOP":
            self.take(), self.take("(")
            var = self.take()
            self.take(",")
            bound = self.expr()
            self.take(")")
            self.emit(f"for {var} in _loop(range(int({bound})), {self.depth}):")
            self.body()
        elif tok == "if":
            self.take(), self.take("(")
            self.emit(f"if _truth({self.expr()}):")
            self.take(")")
            self.body()
        elif tok == "break":
            self.take(), self.take(";")
            self.emit("break")
        elif tok == "__syncthreads":  # each thread is a generator; the driver resumes them in lockstep
            self.take(), self.take("("), self.take(")"), self.take(";")
            self.emit("yield")
        elif tok == "__syncwarp":
            self.take(), self.take("("), self.take(")"), self.take(";")
            self.emit("yield WarpOp('syncwarp', ())")
        elif tok == "wmma":
            self.wmma()
        elif tok == "__shared__":
            self.take()
            if self.peek() == "__align__":
                self.take(), self.take("("), self.take(), self.take(")")
            kind = self.type_name()
            name, dims = self.take(), []
            while self.peek() == "[":
                self.take()
                dims.append(int(self.take()))
                self.take("]")
            self.take(";")
            dtype = "np.int64" if kind == "int" else "np.float32"  # int: an accumulator tile; the others hold exact values
            self.emit(f"{name} = _shared.setdefault({name!r}, np.zeros({tuple(dims)}, {dtype}))")
        elif tok in TYPES:
            self.declaration()
            self.take(";")
        else:
            self.simple()
            self.take(";")

    def wmma(self) -> None:
        """A fragment declaration (the warp's object) or a warp-collective call (a yield to the driver)."""
        self.take("wmma"), self.take("::")
        name = self.take()
        if name == "fragment":
            self.take("<")
            spec, words = [], []
            while self.peek() != ">":
                tok = self.take()
                if tok == ",":
                    spec.append(" ".join(words).replace(" :: ", "::"))
                    words = []
                else:
                    words.append(tok)
            spec.append(" ".join(words).replace(" :: ", "::"))
            self.take(">")
            var = self.take()
            self.take(";")
            self.emit(f"{var} = _fragment(_warp, {var!r}, {spec!r})")
            return
        self.take("(")
        args = []
        while self.peek() != ")":
            args.append(self.expr())
            if self.peek() == ",":
                self.take()
        self.take(")"), self.take(";")
        self.emit(f"yield WarpOp({name!r}, ({', '.join(args)},))")

    def body(self) -> None:
        self.depth += 1
        self.emit("pass")
        self.statement()
        self.depth -= 1

    def declaration(self) -> None:
        kind = self.type_name()
        while True:
            name = self.take()
            self.take("=")
            self.emit(f"{name} = _cast({kind!r}, {self.expr()})")
            if self.peek() != ",":
                return
            self.take(",")

    def simple(self) -> None:
        prefix = self.take() if self.peek() in ("++", "--") else None
        name, indices = self.take(), []
        while self.peek() == "[":
            self.take()
            indices.append(self.expr())
            self.take("]")
        target = name
        for index in indices:
            target = f"_at({target}, {index})"
        op = prefix or self.take()
        if op in ("++", "--"):
            self.emit(f"{target} = {target} {'+' if op == '++' else '-'} 1")
            return
        value = self.expr()
        if op in ("+=", "-="):
            value = f"_bin({op[0]!r}, {target}, {value})"
        if indices:
            self.emit(f"_store({name}, ({', '.join(indices)},), {value})")
        else:
            self.emit(f"{target} = _like({target}, {value})")

    def for_loop(self) -> None:
        self.take("for"), self.take("(")
        if self.peek() in TYPES:
            self.declaration()
        else:
            self.simple()
        self.take(";")
        cond = self.expr()
        self.take(";")
        saved = self.lines
        self.lines = []
        self.simple()
        step = self.lines[0].strip()
        self.lines = saved
        self.take(")")
        self.emit(f"while _truth({cond}):")  # `break` skips the step; `continue` is never generated
        self.depth += 1
        self.statement()
        self.emit(step)
        self.depth -= 1


# -- values with C semantics -----------------------------------------------------------------------------

def _truth(v) -> bool:
    return bool(v) and not (isinstance(v, (np.floating, float)) and math.isnan(v))


def _bin(op: str, a, b):
    if op in ("&&", "||"):
        return int(_truth(a) and _truth(b)) if op == "&&" else int(_truth(a) or _truth(b))
    integer = isinstance(a, int) and isinstance(b, int)
    if isinstance(a, (np.ndarray, Pointer)) and isinstance(b, int) and op == "+":  # a shared array's address + offset
        return Pointer(a, b) if isinstance(a, np.ndarray) else Pointer(a.array, a.offset + b)
    if op in ("<", "<=", ">", ">=", "==", "!="):
        return int({"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b, "!=": a != b}[op])
    if op in ("|", "^", "&", "<<", ">>"):  # integer operands only, as C requires
        if not integer or (op in ("<<", ">>") and not 0 <= b < 64):
            raise TypeError(f"C operator {op} on {a!r}, {b!r}")
        return {"|": a | b, "^": a ^ b, "&": a & b, "<<": a << b, ">>": a >> b}[op]
    if integer:
        if op == "/":  # C truncates toward zero
            return (abs(a) // abs(b)) * (1 if (a < 0) == (b < 0) else -1)
        if op == "%":
            return a - _bin("/", a, b) * b
        return {"+": a + b, "-": a - b, "*": a * b}[op]
    wide = isinstance(a, np.float64) or isinstance(b, np.float64)
    t = np.float64 if wide else np.float32
    a, b = t(a), t(b)
    with np.errstate(all="ignore"):
        return {"+": a + b, "-": a - b, "*": a * b, "/": a / b, "%": np.fmod(a, b)}[op]


def _neg(v):
    return -v


def _cast(kind: str, v):
    if kind in ("float",):
        return np.float32(v)
    if kind == "double":
        return np.float64(v)
    if kind in ("long long", "int", "signed char", "char"):
        if isinstance(v, (np.floating, float)):
            return int(np.trunc(v)) if np.isfinite(v) else 0
        bits = {"long long": 64, "int": 32, "signed char": 8, "char": 8}[kind]
        v = int(v) & ((1 << bits) - 1)
        return v - (1 << bits) if v >> (bits - 1) else v
    if kind == "unsigned int":
        return int(v) & 0xFFFFFFFF
    if kind == "unsigned long long":
        return int(v) & 0xFFFFFFFFFFFFFFFF
    return v  # storage classes (__nv_bfloat16 ...): the value itself


def _like(old, new):
    """An assignment keeps the variable's C type."""
    if isinstance(old, np.float32):
        return np.float32(new)
    if isinstance(old, np.float64):
        return np.float64(new)
    return _cast("long long", new) if isinstance(old, int) else new


def _float_lit(tok: str):
    single = tok.endswith("f") and not tok.startswith("0x") or (tok.startswith("0x") and tok.endswith("f"))
    text = tok[:-1] if single else tok
    value = float.fromhex(text) if text.startswith("0x") else float(text)
    return np.float32(value) if single else np.float64(value)


@dataclass
class Buffer:
    """A device buffer: stored values as float64 (exact for every storage format) and how loads type them."""

    values: np.ndarray
    integer: bool


def _at(buf, index: int):
    """buf[index] of a global Buffer (a typed scalar) or of a __shared__ array (a row or a float)."""
    size = buf.values.size if isinstance(buf, Buffer) else buf.shape[0]
    if not 0 <= index < size:
        raise IndexError(f"kernel read index {index} of a {size}-element array")
    if isinstance(buf, Buffer):
        v = buf.values[index]
        return int(v) if buf.integer else np.float32(v)
    v = buf[index]
    return int(v) if isinstance(v, np.integer) else v  # an int __shared__ tile's element is a C int


def _store(buf, indices: tuple, value) -> None:
    values = buf.values if isinstance(buf, Buffer) else buf
    if len(indices) != values.ndim or not all(0 <= i < n for i, n in zip(indices, values.shape)):
        raise IndexError(f"kernel wrote index {indices} of an array of shape {values.shape}")
    values[indices] = float(value)


def round_format(x: float, keep: int, min_normal: float, min_subnormal: float, max_finite: float,
                 overflow: float) -> float:
    """ln_round_format's specification: RNE to `keep` mantissa bits / the subnormal quantum, overflow."""
    if math.isnan(x):
        return x
    ax = abs(x)
    if ax < min_normal:
        r = round(ax / min_subnormal) * min_subnormal  # Python's round() is ties-to-even
    elif math.isinf(ax):
        r = ax
    else:
        m, e = math.frexp(ax)
        scale = 2.0 ** (e - 1 - keep)
        r = round(ax / scale) * scale
    return math.copysign(overflow if r > max_finite else r, x)


def _fp8(x, mode, fmt):
    return np.float32(round_to(np.float32(x), fmt, Overflow.SATURATE if mode == "sat" else Overflow.INF))


def _pow2_scale(ratio) -> np.float32:
    mantissa, exponent = math.frexp(float(ratio))
    return np.float32(2.0 ** max(-127, min(127, exponent - 1 if mantissa == 0.5 else exponent)))


# The intrinsics and helpers generated code calls, with their IEEE / CUDA meaning.
_N = types.SimpleNamespace(**{
    "__fadd_rn": lambda a, b: np.float32(a) + np.float32(b),
    "__fsub_rn": lambda a, b: np.float32(a) - np.float32(b),
    "__fmul_rn": lambda a, b: np.float32(a) * np.float32(b),
    "__fdiv_rn": lambda a, b: _bin("/", np.float32(a), np.float32(b)),
    "__frcp_rn": lambda a: _bin("/", np.float32(1), np.float32(a)),
    "__fsqrt_rn": lambda a: np.sqrt(np.float32(a)),
    "__fmaf_rn": lambda a, b, c: np.float32(np.float64(a) * np.float64(b) + np.float64(c)),
    "__dadd_rn": lambda a, b: np.float64(a) + np.float64(b),
    "__dsub_rn": lambda a, b: np.float64(a) - np.float64(b),
    "__dmul_rn": lambda a, b: np.float64(a) * np.float64(b),
    "fmodf": lambda a, b: np.fmod(np.float32(a), np.float32(b)),
    "exp2f": lambda a: np.exp2(np.float32(a)),
    "expf": lambda a: np.exp(np.float32(a)),
    "exp": lambda a: np.exp(np.float64(a)),
    "log2f": lambda a: np.log2(np.float32(a)),
    "sinf": lambda a: np.sin(np.float32(a)),
    "tanhf": lambda a: np.tanh(np.float32(a)),
    "erff": lambda a: np.float32(math.erf(float(a))),
    "fabsf": lambda a: np.abs(np.float32(a)),
    "fmax": lambda a, b: np.float64(max(a, b)),
    "fminf": lambda a, b: np.float32(b if np.isnan(a) else a if np.isnan(b) else min(a, b)),
    "fmaxf": lambda a, b: np.float32(b if np.isnan(a) else a if np.isnan(b) else max(a, b)),
    "rintf": lambda a: np.rint(np.float32(a)),
    "isfinite": lambda a: int(np.isfinite(a)),
    "min": min, "max": max,
    "ln_ceil_div": lambda a, b: -(-a // b),
    "__int2float_rn": np.float32, "__bfloat162float": np.float32, "__half2float": np.float32,
    "__float2bfloat16_rn": lambda x: np.float32(round_to(np.float32(x), BF16, Overflow.INF)),
    "__float2half_rn": lambda x: np.float32(round_to(np.float32(x), F16, Overflow.INF)),
    "__float2int_rn": lambda x: int(np.rint(x)),
    "__int_as_float": lambda b: np.array([b], np.uint32).view(np.float32)[0],
    "__ushort_as_half": lambda b: np.float32(np.array([b], np.uint16).view(np.float16)[0]),
    "__longlong_as_double": lambda b: np.array([b], np.uint64).view(np.float64)[0],
    "__NV_SATFINITE": "sat", "__NV_NOSAT": "nosat", "__NV_E4M3": F8E4M3, "__NV_E5M2": F8E5M2,
    "__nv_cvt_float_to_fp8": _fp8,
    "ln_fp8_from_bits": lambda v: v,
    "ln_sat_finite": lambda x, m: x if np.isnan(x) else type(x)(min(max(x, -m), m)),
    "ln_clamp_int": lambda x, lo, hi: min(max(x, lo), hi),
    "ln_round_format": lambda x, *p: np.float64(round_format(float(x), *(float(v) for v in p))),
    "ln_pow2_scale": _pow2_scale,
    "wmma___float_to_tf32": float_to_tf32, "wmma_mem_row_major": "mem_row_major",
    "LnMax_apply": lambda a, b: a if a != a else (b if (b != b or b > a) else a),
    "LnSum_apply": lambda a, b: a + b,
    "ln_block_reduce": lambda v, identity: v,  # one thread per block: the reduction is the value itself
})
NAMED_CONSTANTS = {"__NV_SATFINITE", "__NV_NOSAT", "__NV_E4M3", "__NV_E5M2", "wmma_mem_row_major"}


def entry_body(source: str, entry: str) -> tuple[list[str], str]:
    """(parameter names, body text) of `extern "C" __global__ void entry(...) { ... }`."""
    start = source.index(f"void {entry}(")
    params_end = source.index(")", start)
    params = [p.split()[-1] for p in source[start + len(entry) + 6:params_end].split(",") if p.strip()]
    open_brace = source.index("{", params_end)
    depth, pos = 0, open_brace
    while True:
        depth += {"{": 1, "}": -1}.get(source[pos], 0)
        if depth == 0:
            return params, source[open_brace:pos + 1]
        pos += 1


def compile_entry(source: str, entry: str):
    """A Python function f(sample=None, **buffers_and_dyn) running the entry single-threaded."""
    params, body = entry_body(source, entry)
    parser = _Parser(tokenize(body))
    parser.depth = 1
    parser.statement()
    code = "def _kernel(" + ", ".join(params) + ", blockIdx=_I, threadIdx=_I, blockDim=_D, gridDim=_D, " \
        "_shared=None, _sample=None, _warp=None):\n" + \
        "    def _loop(r, depth):\n        return r if _sample is None or depth != 1 else [x for x in _sample if x in r]\n" + \
        "\n".join(parser.lines) + "\n"
    scope = {"_N": _N, "_truth": _truth, "_bin": _bin, "_neg": _neg, "_cast": _cast, "_like": _like, "_at": _at,
             "_store": _store, "_float_lit": _float_lit, "np": np, "_I": Dim3(0, 0, 0), "_D": Dim3(1, 1, 1),
             "_fragment": fragment, "WarpOp": WarpOp}
    code = code.replace("_N.LN_DYN(", "_at(dyn_dims, ")
    exec(compile(code, f"<{entry}>", "exec"), scope)
    return scope["_kernel"], params


def eval_expr(c_expr: str, env: dict):
    """The value of one C expression (an index or a condition) with the given variables."""
    parser = _Parser(tokenize(c_expr))
    python = parser.expr().replace("_N.LN_DYN(", "_at(dyn_dims, ")
    if parser.i != len(parser.t):
        raise SyntaxError(f"trailing tokens in {c_expr!r}")
    scope = {"_N": _N, "_truth": _truth, "_bin": _bin, "_neg": _neg, "_cast": _cast, "_at": _at,
             "_float_lit": _float_lit, **env}
    return eval(python, scope)
