"""Predicted vs measured end-to-end error of random mixed per-layer genomes (the judge's per-chunk
composition, error/chunks.py).

For each job: 30 random genomes give every chunk of each multi-chunk group (the layers) its own uniform
Gemm format (FP32, TF32, BF16, FP16, FP8 E4M3 block, INT8 per channel: one per layer, drawn at random),
and single-chunk groups a random one too. Each genome's outputs are predicted from its chunks judged
alone on their exact FP64 inputs (SCALED propagation, as the compiler does, and EXACT injection into the
FP64 rest of the model), checked against the budget (every metric), then measured end to end, and with
`--positions N` (smollm2) also judged on N teacher-forced positions pooled: the prediction from the
calibration batches' 24 positions against the KL over all of them (issue 32's must-show). Writes
reports/bench/prediction.csv and prediction.png (scatter, the [0.5x, 2x] band drawn).
"""
from __future__ import annotations

import argparse
import time
import warnings
from contextlib import ExitStack

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from luminal_num.compiler import POSITION_ROWS, WidenedPositions  # noqa: E402
from luminal_num.error.budget import Budget  # noqa: E402
from luminal_num.blas_threads import one_blas_thread  # noqa: E402
from luminal_num.error.chunks import ChunkEffects, Propagation  # noqa: E402
from luminal_num.error.held import HeldArrays  # noqa: E402
from luminal_num.error.judge import Judge  # noqa: E402
from luminal_num.error.metrics import METRICS  # noqa: E402
from luminal_num.error.pooled import STEPS_TOGETHER, PooledRows, judge_positions  # noqa: E402
from luminal_num.error.predict import ShareCheck, budget_ratio  # noqa: E402
from luminal_num.error.reference import references  # noqa: E402
from luminal_num.memory import MemoryPlan, parse_size, plan_memory  # noqa: E402
from luminal_num.models.llm import load_llm  # noqa: E402
from luminal_num.models.registry import llm_job, minilm_job, transformer_job  # noqa: E402
from luminal_num.search.space import ChunkSite, SearchSpace  # noqa: E402

from .summary import OUT, write_csv  # noqa: E402

JOBS = {"minilm": lambda: minilm_job(16), "smollm2": llm_job, "transformer": lambda: transformer_job(3)}
FORMATS = ("f32", "gemm:tf32", "gemm:bf16", "gemm:f16", "gemm:f8e4m3_block", "gemm:int8_channel")


def random_per_layer_genome(space: SearchSpace, rng: np.random.Generator) -> tuple[frozenset, str]:
    """Each chunk its own uniform Gemm format (a format a Gemm lacks leaves that Gemm FP32)."""
    genome, names = [], []
    for g in space.part.groups:
        for c in g.chunks:
            fmt = FORMATS[int(rng.integers(len(FORMATS)))]
            names.append(fmt.removeprefix("gemm:"))
            site = ChunkSite(g.key, c.index) if len(g.chunks) > 1 else g.key
            genome += [(site, k.cls, fmt) for k in space.knobs[g.key] if fmt in k.tags]
    return frozenset(genome), " ".join(names)


def metric_shares(gate: Budget, outputs, refs) -> dict[str, float]:
    """The share of the gate each part of it uses (allclose, each metric limit), worst over batches:
    predict.budget_ratio's terms one by one."""
    out: dict[str, float] = {}
    for o, r in zip(outputs, refs):
        v = gate.check(o, r)
        parts = {"allclose": v.worst_allclose}
        for ov in v.outputs:
            for name, value in ov.metric_values:
                one = Budget(np.inf, np.inf, gate.outputs, tuple(m for m in gate.metrics if m.name == name))
                parts[name] = max(parts.get(name, 0.0), budget_ratio(one, one.check(o, r)))
        for k, x in parts.items():
            out[k] = max(out.get(k, 0.0), float(x))
    return out


def memory_plan(name: str, max_memory: int) -> MemoryPlan:
    """The caches a compile of job `name` within `max_memory` bytes would get (no worker pool: the bench runs
    every chunk in its own process). The LLM's weights are read before its job is built, so the job's FP64
    continuations already run within the plan (they stream the FP64 weights when the cache cannot hold them)."""
    weights = load_llm("smollm2").weights if name == "smollm2" else JOBS[name]().graph.weights
    return plan_memory(weights, max_memory, workers=1)


def scatter_rows(name: str, n: int, seed: int = 0, modes: tuple[Propagation, ...] = tuple(Propagation),
                 positions: int = 0, max_memory: int | None = None, steps_together: int = STEPS_TOGETHER,
                 rows_per_step: int = POSITION_ROWS, done=lambda rows: None, confirm: bool = True,
                 first: int = 0) -> list[dict]:
    """Rows of `n` random genomes, on one BLAS thread as the compiler judges; with `max_memory`, within a
    compile's memory plan for that budget (its caches, and the per-chunk deviations past its share in a
    scratch file). `done(rows so far)` after each genome (a run cut short keeps what it measured)."""
    with ExitStack() as stack:
        # one BLAS thread always, as the compiler judges: a second OpenBLAS thread beside any other busy process
        # makes each small-M call wait on a descheduled thread (a positions pass took 645 s instead of ~90 s)
        stack.enter_context(one_blas_thread())
        held = None
        if max_memory is not None:
            plan = memory_plan(name, max_memory)
            print(f"[prediction] {name}: {plan.describe()}", flush=True)
            stack.enter_context(plan.applied())
            held = HeldArrays(plan.judging)
        return _scatter_rows(name, n, seed, modes, positions, held, steps_together, rows_per_step, done, confirm, first)


def _scatter_rows(name: str, n: int, seed: int, modes: tuple[Propagation, ...], positions: int,
                  held: HeldArrays | None, steps_together: int, rows_per_step: int, done,
                  confirm: bool, first: int) -> list[dict]:
    job = JOBS[name]() if not positions or name != "smollm2" else llm_job(positions_minimum=positions)
    space = SearchSpace.build(job.graph)
    refs = references(job.graph, job.calibration, space.part)  # chunk boundaries and outputs, as the compiler keeps
    base = space.candidates(frozenset())
    budget = Budget.parse(job.default_budget)
    # as the compiler builds them: knob composition, group-shared ratios, effects of the gated outputs only
    effects = {m: ChunkEffects(job.graph, space.part, refs, space.lower_chunk, base, m, changes_of=space.knobs_of,
                               outputs=budget.outputs, held=held)
               for m in (Propagation.SCALED, *modes)}
    judge = Judge(job.graph, budget, list(job.calibration), use_static=False,
                  references=refs, chunks=effects[Propagation.SCALED], use_prediction=False)
    pooled_check = ShareCheck(judge.ev.gate, budget, judge.ev.refs, pooled=True)
    rng = np.random.default_rng(seed)
    rows = []
    source = job.llm.positions if positions and job.llm is not None and confirm else None
    wide = WidenedPositions(space, source, rows_per_step) if source is not None else None
    for i in range(first + n):
        genome, formats = random_per_layer_genome(space, rng)
        if i < first:  # drawn (the rng's sequence), judged by an earlier process
            continue
        cands = space.candidates(genome)
        row = dict(job=name, seed=seed, genome_index=i, formats=formats)
        composed = {}
        for m, ce in effects.items():
            t0 = time.perf_counter()
            composed[m] = ce.compose(cands, judge.ev.gated_refs)
            row[f"predicted_{m.value}"] = judge.ev.checker.check(composed[m]).ratio
            row[f"predict_{m.value}_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        measured, outs = judge.runner.measure(space.program(genome), keep_outputs=True)
        row.update(measured=measured.share.gate, measure_s=time.perf_counter() - t0)
        # each part of the share alone: a count (top-1 over a batch of 8 rows) is discrete where KL is not
        for part, share in metric_shares(judge.ev.gate, composed[Propagation.SCALED], judge.ev.refs).items():
            row[f"predicted_scaled_{part}"] = share
        if job.llm is not None:  # the batches' rows pooled, as a compile whose measurements pool the positions checks
            row["predicted_scaled_pooled"] = pooled_check.check(composed[Propagation.SCALED]).ratio
        for part, share in metric_shares(judge.ev.gate, outs, judge.ev.refs).items():
            row[f"measured_{part}"] = share
            p = row.get(f"predicted_scaled_{part}", float("nan"))
            row[f"within_2x_scaled_{part}"] = bool(0.5 <= share / p <= 2.0) if p > 0 else share == p == 0
        if job.llm is not None:  # the KL the judge predicts from the calibration batches (their mean, as measured)
            row["predicted_scaled_kl"] = float(np.mean([METRICS["kl_logits"](o[k], r[k]) for o, r in zip(
                composed[Propagation.SCALED], judge.ev.gated_refs) for k in o]))
        if wide is not None:  # the same genome judged on every teacher-forced position, pooled (issue 32)
            row.update(confirmed_on_positions(wide, space, genome, judge.ev.gate, budget, steps_together))
            row.update(within_2x_positions(row))
        if "measured_top1_agreement" in row:  # top-1 flips predicted where they happen (a share > 0 is a flip)
            row["same_top1_flips"] = (row["measured_top1_agreement"] > 0) == (row["predicted_scaled_top1_agreement"] > 0)
        for m in effects:
            p = row[f"predicted_{m.value}"]
            row[f"within_2x_{m.value}"] = bool(0.5 <= measured.share.gate / p <= 2.0) if p > 0 else False
        row.update({f"chunk_runs_{m.value}": ce.runs for m, ce in effects.items()})
        row.update({f"chunk_shared_{m.value}": ce.shared for m, ce in effects.items()})
        rows.append(row)
        done(rows)
        print(f"[prediction] {name} {i}: predicted {row['predicted_scaled']:.3g} (exact "
              f"{row.get('predicted_exact', float('nan')):.3g}) measured {measured.share.gate:.3g}", flush=True)
    return rows


def confirmed_on_positions(wide: WidenedPositions, space: SearchSpace, genome, gate: Budget, budget: Budget,
                           steps_together: int) -> dict:
    """The genome judged on every teacher-forced position of `wide`, pooled (the compile's positions stage)."""
    t0 = time.perf_counter()
    run, on = wide.program(genome, space.program(genome))
    verdict, stats = judge_positions(run, on.graph.weights, on, gate, budget, steps_together)
    return dict(positions=stats.rows, rows_per_step=on.rows, steps_together=steps_together,
                positions_share=verdict.share.gate, positions_kl=float(METRICS["kl_logits"].of(PooledRows(stats))),
                positions_top1=float(np.mean(stats.top1)), positions_s=time.perf_counter() - t0)


def within_2x_positions(row: dict) -> dict:
    """Is the predicted KL (24 calibration positions, chunks composed) within [0.5x, 2x] of the KL confirmed
    on the positions, and the predicted share of the gate within 2x of the positions' share?"""
    kl, predicted = row["positions_kl"], row["predicted_scaled_kl"]
    share, p = row["positions_share"], row["predicted_scaled"]
    out = dict(within_2x_positions_kl=bool(0.5 <= kl / predicted <= 2.0) if predicted > 0 else kl == 0,
               within_2x_positions_share=bool(0.5 <= share / p <= 2.0) if p > 0 else share == 0)
    pooled = row.get("predicted_scaled_pooled", float("nan"))
    if np.isfinite(pooled):  # the share a compile with positions predicts (predict.ShareCheck pooled)
        out["within_2x_positions_share_pooled"] = bool(0.5 <= share / pooled <= 2.0) if pooled > 0 else share == 0
    return out


CONFIRMED = ("positions", "rows_per_step", "steps_together", "positions_share", "positions_kl", "positions_top1",
             "positions_s")


def with_earlier_confirmations(rows: list[dict], earlier: pd.DataFrame) -> list[dict]:
    """New predictions of genomes an earlier run confirmed on the positions (same seed and index, checked by their
    formats): their confirmed columns carried over and compared with the new predictions (the predictor changed,
    the genomes' pooled verdicts did not)."""
    old = {(int(r["seed"]), int(r["genome_index"])): r for r in earlier.to_dict("records")
           if np.isfinite(r.get("positions_kl", float("nan")))}
    out = []
    for row in rows:
        prior = old.get((int(row["seed"]), int(row["genome_index"])))
        if prior is not None and row.get("positions") is None:
            if prior["formats"] != row["formats"]:
                raise ValueError(f"genome {row['genome_index']}: the earlier run's formats differ: not the same genome")
            row = {**row, **{k: prior[k] for k in CONFIRMED}}
            row.update(within_2x_positions(row))
        out.append(row)
    return out


def confirm_rows(predicted: pd.DataFrame, positions: int, max_memory: int | None, steps_together: int,
                 rows_per_step: int, done=lambda rows: None, first: int = 0, n: int = 10 ** 9) -> list[dict]:
    """The second half of a split run (`--phase confirm`): each genome of an earlier `--phase predict` run
    (the same seed draws the same genomes, checked by their formats) judged on the positions, in a process that
    holds no chunk verdicts (the two halves of a SmolLM2 run do not fit 2 GB together); genomes `first` to
    `first + n - 1` only (the rows of others already confirmed are kept)."""
    with ExitStack() as stack:
        stack.enter_context(one_blas_thread())  # as _scatter_rows
        if max_memory is not None:
            stack.enter_context(memory_plan("smollm2", max_memory).applied())
        job = llm_job(positions_minimum=positions)
        space = SearchSpace.build(job.graph)
        budget = Budget.parse(job.default_budget)
        wide = WidenedPositions(space, job.llm.positions, rows_per_step)
        seeds = predicted.seed.unique()
        if len(seeds) != 1:
            raise ValueError(f"the predictions come from {len(seeds)} seeds; confirm one run at a time")
        rng = np.random.default_rng(int(seeds[0]))
        rows = {int(r["genome_index"]): r for r in predicted.to_dict("records")}  # every row, written each time
        for i in range(max(rows) + 1):
            genome, formats = random_per_layer_genome(space, rng)  # genome i of the seed's sequence
            if i not in rows or not first <= i < first + n:
                continue
            if formats != rows[i]["formats"]:
                raise ValueError(f"genome {i}: drew {formats!r}, the predictions have {rows[i]['formats']!r}: "
                                 f"not the same genome")
            row = dict(rows[i])
            row.update(confirmed_on_positions(wide, space, genome, budget, budget, steps_together))
            row.update(within_2x_positions(row))
            rows[i] = row
            done([rows[k] for k in sorted(rows)])
            print(f"[prediction] confirm {i}: predicted KL {row['predicted_scaled_kl']:.3g}, on "
                  f"{row['positions']} positions {row['positions_kl']:.3g} ({row['positions_s']:.0f} s)", flush=True)
    return [rows[k] for k in sorted(rows)]


def plot(df: pd.DataFrame, name: str = "prediction.png") -> None:
    fig, ax = plt.subplots(figsize=(6, 5))
    for job, part in df.groupby("job"):
        for m, marker in (("scaled", "o"), ("exact", "x")):
            if f"predicted_{m}" not in part or part[f"predicted_{m}"].isna().all():
                continue
            ax.scatter(part[f"predicted_{m}"], part["measured"], marker=marker, s=18,
                       label=f"{job}, {m} ({part[f'within_2x_{m}'].mean():.0%} within 2x)")
    finite = df[np.isfinite(df.measured) & np.isfinite(df.predicted_scaled)]
    lo = max(min(finite.predicted_scaled.min(), finite.measured.min()), 1e-6)
    hi = max(finite.predicted_scaled.max(), finite.measured.max())
    xs = np.geomspace(lo, hi, 10)
    for f, style in ((1, "-"), (2, "--"), (0.5, "--")):
        ax.plot(xs, xs * f, "k" + style, lw=0.8)
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("predicted share of the budget (chunks judged alone, composed)")
    ax.set_ylabel("measured share of the budget (end to end)")
    ax.legend()
    fig.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT / name, dpi=120)


def figures(df: pd.DataFrame) -> dict:
    """How often a genome's predicted share is within 2x of the measured one, per job and propagation
    (EXACT: what the judge decides with inside SCALED's band; SCALED: the cheap screen, decided with a
    margin calibrated against end-to-end runs)."""
    return {f"{job}: predicted ({mode}) within 2x of measured": float(g[f"within_2x_{mode}"].mean())
            for job, g in df.groupby("job") for mode in ("scaled", "exact") if g[f"predicted_{mode}"].notna().any()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--jobs", default="minilm,smollm2", help=f"comma-separated, of {', '.join(JOBS)}")
    ap.add_argument("--positions", type=int, default=0,
                    help="smollm2: also judge each genome on at least N teacher-forced positions, pooled (0: off)")
    ap.add_argument("--max-memory", default=None,
                    help="size the caches as a compile within this budget sizes them (e.g. 2.4G; default: unbounded)")
    ap.add_argument("--steps-together", type=int, default=STEPS_TOGETHER,
                    help="positions: decode steps run together (fewer: less memory, weight forms made more often)")
    ap.add_argument("--rows-per-step", type=int, default=POSITION_ROWS,
                    help="positions: rows a decode step runs (the compile's POSITION_ROWS; fewer: less memory)")
    ap.add_argument("--phase", choices=("both", "predict", "confirm"), default="both",
                    help="with --positions: 'predict' writes the predictions only, a later 'confirm' (same --out) "
                         "judges those genomes on the positions in a fresh process")
    ap.add_argument("--first", type=int, default=0,
                    help="start at genome FIRST (the earlier ones are drawn, not judged; their rows are read from "
                         "the CSV): a long run split over processes")
    ap.add_argument("--seed", type=int, default=0, help="the genomes' random seed")
    ap.add_argument("--confirmed-from", default=None,
                    help="--phase predict: carry the positions' verdicts of the same genomes over from this earlier "
                         "CSV under reports/bench/ (a new predictor checked against confirmations already made)")
    ap.add_argument("--out", default="prediction", help="the CSV and PNG names under reports/bench/")
    ap.add_argument("--exact-for", default="minilm,smollm2,transformer",
                    help="jobs that also get EXACT propagation (an FP64 run of the rest per chunk choice)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    exact = set(args.exact_for.split(","))
    max_memory = None if args.max_memory is None else parse_size(args.max_memory)
    if args.phase == "confirm":  # every row of the CSV comes back, those in range with their positions
        rows = confirm_rows(pd.read_csv(OUT / f"{args.out}.csv"), args.positions, max_memory, args.steps_together,
                            args.rows_per_step, lambda all_rows: write_csv(pd.DataFrame(all_rows), f"{args.out}.csv"),
                            args.first, args.n)
        write_csv(pd.DataFrame(rows), f"{args.out}.csv")
        print(pd.DataFrame(rows)[["within_2x_positions_kl", "within_2x_positions_share", "positions_s"]].mean())
        return
    rows: list[dict] = []
    if args.first:  # the other genomes' rows, from the earlier processes' CSV
        rows = [r for r in pd.read_csv(OUT / f"{args.out}.csv").to_dict("records")
                if not args.first <= r["genome_index"] < args.first + args.n]

    def done(job_rows: list[dict]) -> None:
        write_csv(pd.DataFrame(rows + job_rows).sort_values(["job", "genome_index"]), f"{args.out}.csv")
    for name in args.jobs.split(","):
        rows += scatter_rows(name, args.n, args.seed, (Propagation.EXACT,) if name in exact else (), args.positions,
                             max_memory, args.steps_together, args.rows_per_step, done, args.phase == "both",
                             args.first)
    if args.confirmed_from:
        rows = with_earlier_confirmations(rows, pd.read_csv(OUT / f"{args.confirmed_from}.csv"))
    df = pd.DataFrame(rows)
    write_csv(df, f"{args.out}.csv")
    plot(df, f"{args.out}.png")
    cols = [c for c in df if c.startswith("within_2x") or c in ("same_top1_flips", "predict_scaled_s", "measure_s",
                                                                 "positions_s")]
    print(df.groupby("job")[cols].mean())


if __name__ == "__main__":
    main()
