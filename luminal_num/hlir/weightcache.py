"""Values derived from weights (stored copies, Gemm operands, float64 references), kept across runs.

The judge builds a new runtime per candidate, so a per-runtime cache would convert every weight
again for every candidate; this one is process-wide, keyed by (the weight's content key, what was
derived), hlir/store.py: equal weights share entries, and an entry is valid for as long as the key
exists (weights are immutable by contract). Arrays that are not weights (no content key) are not
cached: hashing them on every call would cost more than it saves. Entries are evicted
least-recently-used beyond a byte budget (the compile sets it from its memory budget, compiler.py),
and room for a new value is made before it is computed, so the cache and the value being made stay
within the budget together (evicting after would hold both: a 1 GB head's operand over a full cache).
An entry that is a view of its source (an FP32 weight stored as is) keeps the source alive until it
is evicted; its bytes count. It pins no page of a mapped file: streaming (hlir.store.STREAMING), the CPU
runtime releases the pages under it after its last reader, like the weight's own.

Whole-model runs read every weight once, in order, again and again (end-to-end verdicts, the headroom's
probes, the positions' steps); when a model's operands exceed the budget, least-recently-used eviction
then evicts each operand just before the next run reads it, and every read misses (a 1B compile spent
half its time re-making operands). Inside `scanning()`, a miss is cached only where it fits without
evicting: what the cache holds stays for the next run (a share budget / working set of the reads hit),
and the search's per-layer entries survive its end-to-end runs.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator, Mapping, Sequence, TypeVar

import numpy as np

from .store import WeightArray

T = TypeVar("T")
DEFAULT_BUDGET_BYTES = 4 << 30  # a 135M-parameter model's float64 weights plus its FP32 stored weights and Gemm operands


def nbytes(value, source: np.ndarray | None = None, _depth: int = 0) -> int:
    """Bytes held by an array, or by the arrays anywhere inside a tuple, list, mapping or object (a
    prepared Gemm operand is a tuple of Operand records holding arrays: counting only a container's
    direct arrays gave it 0 bytes, and the cache grew past its budget with every variant's operands);
    arrays that are views of `source` (an FP32 weight stored as is) hold nothing of their own: the
    weight's pages are the graph's (often a file's), alive whether or not the entry is."""
    if isinstance(value, np.ndarray):
        return 0 if source is not None and np.may_share_memory(value, source) else value.nbytes
    if _depth > 6 or value is None or isinstance(value, (str, bytes, int, float, complex, bool)):
        return 0
    if isinstance(value, (tuple, list)):
        items = value
    elif isinstance(value, Mapping):
        items = value.values()
    else:
        items = getattr(value, "__dict__", {}).values()
    return sum(nbytes(v, source, _depth + 1) for v in items)


class ByteLRU:
    """Values by key, least recently used evicted beyond a byte budget (each value's size given)."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._items: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()
        self.bytes = 0

    def get(self, key: Hashable):
        """The value (now the most recently used), or None."""
        hit = self._items.get(key)
        if hit is None:
            return None
        self._items.move_to_end(key)
        return hit[0]

    def __contains__(self, key: Hashable) -> bool:
        """Whether `key` has an entry (a look: its recency is left as it was)."""
        return key in self._items

    def make_room(self, size: int) -> None:
        """Evict least-recently-used entries until `size` more bytes fit the budget: a value about to be
        made then never pushes the process past the budget while the entries it will evict still live."""
        while self._items and self.bytes + size > self.budget_bytes:
            self.drop(next(iter(self._items)))

    def put(self, key: Hashable, value, size: int) -> None:
        """Keep `value` (replacing the key's entry) unless it alone exceeds the budget."""
        self.drop(key)
        if size <= self.budget_bytes:
            self._items[key] = (value, size)
            self.bytes += size
            self.resize(self.budget_bytes)

    def drop(self, key: Hashable) -> None:
        entry = self._items.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]

    def resize(self, budget_bytes: int) -> None:
        """A new byte budget, least-recently-used entries evicted down to it."""
        self.budget_bytes = budget_bytes
        while self.bytes > self.budget_bytes:
            self.drop(next(iter(self._items)))

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0


class WeightCache:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self._lru = ByteLRU(budget_bytes)  # (content key(s), what) -> value
        self.hits = self.misses = 0
        self.uncached = 0  # misses a scan made without keeping (no room without evicting)
        self.shared = 0    # gets a step's own uncached value answered (step())
        self._scans = 0
        self._step: dict | None = None  # inside step(): values made and not kept, by key

    @contextmanager
    def scanning(self) -> Iterator[None]:
        """While the block runs (a whole-model run), a miss is kept only where it fits without evicting."""
        self._scans += 1
        try:
            yield
        finally:
            self._scans -= 1

    @contextmanager
    def step(self) -> Iterator[None]:
        """While the block runs (one kernel of a run over several batches), a value made and not kept
        (a scan's miss that found no room) answers every later get of its key in the block, then is
        dropped: each batch reads it, once made. It holds one kernel's weights at most, the transient
        room the memory plan keeps beside the caches."""
        outer, self._step = self._step, {} if self._step is None else self._step
        try:
            yield
        finally:
            if outer is None:
                self._step = None

    def get(self, source, key: Hashable, make: Callable[[], T]) -> T:
        """make() once per (weight content, key); the value must not be mutated. `source` is a weight
        (a WeightArray) or a content key; any other value is not cached."""
        ck = source if isinstance(source, str) else source.content_key if isinstance(source, WeightArray) else None
        if ck is None:
            return make()
        k = (ck, key)
        hit = self._lru.get(k)
        if hit is not None:
            self.hits += 1
            return hit
        if self._step is not None and k in self._step:
            self.shared += 1
            return self._step[k]
        self.misses += 1
        # what is derived from a weight is at most its size in FP32
        need = min(4 * source.size, self._lru.budget_bytes) if isinstance(source, WeightArray) else 0
        if self._scans and self._lru.bytes + need > self._lru.budget_bytes:
            self.uncached += 1  # evicting would evict what the scan reads next (module docstring)
            return self._stepped(k, make())
        self._lru.make_room(need)
        value = make()
        size = nbytes(value, source if isinstance(source, np.ndarray) else None)
        if self._scans and self._lru.bytes + size > self._lru.budget_bytes:
            self.uncached += 1
            return self._stepped(k, value)
        self._lru.put(k, value, size)
        return value

    def _stepped(self, k: Hashable, value: T) -> T:
        if self._step is not None:
            self._step[k] = value
        return value

    def holds(self, source, key: Hashable) -> bool:
        """Whether (the weight's content, key) has an entry now (a look that neither makes nor evicts)."""
        ck = source if isinstance(source, str) else source.content_key if isinstance(source, WeightArray) else None
        return ck is not None and (ck, key) in self._lru

    def get_joint(self, sources: Sequence, key: Hashable, make: Callable[[], T]) -> T:
        """get() for a value derived from several weights (a concatenation): keyed by all their keys;
        not cached unless every source is a weight."""
        if not all(isinstance(s, WeightArray) for s in sources):
            return make()
        return self.get("+".join(s.content_key for s in sources), key, make)

    @property
    def budget_bytes(self) -> int:
        return self._lru.budget_bytes

    def resize(self, budget_bytes: int) -> None:
        self._lru.resize(budget_bytes)

    def clear(self) -> None:
        self._lru.clear()

    @property
    def bytes(self) -> int:
        return self._lru.bytes


WEIGHTS = WeightCache()  # the process-wide cache the CPU backend and the FP64 reference share
