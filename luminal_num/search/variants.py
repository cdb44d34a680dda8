"""How the search ranks a knob's variants before it measures any: speed classes on the target (a Gemm's math
peak, a storage's bits per element), each class ordered by a-priori accuracy. The sensitivity phase walks the
classes fastest first and tries only each class's most accurate variant (the others cost the same)."""
from __future__ import annotations

from ..quant.stored import CalibratedChoice
from ..runtime.targets import OPERAND_MATH, gemm_math, get_target
from .tags import Tag, TagKind


def variant_classes(tags, target: str) -> list[list[str]]:
    """Non-FP32 tags grouped by speed (fastest first), each group ordered most accurate first.

    Speed: a Gemm variant's math peak on the target; a storage variant's bytes per element.
    Accuracy: the variant's a-priori bound (Gemms) or its unit roundoffs (storage, accumulators). A format
    filled by a calibrated rounding (GPTQ) costs what the format costs but has no a-priori order against its
    round-to-nearest (each wins on some layers: only measuring tells): it forms its own class right after.
    """
    t = get_target(target)
    t = get_target("h200") if t.measured_only else t

    def key(text: str) -> tuple[float, float]:
        tag = Tag.parse(text)
        kind = tag.kind
        if kind == TagKind.GEMM:
            v = tag.spec()
            math, tc = gemm_math(v)
            peak = (t.tensor_cores if tc else t.cuda_cores).rate(math) or 0.0
            return -peak, float(v.a_priori_bound(1024, 1024.0, 1.0, 1.0))
        if kind == TagKind.EW:
            p = tag.spec()
            return p.storage.bits, p.storage.unit_roundoff + p.compute.unit_roundoff
        if kind == TagKind.SUM:
            p = tag.spec()
            return p.storage.bits, p.storage.unit_roundoff + p.acc.unit_roundoff
        if kind == TagKind.ATTN:  # one kernel for four: ahead of every unfused class, then by its operand math
            v = tag.spec()
            math_, tc = OPERAND_MATH[v.qk.name]
            return -1e20 - ((t.tensor_cores if tc else t.cuda_cores).rate(math_) or 0.0), v.qk.unit_roundoff
        if kind in (TagKind.STORE, TagKind.KV):  # a weight's (or KV cache's) storage: bits per element, element error
            f = tag.spec()
            if isinstance(f, CalibratedChoice):  # no a-priori order against round-to-nearest: its own class, next
                return (f.nominal_bits_per_weight, 1), sum(f.fmt.element_error(1.0))
            return f.nominal_bits_per_weight, sum(f.element_error(1.0))
        return 0.0, 0.0

    def speed(text: str) -> tuple[float, int]:
        s = key(text)[0]
        return s if isinstance(s, tuple) else (s, 0)
    groups: dict[tuple[float, int], list[str]] = {}
    for tag in tags:
        if tag != "f32":
            groups.setdefault(speed(tag), []).append(tag)
    # equal math and accuracy: the variant that quantizes A in its own prologue (one launch fewer) first
    return [sorted(groups[s], key=lambda tg: (key(tg)[1], not _in_prologue(tg), tg)) for s in sorted(groups)]


def _in_prologue(tag: str) -> bool:
    t = Tag.parse(tag)
    return t.kind == TagKind.GEMM and t.spec().a_prologue
