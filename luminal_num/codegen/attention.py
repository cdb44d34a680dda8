"""The fused attention kernel (KernelKind.ATTENTION), declared once: its variants, its launch
parameters, its LLIR shape check and flop count. Backends (runtime/cpu_attention.py,
codegen/cuda_attention.py, error/attention_bound.py) read these; nothing here imports llir.

What the kernel computes, per score row a (every index of the score tensor but the key axis):
  s[a, j]  = fl(fl(dot(q[a, j, :], k[a, j, :])) * scale) + bias[a, j]     (dot: sequential FP32, no FMA)
  out[a, c] = sum_j softmax_j(s[a, :]) * v[a, c, j]
with q, k read over the Q K^T Mul's full shape (score shape + (D,)), bias over the score shape and v
over the P V Mul's full shape (score shape[:-1] + (Dv, T)), each through its own strided view, so GQA
(K/V stride 0 along a query group) and the KV cache (a view of the scattered buffer) need nothing
special. The softmax is online over key tiles of KEY_TILE keys (FP32 running max m and sum l, the
output rescaled per tile by exp(m_old - m_new)); a decode kernel (one query per head) splits the keys
into `splits` contiguous ranges, each with its own (m, l, o), combined at the end (flash decoding).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..dtypes.formats import BF16, F16, F32, Format
from ..hlir.symbolic import Dim, evaluate, prod

KEY_TILE = 16        # keys per online-softmax step (the CUDA kernel's tile; the emulation's too)
DECODE_SPLITS = 4    # key ranges of a one-query (decode) kernel, combined at the end
# a batch-invariant plan's decode kernels split the keys into ranges of this many keys (a fixed split SIZE,
# not a count): a key's range, and so its row's order of operations, is the same whatever the KV length
INVARIANT_SPLIT_KEYS = 64


@dataclass(frozen=True)
class AttentionVariant:
    """Operand formats of the fused kernel: Q and K rounded to `qk` before the FP32 dot, P (the
    unnormalised weights) and V rounded to `pv` before the FP32 P V accumulation; the softmax itself
    (max, exp, running sums) is FP32. `gemm` names the Gemm variant with the same operand rounding
    and accumulation (the unfused Gemm it replaces; its a-priori bound is the dot's)."""

    name: str
    qk: Format
    pv: Format
    gemm: str


ATTENTION_VARIANTS: dict[str, AttentionVariant] = {v.name: v for v in (
    AttentionVariant("flash_f32", F32, F32, "f32"),
    AttentionVariant("flash_bf16", BF16, BF16, "bf16"),
    AttentionVariant("flash_f16", F16, F16, "f16"),
)}
# the attention tag that keeps the precision of each unfused (Q K^T Gemm, P V Gemm) tag pair
ATTENTION_OF_GEMM = {v.gemm: v.name for v in ATTENTION_VARIANTS.values()}


@dataclass(frozen=True)
class AttentionSpec:
    """Launch parameters of one attention kernel (Kernel.value): the score scale, the key tile and
    the number of key splits (1 = one online pass; > 1 = flash decoding). `split_keys` > 0: each split
    covers that many keys (whole tiles) from key 0 on, the last split the rest, and `splits` is the count
    for the kernel's key length (a batch-invariant plan: ranges do not move with the KV length); 0: the
    tiles are dealt into `splits` equal runs."""

    scale: float
    key_tile: int = KEY_TILE
    splits: int = 1
    split_keys: int = 0

    def __post_init__(self):
        if self.split_keys and self.split_keys % self.key_tile:
            raise ValueError(f"split_keys {self.split_keys} is not a whole number of {self.key_tile}-key tiles")


def splits_for(queries: Dim) -> int:
    """Flash decoding when a head has one query (a decode step): its keys need the parallelism."""
    return DECODE_SPLITS if queries == 1 else 1


def spec_for(scale: float, queries: Dim, keys: Dim, batch_invariant: bool = False) -> AttentionSpec:
    """The launch parameters of one attention kernel. A batch-invariant decode kernel splits at fixed
    INVARIANT_SPLIT_KEYS boundaries (ceil(keys / that) splits for a known key length; one pass over all
    keys when the length is symbolic: also an order that no KV length changes)."""
    if not batch_invariant or queries != 1:
        return AttentionSpec(scale=scale, splits=splits_for(queries))
    if not isinstance(keys, int):
        return AttentionSpec(scale=scale, splits=1)
    return AttentionSpec(scale=scale, splits=max(1, -(-keys // INVARIANT_SPLIT_KEYS)), split_keys=INVARIANT_SPLIT_KEYS)


def key_ranges(t: int, spec: AttentionSpec) -> list[list[tuple[int, int]]]:
    """Per split, its key tiles as [start, stop): tiles dealt out in contiguous runs of whole tiles."""
    tiles = [(s, min(s + spec.key_tile, t)) for s in range(0, t, spec.key_tile)]
    if spec.split_keys:  # fixed ranges from key 0: as many as the keys need
        per = spec.split_keys // spec.key_tile
        return [tiles[i:i + per] for i in range(0, len(tiles), per)] or [[]]
    per = -(-len(tiles) // spec.splits) if tiles else 0
    return [tiles[i * per:(i + 1) * per] for i in range(spec.splits)]


def score_shape(k) -> tuple:
    """The score tensor's shape: the bias input's view shape."""
    return tuple(k.inputs[2].view.shape)


def check_attention(k) -> str:
    """The LLIR shape rule of an ATTENTION kernel (llir.verify)."""
    if len(k.inputs) != 4:
        return f"has {len(k.inputs)} inputs, attention takes (q, k, bias, v)"
    if k.precision not in ATTENTION_VARIANTS or not isinstance(k.value, AttentionSpec):
        return f"needs an attention variant and spec, has {k.precision!r} / {k.value!r}"
    s = score_shape(k)
    q, kk, v = (tuple(k.inputs[i].view.shape) for i in (0, 1, 3))
    if len(s) < 2 or q != kk or q[:-1] != s:
        return f"q {q} / k {kk} are not read over the score shape {s} + (D,)"
    if len(v) != len(s) + 1 or v[:-2] != s[:-1] or v[-1] != s[-1]:
        return f"v {v} is not read over {s[:-1]} + (Dv, {s[-1]})"
    if tuple(k.shape) != s[:-1] + (v[-2],):
        return f"shape {k.shape} is not {s[:-1] + (v[-2],)}"
    return ""


def attention_flops(k, bindings) -> int:
    """2 D per score (the dot), 2 Dv per score (P V), about 6 per score for the online softmax."""
    s = score_shape(k)
    n = evaluate(prod(s), bindings)
    d = evaluate(k.inputs[0].view.shape[-1], bindings)
    dv = evaluate(k.inputs[3].view.shape[-2], bindings)
    return int(n * (2 * d + 2 * dv + 6))


def attention_row(k) -> dict:
    """What the plan's op table says of an attention kernel (search/plan.py)."""
    v, spec = ATTENTION_VARIANTS[k.precision], k.value
    return {"accumulator": "f32 (online softmax)", "quant": f"QK:{v.qk.name} PV:{v.pv.name}",
            "scales": f"key tile {spec.key_tile}, {spec.splits} split(s)"
                      + (f" of {spec.split_keys} keys" if spec.split_keys else "")}
