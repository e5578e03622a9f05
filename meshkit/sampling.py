"""Range checks of globalrouter.v1.SamplingParams, shared by the global frontend and pool frontends."""

from __future__ import annotations

import math

from globalrouter.v1 import sampling_pb2
from meshkit.validation import Violations

MAX_STOP_TOKEN_IDS = 64


def check_sampling(v: Violations, field_path: str, params: sampling_pb2.SamplingParams) -> None:
    """Records every out-of-range field of `params` (each under `field_path`.<name>)."""

    def bounded(name: str, low: float, high: float, *, low_open: bool = False) -> None:
        if not params.HasField(name):
            return
        value = getattr(params, name)
        below = value <= low if low_open else value < low
        if not math.isfinite(value) or below or value > high:
            lower = f"greater than {low:g}" if low_open else f"at least {low:g}"
            v.add(f"{field_path}.{name}", f"must be {lower} and at most {high:g} (got {value:g})")

    bounded("temperature", 0.0, 2.0)
    bounded("top_p", 0.0, 1.0, low_open=True)
    bounded("presence_penalty", -2.0, 2.0)
    bounded("frequency_penalty", -2.0, 2.0)
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        v.add(
            f"{field_path}.stop_token_ids",
            f"must list at most {MAX_STOP_TOKEN_IDS} ids (got {len(params.stop_token_ids)})",
        )
