"""A run's identity: its run id, in its output directory and with its queue, checked at every start.

A run gets an id at its first start, written to ``{output_dir}/run.json`` and to the run name's
record in Redis (:class:`~async_rl.queue.ownership.RunRecord`). At every start the driver binds
the two (:func:`claim_run`): the same id on both sides (a resume) or none on either (a first
start) goes on; anything else is another run's state, and the start is refused with what to do.
``trainer.resume`` decides what happens to state that is already there:

- ``auto`` / a checkpoint path: resume the run whose state it is;
- ``off``: start from the base model, refused over an existing run's state (the plan says so
  before anything starts, :func:`refusal`);
- ``fresh``: move the old state aside (:func:`set_aside`: the output directory's run files into
  ``previous-<run id>/``; the run name's Redis keys to ``<run_name>.previous-<run id>:*``;
  nothing is deleted) and start a new run from the base model.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from async_rl.config import Config
from async_rl.launch.failures import ENV_FILE, REWARD_FILE
from async_rl.launch.plots import PLOTS
from async_rl.launch.tracking import WANDB_ID_FILE
from async_rl.queue.ownership import RunOwnership, RunRecord

__all__ = ["RUN_FILE", "DirState", "RunStateError", "claim_run", "driver_owner", "make_private", "plan_note", "read_dir", "refusal", "set_aside"]

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
"""The run's :class:`~async_rl.queue.ownership.RunRecord` in its output directory."""
STATE_NAMES = (RUN_FILE, "checkpoints", "redis", "learner_steps.jsonl", "metrics.jsonl")
"""What makes an output directory hold a run (runs started before run ids have no ``run.json``)."""
OUTPUT_NAMES = (*STATE_NAMES, "wandb", WANDB_ID_FILE, "servers.json", "resolved_config.yaml", "rejected_rows.jsonl",
                REWARD_FILE, ENV_FILE, *PLOTS)
"""Everything a run writes into its output directory (docs/training.md, "Output"): what
``trainer.resume=fresh`` moves aside. Anything else there (the quickstart's assets) stays."""
ASIDE_PREFIX = "previous-"


class RunStateError(RuntimeError):
    """The output directory and the queue hold state of different runs, or ``trainer.resume``
    does not allow the state found; the message says what to do."""


@dataclass(frozen=True)
class DirState:
    """What an output directory holds."""

    path: Path
    record: RunRecord | None
    """Its ``run.json`` (None: no run id)."""
    holds: tuple[str, ...]
    """The names of :data:`STATE_NAMES` present (non-empty): a run's state."""

    @property
    def run_id(self) -> str | None:
        return self.record.run_id if self.record is not None else None

    def describe(self) -> str:
        return f"{self.path} holds run {self.run_id}" if self.run_id else f"{self.path} holds a run ({', '.join(self.holds)})"


def read_dir(output_dir: str | Path) -> DirState:
    """The run state in ``output_dir`` (nothing is written)."""
    path = Path(output_dir).resolve()
    holds = tuple(name for name in STATE_NAMES if _non_empty(path / name))
    record = None
    if (path / RUN_FILE).is_file():
        try:
            record = msgspec.json.decode((path / RUN_FILE).read_bytes(), type=RunRecord)
        except msgspec.DecodeError as exc:
            raise RunStateError(f"{path / RUN_FILE} is not a run record ({exc}): fix or remove it") from None
    return DirState(path, record, holds)


def refusal(cfg: Config) -> str | None:
    """Why ``cfg`` must not start over its output directory (``trainer.resume=off`` over a
    run's state), or None. Reads only: the plan (``--dry-run``) reports it."""
    if cfg.trainer.resume != "off":
        return None
    state = read_dir(cfg.trainer.output_dir)
    if not state.holds:
        return None
    return (f"trainer.resume=off, but {state.describe()}: resume it with trainer.resume=auto, or start a new run there with "
            f"trainer.resume=fresh, which moves the old state aside to {state.path / _aside_name(state)}/ (nothing is deleted)")


def plan_note(cfg: Config) -> str | None:
    """What ``trainer.resume=fresh`` will move aside in the output directory, or None."""
    if cfg.trainer.resume != "fresh":
        return None
    state = read_dir(cfg.trainer.output_dir)
    return f"trainer.resume=fresh: {state.describe()}; it moves to {state.path / _aside_name(state)}/" if state.holds else None


def set_aside(cfg: Config) -> Path | None:
    """With ``trainer.resume=fresh``, move the run files of the output directory into
    ``previous-<run id>/`` there (a timestamp for a run without an id); returns that
    directory, or None when there was nothing to move. Call before anything is written there."""
    if cfg.trainer.resume != "fresh":
        return None
    state = read_dir(cfg.trainer.output_dir)
    if not state.holds:
        return None
    aside = state.path / _aside_name(state)
    aside.mkdir()
    for name in OUTPUT_NAMES:
        if (state.path / name).exists():
            os.rename(state.path / name, aside / name)
    log.warning("trainer.resume=fresh: moved the state of the previous run in %s to %s", state.path, aside)
    return aside


def make_private(run_dir: Path) -> None:
    """Make the run's files in ``run_dir`` this user's only: the directory and the folders of
    what a run writes (:data:`OUTPUT_NAMES`, ``previous-*``) 0700, their files 0600. They hold
    every prompt and response (the AOF, the logs), the Redis password (``redis/redis.conf``) and
    the weights. The driver's umask (0077) keeps what it writes from now on private; this fixes
    what an older version left readable. Anything else in the directory is left as it is."""
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    run_dir.chmod(0o700)
    for path in run_dir.iterdir():
        if path.name in OUTPUT_NAMES or path.name.startswith(ASIDE_PREFIX):
            _chmod_tree(path)


def _chmod_tree(path: Path) -> None:
    try:
        if path.is_symlink():
            return
        if not path.is_dir():
            path.chmod(0o600)
            return
        path.chmod(0o700)
        children = list(path.iterdir())
    except FileNotFoundError:  # removed meanwhile (a writer's temporary file)
        return
    for child in children:
        _chmod_tree(child)


def driver_owner() -> str:
    """This driver's name in the lease: ``<host>-<pid>``."""
    return f"{socket.gethostname()}-{os.getpid()}"


def claim_run(ownership: RunOwnership, cfg: Config, *, embedded: bool, owner: str) -> str:
    """Bind the output directory and the run name's queue to one run and hold its lease; returns
    the run id. Call after :func:`set_aside` and before the queue is used.

    ``embedded``: the Redis is the output directory's own (its previous driver, if any, died
    with it: its lease is taken over). Raises :class:`RunStateError` when the two sides
    belong to different runs, and :class:`~async_rl.queue.ownership.RunInUseError` when a live
    driver holds the run name. Blocks while a killed driver's lease lapses: call it off the
    event loop. On return the lease is held (release it with ``ownership.release()``).
    """
    t = cfg.trainer
    state = read_dir(t.output_dir)
    where = f"the embedded Redis in {state.path / 'redis'}" if embedded else ownership.url
    run_id = state.run_id or _new_run_id()  # a queue's id without the directory's is another run's: never adopted
    ownership.acquire(run_id, owner, take_over=embedded)
    try:
        found, has_data = ownership.record(), ownership.holds_data()
        if t.resume == "fresh" and (found is not None or has_data):
            aside = f"{t.run_name}.{ASIDE_PREFIX}{found.run_id if found is not None else _stamp()}"
            try:
                moved = ownership.move_aside(aside)
            except FileExistsError as exc:
                raise RunStateError(f"trainer.resume=fresh: {exc}; delete or rename them (redis-cli) and start again") from None
            log.warning("trainer.resume=fresh: moved the %d Redis keys of the previous run of trainer.run_name=%r on %s to %s:*",
                        moved, t.run_name, where, aside)
            found, has_data = None, False
        problem = _mismatch(cfg, state, found, has_data, where)
        if problem:
            raise RunStateError(problem)
        record = state.record or found or RunRecord(run_id, str(state.path), socket.gethostname(), time.time())
        if state.record is None:  # the directory first: a crash before the queue's record is then adopted at the next start
            _write_record(state.path / RUN_FILE, record)
        if found is None:
            ownership.set_record(record)
    except BaseException:
        ownership.release()
        raise
    if found is None and state.record is None:
        log.info("run %s of trainer.run_name=%r starts in %s", run_id, t.run_name, state.path)
    return run_id


def _mismatch(cfg: Config, state: DirState, found: RunRecord | None, has_data: bool, where: str) -> str | None:
    """Why the output directory's run and the queue's cannot go on together, or None."""
    name = cfg.trainer.run_name
    theirs = (f"the queue of run {found.run_id} (output dir {found.output_dir})" if found is not None
              else "queue data of a run without a run id (started before run ids existed, or from another output directory)")
    ways = (f"start this run under another trainer.run_name, or with trainer.resume=fresh to move that queue aside "
            f"(to the keys '{name}.{ASIDE_PREFIX}<run id>:*'; nothing is deleted)")
    if cfg.trainer.resume == "off" and (found is not None or has_data):
        return f"trainer.resume=off, but trainer.run_name={name!r} on {where} holds {theirs}: {ways}"
    if found is not None and found.run_id != state.run_id:
        mine = f"run {state.run_id}" if state.run_id else ("a run without a run id" if state.holds else "no run yet")
        resume = f"resume that run with trainer.output_dir={found.output_dir}, or " if found.output_dir != str(state.path) else ""
        return f"trainer.run_name={name!r} on {where} holds {theirs}, but {state.path} holds {mine}: {resume}{ways}"
    if found is None and has_data and not state.holds:
        return f"trainer.run_name={name!r} on {where} holds {theirs}, but {state.path} holds no run: {ways}"
    return None


def _aside_name(state: DirState) -> str:
    """A free ``previous-<run id>`` (or ``previous-<UTC time>``) name in the output directory."""
    base = f"{ASIDE_PREFIX}{state.run_id or _stamp()}"
    name, n = base, 1
    while (state.path / name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


def _new_run_id() -> str:
    """A run id: its start's UTC time (sorts by age) and a random suffix."""
    return f"{_stamp()}-{secrets.token_hex(3)}"


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def _non_empty(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0


def _write_record(path: Path, record: RunRecord) -> None:
    """Write ``run.json`` atomically (a crash leaves the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(record) + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
