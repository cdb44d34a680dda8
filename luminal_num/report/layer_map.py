"""The per-layer precision map: for each group of structurally identical chunks (the layers), a picture
of chunks x kernels coloured by the format each kernel computes or stores in, so per-layer choices are
visible at a glance (reports/<name>/layer_map.png and layer_map.csv).

A kernel is placed by its e-class (the same e-class in every chunk of a group is the same op); its
format is the Gemm's variant, else the stored dtype plus a non-FP32 accumulator or compute precision.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ..codegen.kinds import KernelKind  # noqa: E402
from ..codegen.llir import Kernel, Program  # noqa: E402


def kernel_format(k: Kernel) -> str:
    if k.kind.is_gemm:
        return k.precision or "f32"
    extra = k.precision or (k.acc.name if k.acc is not None and k.acc is not k.dtype else "")
    return k.dtype.name + (f"/{extra}" if extra and extra != k.dtype.name else "")


def layer_table(program: Program, groups: list[list[int]]) -> pd.DataFrame:
    """One row per (group, chunk, e-class) of the launched kernels: its kernel label and format."""
    rows = []
    by_chunk: dict[int, list[Kernel]] = {}
    for k in program.launched():
        by_chunk.setdefault(k.chunk, []).append(k)
    for gi, chunks in enumerate(groups):
        for c in chunks:
            for k in by_chunk.get(c, []):
                rows.append({"group": gi, "chunk": c, "eclass": k.eclass, "kind": k.kind.value,
                             "op": k.label.split(" (chunk")[0], "format": kernel_format(k)})
    return pd.DataFrame(rows, columns=["group", "chunk", "eclass", "kind", "op", "format"])


def differing_groups(table: pd.DataFrame) -> list[int]:
    """The multi-chunk groups whose chunks do not all run every e-class in the same format."""
    out = []
    for g, part in table.groupby("group"):
        per_chunk = {c: tuple(sorted(zip(p["eclass"], p["format"]))) for c, p in part.groupby("chunk")}
        if len(set(per_chunk.values())) > 1:
            out.append(int(g))
    return out


def write_layer_map(program: Program, groups: list[list[int]], out_dir: str | Path) -> dict[str, Path]:
    """layer_map.csv (every placed kernel) and layer_map.png (one panel per multi-chunk group)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = layer_table(program, groups)
    csv = out_dir / "layer_map.csv"
    table.to_csv(csv, index=False)
    panels = [g for g, part in table.groupby("group") if part["chunk"].nunique() > 1] or sorted(table["group"].unique())[:1]
    formats = sorted(table["format"].unique())
    colour = {f: i for i, f in enumerate(formats)}
    cmap = plt.get_cmap("tab20", max(len(formats), 1))
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.2 + 0.45 * sum(
        table[table.group == g].chunk.nunique() for g in panels) + 0.6 * len(panels)), squeeze=False)
    for ax, g in zip(axes[:, 0], panels):
        part = table[table.group == g]
        chunks = sorted(part["chunk"].unique())
        cols = list(dict.fromkeys(part["eclass"]))  # first chunk's kernel order
        grid = np.full((len(chunks), len(cols)), np.nan)
        for r in part.itertuples():
            grid[chunks.index(r.chunk), cols.index(r.eclass)] = colour[r.format]
        ax.imshow(grid, aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(formats) - 0.5, interpolation="nearest")
        ax.set_yticks(range(len(chunks)), [f"chunk {c}" for c in chunks])
        ops = dict(zip(part["eclass"], part["op"]))
        ax.set_xticks(range(len(cols)), [ops[c] for c in cols], rotation=90, fontsize=6)
        ax.set_title(f"group {g}: {len(chunks)} chunk(s) x {len(cols)} kernels", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(colour[f])) for f in formats]
    fig.legend(handles, formats, loc="upper right", fontsize=7, ncol=min(len(formats), 6))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    png = out_dir / "layer_map.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return {"layer_map_csv": csv, "layer_map_png": png}
