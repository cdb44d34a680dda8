"""Numbers for people: significant digits instead of reprs, latencies with a unit.

Why: reports are read by people; `np.float64(0.0342...)` or 0.00012345678901234567 s says less than
0.0342 or 123 us. The CSV files keep full precision (they are the record); pages and terminals use these.
"""
from __future__ import annotations

import math
import re

DIGITS = 3
_LATENCY_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns"))


def fmt_num(value, digits: int = DIGITS) -> str:
    """`digits` significant digits ('0.0342', '1.2e-05', '1.5e+03'); 'inf', '-inf'; NaN or None -> '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    x = float(value)
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def fmt_latency(seconds, digits: int = DIGITS) -> str:
    """A latency with its unit: '12.3 us', '1.25 ms', '2.1 s'; NaN or None -> '-' (never profiled)."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    s = float(seconds)
    if not math.isfinite(s):
        return fmt_num(s)
    for scale, unit in _LATENCY_UNITS:
        if abs(s) >= scale or unit == "ns":
            return f"{s / scale:.{digits}g} {unit}"
    raise AssertionError("unreachable: the last unit takes every value")


# a decimal literal written with more digits than a reader can use (a repr: 0.964193979565321, 1.2345678e-05);
# not part of a name or of a longer token (f8e4m3, T-779 and version numbers have no such run of digits)
_LONG_NUMBER = re.compile(r"(?<![\w.])(-?\d+\.\d{5,}(?:e[+-]?\d+)?)(?![\w.])")


def fmt_numbers_in(text: str, digits: int = 4) -> str:
    """A message for people: every long decimal in it shown with `digits` significant digits (a limit scaled
    by the headroom, top1_agreement>=0.964193979565321, reads top1_agreement>=0.9642). Files keep the text."""
    return _LONG_NUMBER.sub(lambda m: fmt_num(float(m.group(1)), digits), text)


def fmt_metric_values(values, budget, headroom: float) -> str:
    """Each metric the budget limits with its recorded value (error/metric_values.py), the limit it was judged
    against (the budget scaled by the headroom) and the user's: 'kl_logits 3.056e-14 (judged <=0.01433,
    budget <=0.02)'; a metric without a value reads '-'."""
    gate = {m.name: m for m in budget.gate(headroom).metrics}
    return ", ".join(f"{m.name} {fmt_num(values.get(m.name), 4)} (judged {gate[m.name].operator}"
                     f"{fmt_num(gate[m.name].limit, 4)}, budget {m.operator}{fmt_num(m.limit, 4)})"
                     for m in budget.metrics)


def fmt_launch_form(latency) -> str:
    """How the plan launches and what the other form was priced at: 'megakernel; kernel by kernel 699 us',
    'kernel by kernel; no megakernel: <why>' ('' for a measured latency, which runs kernel by kernel)."""
    if latency.source != "modelled":
        return ""
    if latency.form == "megakernel":
        return f"megakernel; kernel by kernel {fmt_latency(latency.kernels_s)}"
    if latency.megakernel_refusal:
        return f"kernel by kernel; no megakernel: {latency.megakernel_refusal}"
    if latency.megakernel_s is None:
        return "kernel by kernel"
    return f"kernel by kernel; megakernel {fmt_latency(latency.megakernel_s)}"
