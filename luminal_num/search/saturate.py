"""Saturate one group's egglog program in phases and read its choice space back.

Phases (Luminal-style): lower + dtype_prop to a fixpoint, then precision variants, then inplace and
its cleanup. Timings, e-node/e-class counts and per-rule match counts are returned for benchmarks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from egglog import EGraph, i64, relation

from ..hlir.graph import Graph
from ..hlir.partition import Group
from . import egraph as E
from .choice import ChoiceSpace, read_choice_space
from .encode import ChunkTables, encode_chunk
from .rules.dtype_prop import dtype_prop
from .horizontal import fusion_groups, plan_fusions
from .rules.fuse_gemm import epilogue_facts, epilogue_sinks, fuse_gemm, horizontal_facts
from .rules.fuse_attention import attention_facts, attention_schedule
from .rules.fuse_rows import fuse_rows, row_facts
from .rules.inplace import cleanup, inplace
from .rules.lower import lower
from .rules.rotate import rotate
from .rules.smooth import smooth

RootOf = relation("RootOf", E.T, i64)  # marks exported values so they survive serialization by class


def serialized_json(eg: EGraph) -> str:
    """The whole e-graph as egraph-serialize JSON (`nodes` with op / children / eclass / subsumed,
    `class_data` with each class's sort). egglog 14 has no public call for it: `freeze()` is a
    debugging snapshot of replayable actions, not the e-classes. This is the one place that calls the
    private `_serialize`; tests/test_search.py fails loudly if its signature or format changes."""
    return eg._serialize(split_primitive_outputs=False).to_json()


@dataclass(frozen=True)
class SaturationStats:
    encode_s: float
    saturate_s: float
    read_s: float
    e_classes: int
    e_nodes: int
    rule_matches: tuple[tuple[str, int], ...]
    gemm_candidates: int

    def matches(self, needle: str) -> int:
        """Total matches of rules whose text contains `needle` (for reports and tests)."""
        return sum(n for name, n in self.rule_matches if needle in name)


@dataclass(frozen=True)
class GroupSpace:
    group: Group
    space: ChoiceSpace
    tables: ChunkTables
    stats: SaturationStats


def saturate_group(graph: Graph, group: Group, consumers=None, precision_rules=None, fusion: bool = True,
                   calibrated: bool = False, rotation: bool = False, smoothing: bool = False) -> GroupSpace:
    """`fusion`: add the fused-kernel alternatives (one phase after precision); False keeps the
    unfused space exactly. `calibrated`: offer calibrated weight roundings (GPTQ) too. `rotation`: offer
    each weight Gemm with its K Hadamard-rotated (search/rules/rotate.py; with the precision rules only).
    `smoothing`: offer each weight Gemm with its K smoothed per channel (search/rules/smooth.py; likewise)."""
    t0 = time.perf_counter()
    rotation = rotation and precision_rules is not None
    smoothing = smoothing and precision_rules is not None
    enc = encode_chunk(graph, group.representative, consumers, group.chunks, calibrated, rotation, smoothing)
    eg = enc.egraph
    local = {nid: i for i, nid in enumerate(group.representative.nodes)}
    eg.register(*[RootOf(enc.terms[nid], local[nid]) for nid in group.representative.exported])
    t1 = time.perf_counter()
    reports = [eg.run((lower.saturate() + dtype_prop.saturate()).saturate())]
    if rotation:  # before the precision phase, which then gives the rotated Gemms and weight their variants
        reports.append(eg.run(rotate.saturate()))
    if smoothing:  # likewise: the precision phase gives the smoothed Gemms and weights their variants
        reports.append(eg.run(smooth.saturate()))
    if precision_rules is not None:
        reports.append(eg.run((precision_rules.saturate() + lower.saturate() + dtype_prop.saturate()).saturate()))
    tables = enc.tables
    if fusion:  # Gemm fusion (search/rules/fuse_gemm.py): horizontal groups, epilogues on the accumulator
        consumers = consumers if consumers is not None else graph.consumers()
        groups = fusion_groups(graph, group.chunks, consumers)
        fused, tables = plan_fusions(groups, enc.tables)
        rep = group.representative
        facts = epilogue_facts(graph, group.chunks, enc.terms, consumers) + horizontal_facts(
            fused, {local: enc.terms[nid] for local, nid in enumerate(rep.nodes)},
            {gi: enc.terms[g.a_node] for gi, g in enumerate(groups)}, epilogue_sinks(graph, group.chunks, consumers))
        if facts:
            eg.register(*facts)
        reports.append(eg.run((fuse_gemm.saturate() + dtype_prop.saturate()).saturate()))
        facts = attention_facts(tables)  # attention (search/rules/fuse_attention.py): QK^T, softmax, PV as one kernel
        if facts:
            eg.register(*facts)
        reports.append(eg.run((attention_schedule(precision_rules is not None) + dtype_prop.saturate()).saturate()))
    if fusion:  # fewer launches: constants in their consumers, norms as one row kernel (rules/fuse_rows.py)
        facts = row_facts(graph, group, enc.terms, enc.tables.views)
        if facts:
            eg.register(*facts)
        reports.append(eg.run((fuse_rows.saturate() + dtype_prop.saturate()).saturate()))
    reports.append(eg.run((inplace.saturate() + dtype_prop.saturate()).saturate()))
    reports.append(eg.run(cleanup.saturate()))
    t2 = time.perf_counter()
    space = read_choice_space(serialized_json(eg), "RootOf")
    t3 = time.perf_counter()
    matches: dict[str, int] = {}
    for r in reports:
        for name, n in r.num_matches_per_rule.items():
            matches[str(name)] = matches.get(str(name), 0) + n
    stats = SaturationStats(t1 - t0, t2 - t1, t3 - t2, space.n_classes, space.n_nodes,
                            tuple(sorted(matches.items())), enc.gemm_candidates)
    return GroupSpace(group, space, tables, stats)
