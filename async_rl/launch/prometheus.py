"""The run's metrics for Prometheus: ``/metrics`` served by the driver (``logging.prometheus_port``).

A custom collector turns the tracker's latest values into metric families at scrape time
(``prometheus_client`` writes the exposition format and serves it), so nothing is copied
per step and a scrape always sees the newest step. Names follow Prometheus conventions:
``async_rl_`` prefix, base units in the name (``_seconds``, ``_tokens``, ``_groups``,
``_versions``, ``_ratio``), ``_total`` for counters. Each inference server's own vLLM
metrics stay on its OpenAI API port (``http://HOST:PORT/metrics``, listed in ``servers.json``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from async_rl.launch.learning_checks import WARN_PREFIX
from async_rl.rollout.openai_api import ANY_ADDRESS


PREFIX = "async_rl_"

# (tracker key, name without prefix, help) of values that can go up and down.
GAUGES: tuple[tuple[str, str, str], ...] = (
    ("version", "policy_version", "Policy version the learner has produced (learner steps trained)."),
    ("queue/depth", "queue_depth_groups", "Groups in the replay queue not yet read by the learner."),
    ("queue/pending", "queue_pending_groups", "Groups read by the learner but not yet committed by a checkpoint."),
    ("queue/oldest_age_s", "queue_oldest_age_seconds", "Age of the oldest queued group."),
    ("queue/returned_prompts", "queue_returned_prompts", "Prompts given back by stopped or failed workers, waiting to be generated again."),
    ("staleness/mean", "staleness_mean_versions", "Mean staleness of the last batch's groups (learner version minus behaviour version)."),
    ("staleness/max", "staleness_max_versions", "Largest staleness in the last batch."),
    ("rollout/tokens_per_s", "generation_tokens_per_second", "Tokens generated per second by all servers (recent window)."),
    ("perf/tokens_per_s", "training_tokens_per_second", "Tokens trained per second of the last step's compute (wait excluded)."),
    ("perf/idle_fraction", "learner_idle_ratio", "Fraction of the last step the learner waited for data."),
    ("batch/reward_mean", "reward_mean", "Mean reward of the last batch."),
    ("sync/update_s", "weight_update_seconds", "Duration of the last weight update (announcement to every server's acknowledgement)."),
    ("sync/pause_s", "server_pause_seconds", "Longest generation pause a server took to load the last weight update."),
    ("time/step", "step_seconds", "Duration of the last learner step (wait for data included)."),
    ("time/checkpoint", "checkpoint_seconds", "Duration of the last checkpoint save."),
    ("val/greedy_accuracy", "validation_greedy_accuracy_ratio", "Greedy accuracy of the last validation."),
    ("val/pass_at_n", "validation_pass_at_n_ratio", "pass@n of the last validation."),
    ("val/seconds", "validation_seconds", "Duration of the last validation."),
    ("eta_s", "eta_seconds", "Estimated time until the run ends (steps, validations and checkpoints still to come)."),
)
# (tracker key, name without prefix and _total, help) of cumulative values.
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("rollout/tokens_generated", "generated_tokens", "Tokens generated for training."),
    ("tokens_trained", "trained_tokens", "Tokens trained (since this driver started)."),
    ("rollout/groups_put", "groups_generated", "Groups written to the replay queue."),
    ("queue/dead_lettered", "queue_dead_lettered_groups", "Undecodable or invalid queue entries moved to the dead-letter stream."),
    ("queue/dropped_stale", "queue_dropped_stale_groups", "Groups dropped because they were older than algorithm.max_staleness allows."),
    ("queue/dropped/future", "queue_dropped_future_groups",
     "Groups not trained because weights more than algorithm.max_staleness versions newer than the learner's made them (after a resume); their prompts are served again."),
    ("rollout/reward_errors", "reward_errors", "Samples the reward function failed on (raised, timed out, unusable output): not trained."),
    ("rollout/reward_timeouts", "reward_timeouts", "Samples among reward_errors whose scoring exceeded rollout.reward.timeout_s."),
    ("rollout/judge_errors", "judge_errors", "Samples the judge (rollout.reward.judge) gave no answer for: not trained."),
    ("rollout/teacher_errors", "teacher_errors", "Samples the distillation teacher (algorithm.distill) gave no log-probs for: not trained."),
    ("rollout/reward_killed", "reward_workers_killed", "Reward worker process groups killed because a timed-out call did not stop when interrupted."),
    ("rollout/generate_failures", "generate_failures", "Generation calls that failed."),
    ("env/errors", "environment_errors", "Episodes the environment failed (it raised, returned something unusable or blocked its loop)."),
    ("env/timeouts", "environment_timeouts", "Episodes ended by an environment call longer than rollout.env.step_timeout_s."),
    ("rollout/server_restarts", "server_restarts", "Inference servers replaced (dead, broken or lagging)."),
    ("rollout/engine_deaths", "engine_deaths", "Inference servers whose vLLM engine process died while the server lived (each one replaced)."),
)
# Per served model (``models/<name>/<key>``), as the ``model`` label of one family each: (key, name, help, counter?).
MODEL_METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("requests", "model_requests", "Requests to the served model (models.<name>).", True),
    ("failed", "model_failed_requests", "Requests to the served model that failed on every server tried, or by their own fault.", True),
    ("retries", "model_retries", "Attempts of requests to the served model after their first (a server died, failed or timed out).", True),
    ("timeouts", "model_timeouts", "Attempts past models.<name>.request_timeout_s.", True),
    ("restarts", "model_server_restarts", "Servers of the served model replaced.", True),
    ("latency_mean_s", "model_latency_mean_seconds", "Mean seconds from a request's arrival to its answer, retries included.", False),
    ("latency_max_s", "model_latency_max_seconds", "Longest seconds from a request's arrival to its answer.", False),
    ("running", "model_running_requests", "Requests running on the served model now (its queue).", False),
    ("servers", "model_servers", "Servers of the served model now.", False),
)
# Phases of a learner step (``time/<phase>`` keys), as the ``phase`` label of one gauge.
STEP_PHASES = ("wait", "prox", "perception", "fwd_bwd", "optim", "sync")


@dataclass
class ServerState:
    """What the driver last learned of one inference server."""

    server_id: str
    up: bool
    version: int = 0
    """Policy version of the weights the server holds."""
    learner_version: int = 0
    """The learner's version when the server reported ``version`` (its lag is the difference)."""
    running_requests: int = 0


@dataclass
class Snapshot:
    """Everything one scrape reports."""

    latest: dict[str, float] = field(default_factory=dict)
    """Latest value of every tracker key."""
    staleness_groups: dict[int, float] = field(default_factory=dict)
    """Groups trained per staleness (versions), since this driver started."""
    servers: list[ServerState] = field(default_factory=list)


class RunCollector(Collector):
    """Builds the metric families of a :class:`Snapshot` returned by ``source`` at each scrape."""

    def __init__(self, source: Callable[[], Snapshot], max_staleness: int):
        self._source = source
        self._max_staleness = max_staleness

    def collect(self) -> Iterator[Metric]:
        snap = self._source()
        latest = snap.latest
        for key, name, doc in GAUGES:
            if key in latest:
                yield GaugeMetricFamily(PREFIX + name, doc, value=latest[key])
        for key, name, doc in COUNTERS:
            if key in latest:
                yield CounterMetricFamily(PREFIX + name, doc, value=latest[key])
        phases = GaugeMetricFamily(PREFIX + "step_phase_seconds", "Seconds of the last learner step spent in each phase.", labels=["phase"])
        for phase in STEP_PHASES:
            if f"time/{phase}" in latest:
                phases.add_metric([phase], latest[f"time/{phase}"])
        yield phases
        warnings = GaugeMetricFamily(PREFIX + "learning_warning", "1 while the learning check is active (the run may not learn; "
                                     "docs/training.md, Monitoring), else 0.", labels=["warning"])
        for key, value in latest.items():
            if key.startswith(WARN_PREFIX):
                warnings.add_metric([key.removeprefix(WARN_PREFIX)], value)
        yield warnings
        yield _staleness_histogram(snap.staleness_groups, self._max_staleness)
        models = sorted({key.split("/")[1] for key in latest if key.startswith("models/") and key.count("/") == 2})
        for key, name, doc, counter in MODEL_METRICS:
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(PREFIX + name, doc, labels=["model"])
            for model in models:
                if (value := latest.get(f"models/{model}/{key}")) is not None:
                    family.add_metric([model], value)
            yield family
        up = GaugeMetricFamily(PREFIX + "server_up", "1 if the inference server answered its last health check.", labels=["server"])
        held = GaugeMetricFamily(PREFIX + "server_weight_version", "Policy version of the weights each server holds.", labels=["server"])
        lag = GaugeMetricFamily(PREFIX + "server_weight_lag_versions", "Learner version minus the version the server held, at the last health check.",
                                labels=["server"])
        running = GaugeMetricFamily(PREFIX + "server_running_requests", "Requests the server is generating.", labels=["server"])
        for s in snap.servers:
            up.add_metric([s.server_id], float(s.up))
            if s.up:
                held.add_metric([s.server_id], s.version)
                lag.add_metric([s.server_id], max(s.learner_version - s.version, 0))
                running.add_metric([s.server_id], s.running_requests)
        yield from (up, held, lag, running)


def _staleness_histogram(groups: dict[int, float], max_staleness: int) -> HistogramMetricFamily:
    """Cumulative buckets ``le="0", "1", ... "max_staleness"`` (the same every scrape) of the groups trained per staleness."""
    buckets, total = [], 0.0
    for lag in range(max(max_staleness, *groups, 0) + 1):
        total += groups.get(lag, 0.0)
        buckets.append((str(float(lag)), total))
    buckets.append(("+Inf", total))
    return HistogramMetricFamily(PREFIX + "staleness_versions", "Staleness of the groups trained (learner version minus behaviour version).",
                                 buckets=buckets, sum_value=sum(lag * n for lag, n in groups.items()))


class PrometheusServer:
    """Serves ``/metrics`` for ``source`` on ``host:port`` (0: a free port) until :meth:`close`;
    ``max_staleness`` (``algorithm.max_staleness``) fixes the staleness histogram's buckets."""

    def __init__(self, source: Callable[[], Snapshot], host: str, port: int, max_staleness: int):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(RunCollector(source, max_staleness))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise OSError(port_error(host, port, exc)) from None
        self.port: int = self._server.server_port
        import ray

        shown = ray.util.get_node_ip_address() if host in ANY_ADDRESS else host
        shown = f"[{shown}]" if ":" in shown else shown
        self.url = f"http://{shown}:{self.port}/metrics"
        """Where to scrape."""

    def close(self) -> None:
        """Stop serving (a scrape in progress finishes first)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def port_error(host: str, port: int, exc: OSError) -> str:
    """Why ``logging.prometheus_port`` cannot be served, and what to do."""
    return f"logging.prometheus_port={port}: cannot serve on {host}:{port} ({exc}); choose another port, or 0 for a free one"


def server_states(healths: list[Any], learner_version: int) -> list[ServerState]:
    """:class:`ServerState` of each entry of ``ServerPool.health()`` (a ``ServerHealth`` or an
    error text), taken while the learner was at ``learner_version``."""
    return [
        ServerState(f"server-{i}", False) if isinstance(h, str) else ServerState(h.server_id, True, h.version, learner_version, h.running_requests)
        for i, h in enumerate(healths)
    ]

