"""Reward functions that fail on a fixed share of inputs, for ``faulty_user_code.py``.

EasyR1's batch interface (``fn(list of dicts) -> list of dicts``), exact-match scoring as the
quickstart's built-in, except on the inputs a stable hash of the response selects (the same
response always fails, as a symbolic checker does on a pathological expression): there the
function sleeps forever, spins the CPU forever, or raises.
"""

from __future__ import annotations

import time
import zlib
from typing import Any


def _selected(response: str, per_mille: int) -> bool:
    return zlib.crc32(response.encode()) % 1000 < per_mille


def _score(item: dict[str, Any]) -> dict[str, float]:
    hit = float(" ".join(item["response"].split()) == " ".join(str(item["ground_truth"]).split()))
    return {"overall": hit, "accuracy": hit}


def _faulty(per_mille: int, how: str):
    def compute_score(reward_inputs: list[dict[str, Any]]) -> list[dict[str, float]]:
        out = []
        for item in reward_inputs:
            if _selected(item["response"], per_mille):
                if how == "sleep":
                    time.sleep(10**6)
                elif how == "spin":
                    while True:
                        pass
                else:
                    raise ValueError(f"cannot parse {item['response'][:40]!r}")
            out.append(_score(item))
        return out

    compute_score.__name__ = f"{how}_{per_mille}"
    return compute_score


clean = _faulty(0, "raise")
hang_sleep_10pct = _faulty(100, "sleep")
hang_sleep_1pct = _faulty(10, "sleep")
hang_spin_10pct = _faulty(100, "spin")
hang_spin_1pct = _faulty(10, "spin")
raise_10pct = _faulty(100, "raise")
