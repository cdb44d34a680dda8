"""A precision tag, `kind:variant` ("gemm:bf16", "store:int8_channel"), as one type.

Genomes, plans and reports hold tags as their text (plan.json and the reports' bytes stay the text); every
reading of a tag's parts goes through `Tag.parse`, so the ":" format is known here only (a test greps the
package for other splits). Each kind names the one registry its variants are declared in.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping

from ..codegen.attention import ATTENTION_VARIANTS
from ..dtypes.formats import FORMATS
from ..dtypes.variants import ELEMENTWISE_VARIANTS, GEMM_VARIANTS, REDUCE_VARIANTS
from ..hlir.rotation import ROTATIONS
from ..hlir.smoothing import SMOOTHINGS
from ..quant.storage import STORAGE_FORMATS
from ..quant.stored import STORE_CHOICES


class TagKind(enum.StrEnum):
    """What a knob chooses: a Gemm's math, a value's storage (elementwise or reduction), a softmax's or an
    attention kernel's precision, a weight's or the KV cache's storage format, a Gemm's K rotation or smoothing."""
    GEMM = "gemm"
    ATTN = "attn"
    SUM = "sum"
    SOFTMAX = "softmax"
    EW = "ew"
    STORE = "store"
    KV = "kv"
    ROT = "rot"
    SMOOTH = "smooth"


# kind -> the registry its variant names are declared in (softmax precisions are plain number formats)
REGISTRIES: Mapping[TagKind, Mapping] = {
    TagKind.GEMM: GEMM_VARIANTS, TagKind.ATTN: ATTENTION_VARIANTS, TagKind.SUM: REDUCE_VARIANTS,
    TagKind.SOFTMAX: FORMATS, TagKind.EW: ELEMENTWISE_VARIANTS, TagKind.STORE: STORE_CHOICES,
    TagKind.KV: STORAGE_FORMATS, TagKind.ROT: ROTATIONS, TagKind.SMOOTH: SMOOTHINGS,
}

# the order single changes are tried and sorted in: Gemms first (where the time goes), attention (one
# launch for four), reductions, softmax, elementwise storage; any other kind after these
KIND_PRIORITY: Mapping[str, float] = {TagKind.GEMM: 0, TagKind.ATTN: 0.5, TagKind.SUM: 1, TagKind.SOFTMAX: 2,
                                      TagKind.EW: 3}
OTHER_PRIORITY = 4


@dataclass(frozen=True, order=True)
class Tag:
    kind: str
    variant: str

    @classmethod
    def parse(cls, text: str) -> "Tag":
        """The tag `text` names; one without a kind is refused (FP32, BASE, is not a tag of a kind)."""
        kind, sep, variant = text.partition(":")
        if not sep:
            raise ValueError(f"precision tag {text!r} has no kind (expected kind:variant)")
        return cls(kind, variant)

    def __str__(self) -> str:
        return f"{self.kind}:{self.variant}"

    def spec(self):
        """The declared variant this tag names, from its kind's registry."""
        return REGISTRIES[TagKind(self.kind)][self.variant]


def kind_of(text: str) -> str:
    return Tag.parse(text).kind


def is_kind(text: str, kind: TagKind) -> bool:
    """Whether `text` is a tag of `kind` (FP32, the BASE choice, is of none)."""
    return text.partition(":")[0] == kind and ":" in text


def priority(text: str) -> float:
    """Where a tag's kind sorts among single changes (KIND_PRIORITY)."""
    return KIND_PRIORITY.get(kind_of(text), OTHER_PRIORITY)
