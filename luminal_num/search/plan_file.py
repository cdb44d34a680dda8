"""What a plan file must hold before anything trusts it: typed fields and a digest of every field.

Why: plan.json is a contract (audit re-checks it, the runtimes execute its LLIR), and a hand edit ran
silently: an attention kernel's precision changed in the LLIR, or the budget widened to atol=100, and audit
printed PASSED against the edited budget; a budget stored as a string crashed `inspect` with a traceback.
`save` writes one sha256 per top-level field (of its canonical JSON: sorted keys, no whitespace, so the
file's formatting and key order are not covered, its content is); `load` names the fields whose content
no longer matches, or that were added or removed, in one line. The digest guards against edits and
corruption, not against someone who recomputes it: it is a checksum, not a signature.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..error.budget import Budget
from ..error.metric_values import MetricValues

DIGEST_KEY = "digest"
DIGEST_ALGORITHM = "sha256"


class PlanError(ValueError):
    """A plan file that is missing, corrupt, edited, of another version, or for another graph."""


def json_number(x) -> Any:
    if x is None:
        return None
    x = float(x)
    return x if np.isfinite(x) else repr(x)  # JSON has no inf/nan: keep them as "inf"/"nan" strings


def number_from_json(x) -> float | None:
    """A number as plan.json holds it (non-finite ones as their repr) back as a float."""
    return None if x is None else float(x)


@dataclass(frozen=True)
class PlanLatency:
    """plan.json's `latency` record: the chosen plan's latency, and the launch form the search chose."""

    total_s: float
    source: str           # "modelled" or "measured"
    target: str
    cuda_graph: bool
    form: str = "kernels"  # the launch form the search chose (runtime/launch_form.py); older plans: kernels
    kernels_s: float | None = None     # each form's price where both were priced
    megakernel_s: float | None = None
    megakernel_refusal: str = ""       # why the program cannot be one megakernel ("" when it can)

    @staticmethod
    def record(latency) -> dict:
        """The record of a runtime Latency (runtime/cost.py)."""
        return {"total_s": json_number(latency.total_s), "source": latency.source, "target": latency.target,
                "cuda_graph": latency.cuda_graph, "form": latency.form.value,
                "kernels_s": json_number(latency.kernels_s), "megakernel_s": json_number(latency.megakernel_s),
                "megakernel_refusal": latency.megakernel_refusal}

    @staticmethod
    def from_record(lat: Mapping[str, Any]) -> "PlanLatency":
        """Checked by check_fields on load; a plan written before the form was recorded ran kernel by kernel."""
        return PlanLatency(number_from_json(lat["total_s"]), str(lat["source"]), str(lat["target"]),
                           bool(lat["cuda_graph"]), str(lat.get("form", "kernels")),
                           number_from_json(lat.get("kernels_s")), number_from_json(lat.get("megakernel_s")),
                           str(lat.get("megakernel_refusal", "")))


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")


def field_digests(data: Mapping[str, Any]) -> dict[str, str]:
    """sha256 of each top-level field's canonical JSON (the digest record itself excluded)."""
    return {key: hashlib.sha256(_canonical(value)).hexdigest() for key, value in sorted(data.items())
            if key != DIGEST_KEY}


def with_digest(data: Mapping[str, Any]) -> dict[str, Any]:
    """The record as written, digests included. Digested after a JSON round trip, so what load reads back
    (tuples as lists, integer keys as strings) is exactly what was digested."""
    written = json.loads(json.dumps({k: v for k, v in data.items() if k != DIGEST_KEY}))
    return {**written, DIGEST_KEY: {"algorithm": DIGEST_ALGORITHM, "fields": field_digests(written)}}


def check_digest(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The record without its digest when every field matches it; else PlanError naming what differs."""
    record = data.get(DIGEST_KEY)
    if record is None:
        raise PlanError(f"{where} has no digest (written by an older compiler, or the field was removed): "
                        "compile it again")
    if (not isinstance(record, dict) or record.get("algorithm") != DIGEST_ALGORITHM
            or not isinstance(record.get("fields"), dict)):
        raise PlanError(f"{where}: its digest record is not a {DIGEST_ALGORITHM} table of fields (edited?)")
    want, got = record["fields"], field_digests(data)
    problems = []
    changed = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    for what, keys in (("changed since it was written", changed), ("added", sorted(set(got) - set(want))),
                       ("removed", sorted(set(want) - set(got)))):
        if keys:
            problems.append(f"{', '.join(keys)} {what}")
    if problems:
        raise PlanError(f"{where} does not match its digest: field(s) {'; '.join(problems)}; a plan is used as "
                        "compiled: compile it again rather than editing it")
    return {k: v for k, v in data.items() if k != DIGEST_KEY}


# -- typed fields ------------------------------------------------------------------------------------------
def _number(value: Any, allow_none: bool = False) -> bool:
    """A number as plan.json holds one: int/float, or a non-finite one as its repr ("inf", "-inf", "nan")."""
    if value is None:
        return allow_none
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return isinstance(value, str) and value in ("inf", "-inf", "nan")


def _is(kind: type) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, kind) and not (kind is int and isinstance(v, bool))


def _optional(kind: type) -> Callable[[Any], bool]:
    return lambda v: v is None or _is(kind)(v)


def _metric_values(value: Any) -> bool:
    """A verdict's metric values as plan.json holds them (error/metric_values.py's record)."""
    try:
        MetricValues.from_record(value)
    except (TypeError, ValueError, KeyError):
        return False
    return all(_number(v) for v in value.values())


def _fraction(value: Any) -> bool:
    return _number(value) and not isinstance(value, str) and 0 < float(value) <= 1


# field -> (what it must be, the check); nested records are checked key by key below
TOP_LEVEL: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "graph_key": ("a string", _is(str)), "target": ("a string", _is(str)), "seed": ("an integer", _is(int)),
    "compiler_version": ("a string", _is(str)), "genome": ("a list", _is(list)), "groups": ("a list", _is(list)),
    "kernels": ("a list of objects", lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v)),
    "llir": ("an object", _is(dict)), "verdict": ("an object", _is(dict)), "latency": ("an object", _is(dict)),
    "budget": ("an object", _is(dict)), "headroom": ("a number in (0, 1]", _fraction),
    "search": ("an object", _is(dict)), "calibration_ranges": ("an object", _is(dict)),
    "static_scales": ("an object", _is(dict)), "interrupted": ("a string", _is(str)),
    "job": ("an object", _is(dict)), "source": ("an object", _is(dict)), "requirements": ("an object", _is(dict)),
}
RECORDS: dict[str, dict[str, tuple[str, Callable[[Any], bool]]]] = {
    "verdict": {"passed": ("true or false", _is(bool)), "source": ("a string", _is(str)),
                "error": ("a number", _number), "budget_share": ("a number", _number), "max_abs": ("a number or null", lambda v: _number(v, True)),
                "bound": ("a number or null", lambda v: _number(v, True)), "reason": ("a string", _is(str)),
                "metrics": ("an object of metric name: number", _metric_values)},
    "latency": {"total_s": ("a number", _number), "source": ("a string", _is(str)), "target": ("a string", _is(str)),
                "cuda_graph": ("true or false", _is(bool)),
                "form": ("'kernels' or 'megakernel'", lambda v: v in ("kernels", "megakernel")),
                "kernels_s": ("a number or null", lambda v: _number(v, True)),
                "megakernel_s": ("a number or null", lambda v: _number(v, True)),
                "megakernel_refusal": ("a string", _is(str))},
    "job": {"model": ("a string or null", _optional(str)), "workload": ("a string or null", _optional(str)),
            "layers": ("an integer or null", _optional(int)), "heldout": ("a string or null", _optional(str))},
}
OPTIONAL = {("job", "heldout"),  # recorded only when given
            ("verdict", "metrics"),  # plans written before verdicts recorded metric values have none
            # plans written before the launch form was a search choice ran kernel by kernel
            ("latency", "form"), ("latency", "kernels_s"), ("latency", "megakernel_s"), ("latency", "megakernel_refusal")}


def check_fields(data: Mapping[str, Any], where: str) -> None:
    """Every field a command reads has the type it reads it as (one PlanError line, never a traceback)."""
    for key, (what, ok) in TOP_LEVEL.items():
        if key in data and not ok(data[key]):
            raise PlanError(f"{where}: field {key!r} must be {what}, got {_shown(data[key])}")
    for key, fields in RECORDS.items():
        record = data.get(key)
        if record is None:
            continue
        for name, (what, ok) in fields.items():
            if name not in record and (key, name) in OPTIONAL:
                continue
            if name not in record:
                raise PlanError(f"{where}: field {key}.{name} is missing")
            if not ok(record[name]):
                raise PlanError(f"{where}: field {key}.{name} must be {what}, got {_shown(record[name])}")
    for name, bounds in data.get("calibration_ranges", {}).items():
        if not (isinstance(bounds, list) and len(bounds) == 2 and all(_number(b) for b in bounds)):
            raise PlanError(f"{where}: calibration_ranges[{name!r}] must be [low, high], got {_shown(bounds)}")
    try:
        Budget.from_dict(data["budget"])
    except (ValueError, TypeError, KeyError) as exc:
        raise PlanError(f"{where}: field 'budget' is not a budget ({type(exc).__name__}: {exc})") from None


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def array_sha256(array: np.ndarray) -> str:
    """A static scale's content (dtype, shape, values): the scales file is checked against it on load."""
    arr = np.ascontiguousarray(array)
    return hashlib.sha256(f"{arr.dtype.str}{arr.shape}".encode() + arr.tobytes()).hexdigest()
