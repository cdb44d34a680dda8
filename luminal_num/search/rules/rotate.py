"""`rotate`: a Gemm x W^T with its K dimension rotated by a Hadamard matrix (issue 32), one knob per Gemm.

x W^T = (x H)(W H)^T for any orthogonal H (H H^T = I); hlir/rotation.py builds H block diagonal from the
normalized Sylvester matrix H_b. The rotated form is two Gemms: x H (an FP32 Gemm reading H_b, batched over
the K/b blocks) and (x H) times the weight rotated offline (KRotW, FP64 then rounded as its kernel holds
it). Both are ordinary f32 Gemms, so the precision phase gives them every variant and the rotated weight
every storage format, chosen per layer with the rest of the genome. The alias KRotated carries the choice
(tag "rot:hadamard<b>"); the views and layouts come from search/encode.py (RotationOf), which offers the
rotation only for a weight read K-major by an FP32 Gemm whose K the block divides.
"""
from __future__ import annotations

from egglog import eq, i64, rule, ruleset, union, vars_

from ...hlir.rotation import ROTATION_BLOCKS, Rotation
from .. import egraph as E

rotate = ruleset(name="rotate")

t, x, w = vars_("t x w", E.T)
vx, vy, lay, slot, var_, vbr, layr, vam = vars_("vx vy lay slot var_ vbr layr vam", i64)


@rotate.register
def _rotate_k():
    for b in ROTATION_BLOCKS:
        # sound: (x H_blk)(W H_blk)^T = x H_blk H_blk^T W^T = x W^T, H_blk orthogonal (block diagonal of H_b);
        # the two Gemms and the rotated weight differ from it by their roundings only (static bounds)
        x_rot = E.KGemm(x, var_, E.CTOR["KHadamard"](b), vbr, layr, "f32", "f32")
        rotated = E.KGemm(x_rot, vam, E.CTOR["KRotW"](slot, b), vy, lay, "f32", "f32")
        yield rule(eq(t).to(E.KGemm(x, vx, w, vy, lay, "f32", "f32")), eq(w).to(E.KExt(slot, "f32")), E.MatrixWeight(w),
                   E.RotationOf(vx, vy, lay, b, var_, vbr, layr, vam)).then(
            union(t).with_(E.CTOR["KRotated"](rotated, Rotation(b).tag_variant)),
            E.IsWeight(E.CTOR["KRotW"](slot, b)))  # a compile-time value: static weight scales apply
