"""Peer recipes, op by op: what PyTorch's autocast (CUDA and CPU) and the TF32 matmul flag run, as
genomes of our search space, so a baseline is the tool it names and not a guess at it.

PyTorch autocast (torch.amp docs, "Autocast Op Reference"): an op on the lower-precision list casts its
floating inputs to the low type and returns it; an op on the FP32 list casts them to FP32; any other op
runs in the widest floating type of its tensor inputs (0-d tensors and Python scalars do not promote).
Inside one op PyTorch computes in FP32 ("opmath") and rounds only its outputs. The user-level op of
each HLIR node comes from `Graph.op_scopes` (recorded by the GraphTensor methods); a bare primop is the
PyTorch op of the same name. A Linear (`x @ W + b`) is one addmm: the bias add belongs to the matmul.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..codegen.llir import KernelKind
from ..hlir.graph import Graph
from ..hlir.ops import Op
from ..quant.stored import GGUF_KEPT, SOURCE_BLOCKS, source_format
from .extract import BASE
from .space import ChunkSite, Genome, SearchSpace
from .tags import Tag, TagKind, is_kind, kind_of

# -- the lists, as published (torch.amp docs: "CUDA Ops that can autocast to float16" / "... to float32",
#    "CPU Ops that can autocast to bfloat16" / "... to float32"; loss functions omitted: no graph has them)
CUDA_LOW = frozenset({
    "__matmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "multi_dot", "conv1d",
    "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "GRUCell", "linear",
    "LSTMCell", "matmul", "mm", "mv", "prelu", "RNNCell"})
CUDA_F32 = frozenset({
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "cosh", "cdist", "cosine_similarity",
    "cumprod", "cumsum", "dist", "erfinv", "exp", "expm1", "group_norm", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "norm", "normalize", "pdist", "pow", "prod", "reciprocal", "rsqrt", "sinh",
    "softmax", "softmin", "softplus", "sum", "renorm", "tan"})
CPU_LOW = frozenset({
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "addbmm", "linear",
    "_convolution", "matmul", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention"})
CPU_F32 = frozenset({
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile", "nanquantile", "stft",
    "cdist", "trace", "view_as_complex", "cholesky", "cholesky_inverse", "cholesky_solve", "inverse",
    "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d", "max_unpool2d", "max_unpool3d",
    "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d",
    "replication_pad3d", "fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "geqrf", "qr", "svd",
    "triangular_solve", "fractional_max_pool2d", "fractional_max_pool3d", "adaptive_max_pool3d"})

# A bare primop is the PyTorch op of the same meaning.
PRIMOP_NAME = {Op.ADD: "add", Op.MUL: "mul", Op.RECIP: "reciprocal", Op.SQRT: "sqrt", Op.EXP2: "exp2",
               Op.LOG2: "log2", Op.SIN: "sin", Op.SUM_REDUCE: "sum", Op.MAX_REDUCE: "amax",
               Op.SOFTMAX: "softmax", Op.MOD: "remainder", Op.LESS_THAN: "lt", Op.CAST: "to",
               Op.GATHER: "embedding", Op.SCATTER: "index_copy", Op.IOTA: "arange"}

LOW, FP32 = "low", "f32"


@dataclass(frozen=True)
class Autocast:
    """One autocast configuration: its lists, its low type's tags in our space, and its source."""

    name: str
    low_list: frozenset[str]
    f32_list: frozenset[str]
    gemm_tag: str
    store_tags: dict[str, str]  # knob kind -> tag storing a value in the low type (computed in FP32)
    source: str


_SRC = "PyTorch torch.amp docs, Autocast Op Reference: "
CUDA_BF16 = Autocast("BF16 autocast", CUDA_LOW, CUDA_F32, "gemm:bf16",
                     {"ew": "ew:bf16_computef32", "sum": "sum:bf16_accf32", "softmax": "softmax:bf16"},
                     _SRC + "torch.autocast('cuda', dtype=torch.bfloat16), CUDA op lists")
CUDA_F16 = Autocast("FP16 autocast", CUDA_LOW, CUDA_F32, "gemm:f16",
                    {"ew": "ew:f16_computef32", "sum": "sum:f16_accf32"},
                    _SRC + "torch.autocast('cuda', dtype=torch.float16), CUDA op lists")
CPU_BF16 = Autocast("BF16 autocast (CPU)", CPU_LOW, CPU_F32, "gemm:bf16",
                    {"ew": "ew:bf16_computef32", "sum": "sum:bf16_accf32", "softmax": "softmax:bf16"},
                    _SRC + "torch.autocast('cpu', dtype=torch.bfloat16), CPU op lists")
AUTOCASTS = (CUDA_BF16, CUDA_F16, CPU_BF16)
TF32_SOURCE = ("PyTorch torch.set_float32_matmul_precision('high'): FP32 matmuls (mm, bmm, linear) in TF32, "
               "everything else FP32")


@dataclass(frozen=True)
class Recipe:
    genome: Genome
    source: str
    gaps: tuple[str, ...]  # values the recipe wants in a format the search space cannot express there


def user_ops(graph: Graph) -> dict[int, tuple[str, int]]:
    """Node id -> (PyTorch op name, instance id); a Linear's bias add joins its matmul as `linear`."""
    out = {n.id: graph.op_scopes.get(n.id) or (PRIMOP_NAME.get(n.op, n.op.name.lower()), n.id) for n in graph.nodes}
    for n in graph.nodes:
        if n.op is Op.ADD and n.id not in graph.op_scopes and len(n.srcs) == 2:
            a, b = (graph.nodes[s.node] for s in n.srcs)
            for mm, bias in ((a, b), (b, a)):
                if out[mm.id][0] == "matmul" and graph.weight_name(bias.id) is not None:
                    inst = ("linear", out[mm.id][1])
                    for k, v in list(out.items()):
                        if v == out[mm.id]:
                            out[k] = inst
                    out[n.id] = inst
                    break
    return out


def autocast_dtypes(graph: Graph, lists: Autocast) -> tuple[dict[int, str], set[int]]:
    """(value dtype of every floating node: LOW or FP32, the nodes that are outputs of their op)."""
    ops = user_ops(graph)
    consumers = graph.consumers()
    members: dict[tuple, list[int]] = {}
    for nid in range(len(graph.nodes)):
        members.setdefault(ops[nid], []).append(nid)
    dtype: dict[int, str] = {}
    exits: set[int] = set()
    for inst, nids in sorted(members.items(), key=lambda kv: kv[1][0]):
        inside = set(nids)
        name = inst[0]
        ins = {dtype.get(s.node) for n in nids for s in graph.nodes[n].srcs if s.node not in inside
               and graph.nodes[s.node].shape != ()}  # 0-d tensors do not take part in promotion
        if name in lists.low_list:
            dt = LOW
        elif name in lists.f32_list:
            dt = FP32
        else:
            dt = FP32 if FP32 in ins or LOW not in ins else LOW
        for n in nids:
            node = graph.nodes[n]
            if not node.dtype.is_float or node.op is Op.OUTPUT:
                continue
            if node.op in (Op.INPUT, Op.CONSTANT, Op.IOTA):
                dtype[n] = FP32  # the model's parameters and inputs are FP32
                continue
            out = any(c not in inside or graph.nodes[c].op is Op.OUTPUT for c in consumers.get(n, []))
            dtype[n] = dt if out else FP32  # inside one op PyTorch computes in FP32
            if out:
                exits.add(n)
    return dtype, exits


def autocast_recipe(space: SearchSpace, lists: Autocast) -> Recipe:
    graph = space.graph
    dtype, exits = autocast_dtypes(graph, lists)
    ops = user_ops(graph)
    matmuls = set(graph.matmuls)
    genome, gaps = set(), []
    for gk, ks in space.knobs.items():
        node_of = space.groups[gk].space.class_node
        for k in ks:
            nid = node_of.get(k.cls)
            if nid is None:
                continue
            want = None
            if nid in matmuls and ops[nid][0] in lists.low_list:
                want = lists.gemm_tag
            elif nid in exits and dtype.get(nid) == LOW:
                kinds = {kind_of(t) for t in k.tags[1:]}
                want = next((lists.store_tags[kd] for kd in ("ew", "sum", "softmax") if kd in kinds
                             and kd in lists.store_tags), None)
            if want is None:
                continue
            if want in k.tags:
                genome.add((gk, k.cls, want))
            else:
                gaps.append(f"{k.origin} (node {nid}): {want} not in the space")
    return Recipe(frozenset(genome), lists.source, tuple(gaps))


def tf32_recipe(space: SearchSpace) -> Recipe:
    ops = user_ops(space.graph)  # a matmul the model writes for another op (a pooling sum) is not one
    matmuls = {n for n in space.graph.matmuls if ops[n][0] in CUDA_LOW}
    genome = {(gk, k.cls, "gemm:tf32") for gk, ks in space.knobs.items() for k in ks
              if space.groups[gk].space.class_node.get(k.cls) in matmuls and "gemm:tf32" in k.tags}
    return Recipe(frozenset(genome), TF32_SOURCE, ())


# -- weight-storage recipes (issue 13) ------------------------------------------------------------
# label -> the tags it sets (a storage format for every 2-D weight and a Gemm variant for every Gemm)
STORAGE_RECIPES: dict[str, frozenset[str]] = {
    "W8A16 INT8 per-channel": frozenset({"store:int8_channel", "gemm:bf16"}),
    "W4A16 INT4 group 128": frozenset({"store:int4_g128", "gemm:bf16"}),
    "FP8 W8A8 dynamic per-token": frozenset({"store:f8e4m3_channel", "gemm:f8e4m3_channel_prologue"}),
    "BF16 weights + FP8 KV cache": frozenset({"store:bf16", "gemm:bf16", "kv:f8e4m3_channel"}),
}
BF16_WEIGHTS = frozenset({"store:bf16", "gemm:bf16"})  # BF16 weights and BF16 Gemms, FP32 KV cache
STORAGE_SOURCES: dict[str, str] = {
    "W8A16 INT8 per-channel": "weight-only INT8 (one scale per output channel), BF16 activations and Gemms: "
                              "TensorRT-LLM / ModelOpt int8 weight-only",
    "W4A16 INT4 group 128": "weight-only INT4, symmetric, one FP16 scale per 128 weights along K, BF16 activations: "
                            "the GPTQ / AWQ W4A16 recipe",
    "FP8 W8A8 dynamic per-token": "FP8 E4M3 weights per output channel, activations scaled per token at run time: "
                                  "torchao float8 dynamic / ModelOpt FP8",
    "BF16 weights + FP8 KV cache": "BF16 weights and Gemms, KV cache stored as FP8 E4M3 and widened by attention: "
                                   "vLLM kv_cache_dtype='fp8_e4m3' / TensorRT-LLM FP8 KV cache (which scale per "
                                   "tensor from calibration; here one FP32 scale per token row, computed as the "
                                   "row is written)",
}


def pick(space: SearchSpace, pred: Callable[[str], bool]) -> Genome:
    """For every knob of every group, its first tag satisfying `pred` (knobs with none stay FP32)."""
    out = {}
    for gk, ks in space.knobs.items():
        for k in ks:
            tag = next((t for t in k.tags if pred(t)), None)
            if tag is not None:
                out[(gk, k.cls)] = tag
    return frozenset((g, c, t) for (g, c), t in out.items())


def transformed_recipe(space: SearchSpace, tags: frozenset[str], transform: Callable[[str], bool]) -> Genome:
    """A storage recipe's `tags` with every Gemm the space may transform so transformed (`transform` picks the
    tag: a rotation, search/rules/rotate.py, or a smoothing, search/rules/smooth.py): that tag first, then the
    recipe's tags on every other knob, the transformed Gemms and weights included."""
    first = pick(space, transform)
    chosen = {(g, c) for g, c, _ in first}
    return first | frozenset(ch for ch in pick(space, tags.__contains__) if (ch[0], ch[1]) not in chosen)


def rotated_recipe(space: SearchSpace, tags: frozenset[str]) -> Genome:
    """A storage recipe's `tags` with every Gemm the space may rotate rotated."""
    return transformed_recipe(space, tags, lambda t: is_kind(t, TagKind.ROT))


def smoothed_recipe(space: SearchSpace, tags: frozenset[str], variant: str = "sq50") -> Genome:
    """A storage recipe's `tags` with every Gemm the space may smooth smoothed by `variant` (hlir/smoothing.py)."""
    return transformed_recipe(space, tags, f"{TagKind.SMOOTH}:{variant}".__eq__)


def rotated_recipes(space: SearchSpace) -> dict[str, Genome]:
    """Each storage recipe with every Gemm the space may rotate rotated, then with every Gemm it may smooth
    smoothed (none of a kind where it offers none)."""
    out = {}
    for what, transform, fits in _TRANSFORMS:
        made = {f"{name} + {what}": transformed_recipe(space, tags, transform)
                for name, tags in STORAGE_RECIPES.items() if fits(tags)}
        out.update({name: g for name, g in made.items() if any(transform(t) for _, _, t in g)})
    return out


# (what, its tag, the storage recipes it starts from): AWQ's scales are searched for one format, so only its recipe
_TRANSFORMS = (("Hadamard rotation", lambda t: is_kind(t, TagKind.ROT), lambda tags: True),
               ("SmoothQuant smoothing", f"{TagKind.SMOOTH}:sq50".__eq__, lambda tags: True),
               ("AWQ smoothing", f"{TagKind.SMOOTH}:awq_int4_g128".__eq__, lambda tags: "store:int4_g128" in tags))


def recipe_genomes(space: SearchSpace) -> dict[str, Genome]:
    """Every storage recipe as a genome; a KV-cache recipe only where the graph has a KV cache (elsewhere
    it would repeat the weights-only recipe under another name)."""
    has_kv = any(is_kind(t, TagKind.KV) for ks in space.knobs.values() for k in ks for t in k.tags)
    return {name: pick(space, tags.__contains__) for name, tags in STORAGE_RECIPES.items()
            if has_kv or not any(is_kind(t, TagKind.KV) for t in tags)}


# -- the GGUF file's own blocks (issue 32, item 4) -------------------------------------------------------
GGUF_KEPT_BASELINE = "GGUF source blocks kept"
GGUF_KEPT_SOURCE = ("llama.cpp running the GGUF file as it is: every weight read from the file's quantized blocks held "
                    "in those blocks (the tied embedding / LM head too) and dequantized by the Gemm or gather reading "
                    "them, zero added weight error; FP32 activations and arithmetic elsewhere (llama.cpp's CUDA "
                    "kernels also round activations to Q8_1, which this baseline does not)")
# a weight's storage tags that keep its GGUF blocks: its own block format, or each chunk's own (SOURCE_BLOCKS)
KEPT_TAGS = frozenset(str(Tag(TagKind.STORE, f)) for f in (*GGUF_KEPT, SOURCE_BLOCKS))


def gguf_source_recipe(space: SearchSpace) -> Recipe | None:
    """Every weight read from GGUF blocks held in those blocks, every other choice FP32 (None: the graph has
    no such weight). FP32 elsewhere because it is the one exact-arithmetic choice: the plan then computes what
    the FP32 plan computes, bit for bit (the blocks dequantize to exactly the reference's weights), so it adds
    no error at all and differs from FP32 only in the bytes its Gemms read. `gaps` names each such weight
    the lowered program does not hold in exactly its source blocks (no knob keeps it there: a weight its
    group's other chunks did not read from GGUF), so a caller never offers a silently widened plan."""
    sourced = {name: fmt for name, w in space.graph.weights.items()
               if getattr(w, "ndim", 0) == 2 and (fmt := source_format(w)) is not None}
    if not sourced:
        return None
    genome = pick(space, KEPT_TAGS.__contains__)
    program = space.program(genome)
    read = {inp.buffer for k in program.kernels for inp in k.inputs} | {kid for _, kid in program.outputs}
    held: dict[str, set[str | None]] = {}  # weight -> the formats its EXTERNALs that some kernel reads hold it in
    for k in program.kernels:
        if k.kind is KernelKind.EXTERNAL and k.id in read:
            for name in k.concat or (k.external,):  # a fused Gemm's concatenation holds its parts
                held.setdefault(name, set()).add(k.storage)
    gaps = tuple(f"{name} ({fmt} blocks) held as {', '.join(sorted(str(h or 'f32') for h in held[name]))}"
                 for name, fmt in sorted(sourced.items()) if name in held and held[name] != {fmt})
    return Recipe(genome, GGUF_KEPT_SOURCE, gaps)


def baselines(space: SearchSpace) -> tuple[dict[str, Genome], dict[str, str]]:
    """(label -> genome of every baseline offered, label -> one-line reason for each refused). What users pick
    today, each following the tool it names op by op (sources in BASELINE_SOURCES): FP32 everywhere,
    PyTorch's TF32 matmul flag, PyTorch autocast BF16/FP16 (CUDA lists) and BF16 (CPU lists), FP8 E4M3 with
    per-tensor scales on every Gemm, the weight-storage recipes, and for a model read from GGUF its file's
    blocks kept (refused where some GGUF weight cannot be kept: a partly widened plan is not llama.cpp's)."""
    offered = {"FP32 everywhere": frozenset(),
               "TF32 flag": tf32_recipe(space).genome,
               **{a.name: autocast_recipe(space, a).genome for a in AUTOCASTS},
               "FP8 everywhere": pick(space, lambda t: t == "gemm:f8e4m3_tensor"),
               **recipe_genomes(space)}  # weight-storage recipes (W8A16, W4A16, FP8 W8A8)
    refused = {}
    kept = gguf_source_recipe(space)
    if kept is not None and kept.gaps:
        refused[GGUF_KEPT_BASELINE] = (f"{len(kept.gaps)} GGUF weight(s) not kept in their blocks: {kept.gaps[0]}"
                                       + (f" (+{len(kept.gaps) - 1} more)" if len(kept.gaps) > 1 else ""))
    elif kept is not None:
        offered[GGUF_KEPT_BASELINE] = kept.genome
    return offered, refused


def baseline_genomes(space: SearchSpace) -> dict[str, Genome]:
    """The baselines offered (`baselines`). The search starts from them; the compile's headroom probes a few."""
    return baselines(space)[0]


BASELINE_SOURCES = {"FP32 everywhere": "no reduced precision anywhere (PyTorch's default FP32 execution)",
                    "TF32 flag": TF32_SOURCE, **{a.name: a.source for a in AUTOCASTS},
                    "FP8 everywhere": "every Gemm in FP8 E4M3 with per-tensor dynamic scales (no peer tool: a bound)",
                    **STORAGE_SOURCES, GGUF_KEPT_BASELINE: GGUF_KEPT_SOURCE}


# -- the LM head kept wider (issue 32) ------------------------------------------------------------

def head_classes(space: SearchSpace) -> dict[str, frozenset[str]]:
    """Group key -> the knob e-classes of the output Gemm (a Gemm whose value is a graph output: an LM's head):
    the Gemm, its weight's storage, and the Gemms and weights of its rotated / smoothed forms (the online
    Hadamard Gemm included), never the producers of its activation."""
    graph = space.graph
    outputs = set(graph.outputs.values())
    consumers = graph.consumers()
    gemms = {n for n in graph.matmuls if any(c in outputs for c in consumers.get(n, ()))}
    heads = gemms | {o for o in outputs if any(s.node in gemms for s in graph.nodes[o].srcs)}  # one e-class holds both
    out = {}
    for gk in space.knobs:
        seen = _gemm_side(space, gk, heads)
        if seen:
            out[gk] = seen
    return out


def _gemm_side(space: SearchSpace, gk: str, nodes: set[int]) -> frozenset[str]:
    """The knob e-classes of group `gk` that belong to the Gemms at HLIR `nodes` (its representative chunk's):
    the Gemm's classes, its weight's storage, its rotated / smoothed forms' Gemms and weights."""
    cs = space.groups[gk].space
    tagged = {k.cls for k in space.knobs[gk] if any(is_kind(t, TagKind.GEMM) or is_kind(t, TagKind.STORE)
                                                      for t in k.tags)}
    todo = [c for c in tagged if cs.class_node.get(c) in nodes]
    seen = set(todo)
    while todo:
        for n in cs.classes[todo.pop()]:
            for c in _weight_side(cs, n):
                if c in tagged and c not in seen:
                    seen.add(c)
                    todo.append(c)
    return frozenset(seen)


def _weight_side(cs, n) -> tuple[str, ...]:
    """The child e-classes of e-node `n` that belong to its Gemm rather than to its activation: a Gemm's weight
    (and, for an epilogue, its own accumulator), an alias's inner Gemm, and the activation of a rotated Gemm
    only where it is the online Hadamard Gemm x H_b (search/rules/rotate.py)."""
    if n.op not in ("KGemm", "KGemmEpi"):
        return n.child_classes()
    a = n.cls("a")
    hadamard = any(m.op == "KGemm" and any(h.op == "KHadamard" for h in cs.classes[m.cls("b")]) for m in cs.classes[a])
    return (n.cls("b"),) + ((n.cls("acc"),) if n.op == "KGemmEpi" else ()) + ((a,) if hadamard else ())


def head_kept(space: SearchSpace, genome: Genome, tags: frozenset[str]) -> Genome:
    """`genome` with the output Gemm (head_classes) set to `tags` (e.g. W8A16 INT8 per-channel) and everything
    else as it was; a rotation or smoothing the genome chose for the head stays, its transformed weight then
    stored as `tags` say. Peers' 4-bit plans keep the head wider: GPTQ and AWQ leave lm_head unquantized,
    llama.cpp's Q4_K_M stores output.weight as Q6_K. Refused where no Gemm's value is a graph output."""
    head = head_classes(space)
    if not head:
        raise ValueError("no Gemm's value is a graph output: no head to keep")
    transform = (TagKind.ROT, TagKind.SMOOTH)
    kept = frozenset((g, c, t) for g, c, t in genome
                     if c not in head.get(g, ()) or any(is_kind(t, k) for k in transform))
    chosen = {(g, c) for g, c, _ in kept}
    return kept | frozenset(ch for ch in pick(space, tags.__contains__)
                            if ch[1] in head.get(ch[0], ()) and (ch[0], ch[1]) not in chosen)


# -- some Gemms held wider than the rest: mixed plans (issue 32) -------------------------------------------

def gemm_weight(graph: Graph, gemm: int) -> str | None:
    """The name of the weight a matmul's SumReduce `gemm` reads as B (None: both operands are activations)."""
    mul = graph.nodes[graph.nodes[gemm].srcs[0].node]
    return next((w for s in mul.srcs if (w := graph.weight_name(s.node)) is not None), None)


def weights_kept(space: SearchSpace, genome: Genome, select: Callable[[str], bool], tags: frozenset[str]) -> Genome:
    """`genome` with every Gemm whose weight's name `select` accepts set to `tags` (its storage and Gemm variant;
    a rotation or smoothing the genome chose for it stays, its transformed weight then stored as `tags` say),
    every other choice as it was: llama.cpp's Q4_K_M-style mixes (attn_v and some ffn_down wider). The Gemms a
    group's chunks all select change for the group; the others each selecting chunk overrides for itself
    (ChunkSite), so one layer's down_proj can be 8-bit while its group's others stay 4-bit. A horizontally fused
    Gemm whose parts then differ is extracted unfused (horizontal.SliceChoice). Refused where `select` accepts
    no Gemm's weight."""
    graph = space.graph
    matmuls = set(graph.matmuls)
    transform = (TagKind.ROT, TagKind.SMOOTH)
    wide = pick(space, tags.__contains__)
    wide_of = {(g, c): t for g, c, t in wide}
    out = set(genome)
    found = False
    for g in space.part.groups:
        rep = g.representative
        chosen = {c.index: frozenset(i for i, nid in enumerate(c.nodes) if nid in matmuls
                                     and (w := gemm_weight(graph, nid)) is not None and select(w)) for c in g.chunks}
        if not any(chosen.values()):
            continue
        found = True
        common = frozenset.intersection(*chosen.values())  # selected in every chunk: the group's change
        sites = [(g.key, common)] * bool(common) + [(ChunkSite(g.key, i), ls - common) for i, ls in chosen.items()
                                                     if ls - common]
        group_tags = {c: t for s, c, t in out if s == g.key}
        for site, ls in sites:
            classes = _gemm_side(space, g.key, {rep.nodes[i] for i in ls})
            mine = {c: t for s, c, t in out if s == site}
            # the tag each class has at this site (a chunk's own, else its group's): a transform stays
            kept = {c for c in classes if any(is_kind(mine.get(c, group_tags.get(c, BASE)), k) for k in transform)}
            out -= {(s, c, t) for s, c, t in out if s == site and c in classes and c not in kept}
            out |= {(site, c, wide_of[(g.key, c)]) for c in classes - kept if (g.key, c) in wide_of}
    if not found:
        raise ValueError("no Gemm reads a weight the selection accepts: nothing to keep wider")
    return frozenset(out)
