"""CPU placement of a local run: the learner's cores stay its own."""

import os
import subprocess
import sys
import threading

from async_rl.config import load_config
from async_rl.launch.cores import SupportCores, cpu_layout, pinned_to, set_process_cores, support_cores


def test_cpu_layout_gives_disjoint_cores():
    cores = len(os.sched_getaffinity(0))
    cfg = load_config(None, ["rollout.cpus_per_server=1", "learner.cpus_per_rank=1"])
    servers, ranks = cpu_layout(cfg)
    assert len(servers) == 1 and len(ranks) == 1
    assert servers[0] != str(ranks[0][0])
    too_big = load_config(None, [f"rollout.cpus_per_server={cores}", "learner.cpus_per_rank=1"])
    assert cpu_layout(too_big) is None  # does not fit: no pinning


def test_cpu_layout_names_each_pools_cores_and_pins_nothing_on_a_cluster():
    cfg = load_config(None, ["rollout.cpus_per_server=1", "learner.cpus_per_rank=1"])
    layout = cpu_layout(cfg)
    assert layout is not None and (layout.servers, layout.ranks) == tuple(layout)
    assert int(layout.servers[0]) == min(os.sched_getaffinity(0))  # servers first, then the ranks
    cluster = load_config(None, ["rollout.cpus_per_server=1", "learner.cpus_per_rank=1", "ray.address=auto"])
    assert cpu_layout(cluster) is None  # other machines' cores are not this one's to split


def test_support_processes_share_the_server_cores_not_the_learners():
    cfg = load_config(None, ["rollout.cpus_per_server=1", "learner.cpus_per_rank=1"])
    layout = cpu_layout(cfg)
    assert layout is not None  # 1 + 1 cores fit on any machine this project runs on (CI has 2)
    servers, ranks = layout
    assert support_cores(layout) == {int(servers[0])}
    assert support_cores(layout).isdisjoint(ranks[0])


def test_pinned_to_moves_every_thread_and_children_then_restores():
    before = os.sched_getaffinity(0)
    core = min(before)
    started = threading.Event()
    stop = threading.Event()
    seen: dict[str, set[int]] = {}

    def existing_thread() -> None:
        started.set()
        stop.wait(10)
        seen["thread"] = os.sched_getaffinity(0)  # this thread's own mask

    t = threading.Thread(target=existing_thread)
    t.start()
    started.wait(10)
    with pinned_to({core}):
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True, timeout=60)
        stop.set()
        t.join(10)
    assert child.stdout.strip() == str([core])  # a process started inside inherits the cores
    assert seen["thread"] == {core}  # threads that already existed moved too
    assert os.sched_getaffinity(0) == before  # restored afterwards


def test_set_process_cores_moves_every_thread_of_another_process():
    """How the driver lets its embedded Redis (started pinned, with its I/O threads) leave the rollout cores."""
    cores = os.sched_getaffinity(0)
    code = ("import os, sys, threading, time\n"
            "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
            "print('up', flush=True); sys.stdin.readline()\n"
            "masks = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')]\n"
            "print(len(masks), all(m == masks[0] for m in masks), masks[0], flush=True)\n")
    with pinned_to({min(cores)}):
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        set_process_cores(child.pid, cores)
        out, _ = child.communicate("go\n", timeout=30)
    finally:
        child.kill()
    threads, same, mask = out.split(" ", 2)
    assert int(threads) >= 2 and same == "True" and mask.strip() == str(sorted(cores))  # every thread moved


def test_support_cores_moves_what_nobody_placed_once_asked_and_gives_the_driver_its_cores_back():
    """How a run's start uses every core and then leaves the learner's cores to it: processes
    started in the block keep every core until ``place()``; then their unplaced threads and this
    process's move to the support cores, while a process placed on purpose (as vLLM binds its
    OpenMP threads, as a learner rank pins itself) and one kept (the embedded Redis) stay."""
    before = os.sched_getaffinity(0)
    assert len(before) >= 2, before  # CI has 2 cores: one for support, one placed elsewhere
    support, other = {min(before)}, {max(before)}
    older = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # as a test session's Redis: not the run's
    code = ("import os, sys, threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "print('up', flush=True); sys.stdin.readline()\n"
            "print(sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir('/proc/self/task')}), flush=True)\n")
    with SupportCores(support) as cores:
        children = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(3)]
        try:
            assert all(child.stdout.readline().strip() == "up" for child in children)
            unplaced, placed, kept = children
            set_process_cores(placed.pid, other)
            assert os.sched_getaffinity(unplaced.pid) == before  # the start uses every core
            moved = cores.place(keep={kept.pid})
            assert os.sched_getaffinity(0) == support
            assert os.sched_getaffinity(older.pid) == before
            masks = [child.communicate("go\n", timeout=30)[0].strip() for child in children]
        finally:
            for child in [*children, older]:
                child.kill()
    assert masks == [str([tuple(sorted(support))]), str([tuple(sorted(other))]), str([tuple(sorted(before))])], masks
    assert moved >= 2 + threading.active_count()  # the unplaced child's two threads and this process's
    assert os.sched_getaffinity(0) == before  # given back on leaving
