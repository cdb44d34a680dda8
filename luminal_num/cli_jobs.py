"""What the commands are run on: the job a --model names (registry model, LLM, ONNX file), its budget
and the input batches a user hands in, each checked before any work, so that a bad argument is one
line (InputError) and nothing is written. The model, ONNX and budget modules are imported inside the
functions that need them (as in cli.py), so `luminal-num --help` and a bad flag answer without loading
egglog or onnx; no module cycle is involved.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from .dtypes.formats import Kind
from .files import read_npz
from .hlir.ops import Op
from .hlir.symbolic import is_const
from .report.numbers import fmt_num


class InputError(Exception):
    """Bad input to a command: the one line it exits with (exit code 2)."""


def parse_budget(text: str):
    """--budget's text as a Budget; a syntax error is one line naming the text."""
    from .error.budget import Budget, BudgetSyntaxError
    try:
        return Budget.parse(text)
    except BudgetSyntaxError as exc:
        raise InputError(f"bad --budget {text!r}: {exc}") from None


def registry_job(name: str, args=None):
    """A registry job by name; with the command's args, also an LLM (name, .gguf, HF folder) under
    --workload, and --calibration replacing the calibration inputs."""
    from .models.registry import JOBS, load_job
    if args is not None and is_llm(name):
        return llm_job_of(args)
    for option in ("workload", "layers"):
        if args is not None and getattr(args, option, None):
            raise InputError(f"--{option} applies to LLMs (smollm2, gemma3, a .gguf file, a HF folder), not {name!r}")
    try:
        job = load_job(name)
    except KeyError:
        raise InputError(f"unknown model {name!r}; known: {', '.join(JOBS)}, or a .gguf file or "
                         f"Hugging Face folder of a Llama-family model") from None
    for option in ("calibration", "heldout"):
        path = getattr(args, option, None) if args is not None else None
        if path is None:
            continue
        if Path(path).suffix != ".npz":
            raise InputError(f"--{option} {path}: a prompt file applies to LLMs; give {name!r} an .npz")
        job = dataclasses.replace(job, **{option: tuple(input_batches(path, job))})
    return job


LLM_WORKLOAD = "decode:8@64"
# an LLM candidate costs about one layer's run per changed layer (per-chunk verdicts, error/chunks.py), not
# a forward pass: SmolLM2's decode search of 200 takes minutes (reports/bench/search_efficiency.csv)
LLM_CANDIDATES = 200


def is_llm(name: str) -> bool:
    from .models.registry import JOBS, LLM_NAMES
    return name in LLM_NAMES or (name not in JOBS and (name.endswith(".gguf") or Path(name).is_dir()))


_LLM_JOBS: dict = {}


def llm_job_of(args):
    """The LLM job of --model/--workload/--layers, calibrated on --calibration prompts (or an npz batch), its
    held-out set from --heldout (likewise; default: the shipped prompts)."""
    from .models.gguf import GGUFError
    from .models.llm import PromptTooLong
    from .models.registry import llm_job
    from .models.tokenizer import TokenizerError
    workload = getattr(args, "workload", None) or LLM_WORKLOAD
    sets = {option: getattr(args, option, None) for option in ("calibration", "heldout")}
    layers = getattr(args, "layers", None)
    minimum = getattr(args, "positions", 0)
    key = (args.model, workload, sets["calibration"], sets["heldout"], layers, minimum)
    if key in _LLM_JOBS:
        return _LLM_JOBS[key]
    prompts = {option: _prompt_file(path, option) for option, path in sets.items()
               if path is not None and Path(path).suffix != ".npz"}
    try:
        job = llm_job(args.model, workload, layers=layers, positions_minimum=minimum, **prompts)
    except PromptTooLong as exc:  # only a set of one's own is refused (shipped prompts are cut to fit)
        raise InputError(f"--{exc.prompt_set} {sets[exc.prompt_set]}: {exc}; shorten it or give a workload with "
                         "a longer context") from None
    except (GGUFError, TokenizerError, FileNotFoundError, KeyError, ValueError) as exc:
        raise InputError(f"model {args.model!r}: {exc}") from None
    for option, path in sets.items():
        if path is not None and option not in prompts:  # an .npz batch of inputs
            job = dataclasses.replace(job, **{option: tuple(input_batches(path, job))})
            # input batches, not prompts: no windows to teacher-force
            windows = "positions" if option == "calibration" else "heldout_positions"
            job = dataclasses.replace(job, llm=dataclasses.replace(job.llm, **{windows: None}))
    _LLM_JOBS[key] = job
    return job


def _prompt_file(path: str, option: str) -> list:
    """The prompts of a --calibration / --heldout text file (one per line), or a one-line refusal."""
    from .models.llm import parse_prompts
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--{option} file {p} does not exist")
    prompts = parse_prompts(p.read_text("utf-8"))
    if not prompts:
        raise InputError(f"--{option} file {p} holds no prompts (one per line; '#' lines are comments)")
    return prompts


def record_job(plan, job, args):
    """The plan remembering its model (and an LLM's workload and layers), so audit and generate rebuild the
    same graph without --model (a built-in llama-tiny plan was audited as minilm: graph hash mismatch)."""
    from .search.plan import PlanJob
    llm = job.llm is not None
    return plan.with_job(PlanJob(args.model, str(job.llm.workload) if llm else None,
                                 getattr(args, "layers", None) if llm else None, getattr(args, "heldout", None)))


def fill_job_args(args, plan) -> None:
    """Fill --model/--workload/--layers left unset from the plan's recorded job (minilm otherwise)."""
    recorded = plan.job
    if args.model is None:
        args.model = recorded.model if recorded is not None else "minilm"
        if getattr(args, "workload", None) is None:
            args.workload = recorded.workload if recorded is not None else None
        if getattr(args, "layers", None) is None:
            args.layers = recorded.layers if recorded is not None else None


def fill_audit_set(args, plan) -> None:
    """Audit without --inputs/--calibration re-checks a plan on the held-out set its compile was given
    (--heldout, recorded in plan.json), else on the job's own held-out inputs."""
    recorded = plan.job
    if recorded is not None and recorded.heldout is not None and not (args.inputs or args.calibration):
        if not Path(recorded.heldout).is_file():  # the file compile --heldout named: the default audit set
            raise InputError(f"the plan's held-out set {recorded.heldout} (compile --heldout) does not exist here: "
                             "give --inputs or --calibration")
        if Path(recorded.heldout).suffix == ".npz":
            args.inputs = recorded.heldout
        else:
            args.calibration = recorded.heldout  # an LLM's prompts: audited on as given


def onnx_job_of(args):
    """The ONNX job when --model names a .onnx file (else None); refusals become one-line input errors."""
    from .onnx.job import is_onnx_path, onnx_job
    from .onnx.loader import OnnxImportError
    if not is_onnx_path(args.model):
        if getattr(args, "shape", None):
            raise InputError("--shape applies to ONNX models (--model model.onnx) only")
        return None
    source = getattr(args, "inputs", None) or args.calibration
    try:
        oj = onnx_job(args.model, args.shape, source)
    except OnnxImportError as exc:
        raise InputError(str(exc)) from None
    for batch in oj.job.calibration:  # ids a Gather reads must index its table (-1, which ONNX allows, too)
        check_batch(oj.job.graph, batch, source)
    return oj


def onnx_peer_rows(oj, budget, target: str):
    """ONNX Runtime FP32 / FP16 rows judged on the same FP64 reference (empty without onnxruntime)."""
    from .onnx.peers import peer_rows, run_peers
    peers = run_peers(oj.loaded.proto, oj.onnx_batches, oj.fp64_references(), budget)
    for p in peers:
        print(f"[luminal-num] peer {p.label}: error {p.error!r} ({'passes' if p.passes else 'fails'}), "
              f"{p.latency_s!r} s per batch on this CPU")
    return peer_rows(peers, target)


def input_batches(path: str | None, job) -> list[dict]:
    """Held-out batches of the job, or one batch from an .npz file (arrays named like the inputs)."""
    if path is None:
        return list(job.heldout)
    p = Path(path)
    try:
        batch = read_npz(p, "inputs")
    except ValueError as exc:
        raise InputError(str(exc)) from None
    check_batch(job.graph, batch, p)
    return [batch]


_INDEXED = {Op.GATHER: (0, 1), Op.SCATTER: (0, 2)}  # op -> (slot of the table / destination, slot of the ids)


def index_ranges(graph) -> dict[str, tuple[float, float]]:
    """Ranges implied by the graph: an input used as the ids of a Gather/Scatter must index a row of
    its table (0 <= id < rows), whether or not the model declared a value_range for it."""
    by_node = {info.node: name for name, info in graph.inputs.items()}
    out: dict[str, tuple[float, float]] = {}
    for node in graph.nodes:
        slots = _INDEXED.get(node.op)
        if slots is None:
            continue
        table, ids = (node.srcs[i] for i in slots)
        rows = table.view.shape[0]
        name = by_node.get(ids.node)
        if name is not None and is_const(rows):
            out[name] = (0.0, min(float(int(rows) - 1), out.get(name, (0.0, math.inf))[1]))
    return out


def check_batch(graph, batch: dict, source) -> None:
    """Arrays by the model's declared inputs: no unknown names, integer inputs (token ids) given as
    integers, every value inside its declared range and every id inside its table; NaN/Inf refused."""
    declared = {n: info for n, info in graph.inputs.items() if not info.is_weight}
    implied = index_ranges(graph)
    unknown = sorted(set(batch) - set(declared))
    if unknown:
        raise InputError(f"{source} holds arrays the model does not take: {unknown} (inputs: {', '.join(declared)})")
    for name, arr in batch.items():
        info = declared[name]
        if arr.dtype.kind not in "iufb":
            raise InputError(f"input {name!r} in {source} is not numeric (dtype {arr.dtype})")
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            raise InputError(f"input {name!r} in {source} contains NaN or Inf")
        if info.dtype.kind is Kind.INT and arr.dtype.kind not in "iu":
            raise InputError(f"input {name!r} in {source} holds integer ids ({info.dtype.name}); got {arr.dtype} values")
        limits = [r for r in (info.value_range, implied.get(name)) if r is not None]
        if limits and arr.size:
            lo, hi = max(r[0] for r in limits), min(r[1] for r in limits)
            if float(arr.min()) < lo or float(arr.max()) > hi:
                raise InputError(f"input {name!r} in {source} has values in [{fmt_num(arr.min(), 6)}, "
                                 f"{fmt_num(arr.max(), 6)}], outside its declared range [{fmt_num(lo, 6)}, "
                                 f"{fmt_num(hi, 6)}]")
