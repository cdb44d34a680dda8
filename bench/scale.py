"""How the compile's memory and time grow with the model: peak memory and wall time per parameter count.

Each shape is compiled in a fresh process (`--one`) while this one samples that process tree's memory
(bench/memwatch.py: PSS summed over the compile and its workers, plus the largest single RSS), so one
shape's caches never count against the next. The real SmolLM2-135M demo job (its GGUF, its prompts) is
the first row; the larger shapes are random-weight checkpoints of real architectures written to disk
in pieces (luminal_num/models/synthetic.py) and memory-mapped, judged on short byte-tokenized prompts.
Writes reports/bench/scale.csv.

    python -m bench.scale                      # every shape with its default candidates
    python -m bench.scale --shapes smollm2 --candidates 40
    python -m bench.scale --shapes smollm2 --max-memory default,4G  # the same plan and time within 4 GB?
    python -m bench.scale --shapes gemma3-4b-shape --front-end   # loading + teacher forcing only:
                                                                 # reports/bench/scale_front_end.csv
    python -m bench.scale --executor ray [--layers N]            # bench/executors.py: local-1/-2, ray-2
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from luminal_num.models.llama import LlamaConfig

from .memwatch import MemWatch
from .summary import OUT, write_csv

CHECKPOINTS = Path(os.environ.get("LUMINAL_SCALE_DIR", "/tmp/luminal_num_scale"))
# short prompts: with a byte-level tokenizer each character is a token, and a decode step at context 64
# needs the prompt and its next token to fit
PROMPTS = ["The capital of France is", "Once upon a time, there", "def add(a, b):\n    return",
           "The quick brown fox", "Water boils at", "In 1492, Columbus", "My favourite colour is",
           "2 + 2 =", "The sun rises in the", "Paris is a city in", "import numpy as", "Hello, my name is",
           "The largest planet is", "Cats and dogs are", "A triangle has three", "The opposite of hot is",
           "Snow is usually", "She opened the door and", "One, two, three,", "The first month is",
           "Light travels at", "Bread is made from", "Rain falls from the", "The alphabet starts with"]


@dataclass(frozen=True)
class Shape:
    name: str
    config: LlamaConfig | None  # None: the bundled SmolLM2 GGUF (the demo job)
    candidates: int
    workload: str = "decode:8@64"


def _llama(hidden, ffn, layers, heads, kv_heads, vocab, **kw) -> LlamaConfig:
    return LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=5e5,
                       max_position_embeddings=2048, **kw)


SHAPES = {s.name: s for s in (
    Shape("smollm2", None, 200),
    # SmolLM2-360M's shape (hidden 960, 32 layers, 15/5 heads, vocab 49152)
    Shape("llama-360m", _llama(960, 2560, 32, 15, 5, 49152, tie_word_embeddings=True), 100),
    # Llama-3.2-1B's shape with 16 layers (hidden 2048, FFN 8192, 32/8 heads, vocab 128256)
    Shape("llama-1b", _llama(2048, 8192, 16, 32, 8, 128256, tie_word_embeddings=True), 100),
    # Gemma-3-4B's shape as a Llama (34 layers, hidden 2560, FFN 10240, 8/4 heads of 256, vocab 262144): its
    # sizes, not its norms or sliding windows, which do not change what the compile holds in memory
    Shape("gemma3-4b-shape", _llama(2560, 10240, 34, 8, 4, 262144, tie_word_embeddings=True, attention_head_dim=256), 50),
)}


def one(shape: Shape, candidates: int, max_memory: str | None, front_end_only: bool = False) -> dict:
    """Compile one shape here (the child process); returns what the parent records (`front_end_only`:
    the job's loading and teacher-forced inputs, no compile)."""
    import warnings
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    from luminal_num.compiler import compile
    from luminal_num.error.budget import Budget
    from luminal_num.memory import parse_size, plan_memory
    from luminal_num.models.llm import Prompt
    from luminal_num.models.registry import llm_job
    from luminal_num.models.synthetic import write_checkpoint
    from luminal_num.search.search import SearchOptions
    t0 = time.perf_counter()
    if shape.config is None:
        job = llm_job(workload=shape.workload)
    else:
        folder = write_checkpoint(CHECKPOINTS / shape.name, shape.config)  # written by the parent: a no-op here
        prompts = [Prompt(p, False) for p in PROMPTS]
        job = llm_job(str(folder), shape.workload, calibration=prompts, heldout=prompts[:8])
    t1 = time.perf_counter()
    params = sum(int(w.size) for w in job.graph.weights.values())
    if front_end_only:
        return {"shape": shape.name, "params_m": params / 1e6, "front_end_s": t1 - t0,
                "batches": len(job.calibration) + len(job.heldout)}
    memory = plan_memory(job.graph.weights, None if max_memory is None else parse_size(max_memory))
    ended = {"front end": time.monotonic()}  # each stage's end on the machine's monotonic clock (the parent's too)

    def on_stage(name: str, seconds: float) -> None:
        ended[name] = time.monotonic()
        print(f"[scale] {shape.name}: stage {name} done in {seconds:.0f} s ({ended[name] - ended['front end']:.0f} s "
              f"into the compile)", file=sys.stderr, flush=True)  # a 4B compile runs for an hour: say where it is
    # a verdict cache as the CLI keeps one by default (<out>/verdicts), empty at the start: converted weights are
    # written there once and read back after an eviction, as a user's compile does; nothing from an earlier compile
    with tempfile.TemporaryDirectory(prefix=f"{shape.name}-verdicts-", dir=CHECKPOINTS) as cache_dir:
        result = compile(job.graph, Budget.parse(job.default_budget), "h200", job.calibration,
                         SearchOptions(max_candidates=candidates, progress=False), memory=memory, on_stage=on_stage,
                         cache_dir=cache_dir)
    t2 = time.perf_counter()
    chosen = result.search.chosen
    return {"shape": shape.name, "params_m": params / 1e6, "candidates": result.search.stats.candidates,
            "stage_ends": ended,
            "front_end_s": t1 - t0, "compile_s": t2 - t1, "memory_plan": memory.describe(),
            "chosen": chosen.label or f"candidate {chosen.id}", "chosen_latency_us": chosen.latency.total_s * 1e6,
            "plan_sha256": hashlib.sha256(result.plan.to_json().encode()).hexdigest()[:16],
            # where the verdicts came from: end-to-end runs (measured, of which confirmed) are what a big model pays for
            "verdicts": "; ".join(f"{k} {v}" for k, v in result.search.stats.judge.gate.as_dict().items() if v)}


def measure(name: str, candidates: int | None, max_memory: str | None, front_end_only: bool = False) -> dict:
    """Run `--one` in a child process and sample its memory (the checkpoint written first, here, so the
    child's front end is loading it, not writing it)."""
    shape = SHAPES[name]
    if shape.config is not None:
        from luminal_num.models.synthetic import write_checkpoint
        t = time.perf_counter()
        write_checkpoint(CHECKPOINTS / shape.name, shape.config)
        print(f"{name}: checkpoint ready in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "bench.scale", "--one", name, "--candidates", str(candidates or shape.candidates)]
    if max_memory:
        cmd += ["--max-memory", max_memory]
    if front_end_only:
        cmd += ["--front-end"]
    load0 = os.getloadavg()[0]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    with MemWatch(pid=proc.pid, period=2.0) as watch:  # smaps_rollup of a big tree costs ~10% of a core at 0.5 s
        out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: the compile exited {proc.returncode}")
    row = json.loads(out.strip().splitlines()[-1])
    row.update(stage_columns(t0, row.pop("stage_ends", {}), watch.samples))
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the child and its workers, all exited
    row.update(max_memory=max_memory or "default", wall_s=time.monotonic() - t0,
               cpu_s=(cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime), peak_pss_gb=watch.peak_pss / 1e9, peak_rss_sum_gb=watch.peak_rss_sum / 1e9,
               peak_rss_max_gb=watch.peak_rss_max / 1e9, load_before=load0, load_after=os.getloadavg()[0])
    return row


def stage_columns(started: float, ends: dict[str, float], samples) -> dict:
    """`stage_s`: each stage's seconds ("front end 26; partition 0; ..."); `peak_stage`: the stage during which
    the tree's PSS peaked, and `stage_peak_gb`: each stage's peak PSS (what to shrink first)."""
    if not ends:
        return {}
    spans, start = [], started
    for name, end in ends.items():
        spans.append((name, start, end))
        start = end
    peaks = {name: max((s.pss for s in samples if lo <= s.t <= hi), default=0) for name, lo, hi in spans}
    return {"stage_s": "; ".join(f"{name} {hi - lo:.0f}" for name, lo, hi in spans),
            "peak_stage": max(peaks, key=peaks.get),
            "stage_peak_gb": "; ".join(f"{name} {gb / 1e9:.2f}" for name, gb in peaks.items())}


def main(argv=None) -> pd.DataFrame | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--candidates", type=int, default=None, help="default: each shape's own")
    ap.add_argument("--max-memory", default=None,
                    help="the compile's memory budget; several, comma-separated ('default' for none), are each "
                         "run on every shape, one after the other in this run (e.g. default,4G)")
    ap.add_argument("--front-end", action="store_true", help="load and teacher-force only (scale_front_end.csv)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--executor", choices=("ray",), default=None,
                    help="instead: the SmolLM2 demo's tasks on 1 and 2 local processes and a 2-node Ray cluster "
                         "(bench/executors.py; --layers N, --candidates N)")
    args, rest = ap.parse_known_args(argv)
    if args.executor:
        from . import executors
        return executors.main(rest + (["--candidates", str(args.candidates)] if args.candidates else []))
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.one:
        print(json.dumps(one(SHAPES[args.one], args.candidates or SHAPES[args.one].candidates, args.max_memory,
                             args.front_end)))
        return None
    rows = []
    budgets = [None if b in (None, "default") else b for b in (args.max_memory or "default").split(",")]
    for name in args.shapes.split(","):
        for budget in budgets:
            rows.append(measure(name, args.candidates, budget, args.front_end))
            print(json.dumps(rows[-1]), flush=True)
    df = pd.DataFrame(rows)
    name = "scale_front_end.csv" if args.front_end else "scale.csv"
    path = OUT / name
    if path.is_file():  # keep the rows of shapes (and memory budgets) not run this time
        old = pd.read_csv(path)
        if "max_memory" not in old:
            old["max_memory"] = "default"
        key = ["shape", "max_memory"] if "max_memory" in df else ["shape"]
        ran = set(map(tuple, df[key].astype(str).values))
        df = pd.concat([old[[tuple(r) not in ran for r in old[key].astype(str).values]], df], ignore_index=True)
    write_csv(df, name)
    return df


if __name__ == "__main__":
    main()
