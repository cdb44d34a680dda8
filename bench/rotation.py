"""Hadamard rotation, SmoothQuant smoothing and GPTQ on SmolLM2 (issue 32): what W4 and FP8 W8A8 reach on pooled
teacher-forced positions with and without them.

SmolLM2 decode:8@64 (all 30 layers unless --layers), its search space with the rotation (`rot:`) and GPTQ
(`+gptq`) alternatives; per genome, one pooled judgement on >= --positions teacher-forced positions (the
compile's `positions` stage: windows over the 24 calibration prompts + FP64's continuation, every position fed
as a decode step) and the same metrics on the search's 24 calibration positions. GPTQ fills and smoothing scales use the
statistics the compile collects (compiler.reference_stage: every teacher-forced position of the calibration
prompts, the positions judged here, so a GPTQ row is in-sample). Genomes are
the storage recipes of search/recipes.py applied to every Gemm; "+ rotation" rotates every Gemm whose K an
offered block divides (all of SmolLM2's: K = 576 = 9 x 64, 1536 = 6 x 256) and stores its rotated weight in
the recipe's format; "+ smoothing" smooths every weight Gemm (search/rules/smooth.py: SmoothQuant a = 0.5, powers
of two, one s per activation), "+ AWQ smoothing" by AWQ's grid search for int4 g128, and stores its smoothed
weight in the recipe's format. "INT8 W8A8" rows run every weight Gemm as gemm:int8_channel (INT8 activations
scaled per token at run time x INT8 weights per output channel, INT32 sums) on weights stored int8_channel;
rows ending ", head W8A16 INT8" keep the output Gemm (the tied LM head) at INT8 per channel with a BF16 Gemm
(search/recipes.head_kept), as peers' 4-bit plans keep their head wider. Every row reports the stored bits per
Gemm weight (scales included, each stored buffer once) and the weights held wider than 4 bits. One CSV:
reports/bench/rotation.csv (--csv another name).

Mixed W4 plans (mixed_genomes): "sensitivity: ..." rows hold one role or one block of 5 layers at W4 g32 asym and
every other decoder Gemm at W8A16 INT8 (what that part alone costs); "Q4_K_M layers ..." is llama.cpp's layer choice
with 8 bits for its Q6_K; "ranked: ..." widens whole roles in the order the sensitivity run measured (RANKED).
They select Gemms by weight name (Wider, search/recipes.weights_kept), per layer where layers differ.

With --residual-rotation, the model's residual stream is rotated first (QuaRot: models/residual_rotation.py,
norms folded into the Gemms that read them, E Q, W Q, Q^T W, head untied): every genome runs on the rotated
model, judged against the SOURCE model's FP64 (positions and calibration batches alike), so the rotated
weights' FP32 rounding is counted; rows are named "... + residual rotation".

With --hessian-positions N, the statistics come instead from >= N teacher-forced positions over the 12
held-out prompts (error/hessians.positions_hessians, 32 rows a step; the judged positions are the calibration
prompts', so none of them calibrated the fill or the scales).

`python -m bench.rotation [--layers N] [--positions 2000] [--hessian-positions N] [--genomes NAME ...]
[--residual-rotation] [--memory GB] [--derived-cache GB] [--rows-per-step N] [--steps-together N]`
"""
from __future__ import annotations

import argparse
import math
import re
import tempfile
import time
from dataclasses import dataclass

import pandas as pd

from .llm_calibration import row_metrics
from .summary import write_csv

CSV = "rotation.csv"
WORKLOAD = "decode:8@64"
MEMORY = 5 << 30  # the memory plan the caches are sized from (as bench/llm_calibration.py) ...
DERIVED_CACHE = 3 << 30  # ... but the derived cache at least this (see rows())
W4 = frozenset({"store:int4_g128", "gemm:bf16"})
W4_GPTQ = frozenset({"store:int4_g128+gptq", "gemm:bf16"})
W4_G32 = frozenset({"store:int4_g32_asym", "gemm:bf16"})  # the g32 int4 the space offers: asymmetric (uint4 + zero)
W4_G32_GPTQ = frozenset({"store:int4_g32_asym+gptq", "gemm:bf16"})
W8A8 = frozenset({"store:f8e4m3_channel", "gemm:f8e4m3_channel_prologue"})
W8A8_GPTQ = frozenset({"store:f8e4m3_channel+gptq", "gemm:f8e4m3_channel_prologue"})
# INT8 W8A8 (SmoothQuant's, TensorRT-LLM int8 SmoothQuant, torch dynamic int8): activations INT8 per token at run
# time, weights INT8 per output channel, INT32 accumulation (dtypes/variants.py int8_channel)
INT8_W8A8 = frozenset({"store:int8_channel", "gemm:int8_channel"})
INT8_W8A8_GPTQ = frozenset({"store:int8_channel+gptq", "gemm:int8_channel"})
HEAD_W8A16 = frozenset({"store:int8_channel", "gemm:bf16"})  # the head kept at INT8 per channel, BF16 Gemm


@dataclass(frozen=True)
class Wider:
    """Some decoder Gemms held in `tags` instead of the row's recipe (search/recipes.weights_kept): those whose
    weight is one of `roles` (the name inside a layer, e.g. "mlp.down_proj"; None: every Gemm of the layer) in one
    of `layers` (None: every layer)."""

    tags: frozenset[str]
    roles: frozenset[str] | None = None
    layers: frozenset[int] | None = None

    def selects(self, weight: str) -> bool:
        m = _LAYER.fullmatch(weight)
        return m is not None and (self.layers is None or int(m["layer"]) in self.layers) \
            and (self.roles is None or m["role"] in self.roles)


_LAYER = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<role>.+)\.weight")


@dataclass(frozen=True)
class BenchGenome:
    """A row's plan: storage recipe `tags` on every Gemm, `transform` (None, "rot" or a smoothing variant of
    hlir/smoothing.SMOOTHINGS) on every Gemm the space may transform, the output Gemm (the LM head) set to
    `head` instead where given (search/recipes.head_kept), then the Gemms each of `wider` selects set to its
    tags (a mixed plan)."""

    tags: frozenset[str]
    transform: str | None = None
    head: frozenset[str] | None = None
    wider: tuple[Wider, ...] = ()

    @property
    def calibrated(self) -> bool:
        """Whether it needs the calibration statistics (GPTQ fills, smoothing scales)."""
        every = self.tags | (self.head or frozenset()) | frozenset(t for w in self.wider for t in w.tags)
        return any("+gptq" in t for t in every) or self.transform not in (None, "rot")


_HEAD = ", head W8A16 INT8"
GENOMES: dict[str, BenchGenome] = {
    "W4A16 INT4 g128 RTN": BenchGenome(W4),
    "W4A16 INT4 g128 + GPTQ": BenchGenome(W4_GPTQ),
    "W4A16 INT4 g128 + rotation": BenchGenome(W4, "rot"),
    "W4A16 INT4 g128 + rotation + GPTQ": BenchGenome(W4_GPTQ, "rot"),
    "FP8 W8A8 dynamic per-token RTN": BenchGenome(W8A8),
    "FP8 W8A8 dynamic per-token + rotation": BenchGenome(W8A8, "rot"),
    "FP8 W8A8 dynamic per-token + rotation + GPTQ": BenchGenome(W8A8_GPTQ, "rot"),
    "W4A16 INT4 g128 + smoothing": BenchGenome(W4, "sq50"),
    "W4A16 INT4 g128 + smoothing + GPTQ": BenchGenome(W4_GPTQ, "sq50"),
    "FP8 W8A8 dynamic per-token + smoothing": BenchGenome(W8A8, "sq50"),
    "FP8 W8A8 dynamic per-token + smoothing + GPTQ": BenchGenome(W8A8_GPTQ, "sq50"),
    "W4A16 INT4 g128 + AWQ smoothing": BenchGenome(W4, "awq_int4_g128"),
    "W4A16 INT4 g128 + AWQ smoothing + GPTQ": BenchGenome(W4_GPTQ, "awq_int4_g128"),
    "INT8 W8A8 dynamic per-token RTN": BenchGenome(INT8_W8A8),
    "INT8 W8A8 dynamic per-token + GPTQ": BenchGenome(INT8_W8A8_GPTQ),
    "INT8 W8A8 dynamic per-token + rotation": BenchGenome(INT8_W8A8, "rot"),
    "INT8 W8A8 dynamic per-token + rotation + GPTQ": BenchGenome(INT8_W8A8_GPTQ, "rot"),
    "INT8 W8A8 dynamic per-token + smoothing": BenchGenome(INT8_W8A8, "sq50"),
    "INT8 W8A8 dynamic per-token + smoothing + GPTQ": BenchGenome(INT8_W8A8_GPTQ, "sq50"),
    "INT8 W8A8 dynamic per-token + rotation + GPTQ" + _HEAD: BenchGenome(INT8_W8A8_GPTQ, "rot", HEAD_W8A16),
    "W4A16 INT4 g128 RTN" + _HEAD: BenchGenome(W4, None, HEAD_W8A16),
    "W4A16 INT4 g128 + rotation + GPTQ" + _HEAD: BenchGenome(W4_GPTQ, "rot", HEAD_W8A16),
    "W4A16 INT4 g128 + AWQ smoothing + GPTQ" + _HEAD: BenchGenome(W4_GPTQ, "awq_int4_g128", HEAD_W8A16),
    "W4A16 INT4 g32 asym RTN" + _HEAD: BenchGenome(W4_G32, None, HEAD_W8A16),
    "W4A16 INT4 g32 asym + rotation + GPTQ" + _HEAD: BenchGenome(W4_G32_GPTQ, "rot", HEAD_W8A16),
}


# -- mixed W4 plans (issue 32): mostly W4 g32 asym + rotation + GPTQ, some Gemms W8A16 INT8 + GPTQ -----------------
W8A16_GPTQ = frozenset({"store:int8_channel+gptq", "gemm:bf16"})
ROLES = {"q|k": frozenset({"self_attn.q_proj", "self_attn.k_proj"}), "v": frozenset({"self_attn.v_proj"}),
         "o": frozenset({"self_attn.o_proj"}), "gate|up": frozenset({"mlp.gate_proj", "mlp.up_proj"}),
         "down": frozenset({"mlp.down_proj"})}
LAYERS = 30  # SmolLM2's: the layer sets below are for it
BLOCKS = tuple(range(a, a + 5) for a in range(0, LAYERS, 5))


def use_more_bits(i: int, n: int = LAYERS) -> bool:
    """llama.cpp's Q4_K_M layer choice (src/llama-quant.cpp use_more_bits): attn_v and ffn_down of these layers
    are Q6_K, the rest Q4_K: the first and last eighth and every third layer between (14 of SmolLM2's 30)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


Q4_K_M_LAYERS = frozenset(i for i in range(LAYERS) if use_more_bits(i))
_REST8 = ", rest W8A16 INT8 + rotation + GPTQ" + _HEAD
_W4G32 = " W4 g32 asym + rotation + GPTQ"


def mixed_genomes() -> dict[str, BenchGenome]:
    """Sensitivity rows (one Gemm role, or one block of 5 layers, at W4 and every other decoder Gemm at W8A16 INT8,
    all rotated and GPTQ-filled, head INT8: what that part alone costs) and the mixed plans: llama.cpp's Q4_K_M
    layer choice with 8-bit in place of Q6_K, on g32 asym and on g128."""
    w4 = BenchGenome(W4_G32_GPTQ, "rot", HEAD_W8A16)
    out = {"W8A16 INT8 + rotation + GPTQ" + _HEAD: BenchGenome(W8A16_GPTQ, "rot", HEAD_W8A16)}
    out.update({f"sensitivity: {role}{_W4G32}{_REST8}":
                BenchGenome(W8A16_GPTQ, "rot", HEAD_W8A16, (Wider(W4_G32_GPTQ, roles),)) for role, roles in ROLES.items()})
    out.update({f"sensitivity: layers {b[0]}-{b[-1]}{_W4G32}{_REST8}":
                BenchGenome(W8A16_GPTQ, "rot", HEAD_W8A16, (Wider(W4_G32_GPTQ, None, frozenset(b)),)) for b in BLOCKS})
    q4km = Wider(W8A16_GPTQ, ROLES["v"] | ROLES["down"], Q4_K_M_LAYERS)
    out["Q4_K_M layers (attn_v, ffn_down W8A16 INT8 in 14 of 30)," + _W4G32 + _HEAD] = \
        BenchGenome(w4.tags, "rot", HEAD_W8A16, (q4km,))
    out["Q4_K_M layers (attn_v, ffn_down W8A16 INT8 in 14 of 30), W4 g128 + rotation + GPTQ" + _HEAD] = \
        BenchGenome(W4_GPTQ, "rot", HEAD_W8A16, (q4km,))
    for k in range(1, 5):
        roles = RANKED[:k]
        out[f"ranked: {', '.join(roles)} W8A16 INT8, rest{_W4G32}{_HEAD}"] = \
            BenchGenome(W4_G32_GPTQ, "rot", HEAD_W8A16, (Wider(W8A16_GPTQ, frozenset().union(*(ROLES[r] for r in roles))),))
    # the last block of layers (the most sensitive, by the same CSV) wholly 8-bit on top of the three roles
    three = Wider(W8A16_GPTQ, frozenset().union(*(ROLES[r] for r in RANKED[:3])))
    out[f"ranked: {', '.join(RANKED[:3])} W8A16 INT8 and layers 25-29 all, rest{_W4G32}{_HEAD}"] = \
        BenchGenome(W4_G32_GPTQ, "rot", HEAD_W8A16, (three, Wider(W8A16_GPTQ, None, frozenset(BLOCKS[-1]))))
    return out


# The roles by the KL that role alone at W4 adds per weight (reports/bench/rotation_w4_sensitivity.csv, 512 positions:
# down 6.1e-4 per M weights, gate|up 3.7e-4, o 3.7e-4, v 1.5e-4, q|k 1.4e-4; gate|up before o for its 5x larger
# absolute KL), the most sensitive first
RANKED = ("down", "gate|up", "o", "v", "q|k")
GENOMES.update(mixed_genomes())


def genome_of(space, g: BenchGenome):
    from luminal_num.search.recipes import head_kept, pick, rotated_recipe, smoothed_recipe, weights_kept
    if g.transform is None:
        genome = pick(space, g.tags.__contains__)
    elif g.transform == "rot":
        genome = rotated_recipe(space, g.tags)
    else:
        genome = smoothed_recipe(space, g.tags, g.transform)
    genome = genome if g.head is None else head_kept(space, genome, g.head)
    for w in g.wider:
        genome = weights_kept(space, genome, w.selects, w.tags)
    return genome


def gemm_weight_bits(program, weights) -> tuple[float, str]:
    """(stored bits per weight over every weight a Gemm reads, scales included, each stored buffer once; the
    weights wider than 4 bits, by format): a mixed plan's figures beside its name."""
    from luminal_num.quant.storage import storage_format
    bits, count, wide = 0.0, 0, {}
    for b in {k.inputs[1].buffer: program.kernel(k.inputs[1].buffer) for k in program.kernels if k.kind.is_gemm}.values():
        if not b.weight_sources or not all(s in weights for s in b.weight_sources):
            continue  # an activation, a KV cache, or H_b
        shape = tuple(int(d) for d in b.shape)
        fmt = storage_format(b.storage) if b.storage else storage_format("f32")
        n = math.prod(shape)
        bits += fmt.bits_per_weight(shape) * n
        count += n
        if fmt.element.bits > 4:
            wide.setdefault(fmt.name, []).extend(b.weight_sources)
    described = "; ".join(f"{f}: {', '.join(ws) if len(ws) <= 3 else f'{len(ws)} weights'}" for f, ws in wide.items())
    return bits / max(count, 1), described


def heldout_hessians(job, minimum: int, rows: int):
    """Calibration statistics from teacher-forced positions over the 12 held-out prompts (never the positions the
    genomes are judged on), `rows` windows a FP64 step, each position once (error/hessians.positions_hessians)."""
    from luminal_num.error.hessians import positions_hessians
    from luminal_num.models.llm import load_prompts
    from luminal_num.models.llm_positions import TeacherForcedWindows
    m = job.llm.model
    source = TeacherForcedWindows(m, job.llm.built, tuple(load_prompts("heldout", m.architecture.prompts)), minimum,
                                  cut=True)
    return positions_hessians(source, rows), source.positions


def rows(names, minimum: int, layers: int | None, hessian_positions: int = 0, memory_bytes: int = MEMORY,
         derived_cache: int = DERIVED_CACHE, done=lambda out: None, residual_rotation: bool = False,
         rows_per_step: int | None = None, steps_together: int | None = None) -> list[dict]:
    """The bench's rows; `done(rows so far)` after each genome (the CSV is written as they come: a run cut
    short keeps what it measured). `rows_per_step`/`steps_together`: the positions pass's (default the
    compile's POSITION_ROWS and pooled.STEPS_TOGETHER; fewer hold less memory)."""
    from luminal_num.compiler import POSITION_ROWS, WidenedPositions, reference_stage
    from luminal_num.search.space import Offers
    from luminal_num.error.budget import Budget
    from luminal_num.error.metrics import Compared
    from luminal_num.error.pooled import STEPS_TOGETHER, RowStats, judge_positions
    from luminal_num.error.reference import references
    from luminal_num.hlir.partition import partition
    from luminal_num.memory import plan_memory
    from luminal_num.models.registry import llm_job
    from luminal_num.quant.calibration import CALIBRATION, NO_HESSIANS
    from luminal_num.quant.stored import CONVERTED
    from luminal_num.hlir.weightcache import WEIGHTS
    from luminal_num.blas_threads import one_blas_thread
    from luminal_num.runtime.cpu import CpuRuntime
    from luminal_num.search.space import SearchSpace

    from luminal_num.models.llm import build_workload
    job = llm_job("smollm2", WORKLOAD, layers=layers, positions_minimum=minimum, residual_rotation=residual_rotation)
    rows_per_step = rows_per_step or POSITION_ROWS
    steps_together = steps_together or STEPS_TOGETHER
    suffix = " + residual rotation" if residual_rotation else ""
    budget = Budget.parse(job.default_budget)
    source = job.llm.positions
    out = []
    memory = plan_memory(job.graph.weights, memory_bytes, workers=1, rotation=True)
    print(memory.describe(), f"; derived cache at least {derived_cache >> 20} MB", flush=True)
    with one_blas_thread(), memory.applied(), tempfile.TemporaryDirectory() as converted, CONVERTED.on_disk(converted):
        # GPTQ fills evicted from the in-memory caches are read back from disk, not filled again (a compile keeps
        # them beside its verdict cache the same way); the rotated weights (FP32, one per weight) and what is
        # derived from them need about twice the derived cache the memory plan gives a model without them
        WEIGHTS.resize(max(WEIGHTS.budget_bytes, derived_cache))
        t0 = time.perf_counter()
        made = source.positions
        out.append({"what": "make windows", "positions": made, "seconds": time.perf_counter() - t0})
        t0 = time.perf_counter()
        space = SearchSpace.saturated(job.graph, partition(job.graph), calibrated=True, rotation=True, smoothing=True)
        out.append({"what": "saturate (rotation + smoothing + GPTQ offered)", "seconds": time.perf_counter() - t0})
        # the judge is the source model's FP64 (a rotated model's own graph in FP64 would hide its weights' rounding)
        source_graph = build_workload(job.llm.model.reference, job.llm.workload).graph if residual_rotation else job.graph
        refs = [r.outputs(source_graph)["logits"] for r in references(source_graph, job.calibration,
                                                                         partition(source_graph))]
        needs = any(GENOMES[n].calibrated for n in names)
        hessians, hessian_rows = NO_HESSIANS, 0
        if needs:  # GPTQ fills and smoothing scales need the calibration statistics
            t0 = time.perf_counter()
            if hessian_positions:
                hessians, made = heldout_hessians(job, hessian_positions, POSITION_ROWS)
                what = "held-out statistics"
            else:
                hessians, made = reference_stage(job.graph, job.calibration, space, source).hessians, source.positions
                what = "statistics (the compile's: calibration positions)"
            hessian_rows = next(iter(hessians.by_weight.values())).rows
            out.append({"what": what, "positions": made, "seconds": time.perf_counter() - t0})
        wide = WidenedPositions(space, source, rows_per_step, Offers(calibrated=True, rotation=True, smoothing=True))
        with CALIBRATION.installed(hessians):
            for name in names:
                bench = GENOMES[name]
                genome = genome_of(space, bench)
                program = space.program(genome)
                runtime = CpuRuntime(program, job.graph.weights)
                batch_rows = RowStats.concat([RowStats.of(Compared(runtime.run(b).outputs["logits"], ref))
                                              for b, ref in zip(job.calibration, refs)])
                del runtime
                t0 = time.perf_counter()
                run, on = wide.program(genome, program)
                verdict, stats = judge_positions(run, on.graph.weights, on, budget, budget, steps_together)
                row = {"what": name + suffix, "residual_rotation": residual_rotation, "positions": stats.rows,
                       "rows_per_run": on.rows,
                       "hessian_rows": hessian_rows if bench.calibrated else 0,
                       "statistics": ("held-out" if hessian_positions else "calibration positions")
                       if bench.calibrated else "",
                       "seconds": time.perf_counter() - t0, "passes_budget": verdict.passed,
                       "rotated_gemms": sum(1 for k in program.kernels if k.rotation is not None and k.rotation.source),
                       "hadamard_gemms": sum(1 for k in program.kernels if k.kind.is_gemm and _reads_hadamard(program, k)),
                       "smoothed_gemms": sum(1 for k in program.kernels if k.smoothing is not None and k.smoothing.source),
                       "gemms": sum(1 for k in program.kernels if k.kind.is_gemm)}
                row["gemm_weight_bits"], row["gemm_weights_wider_than_4bit"] = gemm_weight_bits(program,
                                                                                              job.graph.weights)
                row.update(row_metrics(stats, batch_rows))
                out.append(row)
                print(row, flush=True)
                done(out)
    return out


def _reads_hadamard(program, k) -> bool:
    b = program.kernel(k.inputs[1].buffer)
    return b.rotation is not None and b.rotation.source is None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--genomes", nargs="*", default=list(GENOMES)[:6], choices=list(GENOMES))
    ap.add_argument("--positions", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=None, help="the first N layers only (a quick look; default all 30)")
    ap.add_argument("--hessian-positions", type=int, default=0,
                    help="GPTQ's Hessians and smoothing's channel max from at least N teacher-forced positions over the "
                         "held-out prompts (default 0: the compile's, every calibration position)")
    ap.add_argument("--memory", type=float, default=MEMORY / 2 ** 30, help="GB the caches are planned for")
    ap.add_argument("--derived-cache", type=float, default=DERIVED_CACHE / 2 ** 30, help="GB, the derived cache's floor")
    ap.add_argument("--residual-rotation", action="store_true",
                    help="rotate the model's residual stream first (QuaRot, models/residual_rotation.py)")
    ap.add_argument("--rows-per-step", type=int, default=None, help="positions: decode rows a step (default 32)")
    ap.add_argument("--steps-together", type=int, default=None, help="positions: steps run together (default 4)")
    ap.add_argument("--csv", default=CSV)
    args = ap.parse_args(argv)
    made = rows(args.genomes, args.positions, args.layers, args.hessian_positions, int(args.memory * 2 ** 30),
                int(args.derived_cache * 2 ** 30), lambda out: write_csv(pd.DataFrame(out), args.csv),
                args.residual_rotation, args.rows_per_step, args.steps_together)
    path = write_csv(pd.DataFrame(made), args.csv)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
