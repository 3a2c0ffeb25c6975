"""The tiny-asset cache (:mod:`async_rl.tiny.cache`): built once per key, read back whole."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from async_rl.tiny import TinyAssetsReport
from async_rl.tiny.cache import cache_key, cached_tiny_assets, read_report

pytestmark = pytest.mark.assets


@pytest.mark.assets
def test_a_cached_build_reads_back_its_report_and_is_built_once(tiny_assets: TinyAssetsReport, tmp_path: Path) -> None:
    built: list[Path] = []

    def copy(out: Path) -> TinyAssetsReport:  # stands for a build: the fixture's files, copied
        import shutil

        built.append(out)
        shutil.copytree(tiny_assets.out_dir, out)
        return read_report(out)

    first = cached_tiny_assets("addition", 0, copy, root=tmp_path)
    again = cached_tiny_assets("addition", 0, copy, root=tmp_path)
    assert len(built) == 1 and not built[0].exists()  # built beside its name, then renamed into place
    assert first == again and first.out_dir == tmp_path / cache_key("addition", 0)
    expected = {k: v for k, v in asdict(tiny_assets).items() if not isinstance(v, Path)}
    assert {k: v for k, v in asdict(first).items() if not isinstance(v, Path)} == expected
    assert first.train_path.read_bytes() == tiny_assets.train_path.read_bytes() and first.model_dir.is_dir()


def test_the_key_names_task_and_seed_and_changes_with_them() -> None:
    keys = {cache_key(task, seed) for task in ("addition", "vlm") for seed in (0, 1)}
    assert len(keys) == 4 and cache_key("vlm", 1).startswith("vlm-seed1-")
    assert cache_key("addition", 0) == cache_key("addition", 0)


@pytest.mark.assets
def test_concurrent_callers_build_once(tiny_assets: TinyAssetsReport, tmp_path: Path) -> None:
    """Two pytest-xdist workers asking at once: one builds, the other waits and reads it."""
    import shutil
    import threading
    import time

    built: list[Path] = []

    def slow_copy(out: Path) -> TinyAssetsReport:
        built.append(out)
        time.sleep(1.0)
        shutil.copytree(tiny_assets.out_dir, out)
        return read_report(out)

    reports: list[TinyAssetsReport] = []
    threads = [threading.Thread(target=lambda: reports.append(cached_tiny_assets("addition", 0, slow_copy, root=tmp_path))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(built) == 1 and len(reports) == 2 and reports[0] == reports[1]
