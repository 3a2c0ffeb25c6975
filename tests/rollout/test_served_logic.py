"""The served models' pure logic (rollout/served.py): what counts as a request's own fault,
and the request ledger behind ``models/<name>/*``. The actors themselves, on real vLLM
engines, are tests/rollout/test_rollout_pool.py's."""

from __future__ import annotations

import time

from async_rl.rollout.served import RequestLedger, request_fault
from async_rl.rollout.types import ServedModelError


def test_a_requests_own_fault_is_a_value_or_type_error_or_vllms_client_error():
    class VLLMClientError(Exception):
        pass

    class VLLMValidationError(VLLMClientError):  # vLLM's: a prompt past the context, no ValueError
        pass

    assert request_fault(ValueError("too few tokens")) and request_fault(TypeError("x")) and request_fault(VLLMValidationError("long"))
    assert not request_fault(RuntimeError("engine dead")) and not request_fault(ServedModelError("gave up"))


def test_the_ledger_counts_answers_latencies_and_keys_them_by_model():
    ledger = RequestLedger("judge")
    ledger.counters["requests"] += 3
    ledger.counters["failed"] += 1
    ledger.answered(time.monotonic() - 2.0)
    ledger.answered(time.monotonic() - 1.0)
    stats = ledger.stats(running=4, servers=2, restarts=1)
    assert (stats["models/judge/requests"], stats["models/judge/answered"], stats["models/judge/failed"]) == (3.0, 2.0, 1.0)
    assert 1.5 <= stats["models/judge/latency_mean_s"] < 1.6 and 2.0 <= stats["models/judge/latency_max_s"] < 2.1
    assert (stats["models/judge/running"], stats["models/judge/servers"], stats["models/judge/restarts"]) == (4.0, 2.0, 1.0)
    assert RequestLedger("rm").stats(0, 1, 0)["models/rm/latency_mean_s"] == 0.0  # nothing answered yet
