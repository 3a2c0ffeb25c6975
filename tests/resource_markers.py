"""What each test really starts: redis-server, Ray, a vLLM engine, a process group, the tiny
assets (issue 43, the resource markers). tests/conftest.py calls it.

Seen three ways, all in the test's own window (setup, call and teardown):
- calls in the test process: ``subprocess.Popen`` of ``redis-server``, ``ray.init``,
  ``torch.distributed.init_process_group``, a weight group's ``WeightGroup.join``, a process
  spawned to run a learner rank (a ``learner_helpers`` body: each joins a process group);
- processes: every 0.5 s, the new descendants of the test process by command line
  (``redis-server``, ``raylet``, a vLLM ``EngineCore``, a ``ray::LearnerActor`` rank), which
  is how a CLI run's or a Ray actor's parts are seen;
- fixtures: what a module or function fixture's setup started (a module's Ray and vLLM
  pool) is needed by every test that uses the fixture, also those after the first; the
  session fixtures by :data:`FIXTURES`.

Always on: a test that started a resource its markers do not name fails at its teardown
(:func:`unmarked`), so the markers stay true. ``ASYNC_RL_TEST_RESOURCES=PATH`` also writes, at
the session's end, ``{test id: [resources]}`` as JSON to PATH (one file per lane of
scripts/test.sh and pytest-xdist worker: ``PATH.rest``, ``PATH.stack``, ``PATH.gw0``, ...), the map ``python tests/resource_markers.py PATH...`` sets the markers
from (``slow`` too, which is timed, not enforced).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from processes import Identity, descendants, table

RESOURCES = ("redis", "ray", "vllm", "dist", "assets")
"""The resource markers (registered in pyproject.toml), besides ``slow``."""

SLOW_S = 10.0
"""A test whose call takes longer than this is ``slow`` (seconds, on 2 cores)."""

FIXTURES = {"redis_url": "redis", "one_rank": "dist", "tiny_assets": "assets", "tiny_vlm_assets": "assets"}
"""Session fixtures and what every test that uses one needs: a session fixture is set up once,
in the first test that asks for it, yet the later ones use its Redis or process group just the
same; and the cached assets start no process to see."""

PROCESSES = (("redis-server", "redis"), ("raylet", "ray"), ("EngineCore", "vllm"), ("ray::LearnerActor", "dist"))
"""(text in a command line, resource) of the processes the sampler recognises."""

SAMPLE_S = 0.5
"""How often the process table is read while a test runs, seconds."""

ENV = "ASYNC_RL_TEST_RESOURCES"


class Recorder:
    """The resources each test used, by test id."""

    def __init__(self, out: Path | None):
        self.out = out
        self.used: dict[str, set[str]] = {}
        self.fixtures: dict[tuple[str, str], set[str]] = {}  # (where it is defined, name) -> what its setups started
        self.uses: dict[str, list[tuple[str, str]]] = {}  # test id -> the fixtures it uses
        self.seconds: dict[str, float] = {}  # test id -> its setup, call and teardown, seconds
        self.current: str | None = None
        self._setting_up: list[tuple[str, str]] = []  # the fixtures being set up, innermost last
        self._seen: set[Identity] = set()  # processes already noted, or there before the first test
        self._lock = threading.Lock()
        self._scanning = threading.Lock()  # one scan at a time, never across a test's start or end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="resource-sampler", daemon=True)

    def note(self, resource: str) -> None:
        with self._lock:
            if self.current is not None:
                self.used.setdefault(self.current, set()).add(resource)
            if self._setting_up:
                self.fixtures.setdefault(self._setting_up[-1], set()).add(resource)

    def begin(self, test_id: str, fixtures: list[tuple[str, str]]) -> None:
        """``fixtures``: (where defined, name) of each fixture the test uses."""
        with self._scanning, self._lock:
            self.current = test_id
            self.uses[test_id] = fixtures
            self.used.setdefault(test_id, set()).update(FIXTURES[name] for _, name in fixtures if name in FIXTURES)

    def enter_fixture(self, fixture: tuple[str, str]) -> None:
        with self._scanning:
            self._scan()  # what started before this setup (an earlier fixture's) is not its
            with self._lock:
                self._setting_up.append(fixture)

    def exit_fixture(self) -> None:
        with self._scanning:
            self._scan()  # what the setup started, before the test's own call
        with self._lock:
            self._setting_up.pop()

    def timed(self, test_id: str, phase: str, seconds: float) -> None:
        """A phase (setup, call, teardown) of a test took ``seconds``."""
        with self._lock:
            self.seconds[test_id] = self.seconds.get(test_id, 0.0) + seconds
            if phase == "call" and seconds > SLOW_S:
                self.used.setdefault(test_id, set()).add("slow")

    def end(self) -> set[str]:
        """What the test that ends used: its own resources and those of the fixtures it uses."""
        with self._scanning:
            self._scan()
            with self._lock:
                test, self.current = self.current, None
                return self._used(test) if test is not None else set()

    def _used(self, test: str) -> set[str]:
        return self.used.get(test, set()).union(*(self.fixtures.get(f, set()) for f in self.uses.get(test, ())))

    def _scan(self) -> None:
        procs = table()
        for pid in descendants(procs, os.getpid()):
            _, start, cmd = procs[pid]
            if (pid, start) not in self._seen:
                for text, resource in PROCESSES:
                    if text in cmd:
                        self._seen.add((pid, start))  # said once, of what was running (or set up) when it started
                        self.note(resource)

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            with self._scanning:
                if self.current is not None:
                    self._scan()

    def install(self) -> None:
        """Wrap the calls that start a resource in this process; start the sampler."""
        import multiprocessing.context

        import ray
        import torch.distributed as dist

        from async_rl.sync.group import WeightGroup

        popen_init = subprocess.Popen.__init__

        def popen(proc, args, *a, **kw):
            argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
            if argv and Path(os.fsdecode(argv[0]).split()[0]).name == "redis-server":
                self.note("redis")
            return popen_init(proc, args, *a, **kw)

        subprocess.Popen.__init__ = popen
        ray_init = ray.init

        def init(*a, **kw):
            self.note("ray")
            return ray_init(*a, **kw)

        ray.init = init
        init_pg = dist.init_process_group

        def init_process_group(*a, **kw):
            self.note("dist")
            return init_pg(*a, **kw)

        dist.init_process_group = init_process_group
        join = WeightGroup.join.__func__

        def join_group(cls, *a, **kw):
            self.note("dist")
            return join(cls, *a, **kw)

        WeightGroup.join = classmethod(join_group)
        spawn_start = multiprocessing.context.SpawnProcess.start

        def start(proc):
            if getattr(getattr(proc, "_target", None), "__module__", "") == "learner_helpers":
                self.note("dist")
            return spawn_start(proc)

        multiprocessing.context.SpawnProcess.start = start
        procs = table()
        self._seen = {(pid, procs[pid][1]) for pid in descendants(procs, os.getpid())}
        self._thread.start()

    def write(self) -> None:
        """Stop watching; write the map when asked for one."""
        self._stop.set()
        if self.out is None:
            return
        with self._lock:
            used = {test: sorted(self._used(test)) for test in sorted(self.used)}
            seconds = {test: round(s, 2) for test, s in sorted(self.seconds.items())}
        part = ".".join(filter(None, (os.environ.get("ASYNC_RL_TEST_LANE"), os.environ.get("PYTEST_XDIST_WORKER"))))
        out = self.out.with_name(f"{self.out.name}.{part}") if part else self.out  # one file per lane and worker
        out.write_text(json.dumps({"resources": used, "seconds": seconds}, indent=1) + "\n")


class MarkerPlugin:
    """The pytest hooks around a :class:`Recorder` (registered by tests/conftest.py): each
    test's window, its fixtures' setups, its phases' durations; at its teardown, a test that
    started a resource its markers do not name fails (:func:`unmarked`)."""

    def __init__(self) -> None:
        self.recorder = recorder()
        self.recorder.install()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        info = getattr(item, "_fixtureinfo", None)
        used = [(defs[-1].baseid, name) for name, defs in info.name2fixturedefs.items() if defs] if info is not None else []
        self.recorder.begin(item.nodeid, used)
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
        outcome = yield
        report = outcome.get_result()
        self.recorder.timed(item.nodeid, report.when, report.duration)
        if report.when == "teardown":
            why = unmarked(self.recorder.end(), {m.name for m in item.iter_markers()})
            if why is not None and report.passed:
                report.outcome, report.longrepr = "failed", why

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Iterator[None]:
        self.recorder.enter_fixture((fixturedef.baseid, fixturedef.argname))
        try:
            yield
        finally:
            self.recorder.exit_fixture()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.recorder.write()


DURATIONS = Path(__file__).parent / "durations.json"
"""Seconds each test took in the last recorded full run (2 cores), by test id (0.0: known and
under 0.05 s; a test not listed is new, its duration unknown): the suite runs
the longest modules first under pytest-xdist, so that no long module starts last
(tests/conftest.py), and the lanes of scripts/test.sh their shared tail longest first
(tests/lanes.py)."""


def write_durations(seconds: dict[str, float]) -> None:
    """:data:`DURATIONS` from a recorded run's ``{test id: seconds}``."""
    DURATIONS.write_text(json.dumps({t: round(s, 1) for t, s in sorted(seconds.items(), key=lambda kv: -kv[1])}, indent=1) + "\n")


def test_seconds() -> dict[str, float]:
    """:data:`DURATIONS`: seconds by test id (empty when absent)."""
    return json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}


def longest_first(paths: list[str]) -> list[str]:
    """The distinct test modules of ``paths`` in the order to run them: those :data:`DURATIONS`
    does not know (new: their duration is unknown) first, then the longest first."""
    modules: dict[str, float] = {}
    for test, s in test_seconds().items():
        module = test.partition("::")[0]
        modules[module] = modules.get(module, 0.0) + s
    return sorted(dict.fromkeys(paths), key=lambda m: -modules.get(m, float("inf")))


def recorder() -> Recorder:
    """A recorder; it writes its map to ``$ASYNC_RL_TEST_RESOURCES`` when that is set."""
    path = os.environ.get(ENV)
    return Recorder(Path(path) if path else None)


def unmarked(used: set[str], markers: set[str]) -> str | None:
    """Why a test that started ``used`` and carries ``markers`` fails, or None."""
    missing = sorted((used & set(RESOURCES)) - markers)
    if not missing:
        return None
    marks = " ".join(f"@pytest.mark.{m}" for m in missing)
    return (f"this test started {', '.join(missing)} without its marker: add {marks} (or to the module's pytestmark); "
            f"the resource markers select the inner loop, see docs/testing.md")


MARK_ORDER = (*RESOURCES, "slow")


def apply(used: dict[str, list[str]]) -> None:
    """Set the markers of a recorded map on the test files: module-level ``pytestmark`` for a
    resource every test of a module needs, a decorator on each test function otherwise (the
    union over its parametrizations); markers already there are kept."""
    import ast
    import collections
    import re

    by_file = collections.defaultdict(lambda: collections.defaultdict(set))
    for nodeid, res in used.items():
        path, _, rest = nodeid.partition("::")
        func = rest.split("[")[0].split("::")[-1]
        by_file[path][func].update(res)
    for path, funcs in sorted(by_file.items()):
        p = Path(path)
        src = original = p.read_text()
        tree = ast.parse(src)
        defs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")}
        names = [n for n in defs if n in funcs]
        if not names:
            continue
        module = [m for m in MARK_ORDER if all(m in funcs[n] for n in names)] if len(names) == len(defs) else []
        lines = src.splitlines(keepends=True)
        inserts = []  # (line index, text)
        for name in names:
            node = defs[name]
            need = [m for m in MARK_ORDER if m in funcs[name] and m not in module]
            if not need:
                continue
            existing = {d.attr for d in node.decorator_list if isinstance(d, ast.Attribute) and isinstance(d.value, ast.Attribute) and d.value.attr == "mark"}
            need = [m for m in need if m not in existing]
            if not need:
                continue
            first = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            indent = re.match(r"\s*", lines[first]).group(0)
            inserts.append((first, "".join(f"{indent}@pytest.mark.{m}\n" for m in need)))
        for idx, text in sorted(inserts, reverse=True):
            lines.insert(idx, text)
        src = "".join(lines)
        if not inserts and not module:
            continue
        if module:
            marks = [f"pytest.mark.{m}" for m in module]
            tree = ast.parse(src)
            found = [n for n in tree.body if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["pytestmark"]]
            if found:  # rewritten whole when a mark is missing, however many lines it spans (its comments are lost)
                node = found[0]
                value = node.value
                items = [ast.unparse(e) for e in value.elts] if isinstance(value, ast.List) else [ast.unparse(value)]
                missing = [x for x in marks if x not in items]
                if missing:
                    ls = src.splitlines(keepends=True)
                    ls[node.lineno - 1:node.end_lineno] = [f"pytestmark = [{', '.join(items + missing)}]\n"]
                    src = "".join(ls)
            else:
                # after the last top-level import
                tree = ast.parse(src)
                last = max(n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
                ls = src.splitlines(keepends=True)
                ls.insert(last, f"\npytestmark = [{', '.join(marks)}]\n")
                src = "".join(ls)
        if "import pytest" not in src:
            tree = ast.parse(src)
            first_import = min(n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and not (isinstance(n, ast.ImportFrom) and n.module == "__future__"))
            ls = src.splitlines(keepends=True)
            ls.insert(first_import - 1, "import pytest\n")
            src = "".join(ls)
        if src != original:
            p.write_text(src)
            print(path, "module:", module, "funcs:", len(inserts))


if __name__ == "__main__":  # python tests/resource_markers.py MAP.json [MAP.json.gw1 ...]   (from the repository root)
    import sys

    resources: dict[str, list[str]] = {}
    seconds: dict[str, float] = {}
    for name in sys.argv[1:]:
        recorded = json.loads(Path(name).read_text())
        resources.update(recorded["resources"])
        seconds.update(recorded["seconds"])
    apply(resources)
    write_durations(seconds)
