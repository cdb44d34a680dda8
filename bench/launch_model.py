"""SmolLM2 decode per genome: kernels and modelled H200 latency with the old and the new launch constants,
and as one megakernel (issue 33).

The old constants (targets.LEGACY_LAUNCH): 1 us per CUDA graph node, no minimum kernel time, no wave
quantization. The new (targets.PUBLISHED_HOPPER_LAUNCH): 1.3 us per node (Hazy Research, H100), a 1.0 us
minimum kernel time (sglang #24733, H100) and wave quantization of each kernel's tiles over the 132 SMs
(codegen/blockops.py). The megakernel column is runtime/megakernel_cost.py: the same work queue's tiles
on the SMs, barrier waits along the critical path, one launch, pricing the bodies the device megakernel
runs (a Gemm over a stored weight its dequantize-on-load body, every other Gemm its tiled body:
runtime/cuda_megakernel.py). `floor_us` is the plan's bytes (weights at their stored bytes) / 4.8 TB/s
(the published bandwidth). `critical_hops` is the number of tiles on the longest barrier chain; `overhead_share` the part of the
critical path that per-tile overheads are. The megakernel model charges what its loop does (see
runtime/megakernel_cost.py): a Gemm tile streams its own weight rows from when its SM pops it, before its
barrier wait (codegen/weight_stream.py; `weight_streamed_share` is the streamed share of the step's
bytes), an attention tile streams the KV-cache rows it reads, less the rows this step's scatter writes, the
same way (codegen/cache_stream.py; `cache_streamed_share`), and a one-row norm read only by a GEMV is
recomputed by that GEMV's tiles (no tiles or hop of its own: codegen/megakernel.py). Its per-tile overheads are ASSUMPTIONS, round trips of round published
H100 latencies (L2 200 cycles, DRAM 400 cycles at 1755 MHz), not measurements: pre-wait the queue pop and
the first DRAM load, post-wait the counter acquire and the signal's fence (megakernel_cost.PRE_WAIT_S,
POST_WAIT_S; a tile streaming nothing pops before its wait and pays the rest of TILE_OVERHEAD_S after it). `chosen_form`: the launch form the search records
(runtime/launch_form.py), `chosen_us` its price. The step is a SmolLM2-135M-shaped decode (bench/storage_decode.py's config, random
weights: the model reads shapes), one sequence, fusion on, each genome of bench/fusion.py.
A Gemm that scales an operand itself (FP8 W8A8) runs its per-step scale launches before its body, as the loop
does (codegen/megakernel.py QueueOp.prologue), and the model schedules their tiles; a weight's static scales are
no step work (written once at load), and a GEMV's A scales are computed by each body tile (priced in its time). Writes
reports/bench/launch_model.csv, and reports/bench/launch_model_breakdown.csv: per genome, where the megakernel's
time goes (breakdown_row: the SMs' busy time per block kind over the SMs, `scale` the Gemms' scale launches;
`idle_us` the SM time spent holding a tile that waits on its barrier, or past the queue's end; the critical
path and its per-tile overheads, and per block kind its tiles on that path, the microseconds the path grew by at
them and the per-tile overhead among those: `critical_<kind>_hops`, `_us`, `_overhead_us`).
"""
from __future__ import annotations

import argparse
import time

import pandas as pd

from luminal_num.runtime.latency import kernel_works, modelled_latency
from luminal_num.runtime.targets import LEGACY_LAUNCH, get_target
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace
from .fusion import GENOMES, _cases
from .storage_decode import SMOLLM2
from .summary import write_csv

TARGET = "h200"


def breakdown_row(name: str, label: str, mega, sms: int) -> dict:
    """Where a megakernel step's time goes: the makespan is the SMs' busy time (per block kind, over the SMs)
    plus the time SMs hold a popped tile waiting on its barrier or sit past the queue's end (`idle_us`); the
    critical path (unlimited SMs) bounds it from below."""
    row = dict(model=name, genome=label, megakernel_us=1e6 * mega.total_s, launch_us=1e6 * mega.launch_s,
               makespan_us=1e6 * mega.makespan_s, critical_path_us=1e6 * mega.critical_path_s,
               critical_hops=mega.critical_hops, critical_overhead_us=1e6 * mega.critical_overhead_s,
               tiles=mega.tiles, busy_fraction=mega.busy_fraction,
               busy_over_sms_us=1e6 * mega.busy_fraction * mega.makespan_s,
               idle_us=1e6 * (1 - mega.busy_fraction) * mega.makespan_s)
    row.update({f"busy_{kind}_us": 1e6 * seconds / sms for kind, seconds in mega.busy_by_kind})
    for kind, hops, seconds, overhead in mega.critical_by_kind:  # what the critical path is made of
        row.update({f"critical_{kind}_hops": hops, f"critical_{kind}_us": 1e6 * seconds,
                    f"critical_{kind}_overhead_us": 1e6 * overhead})
    return row


def rows_for(name: str, graph, bindings) -> list[dict]:
    from luminal_num.codegen.megakernel import build_queue
    from luminal_num.runtime.launch_form import priced_latency
    from luminal_num.runtime.megakernel_cost import megakernel_latency
    space = SearchSpace.build(graph, fusion=True)
    target = get_target(TARGET)
    rows, breakdown = [], []
    for label, tags in GENOMES.items():
        program = space.program(pick(space, tags.__contains__))
        works = kernel_works(program, bindings)
        moved = sum(w.bytes_moved for w in works)
        floor = bytes_floor_s(works)
        old = modelled_latency(program, TARGET, bindings, launch=LEGACY_LAUNCH).total_s
        new = modelled_latency(program, TARGET, bindings).total_s
        queue = build_queue(program)
        mega = megakernel_latency(queue, program, TARGET, bindings)
        chosen = priced_latency(program, TARGET, bindings)
        rows.append(dict(model=name, genome=label, kernels=len(works), bytes_moved=moved, floor_us=1e6 * floor,
                         old_us=1e6 * old, new_us=1e6 * new, megakernel_us=1e6 * mega.total_s,
                         megakernel_critical_path_us=1e6 * mega.critical_path_s, critical_hops=mega.critical_hops,
                         overhead_share=mega.overhead_share, megakernel_over_floor=mega.total_s / floor,
                         weight_streamed_share=mega.weight_bytes_streamed / mega.bytes_moved,
                         cache_streamed_share=mega.cache_bytes_streamed / mega.bytes_moved,
                         chosen_form=chosen.form.value, chosen_us=1e6 * chosen.total_s,
                         chosen_over_floor=chosen.total_s / floor, new_over_old=new / old))
        breakdown.append(breakdown_row(name, label, mega, target.sm_count))
    for key in ("old_us", "new_us", "megakernel_us", "chosen_us"):
        order = sorted(range(len(rows)), key=lambda i: rows[i][key])
        for rank, i in enumerate(order, 1):
            rows[i][f"rank_{key[:-3]}"] = rank
    return rows, breakdown


def run(layers: int = SMOLLM2.num_hidden_layers, max_cache: int = 256) -> dict:
    start = time.perf_counter()
    rows, breakdown = [], []
    for name, graph, bindings in _cases(layers, max_cache, with_minilm=False):
        more, parts = rows_for(name, graph, bindings)
        rows, breakdown = rows + more, breakdown + parts
    df = pd.DataFrame(rows)
    write_csv(df, "launch_model.csv")
    parts = pd.DataFrame(breakdown).fillna(0.0)
    write_csv(parts, "launch_model_breakdown.csv")
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        print(df[["genome", "kernels", "floor_us", "old_us", "new_us", "megakernel_us", "megakernel_over_floor",
                  "critical_hops", "overhead_share", "weight_streamed_share", "cache_streamed_share",
                  "chosen_form", "chosen_us", "rank_old", "rank_new", "rank_megakernel", "rank_chosen"]
                 ].round(2).to_string(index=False))
    with pd.option_context("display.width", 250, "display.max_columns", 60):
        print(parts.drop(columns=["model"]).round(2).to_string(index=False))
    print(f"[{time.perf_counter() - start:.1f} s]")
    best_old, best_new = df.loc[df.old_us.idxmin()], df.loc[df.new_us.idxmin()]
    best_mega = df.loc[df.megakernel_us.idxmin()]
    best_chosen = df.loc[df.chosen_us.idxmin()]
    return {"SmolLM2 decode fastest (old constants)": f"{best_old.genome}: {best_old.old_us:.1f} us",
            "SmolLM2 decode fastest (new constants)": f"{best_new.genome}: {best_new.new_us:.1f} us",
            "SmolLM2 decode megakernel": f"{best_mega.genome}: {best_mega.megakernel_us:.1f} us, "
                                         f"{best_mega.megakernel_over_floor:.2f}x the bytes floor",
            "SmolLM2 decode as the search prices it": f"{best_chosen.genome}: {best_chosen.chosen_form}, "
                                                     f"{best_chosen.chosen_us:.1f} us"}


def bytes_floor_s(works) -> float:
    """The step's bytes (weights at their stored bytes) over the target's HBM bandwidth: what no schedule beats."""
    return sum(w.bytes_moved for w in works) / get_target(TARGET).hbm_bandwidth


def write_and_show(rows: list[dict], csv: str) -> pd.DataFrame:
    """A what-if's rows: written to reports/bench/`csv` and printed (the decode-step benches' one table form)."""
    df = pd.DataFrame(rows)
    write_csv(df, csv)
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        print(df.drop(columns=["model"]).round(2).to_string(index=False))
    return df


def step_cli(run, doc: str, argv=None):
    """The SmolLM2 decode-step benches' command line (this one and its what-ifs): --layers and --max-cache, then
    run(layers, max_cache)."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--layers", type=int, default=SMOLLM2.num_hidden_layers)
    ap.add_argument("--max-cache", type=int, default=256)
    args = ap.parse_args(argv)
    return run(args.layers, args.max_cache)


def main(argv=None) -> dict:
    return step_cli(run, __doc__, argv)


if __name__ == "__main__":
    main()
