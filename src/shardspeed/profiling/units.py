"""DeepSpeed's number formats for the profile ("12.3 M", "4.1 GMACs", "1.2 ms", "56.7 TFLOPS", "25.2 M" params)."""

from __future__ import annotations

_SCALES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))
PRECISION = 2


def number_to_string(num: float, precision: int = PRECISION) -> str:
    """``num`` with an SI prefix: T, G, M, K, none, m (milli), u (micro); ``"{:g} {unit}"``."""
    magnitude, unit = next(((m, u) for m, u in _SCALES if num >= m), (0.0, ""))
    if not magnitude:
        if num >= 1 or num == 0:
            magnitude, unit = 1.0, ""
        elif num >= 1e-3:
            magnitude, unit = 1e-3, "m"
        else:
            magnitude, unit = 1e-6, "u"
    return f"{round(num / magnitude, precision):g} {unit}"


def macs_to_string(macs: float) -> str:
    return f"{number_to_string(macs)}MACs"


def flops_to_string(flops: float) -> str:
    return f"{number_to_string(flops)}FLOPS"


def params_to_string(params: float) -> str:
    return number_to_string(params).replace("G", "B").strip()  # billions, as DeepSpeed writes parameter counts


def duration_to_string(seconds: float) -> str:
    return f"{number_to_string(seconds)}s"
