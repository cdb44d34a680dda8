"""bench/hop_whatif.py's what-if queue (an attention that would not wait on the rope and the KV scatters) against
the queue it rewrites, on a 1-layer SmolLM2-shaped decode with fused attention: the attention then waits on what
its producers wait on (the q|k|v GEMV) and nothing else changes; its work adds the rope's once and each scatter's
heads / KV heads times (9 query heads over 3 KV heads: 3)."""
from __future__ import annotations

from bench.fusion import GENOMES, _cases
from bench.hop_whatif import without_new_row_hop
from luminal_num.codegen.llir import KernelKind
from luminal_num.codegen.megakernel import build_queue
from luminal_num.runtime.cost import LaunchForm
from luminal_num.runtime.latency import kernel_works
from luminal_num.runtime.megakernel_cost import megakernel_latency
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace


def test_the_attention_waits_on_the_gemv_alone_and_does_its_producers_work():
    _, graph, bindings = next(_cases(1, 64, with_minilm=False))
    space = SearchSpace.build(graph, fusion=True)
    program = space.program(pick(space, GENOMES["BF16 + fused attention"].__contains__))
    queue = build_queue(program)
    works = kernel_works(program, bindings, LaunchForm.MEGAKERNEL)
    what, what_works = without_new_row_hop(program, queue, works, bindings)
    launched = [k.id for k in program.launched()]
    [a] = [i for i, op in enumerate(queue.ops) if program.kernel(op.kernel).kind is KernelKind.ATTENTION]
    producers = [queue.ops[w.producer] for w in queue.ops[a].waits]
    kinds = sorted(program.kernel(p.kernel).kind.value for p in producers)
    assert kinds == ["rows", "scatter_ew", "scatter_nocopy"]
    gemv = {w.producer for p in producers for w in p.waits}
    assert len(gemv) == 1 and queue.ops[gemv.pop()].block.kind == "gemv"
    assert [w.producer for w in what.ops[a].waits] == sorted({w.producer for p in producers for w in p.waits})
    assert all(what.ops[i] == op for i, op in enumerate(queue.ops) if i != a)
    extra = {program.kernel(p.kernel).kind.value: works[launched.index(p.kernel)] for p in producers}
    before, after = works[launched.index(queue.ops[a].kernel)], what_works[launched.index(queue.ops[a].kernel)]
    assert after.bytes_read - before.bytes_read == extra["rows"].bytes_read + 3 * (
        extra["scatter_ew"].bytes_read + extra["scatter_nocopy"].bytes_read)
    # priced: the what-if's chain is never longer, and it runs the same tiles
    now = megakernel_latency(queue, program, "h200", bindings, works=works)
    then = megakernel_latency(what, program, "h200", bindings, works=what_works)
    assert then.tiles == now.tiles and then.critical_path_s <= now.critical_path_s + 1e-12
