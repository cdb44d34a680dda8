"""The Plan: a versioned, self-describing JSON document of what the compiler chose and why to trust it.

It records the graph's structural hash, the budget, the precision genome and the exact e-node chosen
for every e-class (so loading can verify that this compiler rebuilds the same choice space), the
per-kernel table of what runs, the verdict and its source, the error, the latency and its source.
Serialisation is canonical (sorted keys, floats as repr) so the same seed gives the same bytes.
"""
from __future__ import annotations

import dataclasses

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import __version__
from ..codegen.attention import attention_row
from ..codegen.cuda_dispatch import gemm_implementation
from ..codegen.kinds import LAUNCHED_KINDS, backend_table
from ..codegen.llir import KernelKind, Program, count_ops, external_value
from ..codegen.rows import row_sums
from ..codegen.serialize import LlirDataError, program_from_data, program_to_data
from ..dtypes.variants import GEMM_VARIANTS
from ..error.budget import Budget
from ..error.metric_values import MetricValues
from ..hlir.gemm import gemm_operand_b, read_operand
from ..hlir.graph import Graph
from ..hlir.partition import Partition, partition
from ..hlir.store import STREAMING
from ..files import atomic_write_bytes, atomic_write_text
from ..quant.scales import compute_scales
from ..quant.storage import STORAGE_FORMATS
from ..quant.stored import FILL_SEPARATOR, convert_all, stored_key
from ..quant.weights_file import WeightsFileError, content_hash, load_weights, save_weights
from .outcome import InvariancePrice
from .plan_file import PlanError, PlanLatency, array_sha256, check_digest, check_fields, with_digest
from .plan_file import json_number as _num, number_from_json as _float
from .space import ChunkSite, Genome, SearchSpace

PLAN_FORMAT = "luminal_num.plan"
PLAN_VERSION = 2  # 2: the lowered LLIR is stored ("llir"); version-1 files are refused


def graph_key(graph: Graph) -> str:
    """Structure plus input/output names (a plan names the outputs it was judged on)."""
    return graph.structural_key(extra=("io", tuple(sorted(graph.inputs)), tuple(sorted(graph.outputs))))


def op_table(program: Program, bindings) -> list[dict]:
    """Per launched kernel: what actually runs (dtype, accumulator, quant format, scale granularity) and what
    the CUDA runtime launches for it at these bindings (`implementation`: a Gemm's cuda_dispatch.GemmImpl
    value, else its kind: the class the cost model prices)."""
    rows = []
    dtypes = program.dtypes()
    for k in program.launched():
        implementation = gemm_implementation(k, program, bindings).value if k.kind.is_gemm else k.kind.value
        row = {"kernel": k.id, "chunk": k.chunk, "kind": k.kind.value, "op": k.label, "implementation": implementation,
               "dtype": k.dtype.name,
               "inputs": ",".join(dtypes[i.buffer].name for i in k.inputs),
               "weights": _weights_read(program, k, bindings),
               "shape": "x".join(str(d) for d in k.shape), "accumulator": "", "precision": k.precision or "",
               "quant": "", "scales": "", **_OP_ROW[k.kind](k)}
        rows.append(row)
    return rows


def _weights_read(program: Program, k, bindings) -> str:
    """The stored weights a kernel reads: "name:format:bytes" each (what the cost model charges for them)."""
    out = []
    for inp in k.inputs:
        src = program.kernel(inp.buffer)
        if src.storage is not None:
            shape = tuple(int(d) for d in src.shape)
            held = src.storage + (f"{FILL_SEPARATOR}{src.fill}" if src.fill else "")
            out.append(f"{src.external}:{held}:{STORAGE_FORMATS[src.storage].stored_bytes(shape)}")
    return ";".join(out)


def _gemm_row(k) -> dict:
    v = GEMM_VARIANTS[k.precision or "f32"]
    return {"accumulator": v.accumulator.name + (f" (promote every {v.promote_every})" if v.promote_every else ""),
            "quant": f"A:{v.a_format.name} B:{v.b_format.name}",
            "scales": "; ".join(_scale_label(side, s) for side, s in (("A", v.a_scale), ("B", v.b_scale))
                                if s is not None)}


def _rows_row(k) -> dict:
    """A row kernel: the accumulators of the row sums it holds (codegen/llir.py FRowSum)."""
    return {"accumulator": ",".join(sorted({s.acc.name for s in row_sums(k.body)})) or k.dtype.name}


def _no_extra(k) -> dict:
    return {}


# What the op table adds per kind beyond dtype and shape (one entry per launched kind).
_OP_ROW = backend_table("plan op table", {
    KernelKind.CONST: _no_extra, KernelKind.IOTA: _no_extra, KernelKind.ELEMENTWISE: _no_extra,
    KernelKind.SUM: lambda k: {"accumulator": (k.acc or k.dtype).name},
    KernelKind.MAX: _no_extra, KernelKind.SOFTMAX: _no_extra, KernelKind.GEMM: _gemm_row,
    # what the dynamic scales of the Gemm's A actually are
    KernelKind.QUANTIZE: lambda k: {"quant": f"A:{k.dtype.name}", "scales": _scale_label("A", k.scale_spec)},
    KernelKind.GATHER: _no_extra, KernelKind.SCATTER: _no_extra, KernelKind.SCATTER_NOCOPY: _no_extra,
    KernelKind.GEMM_EPILOGUE: lambda k: {**_gemm_row(k), "epilogue": f"{count_ops(k.body)} ops on the accumulator"},
    KernelKind.ATTENTION: attention_row,
    KernelKind.ROWS: _rows_row, KernelKind.SCATTER_EW: _rows_row,
}, LAUNCHED_KINDS)


def _scale_label(side: str, spec) -> str:
    """e.g. "A:channel/dynamic", "B:mx/static/e8m0"."""
    return (f"{side}:{spec.granularity.value}{'/static' if spec.static else '/dynamic'}"
            f"{'/e8m0' if spec.scale_format.name == 'e8m0' else ''}")


def static_weight_scales(program: Program, weights, bindings) -> dict[int, np.ndarray]:
    """Compile-time scales of every Gemm whose variant scales its weight operand statically."""
    out = {}
    ext = {k.id: k for k in program.kernels if k.kind is KernelKind.EXTERNAL}
    for k in program.launched():
        if not k.kind.is_gemm:
            continue
        v = GEMM_VARIANTS[k.precision or "f32"]
        if v.b_scale is None or not v.b_scale.static:
            continue
        src = ext.get(k.inputs[1].buffer)
        if src is None or src.kind is not KernelKind.EXTERNAL or any(n not in weights for n in src.weight_sources):
            raise PlanError(f"kernel {k.id} uses static weight scales but its B operand is not a weight")
        b = gemm_operand_b(read_operand(k.inputs[1].view, external_value(src, weights).astype(np.float32), bindings),
                           k.layout)
        out[k.id] = compute_scales(b, v.b_format, v.b_scale)
        for n in src.weight_sources:  # read whole: a streaming compile gives its pages back
            STREAMING.after_read(weights[n])
    return out


def stored_layout(program: Program) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """stored_key -> (weight name, storage format, shape) of every weight the program holds in a format
    (stored_fills says which are filled by a calibrated rounding)."""
    shapes = {k.external: tuple(int(d) for d in k.shape) for k in program.kernels
              if k.kind is KernelKind.EXTERNAL and not k.concat}
    return {stored_key(name, k.storage, k.fill): (name, k.storage, shapes[name]) for k, name in _stored(program)}


def stored_fills(program: Program) -> dict[str, str]:
    """stored_key -> fill of the stored weights whose codes a calibrated rounding chose (quant/calibration.Fill)."""
    return {stored_key(name, k.storage, k.fill): k.fill for k, name in _stored(program) if k.fill is not None}


def _stored(program: Program):
    """(EXTERNAL kernel, weight name) of every weight the weights file holds: KV caches are runtime inputs,
    converted on entry; a concatenation held in a format (KCatStored) is its parts' stored tensors."""
    caches = program.cache_buffers()
    return [(k, name) for k in program.kernels if k.storage is not None and k.kind is KernelKind.EXTERNAL
            and k.id not in caches for name in (k.concat or (k.external,))]


def weights_path(plan_path: str | Path) -> Path:
    p = Path(plan_path)
    return p.with_name(p.stem + "_weights.safetensors")


def scales_path(plan_path: str | Path) -> Path:
    p = Path(plan_path)
    return p.with_name(p.stem + "_scales.npz")


@dataclass(frozen=True)
class PlanVerdict:
    """The chosen plan's verdict as the plan states it."""
    passed: bool
    source: str
    error: float          # allclose share of the user's budget (Share.user_allclose)
    max_abs: float
    bound: float | None
    reason: str
    budget_share: float   # of the user's budget, over allclose and every metric (the reports' error axis)
    metrics: MetricValues  # each budget metric's worst value on the calibration set (empty: none recorded)


@dataclass(frozen=True)
class PlanJob:
    """The job the CLI compiled (so audit and generate rebuild the same graph without --model)."""
    model: str | None = None
    workload: str | None = None   # an LLM's workload (e.g. decode:8@64)
    layers: int | None = None     # an LLM's first N decoder layers
    heldout: str | None = None    # compile --heldout FILE: what audit re-checks the plan on by default

    def record(self) -> dict:
        """As plan.json's `job` (heldout only when given: other plans keep their bytes)."""
        rec = {"model": self.model, "workload": self.workload, "layers": self.layers}
        return rec if self.heldout is None else {**rec, "heldout": self.heldout}


@dataclass(frozen=True)
class Plan:
    data: dict  # the canonical plan.json record (read through the typed properties below)
    scales: dict | None = None  # Gemm kernel id -> static weight scales (saved beside the plan)
    stored: dict | None = None  # stored_key -> StoredTensor: weights converted to their storage formats

    @staticmethod
    def create(space: SearchSpace, genome: Genome, program: Program, budget: Budget, target: str, seed: int,
               verdict, latency, bindings, search_stats: dict, calibration_ranges: dict,
               weights=None, headroom: float = 1.0) -> "Plan":
        """`verdict.share.user_allclose` (the allclose share of the user's budget) is the error the plan states,
        beside the share of the budget over every metric (the reports' error axis)."""
        cands = space.candidates(genome)
        groups = []
        for gi, g in enumerate(space.part.groups):
            cand = cands[g.chunks[0].index]
            gs = space.groups[g.key].space
            entry = {"group": gi, "chunks": [c.index for c in g.chunks],
                     "choices": [[cls, idx, gs.classes[cls][idx].op] for cls, idx in cand.choices]}
            own = {str(c.index): [[cls, idx, gs.classes[cls][idx].op] for cls, idx in cands[c.index].choices]
                   for c in g.chunks[1:] if cands[c.index] != cand}
            if own:  # precision per chunk: the chunks whose choices differ from the group's first chunk
                entry["chunk_choices"] = own
            groups.append(entry)
        data = {
            "format": PLAN_FORMAT, "version": PLAN_VERSION, "compiler_version": __version__,
            "graph_key": graph_key(space.graph), "budget": budget.to_dict(), "target": target, "seed": seed,
            "genome": sorted(_genome_entry(space, site, c, t) for site, c, t in genome),
            "groups": groups,
            # error: allclose alone (0 under an LLM's atol=inf); budget_share: over allclose and every metric
            "verdict": {"passed": bool(verdict.passed), "source": verdict.source, "error": _num(verdict.share.user_allclose),
                        "budget_share": _num(verdict.share.of_budget(headroom)),
                        "max_abs": _num(verdict.max_abs), "bound": _num(verdict.bound), "reason": verdict.reason,
                        "metrics": verdict.metrics.record()},
            "latency": PlanLatency.record(latency),
            "kernels": op_table(program, bindings),
            "calibration_ranges": {k: [_num(lo), _num(hi)] for k, (lo, hi) in sorted(calibration_ranges.items())},
            "search": search_stats,
            "headroom": headroom,
            # what runs, exactly: audit and the runtimes load it without rebuilding the e-graph; each
            # kernel names its chunk and e-class, the choices above are its provenance
            "llir": program_to_data(program),
        }
        if program.batch_invariant:  # a requirement like the budget: audit checks it, runtimes honour it
            data["requirements"] = {"batch_invariant": True}
        scales = static_weight_scales(program, weights or {}, bindings)
        data["static_scales"] = {str(kid): {"kernel": kid, "shape": list(arr.shape), "sha256": array_sha256(arr)}
                                for kid, arr in sorted(scales.items())}
        layout = stored_layout(program)
        fills = stored_fills(program)
        missing = sorted({n for k, _ in _stored(program) for n in k.weight_sources} - set(weights or {}))
        if missing:
            raise PlanError(f"the plan stores weights it was not given: {', '.join(missing)}")
        rotated = {k.external: external_value(k, weights) for k, _ in _stored(program)
                   if k.rotation is not None or k.smoothing is not None}
        stored = convert_all({**(weights or {}), **rotated},
                             {key: (name, fmt) for key, (name, fmt, _) in layout.items()}, fills)
        if stored:  # the converted weights, tied to this plan by graph hash and content hash
            data["stored_weights"] = {key: {"weight": name, "format": fmt, "shape": list(shape),
                                            **({"fill": fills[key]} if key in fills else {})}
                                      for key, (name, fmt, shape) in sorted(layout.items())}
            data["weights_sha256"] = content_hash(stored)
        return Plan(data, scales, stored or None)

    # -- serialisation ------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(self.data, sort_keys=True, indent=1) + "\n"

    def save(self, path: str | Path) -> Path:
        """plan.json, plus <stem>_scales.npz holding the static weight scales when there are any."""
        data = dict(self.data)
        if self.scales:
            buf = io.BytesIO()
            np.savez(buf, **{f"k{kid}": arr for kid, arr in sorted(self.scales.items())})
            atomic_write_bytes(scales_path(path), buf.getvalue())
            data["scales_file"] = scales_path(path).name
        if self.stored:
            save_weights(weights_path(path), self.stored, self.data["graph_key"])
            data["weights_file"] = weights_path(path).name
        return atomic_write_text(path, json.dumps(with_digest(data), sort_keys=True, indent=1) + "\n")

    @staticmethod
    def load(path: str | Path) -> "Plan":
        path = Path(path)
        if not path.exists():
            raise PlanError(f"plan file {path} does not exist")
        if not path.is_file():
            raise PlanError(f"{path} is not a plan file (it is a directory or a special file)")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PlanError(f"plan file {path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"{path} is not a luminal_num plan (format field missing or wrong)")
        if data.get("version") == 1:
            raise PlanError(f"{path} is a version-1 plan (no stored LLIR); this compiler reads {PLAN_VERSION}: "
                            "compile it again")
        if data.get("version") != PLAN_VERSION:
            raise PlanError(f"{path} has plan version {data.get('version')!r}; this compiler reads {PLAN_VERSION}")
        for key in ("graph_key", "budget", "genome", "groups", "target", "verdict", "latency", "kernels", "llir"):
            if key not in data:
                raise PlanError(f"plan file {path} is missing the field {key!r}")
        check_fields(data, f"plan file {path}")
        data = check_digest(data, f"plan file {path}")
        scales = None
        if data.get("scales_file"):
            sp = path.with_name(data["scales_file"])
            if not sp.exists():
                raise PlanError(f"the plan's static scales file {sp} is missing")
            try:
                with np.load(sp) as f:
                    scales = {int(k[1:]): f[k] for k in f.files}
            except Exception as exc:  # noqa: BLE001 - any unreadable scales file is a corrupt plan
                raise PlanError(f"cannot read the plan's static scales {sp}: {exc}") from None
            listed = {v["kernel"]: v.get("sha256") for v in data.get("static_scales", {}).values()}
            if sorted(scales) != sorted(listed) or any(array_sha256(scales[k]) != listed[k] for k in scales):
                raise PlanError(f"{sp} does not hold the scales the plan lists (content hash differs)")
        return Plan(data, scales, _load_stored(path, data))

    # -- use ----------------------------------------------------------------------------------
    @property
    def stored_weights(self) -> dict:
        """stored_key -> StoredTensor for the runtimes (empty when no weight is held in a format)."""
        return dict(self.stored or {})

    @property
    def budget(self) -> Budget:
        return Budget.from_dict(self.data["budget"])

    def with_fields(self, **fields) -> "Plan":
        """This plan with top-level fields added or replaced (the job it records, a partial result's mark):
        a new Plan, so no caller edits a plan's data in place."""
        return dataclasses.replace(self, data={**self.data, **fields})

    def with_invariance_price(self, price: InvariancePrice) -> "Plan":
        """A batch-invariant plan recording its price (a field only such plans have: ordinary plans' bytes stay)."""
        if not self.batch_invariant:
            raise PlanError("only a batch-invariant plan has a price of invariance")
        return self.with_fields(invariance_price={"target": price.target, "source": price.source,
                                                  "invariant_s": _num(price.invariant_s), "plain_s": _num(price.plain_s),
                                                  "ratio": _num(price.ratio)})

    @property
    def invariance_price(self) -> InvariancePrice | None:
        rec = self.data.get("invariance_price")
        return None if rec is None else InvariancePrice(str(rec["target"]), str(rec["source"]),
                                                        _float(rec["invariant_s"]), _float(rec["plain_s"]))

    def with_source(self, source: dict) -> "Plan":
        """This plan recording the model file it was compiled from (e.g. {"format", "file", "sha256"})."""
        return self.with_fields(source=dict(source))

    # -- typed reads of the record ------------------------------------------------------------
    @property
    def verdict(self) -> PlanVerdict:
        v = self.data["verdict"]
        return PlanVerdict(bool(v["passed"]), str(v["source"]), _float(v["error"]), _float(v["max_abs"]),
                           _float(v["bound"]), str(v["reason"]), _float(v["budget_share"]),
                           MetricValues.from_record(v.get("metrics", {})))  # checked on load (plan_file.py)

    @property
    def latency(self) -> PlanLatency:
        return PlanLatency.from_record(self.data["latency"])

    @property
    def kernels(self) -> list[dict]:
        """The per-kernel table of what runs (op_table's rows)."""
        return list(self.data["kernels"])

    @property
    def pooled_positions(self) -> int:
        """The teacher-forced positions its verdict was pooled over (0: the calibration batches, worst batch)."""
        record = (self.data.get("search") or {}).get("positions") or {}
        return int(record.get("positions", 0)) if record.get("metrics") else 0

    @property
    def interrupted(self) -> str:
        """Why the search stopped early ("" for a complete search's plan)."""
        return str(self.data.get("interrupted") or "")

    @property
    def job(self) -> PlanJob | None:
        """The job the CLI recorded (None when compiled through the API)."""
        rec = self.data.get("job")
        return PlanJob(rec.get("model"), rec.get("workload"), rec.get("layers"), rec.get("heldout")) if rec else None

    def with_job(self, job: PlanJob) -> "Plan":
        return self.with_fields(job=job.record())

    @property
    def calibration_ranges(self) -> dict[str, tuple[float, float]]:
        return {k: (_float(lo), _float(hi)) for k, (lo, hi) in self.data.get("calibration_ranges", {}).items()}

    @property
    def headroom(self) -> float:
        return float(self.data.get("headroom", 1.0))

    @property
    def batch_invariant(self) -> bool:
        """Whether the plan requires batch invariance (issue 37): its LLIR says so too, or it is refused."""
        required = bool(self.data.get("requirements", {}).get("batch_invariant", False))
        if required != bool(self.data.get("llir", {}).get("batch_invariant", False)):
            raise PlanError(f"the plan {'requires' if required else 'does not require'} batch invariance but its "
                            "LLIR says otherwise (edited plan?)")
        return required

    def describe(self) -> str:
        """One line: version, compiler, target, seed."""
        d = self.data
        return f"plan v{d['version']} (compiler {d['compiler_version']}), target {d['target']}, seed {d['seed']}"

    def check_source(self, source: dict) -> None:
        """A plan that recorded its model file refuses a file with other bytes (sha256 differs)."""
        recorded = self.data.get("source")
        if recorded and recorded.get("sha256") != source.get("sha256"):
            raise PlanError(f"model file mismatch: the plan was compiled from {recorded.get('file')!r} "
                            f"sha256 {str(recorded.get('sha256'))[:12]}, this file has {str(source.get('sha256'))[:12]}")

    def check_graph(self, graph: Graph) -> None:
        if self.data["graph_key"] != graph_key(graph):
            raise PlanError("graph hash mismatch: this plan was compiled for a different graph "
                            f"(plan {self.data['graph_key'][:12]}, graph {graph_key(graph)[:12]})")

    def genome(self, space: SearchSpace) -> Genome:
        """[group, e-class, tag] applies to every chunk of the group; [group, e-class, tag, chunk] to one."""
        keys = [g.key for g in space.part.groups]
        out = []
        for entry in self.data["genome"]:
            if not (isinstance(entry, list) and len(entry) in (3, 4) and isinstance(entry[0], int)
                    and 0 <= entry[0] < len(keys)):
                raise PlanError(f"genome entry {entry!r} names no group of this graph ({len(keys)} groups)")
            group = space.part.groups[entry[0]]
            if len(entry) == 4 and entry[3] not in [c.index for c in group.chunks]:
                raise PlanError(f"genome entry {entry!r} names a chunk that is not in group {entry[0]}")
            site = keys[entry[0]] if len(entry) == 3 else ChunkSite(keys[entry[0]], entry[3])
            out.append((site, entry[1], entry[2]))
        return frozenset(out)

    def program(self, graph: Graph, space: SearchSpace | None = None) -> tuple[Program, Partition]:
        """The stored program (no e-graph is built), and the graph's partition. Given a `space`, also
        verify that this compiler's choice space rebuilds exactly the recorded choices and program."""
        self.check_graph(graph)
        try:
            program = program_from_data(self.data["llir"])
        except LlirDataError as exc:
            raise PlanError(f"the plan's LLIR cannot be loaded: {exc}") from None
        if space is None:
            return program, partition(graph)
        space = space.with_batch_invariance(self.batch_invariant)
        genome = self.genome(space)
        cands = space.candidates(genome)
        for grp in self.data["groups"]:
            if not 0 <= grp.get("group", -1) < len(space.part.groups):
                raise PlanError(f"the plan names group {grp.get('group')!r}, which this graph does not have")
            g = space.part.groups[grp["group"]]
            own = grp.get("chunk_choices", {})
            for c in g.chunks:
                recorded = own.get(str(c.index), grp["choices"])
                want = [(cls, i) for cls, i, _ in recorded]
                if list(cands[c.index].choices) != want or any(
                        space.groups[g.key].space.classes[cls][i].op != op for cls, i, op in recorded):
                    raise PlanError(f"group {grp['group']} chunk {c.index}: the recorded choices do not match "
                                    "this compiler's choice space (plan from another compiler version?)")
        if program_to_data(space.program(genome)) != self.data["llir"]:
            raise PlanError("the stored LLIR is not what this compiler lowers from the recorded choices")
        return program, space.part


def _genome_entry(space: SearchSpace, site, cls: str, tag: str) -> list:
    if isinstance(site, ChunkSite):
        return [space.group_index(site.group), cls, tag, site.chunk]
    return [space.group_index(site), cls, tag]


def _load_stored(path: Path, data: dict) -> dict | None:
    """The plan's weights file, verified against the plan (graph hash, formats, shapes, content hash)."""
    listed = data.get("stored_weights") or {}
    if not listed:
        return None
    if not data.get("weights_file"):
        raise PlanError(f"plan file {path} stores {len(listed)} converted weights but names no weights file")
    expected = {key: (rec["format"], tuple(rec["shape"])) for key, rec in listed.items()}
    kernels = data["llir"].get("kernels", [])
    caches = {k["inputs"][0][0] for k in kernels if k["kind"] == KernelKind.SCATTER_NOCOPY.value and k.get("storage")}
    in_llir = {stored_key(name, k["storage"], k.get("fill")) for k in kernels
               if k.get("storage") and k["kind"] == KernelKind.EXTERNAL.value and k["id"] not in caches
               for name in (k.get("concat") or [k["external"]])}
    if in_llir != set(expected):
        raise PlanError(f"plan file {path}: its stored-weights table does not match the stored weights its LLIR reads")
    try:
        loaded = load_weights(path.with_name(data["weights_file"]), data["graph_key"], expected)
    except WeightsFileError as exc:
        raise PlanError(str(exc)) from None
    if loaded.content_hash != data.get("weights_sha256"):
        raise PlanError(f"{data['weights_file']}: content hash {loaded.content_hash[:16]}... is not the plan's "
                        f"{str(data.get('weights_sha256'))[:16]}...")
    return dict(loaded.tensors)
