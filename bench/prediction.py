"""Predicted vs measured end-to-end error of random mixed genomes (the judge's first-order composition).

For each job: every change of the pool is measured alone end to end (its output error vectors kept),
then N random genomes of 2-6 changes are predicted (sum of the changes' errors) and measured end to
end. Writes reports/bench/prediction.csv and prediction.png (scatter, the [0.5x, 2x] band drawn).
Genomes are per group (all chunks of a group share a choice): per-layer genomes are not built yet.
"""
from __future__ import annotations

import argparse
import time
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from luminal_num.error.budget import Budget  # noqa: E402
from luminal_num.error.judge import Judge  # noqa: E402
from luminal_num.models.registry import llama_tiny_job, transformer_job  # noqa: E402
from luminal_num.search.search import variant_classes  # noqa: E402
from luminal_num.search.space import SearchSpace  # noqa: E402

from .summary import OUT, write_csv  # noqa: E402

JOBS = {"transformer": lambda: transformer_job(2), "llama-tiny": llama_tiny_job}


def pool_of(space: SearchSpace, target: str = "h200") -> list[tuple[str, str, str]]:
    """Per knob, the most accurate variant of each speed class (what the search tries alone)."""
    return [(gk, k.cls, tags[0]) for gk, ks in space.knobs.items() for k in ks
            for tags in variant_classes(k.tags, target)]


def scatter_rows(name: str, n: int, seed: int = 0) -> list[dict]:
    job = JOBS[name]()
    space = SearchSpace.build(job.graph)
    judge = Judge(job.graph, Budget.parse(job.default_budget), list(job.calibration), use_static=False)
    pool = pool_of(space)
    for ch in pool:  # each change alone, end to end: the composition's inputs
        judge.judge(space.program([ch]), frozenset([ch]), predict=False)
    rng = np.random.default_rng(seed)
    rows = []
    while len(rows) < n:
        k = int(rng.integers(2, 7))
        picked = {}
        for i in rng.permutation(len(pool))[: 4 * k]:
            g, c, t = pool[int(i)]
            picked.setdefault((g, c), t)
            if len(picked) == k:
                break
        genome = [(g, c, t) for (g, c), t in picked.items()]
        p = judge.predictor.predict(genome)
        t0 = time.perf_counter()
        measured, _ = judge._measure(space.program(genome))
        rows.append(dict(job=name, changes=len(genome), predicted=p.ratio, measured=measured.ratio,
                         within_2x=bool(0.5 <= measured.ratio / p.ratio <= 2.0) if p.ratio > 0 else False,
                         measure_s=time.perf_counter() - t0, genome=" ".join(sorted(t for _, _, t in genome))))
    return rows


def plot(df: pd.DataFrame) -> None:
    fig, ax = plt.subplots(figsize=(6, 5))
    for job, part in df.groupby("job"):
        ax.scatter(part["predicted"], part["measured"], label=f"{job} ({part.within_2x.mean():.0%} within 2x)", s=18)
    lo = max(min(df.predicted.min(), df.measured.min()), 1e-6)
    hi = max(df.predicted.max(), df.measured.max())
    xs = np.geomspace(lo, hi, 10)
    for f, style in ((1, "-"), (2, "--"), (0.5, "--")):
        ax.plot(xs, xs * f, "k" + style, lw=0.8)
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("predicted share of the budget (sum of single-change errors)")
    ax.set_ylabel("measured share of the budget (end to end)")
    ax.legend()
    fig.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT / "prediction.png", dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=30)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    df = pd.DataFrame([r for name in JOBS for r in scatter_rows(name, args.n)])
    write_csv(df, "prediction.csv")
    plot(df)
    print(df.groupby("job")[["within_2x"]].mean())


if __name__ == "__main__":
    main()
