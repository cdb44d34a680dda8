"""Precision tags are one type: `Tag.parse` is the only reader of the `kind:variant` text, and each kind's
variants are the names its registry declares."""
import re
from pathlib import Path

import pytest

from luminal_num.search.space import SearchSpace
from luminal_num.search.tags import REGISTRIES, Tag, TagKind, is_kind, kind_of, priority

PKG = Path(__file__).resolve().parents[1] / "luminal_num"
# a split of text on ":" (str.split / rsplit / partition / rpartition), in any module but the Tag type's
COLON_SPLIT = re.compile(r"""\.(r?split|r?partition)\(\s*['"]:['"]""")
# the one other ":" split, which is not of a tag: an e-node parameter spec "name:sort" (codegen/kinds.py)
NOT_TAGS = {("codegen", "kinds.py")}


def test_no_colon_split_outside_the_tag_type():
    hits = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if rel == Path("search/tags.py") or tuple(rel.parts) in NOT_TAGS:
            continue
        for n, line in enumerate(path.read_text("utf-8").splitlines(), 1):
            if COLON_SPLIT.search(line):
                hits.append(f"{rel}:{n}: {line.strip()}")
    assert not hits, "split tags with Tag.parse:\n" + "\n".join(hits)


def test_the_grep_finds_a_split():  # the pattern above must match what it forbids
    assert COLON_SPLIT.search('kind, name = tag.split(":", 1)')
    assert COLON_SPLIT.search("tag.partition(':')")
    assert not COLON_SPLIT.search('spec.split()')


def test_parse_round_trips_and_refuses_a_tag_without_kind():
    tag = Tag.parse("gemm:f8e4m3_channel_prologue")
    assert (tag.kind, tag.variant, str(tag)) == ("gemm", "f8e4m3_channel_prologue", "gemm:f8e4m3_channel_prologue")
    assert str(Tag(TagKind.STORE, "int8_channel")) == "store:int8_channel"
    with pytest.raises(ValueError, match="has no kind"):
        Tag.parse("f32")
    assert not is_kind("f32", TagKind.GEMM) and is_kind("kv:bf16", TagKind.KV) and not is_kind("kv:bf16", TagKind.GEMM)
    assert [priority(t) for t in ("gemm:bf16", "attn:x", "sum:y", "softmax:bf16", "ew:z", "store:int8")] \
        == [0, 0.5, 1, 2, 3, 4]


def test_every_tag_a_model_offers_names_a_declared_variant(transformer_job_space):
    """Each knob tag of a real search space (the transformer: Gemms, storage, reductions, softmax) names an
    entry of its kind's registry."""
    tags = {t for ks in transformer_job_space.knobs.values() for k in ks for t in k.tags[1:]}
    kinds = {kind_of(t) for t in tags}
    assert {"gemm", "ew", "sum"} <= kinds
    for t in tags:
        tag = Tag.parse(t)
        assert tag.variant in REGISTRIES[TagKind(tag.kind)], t
        assert tag.spec() is REGISTRIES[TagKind(tag.kind)][tag.variant]


@pytest.fixture(scope="module")
def transformer_job_space():
    from luminal_num.models.registry import load_job
    return SearchSpace.build(load_job("transformer").graph)
