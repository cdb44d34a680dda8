"""The per-layer precision map: for every group of structurally identical chunks (the layers, and the
single embedding and head chunks), a picture of chunks x kernels coloured by what each kernel computes
in and what its weights are stored in, so per-layer choices are visible at a glance
(reports/<name>/layer_map.png and layer_map.csv; the picture is also on pareto.html).

A kernel is placed by its e-class (the same e-class in every chunk of a group is the same op) and named by
the weights it reads (q, k, v, o, gate, up, down, lm_head; q+k+v for a Gemm over concatenated weights),
else by its kind: e-graph names (KGemm, SumReduce) say nothing to a reader. Its format is the Gemm's
variant, else the stored dtype plus a non-FP32 accumulator or compute precision, followed by the storage
format of the weights or cache rows it reads (`bf16 w:int8_channel`: a W8A16 Gemm is not a BF16 one).
"""
from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ..codegen.kinds import KernelKind  # noqa: E402
from ..codegen.llir import Kernel, Program  # noqa: E402

# a layer's weights are named <prefix>.<layers|layer|h|blocks>.<i>.<role>[.weight]; the role names the op
_LAYER_ROLE = re.compile(r"(?:^|\.)(?:layers?|h|blocks?)\.\d+\.(.+)$")
_GENERIC = frozenset({"dense", "linear", "proj", "weight", "kernel"})  # say nothing alone: keep their path


def weight_role(name: str) -> str:
    """A weight's short name: model.layers.3.self_attn.q_proj.weight -> q, mlp.down_proj -> down, lm_head
    -> lm_head, encoder.layer.0.attention.output.dense.weight -> attention.output.dense."""
    base = name[:-len(".weight")] if name.endswith(".weight") else name
    match = _LAYER_ROLE.search(base)
    role = match.group(1) if match else base
    last = role.split(".")[-1]
    short = role if last in _GENERIC else last
    return short[:-len("_proj")] if short.endswith("_proj") else short


def _weights_of(program: Program, k: Kernel, weights: frozenset[str]) -> list[Kernel]:
    """The EXTERNAL weight kernels `k` reads directly (a concatenation counts as its parts' one kernel)."""
    out = []
    for inp in k.inputs:
        src = program.kernel(inp.buffer)
        if src.kind is KernelKind.EXTERNAL and (src.derived or src.external in weights):
            out.append(src)
    return out


def kernel_name(program: Program, k: Kernel, weights: frozenset[str]) -> str:
    """What a reader calls the kernel: the role of the weights it reads, else its kind."""
    srcs = _weights_of(program, k, weights)
    roles = [weight_role(n) for src in srcs for n in src.weight_sources]
    if any(src.rotation is not None for src in srcs):  # a rotated weight's Gemm, or the online rotation (H_b)
        return "+".join(dict.fromkeys(roles)) + " (rotated)" if roles else "hadamard"
    if any(src.smoothing is not None for src in srcs):  # a smoothed weight's Gemm, or the activation's 2^-e multiply
        return "+".join(dict.fromkeys(roles)) + " (smoothed)" if roles else "smoothing scale"
    return "+".join(dict.fromkeys(roles)) if roles else k.kind.value


def kernel_format(k: Kernel) -> str:
    """What the kernel computes in (a Gemm's variant, else its dtype and a narrower accumulator/compute)."""
    if k.kind.is_gemm:
        return k.precision or "f32"
    extra = k.precision or (k.acc.name if k.acc is not None and k.acc is not k.dtype else "")
    return k.dtype.name + (f"/{extra}" if extra and extra != k.dtype.name else "")


def held_format(program: Program, k: Kernel, weights: frozenset[str]) -> str:
    """kernel_format plus the storage of what it reads: weights (`w:`) and KV-cache rows (`kv:`)."""
    read_weights = _weights_of(program, k, weights)
    held = [f"w:{src.storage}" for src in read_weights if src.storage]
    others = [program.kernel(inp.buffer) for inp in k.inputs]
    held += [f"kv:{src.storage}" for src in others if src.storage and src.id not in {w.id for w in read_weights}]
    if k.storage and k.kind is not KernelKind.EXTERNAL:
        held.append(f"kv:{k.storage}")
    return " ".join([kernel_format(k), *dict.fromkeys(held)])


def layer_table(program: Program, groups: list[list[int]], weights=frozenset()) -> pd.DataFrame:
    """One row per (group, chunk, e-class) of the launched kernels: its name and format. `weights`: the
    graph's weight names (what a Gemm is named after)."""
    weights = frozenset(weights)
    rows = []
    by_chunk: dict[int, list[Kernel]] = {}
    for k in program.launched():
        by_chunk.setdefault(k.chunk, []).append(k)
    for gi, chunks in enumerate(groups):
        for c in chunks:
            for k in by_chunk.get(c, []):
                rows.append({"group": gi, "chunk": c, "eclass": k.eclass, "kind": k.kind.value,
                             "op": kernel_name(program, k, weights), "format": held_format(program, k, weights)})
    return pd.DataFrame(rows, columns=["group", "chunk", "eclass", "kind", "op", "format"])


def differing_groups(table: pd.DataFrame) -> list[int]:
    """The multi-chunk groups whose chunks do not all run every e-class in the same format."""
    out = []
    for g, part in table.groupby("group"):
        per_chunk = {c: tuple(sorted(zip(p["eclass"], p["format"]))) for c, p in part.groupby("chunk")}
        if len(set(per_chunk.values())) > 1:
            out.append(int(g))
    return out


def write_layer_map(program: Program, groups: list[list[int]], out_dir: str | Path,
                    weights=frozenset()) -> dict[str, Path]:
    """layer_map.csv (every placed kernel) and layer_map.png (one panel per group, chunks as rows)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = layer_table(program, groups, weights)
    csv = out_dir / "layer_map.csv"
    table.to_csv(csv, index=False)
    panels = sorted(int(g) for g in table["group"].unique())
    formats = sorted(table["format"].unique())
    colour = {f: i for i, f in enumerate(formats)}
    cmap = plt.get_cmap("tab20", max(len(formats), 1))
    rows = [table[table.group == g].chunk.nunique() for g in panels]
    # inches: 0.3 per chunk row, plus each panel's title and rotated kernel names, plus the legend
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 0.8 + sum(0.3 * n + 1.5 for n in rows)), squeeze=False,
                             gridspec_kw={"height_ratios": [max(n, 1) for n in rows]})
    for ax, g in zip(axes[:, 0], panels):
        part = table[table.group == g]
        chunks = sorted(part["chunk"].unique())
        cols = list(dict.fromkeys(part["eclass"]))  # first chunk's kernel order
        grid = np.full((len(chunks), len(cols)), np.nan)
        for r in part.itertuples():
            grid[chunks.index(r.chunk), cols.index(r.eclass)] = colour[r.format]
        ax.imshow(grid, aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(formats) - 0.5, interpolation="nearest")
        ax.set_yticks(range(len(chunks)), [f"chunk {c}" for c in chunks], fontsize=7)
        names = dict(zip(part["eclass"], part["op"]))
        ax.set_xticks(range(len(cols)), [names[c] for c in cols], rotation=90, fontsize=6)
        ax.set_title(f"group {g}: {len(chunks)} chunk(s) x {len(cols)} kernels", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(colour[f])) for f in formats]
    fig.legend(handles, formats, loc="upper right", fontsize=7, ncol=min(len(formats), 4))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    png = out_dir / "layer_map.png"
    fig.savefig(png, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return {"layer_map_csv": csv, "layer_map_png": png}
