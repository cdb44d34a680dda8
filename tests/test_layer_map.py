"""The per-layer precision map shows what each chunk's kernels run in, placed by e-class."""
import pytest

from luminal_num.models.testnets import transformer
from luminal_num.report.layer_map import layer_table, write_layer_map
from luminal_num.search.extract import extract
from luminal_num.search.lower import lower_program
from luminal_num.search.space import SearchSpace


@pytest.fixture(scope="module")
def tspace():
    return SearchSpace.build(transformer(3).graph, fusion=False)  # one Gemm per knob (no fused q/k/v)


def test_map_shows_a_per_chunk_difference(tspace, tmp_path):
    """Chunk 1 alone gets BF16 on one Gemm (built by lowering per-chunk candidates directly): the map
    differs from its neighbours at exactly that kernel, and agrees everywhere else."""
    group = next(g for g in tspace.part.groups if len(g.chunks) > 1)
    gemm = next(k for k in tspace.knobs[group.key] if "gemm:bf16" in k.tags)
    cands = tspace.candidates(frozenset())
    cands[group.chunks[1].index] = extract(tspace.groups[group.key].space, {gemm.cls: "gemm:bf16"})
    program = lower_program(tspace.graph, tspace.part, tspace.groups, cands)
    groups = [[c.index for c in g.chunks] for g in tspace.part.groups]
    table = layer_table(program, groups)
    part = table[table.group == tspace.part.groups.index(group)]
    pivot = part.pivot(index="eclass", columns="chunk", values="format")
    c0, c1, c2 = (c.index for c in group.chunks)
    differs = pivot[pivot[c1] != pivot[c0]]
    assert list(differs.index) == [gemm.cls] and differs.loc[gemm.cls, c1] == "bf16"
    assert (pivot[c0] == pivot[c2]).all() and (pivot[c0].loc[gemm.cls] == "f32")
    files = write_layer_map(program, groups, tmp_path)
    assert files["layer_map_png"].stat().st_size > 1000
    assert files["layer_map_csv"].read_text().count("\n") == len(table) + 1
