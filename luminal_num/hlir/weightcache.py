"""Values derived from weight arrays (stored copies, Gemm operands, float64 references), kept across runs.

The judge builds a new runtime per candidate, so a per-runtime cache would convert every weight
again for every candidate; this one lives with the weight arrays themselves. Weights are immutable
by contract (a plan's weights never change under it), so an entry is keyed by the array's identity
and dropped when the array is garbage collected (a weak reference guards against a reused id).
Entries are evicted least-recently-used beyond a byte budget. An entry that is a view of its source
(an FP32 weight stored as is) keeps the source alive until it is evicted; its bytes count.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable, Hashable, Sequence, TypeVar

import numpy as np

T = TypeVar("T")
DEFAULT_BUDGET_BYTES = 4 << 30  # a 135M-parameter model's float64 weights plus its FP32 stored weights and Gemm operands


def nbytes(value) -> int:
    """Bytes held by an array, or by the arrays among a dataclass's fields / a tuple's items."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    items = value if isinstance(value, tuple) else getattr(value, "__dict__", {}).values()
    return sum(v.nbytes for v in items if isinstance(v, np.ndarray))


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
        self._lru = ByteLRU(budget_bytes)  # (id(source), key) -> (weak ref to source, value)
        self.hits = self.misses = 0

    def get(self, source: np.ndarray, key: Hashable, make: Callable[[], T]) -> T:
        """make() once per (source array, key) while `source` lives; the value must not be mutated."""
        if not isinstance(source, np.ndarray):
            return make()  # only arrays can be weakly referenced (and are immutable by contract)
        k = (id(source), key)
        hit = self._lru.get(k)
        if hit is not None and hit[0]() is source:
            self.hits += 1
            return hit[1]
        self.misses += 1
        value = make()
        self._lru.put(k, (weakref.ref(source, lambda _, k=k: self._lru.drop(k)), value), nbytes(value))
        return value

    def get_joint(self, sources: Sequence[np.ndarray], key: Hashable, make: Callable[[], T]) -> T:
        """get() for a value derived from several arrays (a concatenation of weights): kept under the
        first, and returned only while the others are the very arrays it was made from (an id reused
        by a new array after one part was freed makes it again)."""
        first, rest = sources[0], tuple(sources[1:])
        k = (key, tuple(id(s) for s in rest))
        made, value = self.get(first, k, lambda: (tuple(weakref.ref(s) for s in rest), make()))
        if all(r() is s for r, s in zip(made, rest)):
            return value
        self._lru.drop((id(first), k))
        return self.get(first, k, lambda: (tuple(weakref.ref(s) for s in rest), make()))[1]

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
