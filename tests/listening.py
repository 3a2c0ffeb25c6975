"""What a run listens on: the TCP sockets in LISTEN state of a process tree, for the tests
that check a run binds what it needs where it needs it (docs/security.md, "Ports").

    found = tree_listeners(proc.pid)       # the CLI and every process it started
    print(table(found))
    assert [x for x in found if x.address != "127.0.0.1"] == [], table(found)

Ray starts its daemons (GCS, raylet, agents) as children of the driver and its workers as
children of the raylet, so they are all descendants of the CLI's process; a process whose
parent died meanwhile (re-parented to init) is still found through the Ray session directory
its command line names.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

import psutil

_SESSION = re.compile(r"(/\S*/session_\d{4}-\d\d-\d\d_[\w.-]+?_\d+)(?:/|\s|$)")
"""A Ray session directory in a command line (``--session-dir=/tmp/ray/session_2026-01-01_12-00-00_123456_789``)."""


@dataclass(frozen=True, order=True)
class Listener:
    """One listening TCP socket and the process that holds it."""

    address: str
    """The bound address: ``127.0.0.1``, ``0.0.0.0`` (every IPv4 interface), ``::`` (every
    interface)...; an IPv4-mapped IPv6 address (``::ffff:127.0.0.1``, as Ray's gRPC servers
    bind loopback) is shown as the IPv4 address it is."""
    port: int
    name: str
    """The process's name as ``ps`` shows it (Ray sets ``ray::LearnerActor`` and the like)."""
    pid: int
    cmdline: str
    """The start of its command line (a hint when the name is a bare ``python``)."""


def process_tree(root: int) -> list[psutil.Process]:
    """``root`` and its descendants, plus any live process whose command line names a Ray
    session directory that one of them names (Ray daemons re-parented to init)."""
    try:
        top = psutil.Process(root)
        procs = {p.pid: p for p in [top, *top.children(recursive=True)]}
    except psutil.NoSuchProcess:
        return []
    sessions = {m.group(1) for p in procs.values() for m in _SESSION.finditer(_cmdline(p))}
    if sessions:
        for p in psutil.process_iter():
            if p.pid not in procs and any(s in _cmdline(p) for s in sessions):
                procs[p.pid] = p
    return list(procs.values())


def listeners(procs: list[psutil.Process]) -> list[Listener]:
    """The listening TCP sockets (IPv4 and IPv6) of ``procs``, sorted by address and port;
    a process that exits meanwhile is skipped."""
    found = set()
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
            name, cmd = p.name(), _cmdline(p)[:120]
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        found.update(Listener(_plain(c.laddr.ip), c.laddr.port, name, p.pid, cmd) for c in conns if c.status == psutil.CONN_LISTEN)
    return sorted(found)


def tree_listeners(root: int) -> list[Listener]:
    """:func:`listeners` of :func:`process_tree` ``(root)``."""
    return listeners(process_tree(root))


def table(found: list[Listener]) -> str:
    """One line per socket: ``address:port  name  pid  command line``."""
    return "\n".join(f"{x.address + ':' + str(x.port):<22} {x.name:<28} {x.pid:>7}  {x.cmdline}" for x in found)


def _plain(ip: str) -> str:
    """``ip`` as written by :mod:`ipaddress`, an IPv4-mapped IPv6 address as its IPv4 address."""
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return str(mapped or address)


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""
