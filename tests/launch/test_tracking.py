"""The tracker's sinks for real: W&B offline (read back from its run files), metrics.jsonl,
Prometheus over HTTP, and the plots written when a run ends."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from wandb_records import history

from async_rl.config import load_config
from async_rl.launch.plots import PLOTS
from async_rl.launch.prometheus import ServerState
from async_rl.launch.tracking import WANDB_ID_FILE, Tracker


def _config(run_dir: Path, *overrides: str):
    return load_config(None, [f"trainer.output_dir={run_dir}", "trainer.total_steps=6", "trainer.save_every=3", "trainer.val_every=2",
                              "logging.console=false", "logging.wandb.mode=offline", *overrides])


def _step(version: int, lag: int = 1) -> dict[str, float]:
    return {"version": version, "perf/tokens_per_s": 100.0, "perf/tokens": 50.0, "batch/reward_mean": 0.5, f"staleness/hist/{lag}": 4.0,
            "staleness/mean": float(lag), "time/step": 0.2, "time/wait": 0.01, "time/fwd_bwd": 0.15}


def _val(version: int, accuracy: float) -> dict[str, float]:
    return {"version": version, "val/greedy_accuracy": accuracy, "val/pass_at_n": accuracy, "val/seconds": 0.1}


def test_every_validation_reaches_wandb_in_order_also_after_a_resume(tmp_path, monkeypatch):
    """Validation results arrive after the steps that ran meanwhile (as in a run): W&B keeps
    every one, at its version; a resumed tracker continues the same W&B run after them."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = _config(tmp_path)
    tracker = Tracker(cfg, tmp_path, 6)
    for record in (_step(1), _step(2), _val(0, 0.25), _step(3), _val(2, 0.375)):
        tracker.log(record)
    tracker.close()
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()

    resumed = Tracker(cfg, tmp_path, 6, resumed=True)  # the learner resumed from its version-3 checkpoint
    for record in (_step(4), _val(4, 0.5), _step(5), _step(6), _val(6, 0.625)):
        resumed.log(record)
    resumed.close()

    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = history(tmp_path)
    assert [step for step, _ in rows] == list(range(len(jsonl)))  # one W&B step per record, increasing across the resume
    expected = [(r["version"], r["val/greedy_accuracy"]) for r in jsonl if "val/greedy_accuracy" in r]
    assert [(row["version"], row["val/greedy_accuracy"]) for _, row in rows if "val/greedy_accuracy" in row] == expected
    assert expected == [(0, 0.25), (2, 0.375), (4, 0.5), (6, 0.625)]
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(run_id) for r in runs)  # the same W&B run, continued

    # The run's end wrote the plots and the summary names them.
    assert resumed.plots == [tmp_path / name for name in PLOTS]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in resumed.plots)


def test_a_new_run_in_the_same_directory_starts_a_new_wandb_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = _config(tmp_path)
    ids = []
    for _ in range(2):
        tracker = Tracker(cfg, tmp_path, 6)  # not resumed: the learner started from the base model
        tracker.log(_step(1))
        tracker.close()
        ids.append((tmp_path / WANDB_ID_FILE).read_text())
    assert ids[0] != ids[1]


def test_prometheus_serves_the_runs_metrics_over_http(tmp_path):
    tracker = Tracker(_config(tmp_path, "logging.wandb.enable=false", "logging.prometheus_port=0", "logging.prometheus_host=127.0.0.1",
                              "algorithm.max_staleness=2"), tmp_path, 6)
    try:
        tracker.servers = [ServerState("server-0", True, version=1, learner_version=3, running_requests=3), ServerState("server-1", False)]
        for record in (_step(1, lag=0), _step(2, lag=1), _step(3, lag=1), _val(2, 0.5)):
            tracker.log(record)
        tracker.log({"version": 3, "rollout/tokens_generated": 1234.0, "queue/dead_lettered": 2.0, "queue/depth": 5.0,
                     "rollout/tokens_per_s": 80.0, "perf/tokens_per_s": 90.0, "perf/tokens": 10.0,
                     "warn/no_learning_signal": 1.0, "warn/token_budget": 0.0, "rollout/judge_errors": 3.0,
                     "models/judge/requests": 40.0, "models/judge/latency_mean_s": 0.25, "models/teacher/running": 2.0})
        url = tracker.prometheus.url
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        body = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        tracker.close()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    samples = [s for f in families.values() for s in f.samples]

    def value(name: str, **labels: str) -> float:
        return next(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("async_rl_policy_version") == 3  # the validation of version 2 did not move it back
    assert value("async_rl_queue_depth_groups") == 5
    assert families["async_rl_queue_dead_lettered_groups"].type == "counter"
    assert value("async_rl_queue_dead_lettered_groups_total") == 2
    assert value("async_rl_generated_tokens_total") == 1234
    assert value("async_rl_trained_tokens_total") == 160  # 3 x 50 + 10
    assert value("async_rl_validation_greedy_accuracy_ratio") == 0.5
    assert value("async_rl_step_phase_seconds", phase="fwd_bwd") == pytest.approx(0.15)
    assert value("async_rl_server_weight_lag_versions", server="server-0") == 2
    assert value("async_rl_server_up", server="server-1") == 0
    assert value("async_rl_eta_seconds") > 0
    assert value("async_rl_learning_warning", warning="no_learning_signal") == 1
    assert value("async_rl_learning_warning", warning="token_budget") == 0
    staleness = {s.labels["le"]: s.value for s in families["async_rl_staleness_versions"].samples if s.name.endswith("_bucket")}
    assert staleness == {"0.0": 4, "1.0": 12, "2.0": 12, "+Inf": 12}  # groups: 4 at lag 0, 8 at lag 1; buckets up to max_staleness
    assert value("async_rl_staleness_versions_sum") == 8
    # the served models, a family per metric labelled by model (models.<name>), and the judge's failures
    assert value("async_rl_model_requests_total", model="judge") == 40 and families["async_rl_model_requests"].type == "counter"
    assert value("async_rl_model_latency_mean_seconds", model="judge") == 0.25
    assert value("async_rl_model_running_requests", model="teacher") == 2
    assert value("async_rl_judge_errors_total") == 3


def test_a_taken_prometheus_port_is_a_clear_error(tmp_path):
    first = Tracker(_config(tmp_path, "logging.wandb.enable=false", "logging.prometheus_port=0", "logging.prometheus_host=127.0.0.1"), tmp_path, 6)
    try:
        with pytest.raises(OSError, match=f"logging.prometheus_port={first.prometheus.port}: cannot serve"):
            Tracker(_config(tmp_path, "logging.wandb.enable=false", f"logging.prometheus_port={first.prometheus.port}",
                            "logging.prometheus_host=127.0.0.1"), tmp_path, 6)
    finally:
        first.close()


def test_metrics_a_full_disk_refused_are_held_and_written_in_order(tmp_path, capsys):
    """metrics.jsonl on a disk that takes nothing (``/dev/full``): the tracker says so once,
    counts the failed writes, and writes every held line, in order, once the disk takes them."""
    cfg = _config(tmp_path, "logging.wandb.enable=false", "logging.console=true", "logging.plots=false")
    metrics = tmp_path / "metrics.jsonl"
    metrics.symlink_to("/dev/full")
    tracker = Tracker(cfg, tmp_path, 6)
    tracker.log(_step(1))
    tracker.log(_step(2))
    assert capsys.readouterr().out.count("metrics.jsonl cannot be written") == 1
    assert tracker.latest["disk/metrics_write_errors"] == 2.0 and tracker.latest["disk/metrics_lines_dropped"] == 0.0
    metrics.unlink()  # space is back
    tracker.log(_step(3))
    tracker.close()
    assert [json.loads(line)["version"] for line in metrics.read_text().splitlines()] == [1.0, 2.0, 3.0]
