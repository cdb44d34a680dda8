"""The strict-budget comparison: MiniLM at `atol=2e-3,rtol=0,cosine>=0.99994` (PyTorch autocast BF16's
quality on real sentences). Is the chosen plan's modelled H200 latency below the faithful BF16-autocast
baseline's, both from the same compile? Where it is not, which missing choice blocks it: for each kind
of change the autocast recipe makes and the chosen plan does not (Gemm variants, elementwise storage,
reductions, softmax), the chosen plan with exactly those changes added is judged against the same gate
(the budget tightened by the compile's headroom) and modelled: a faster combination that passes is one
the search never tried; one that fails is blocked by the budget (and the headroom).

Every returned plan row is also audited on the held-out sentences against the user's budget.
`python -m bench.strict_budget` writes reports/bench/strict_budget.csv; with `--gptq --rotate --smooth`
(compile's options: GPTQ fills, Hadamard-rotated and SmoothQuant-smoothed Gemms as search choices) it
writes strict_budget_<offers>.csv, so both runs can be read side by side.
"""
from __future__ import annotations

import argparse
import warnings

import pandas as pd

from luminal_num.error.budget import Budget
from luminal_num.error.judge import Judge
from luminal_num.runtime.cost import UnsupportedOnTarget
from luminal_num.runtime.launch_form import program_latency
from luminal_num.search.front import LATENCY_TIE
from luminal_num.search.space import Offers, group_of

from .heldout import TARGET, HeldoutJob, audit_returned, compile_job, jobs, layer_map_row
from .summary import write_csv

STRICT = "atol=2e-3,rtol=0,cosine>=0.99994"
AUTOCAST = "BF16 autocast"
CSV = "strict_budget.csv"


def _kind(change) -> str:
    return change[2].split(":")[0]


def with_changes(genome: frozenset, extra) -> frozenset:
    """`genome` with `extra` (group-wide changes) replacing whatever it set on those e-classes, per chunk too."""
    over = {(group_of(s), c) for s, c, _ in extra}
    return frozenset([ch for ch in genome if (group_of(ch[0]), ch[1]) not in over] + list(extra))


def blockers(job, result, budget: Budget) -> list[dict]:
    """Per kind of change the autocast recipe makes that the chosen plan lacks: the chosen plan with them
    added, judged end to end against the compile's gate and modelled on TARGET."""
    search, space = result.search, result.space
    chosen, auto = search.chosen, search.baselines[AUTOCAST]
    head = search.stats.headroom_share
    judge = Judge(job.graph, budget, list(job.calibration), use_static=False, headroom=head, use_prediction=False)
    missing = sorted(auto.genome - chosen.genome)
    rows = []
    for kind in sorted({_kind(c) for c in missing}):
        extra = [c for c in missing if _kind(c) == kind]
        genome = with_changes(chosen.genome, extra)
        program = space.program(genome)
        v = judge.judge(program, predict=False)
        lat = program_latency(program, TARGET, judge.latency_bindings, job.graph.weights, job.calibration[0])
        faster = lat.total_s < chosen.latency_s * (1 - LATENCY_TIE)  # closer is a tie (search.choose)
        verdict = ("never combined by the search: passes and is faster" if v.passed and faster else
                   "blocked by the budget: faster but breaks the gate" if faster else
                   "no latency to gain" + ("" if v.passed else " (and breaks the gate)"))
        rows.append({"kind": kind, "changes": len(extra), "example": extra[0][2], "gate_share": v.share.gate,
                     "user_allclose": v.share.user_allclose, "passes_gate": v.passed, "latency_s": lat.total_s,
                     "gain_vs_chosen_s": chosen.latency_s - lat.total_s, "finding": verdict})
    return rows


def csv_name(offers: Offers) -> str:
    """strict_budget.csv without offers; strict_budget_gptq_rotate.csv ... with them."""
    on = [name for name, flag in (("gptq", offers.calibrated), ("rotate", offers.rotation),
                                  ("smooth", offers.smoothing)) if flag]
    return CSV if not on else CSV.replace(".csv", "_" + "_".join(on) + ".csv")


def run(batch: int = 4, candidates: int = 60, offers: Offers = Offers()) -> dict:
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    spec = HeldoutJob("minilm", jobs(minilm_batch=batch)["minilm"].load, candidates, STRICT, offers)
    job, budget, result, seconds = compile_job(spec)
    search = result.search
    chosen, auto = search.chosen, search.baselines[AUTOCAST]
    held = {r["candidate"]: r for r in audit_returned("minilm", job, result, budget)}
    rows = []
    for role, label, e in [("chosen", chosen.label or f"candidate {chosen.id}", chosen)] + \
            [("baseline", name, b) for name, b in search.baselines.items()]:
        rows.append({"section": "plan", "role": role, "label": label, "stage": e.stage,
                     "latency_s": e.latency_s, "passes_gate": e.verdict.passed, "gate_share": e.verdict.share.gate,
                     "user_allclose": e.verdict.share.user_allclose, "verdict_source": e.verdict.source,
                     "heldout_broken": held[e.id]["broken"] if e.id in held else None,
                     "headroom": search.stats.headroom_share, "compile_s": seconds})
    below = bool(chosen.latency_s < auto.latency_s)
    found = [] if below else blockers(job, result, budget)
    rows += [{"section": "missing", "role": "chosen + autocast's " + r["kind"], **r} for r in found]
    faster = faster_than(job, result, auto.latency_s)
    rows += faster
    layers = layer_map_row("minilm_strict", result)
    df = pd.DataFrame(rows).assign(budget=STRICT, chosen_below_autocast=below,
                                   layers_differ=layers["layers_differ"], layer_map=layers["layer_map"])
    path = write_csv(df, csv_name(offers))
    print(df.drop(columns=["budget", "layer_map"]).to_string())
    print(f"wrote {path}")
    out = {"chosen plan (modelled H200)": chosen.latency_s, f"{AUTOCAST} (modelled H200)": auto.latency_s,
           f"{AUTOCAST} passes the gate": bool(auto.verdict.passed), "chosen below autocast": below,
           "chosen plan's layers differ": layers["layers_differ"]}
    for r in found:
        out[f"chosen + autocast's {r['kind']} changes"] = r["finding"]
    out["candidates evaluated faster than autocast (passing)"] = f"{len(faster)} ({sum(r['passes_gate'] for r in faster)})"
    if faster and not below:
        best = min(faster, key=lambda r: r["gate_share"])
        out["most accurate candidate faster than autocast"] = (f"{best['label']} ({best['stage']}): "
                                                              f"{best['gate_share']:.3g}x the gate")
    if not below:
        out["what blocks a plan below autocast"] = blocking(faster, auto.latency_s)
    stages = pd.Series([e.stage for e in search.evaluated]).value_counts()
    out["candidates per stage"] = ", ".join(f"{k} {v}" for k, v in stages.items())
    out.update({k: v for k, v in search.stats.allocation.items()})
    return out


def blocking(faster: list[dict], latency_s: float) -> str:
    """One line: which choices would beat `latency_s` by more than a latency tie, and why none is taken
    (the most accurate of them breaks the gate by its share; none at all: every faster plan is a tie)."""
    if not faster:
        return (f"no evaluated plan (baselines included) is modelled more than {LATENCY_TIE:.1%} faster than "
                f"{AUTOCAST}: the faster choices gain within the latency tie")
    if any(r["passes_gate"] for r in faster):
        return "a faster plan passes the gate: the search's choice is the blocker (see the 'faster' rows)"
    best = min(faster, key=lambda r: r["gate_share"])
    return (f"only {len(faster)} plans are modelled faster than {AUTOCAST} beyond the {LATENCY_TIE:.1%} tie and "
            f"each breaks the gate; the most accurate, {best['label']} ({best['latency_s'] / latency_s:.3g}x its "
            f"latency), uses {best['gate_share']:.3g}x the gate: the missing choice is a variant as fast as "
            f"those ({'; '.join(sorted({r['label'] for r in faster}))}) with under 1/{best['gate_share']:.3g} "
            f"of the most accurate one's error")


def faster_than(job, result, latency_s: float) -> list[dict]:
    """Every evaluated candidate (baselines too) whose modelled latency is below `latency_s` by more than a
    latency tie (one the gate rejected was never timed: it is modelled here), with its verdict: what would
    beat the baseline, and what it costs in error."""
    rows = []
    bindings = job.graph.bind_symbols(job.calibration[0])  # what the search modelled latencies with
    for e in result.search.evaluated:
        if e.program is None:
            continue
        lat = e.latency_s if e.latency is not None else _modelled(job, e.program, bindings)
        if lat < latency_s * (1 - LATENCY_TIE):
            rows.append({"section": "faster", "role": f"{e.stage} candidate {e.id}", "label": e.label or
                         ", ".join(sorted({t for _, _, t in e.genome})), "stage": e.stage, "latency_s": lat,
                         "passes_gate": e.verdict.passed, "gate_share": e.verdict.share.rank(), "user_allclose": e.verdict.share.user_allclose,
                         "verdict_source": e.verdict.source, "finding": "passes" if e.verdict.passed else
                         f"breaks the gate: {e.verdict.reason[:120]}"})
    return sorted(rows, key=lambda r: (r["gate_share"], r["latency_s"]))


def _modelled(job, program, bindings) -> float:
    try:
        return program_latency(program, TARGET, bindings, job.graph.weights, job.calibration[0]).total_s
    except UnsupportedOnTarget:
        return float("inf")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4, help="MiniLM sentences per batch")
    ap.add_argument("--candidates", type=int, default=60)
    ap.add_argument("--gptq", action="store_true", help="weights may also be GPTQ-filled (compile --gptq)")
    ap.add_argument("--rotate", action="store_true", help="Gemms may also be Hadamard-rotated (compile --rotate)")
    ap.add_argument("--smooth", action="store_true", help="Gemms may also be SmoothQuant-smoothed (compile --smooth)")
    a = ap.parse_args(argv)
    return run(a.batch, a.candidates, Offers(calibrated=a.gptq, rotation=a.rotate, smoothing=a.smooth))


if __name__ == "__main__":
    main()
