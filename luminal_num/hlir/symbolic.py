"""Symbolic dimensions: integer polynomials over named symbols (sequence length `s`, cache length...).

Why polynomials and not strings: strides of a (4, s) tensor are (s, 1) and the element count of
(s, 64) is 64*s; shape algebra must add, multiply and compare such expressions exactly. A constant
polynomial always normalises to a plain `int`, so code that sees only concrete shapes never meets a
`Poly`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

Monomial = tuple[str, ...]  # sorted symbol names, with repetition for powers


@dataclass(frozen=True)
class Poly:
    """sum(coef * prod(symbols)); terms sorted, no zero coefficients, never a bare constant."""

    terms: tuple[tuple[Monomial, int], ...]

    @staticmethod
    def var(name: str) -> "Poly":
        if not name.isidentifier():
            raise ValueError(f"symbol name must be an identifier, got {name!r}")
        return Poly(((((name,)), 1),))

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def _make(acc: dict[Monomial, int]) -> "Dim":
        terms = tuple(sorted((m, c) for m, c in acc.items() if c != 0))
        if not terms:
            return 0
        if len(terms) == 1 and terms[0][0] == ():
            return terms[0][1]
        return Poly(terms)

    def _acc(self) -> dict[Monomial, int]:
        return dict(self.terms)

    # -- arithmetic ---------------------------------------------------------------------------
    def __add__(self, other: "Dim") -> "Dim":
        acc = self._acc()
        for m, c in _terms(other):
            acc[m] = acc.get(m, 0) + c
        return Poly._make(acc)

    __radd__ = __add__

    def __neg__(self) -> "Dim":
        return Poly._make({m: -c for m, c in self.terms})

    def __sub__(self, other: "Dim") -> "Dim":
        return self + (-other if isinstance(other, Poly) else -int(other))

    def __rsub__(self, other: "Dim") -> "Dim":
        return (-self) + other

    def __mul__(self, other: "Dim") -> "Dim":
        acc: dict[Monomial, int] = {}
        for m1, c1 in self.terms:
            for m2, c2 in _terms(other):
                m = tuple(sorted(m1 + m2))
                acc[m] = acc.get(m, 0) + c1 * c2
        return Poly._make(acc)

    __rmul__ = __mul__

    def __floordiv__(self, other: int) -> "Dim":
        """Exact division by an integer only (every coefficient divisible); shape math never needs more."""
        if not isinstance(other, int) or other == 0 or any(c % other for _, c in self.terms):
            raise ValueError(f"{self} is not exactly divisible by {other!r}")
        return Poly._make({m: c // other for m, c in self.terms})

    # -- queries ------------------------------------------------------------------------------
    def symbols(self) -> frozenset[str]:
        return frozenset(s for m, _ in self.terms for s in m)

    def evaluate(self, bindings: Mapping[str, int]) -> int:
        total = 0
        for m, c in self.terms:
            v = c
            for s in m:
                if s not in bindings:
                    raise KeyError(f"symbolic dimension {s!r} is not bound (bound: {sorted(bindings)})")
                v *= int(bindings[s])
            total += v
        return total

    def __str__(self) -> str:
        parts = []
        for m, c in self.terms:
            body = "*".join(m)
            if not m:
                parts.append(str(c))
            elif c == 1:
                parts.append(body)
            else:
                parts.append(f"{c}*{body}")
        return " + ".join(parts)

    __repr__ = __str__


Dim = Union[int, Poly]


def _terms(d: Dim) -> tuple[tuple[Monomial, int], ...]:
    if isinstance(d, Poly):
        return d.terms
    if isinstance(d, bool) or not isinstance(d, int):
        raise TypeError(f"dimension must be int or Poly, got {type(d).__name__}")
    return (((), d),) if d else ()


def sym(name: str) -> Poly:
    """A named symbolic dimension, e.g. `s = sym("s")`."""
    return Poly.var(name)


def as_dim(d: "Dim | str") -> Dim:
    if isinstance(d, str):
        return sym(d)
    if isinstance(d, Poly):
        return d
    if isinstance(d, bool) or not hasattr(d, "__index__"):
        raise TypeError(f"dimension must be int, str or Poly, got {d!r}")
    return int(d)


def evaluate(d: Dim, bindings: Mapping[str, int]) -> int:
    return d.evaluate(bindings) if isinstance(d, Poly) else int(d)


def symbols_of(*dims: Dim) -> frozenset[str]:
    out: frozenset[str] = frozenset()
    for d in dims:
        if isinstance(d, Poly):
            out |= d.symbols()
    return out


def prod(dims) -> Dim:
    out: Dim = 1
    for d in dims:
        out = out * d if isinstance(out, Poly) or isinstance(d, Poly) else out * d
    return out


def is_const(d: Dim) -> bool:
    return not isinstance(d, Poly)


def encode(d: Dim) -> tuple:
    """A canonical, hashable encoding for structural hashes (never printed text)."""
    return ("poly", d.terms) if isinstance(d, Poly) else ("int", int(d))


def bind_shapes(declared: "Mapping[str, tuple[Dim, ...]]", actual: "Mapping[str, tuple[int, ...]]",
                bindings: "Mapping[str, int] | None" = None) -> dict[str, int]:
    """Bind symbolic dims from the shapes of the given arrays and check every shape against them.

    A declared dim that is a single symbol (`s`) binds to the array's size there; a symbol bound to
    two sizes, a wrong rank or any shape that disagrees once bound raises ValueError naming the input.
    """
    out = dict(bindings or {})
    for name, shape in declared.items():
        if name not in actual:
            continue
        got = tuple(actual[name])
        if len(got) != len(shape):
            raise ValueError(f"input {name!r}: expected rank {len(shape)}, got shape {got}")
        for d, size in zip(shape, got):
            if isinstance(d, Poly) and len(d.terms) == 1 and d.terms[0][1] == 1 and len(d.terms[0][0]) == 1:
                s = d.terms[0][0][0]
                if out.setdefault(s, size) != size:
                    raise ValueError(f"symbol {s!r} bound to {out[s]} and {size} (input {name!r})")
    for name, shape in declared.items():
        if name in actual:
            want = tuple(evaluate(d, out) for d in shape)
            if tuple(actual[name]) != want:
                raise ValueError(f"input {name!r}: expected shape {want}, got {tuple(actual[name])}")
    return out
