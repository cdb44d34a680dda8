"""Mixed W4 plans (issue 32): search/recipes.weights_kept holds exactly the Gemms whose weights it selects at the
stated wider format, per layer where the selection differs between layers, and nothing else.

Truths used: the graph's own weight names (which Gemm reads which weight, read back from the lowered program's
stored buffers, not from the e-classes the recipe set); the FP64 evaluation of the graph with the static bound's
soundness check (bound_checks) for a mixed plan.
"""
from __future__ import annotations

import re
import warnings

import pytest

from luminal_num.models.llama import LLAMA_TINY
from luminal_num.quant.calibration import CALIBRATION
from luminal_num.search.recipes import head_kept, pick, rotated_recipe, weights_kept
from luminal_num.search.space import ChunkSite
from tiny_llama import llama_with_hessians
from bound_checks import assert_plan_bounded

warnings.filterwarnings("ignore", category=RuntimeWarning)
CFG = LLAMA_TINY.with_layers(2)
W4_G32_GPTQ = frozenset({"store:int4_g32_asym+gptq", "gemm:bf16"})
W4 = frozenset({"store:int4_g128", "gemm:bf16"})
W8_GPTQ = frozenset({"store:int8_channel+gptq", "gemm:bf16"})
W8 = frozenset({"store:int8_channel", "gemm:bf16"})
HEAD = frozenset({"store:int8_channel", "gemm:bf16"})
LAYER = re.compile(r"layers\.(\d+)\.")


def _llama(seq: int = 6):
    return llama_with_hessians(CFG, seq)


def _held(program, weights) -> dict[str, set[tuple[str, str, bool]]]:
    """Weight name -> {(storage choice, Gemm precision, rotated)} over every Gemm reading it (a fused Gemm's
    concatenated B counts for each of its parts)."""
    out: dict[str, set] = {}
    for k in program.kernels:
        if k.kind.is_gemm:
            b = program.kernel(k.inputs[1].buffer)
            if b.weight_sources and all(s in weights for s in b.weight_sources):
                choice = (b.storage or "f32") + (f"+{b.fill}" if b.fill else "")
                for s in b.weight_sources:
                    out.setdefault(s, set()).add((choice, k.precision, b.rotation is not None))
    return out


def _q4_k_m_like(name: str) -> bool:
    """attn_v everywhere and ffn_down in the second layer only (a per-layer choice inside one group)."""
    layer = LAYER.search(name)
    return "v_proj" in name or ("down_proj" in name and layer is not None and layer.group(1) == "1")


@pytest.mark.parametrize("rotated", [True, False])
def test_weights_kept_holds_exactly_the_selected_gemms_wider(rotated):
    m, space, batches, hs = _llama()
    tags, wide = (W4_G32_GPTQ, W8_GPTQ) if rotated else (W4, W8)
    base = head_kept(space, rotated_recipe(space, tags) if rotated else pick(space, tags.__contains__), HEAD)
    genome = weights_kept(space, base, _q4_k_m_like, wide)
    with CALIBRATION.installed(hs):
        program = space.program(genome)
    held = _held(program, m.graph.weights)
    narrow = next(t for t in tags if t.startswith("store:")).removeprefix("store:")
    wider = next(t for t in wide if t.startswith("store:")).removeprefix("store:")
    gemm_weights = {n for n, w in m.graph.weights.items() if n.endswith("proj.weight")} | {"lm_head.weight"}
    assert set(held) == gemm_weights
    for name, h in held.items():
        want = "int8_channel" if name == "lm_head.weight" else wider if _q4_k_m_like(name) else narrow
        assert h == {(want, "bf16", rotated)}, name
    # both layers share one group; only layer 1's down_proj differs, so that alone is a chunk's own change
    sites = {s for s, _, _ in genome if isinstance(s, ChunkSite)}
    assert len(sites) == 1
    # the mixed plan still runs within its static bound of FP64
    batch = batches[0]
    assert_plan_bounded(program, m.graph, batch, hs)


def test_weights_kept_of_a_whole_layer_and_of_nothing():
    m, space, _, hs = _llama()
    base = head_kept(space, rotated_recipe(space, W4_G32_GPTQ), HEAD)
    genome = weights_kept(space, base, lambda n: n.startswith("model.layers.0."), W8_GPTQ)
    with CALIBRATION.installed(hs):
        held = _held(space.program(genome), m.graph.weights)
    for name, h in held.items():
        want = ("int8_channel" if name == "lm_head.weight" else "int8_channel+gptq" if "layers.0." in name
                else "int4_g32_asym+gptq")
        assert h == {(want, "bf16", True)}, name
    # a role everywhere, then one whole layer on top (the bench's "... and layers 25-29 all")
    both = weights_kept(space, weights_kept(space, base, lambda n: "o_proj" in n, W8_GPTQ),
                        lambda n: n.startswith("model.layers.1."), W8_GPTQ)
    with CALIBRATION.installed(hs):
        held = _held(space.program(both), m.graph.weights)
    for name, h in held.items():
        want = ("int8_channel" if name == "lm_head.weight" else "int8_channel+gptq"
                if "layers.1." in name or "o_proj" in name else "int4_g32_asym+gptq")
        assert h == {(want, "bf16", True)}, name
    with pytest.raises(ValueError, match="no Gemm reads a weight the selection accepts"):
        weights_kept(space, base, lambda n: False, W8_GPTQ)


def test_the_bench_selects_llama_cpp_q4_k_m_layers_and_roles_by_weight_name():
    from bench.rotation import Q4_K_M_LAYERS, ROLES, Wider
    # llama.cpp use_more_bits for 30 layers, by hand: i < 3, i >= 26, and (i - 3) % 3 == 2
    assert Q4_K_M_LAYERS == {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
    w = Wider(W8_GPTQ, ROLES["v"] | ROLES["down"], Q4_K_M_LAYERS)
    assert w.selects("model.layers.5.self_attn.v_proj.weight") and w.selects("model.layers.29.mlp.down_proj.weight")
    assert not w.selects("model.layers.4.mlp.down_proj.weight")
    assert not w.selects("model.layers.5.self_attn.k_proj.weight")
    assert not w.selects("model.embed_tokens.weight") and not w.selects("model.layers.5.input_layernorm.bias")
    assert Wider(W8_GPTQ).selects("model.layers.12.mlp.up_proj.weight")
