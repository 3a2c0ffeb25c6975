"""Listening where it is needed: a ``torch.distributed`` TCP store bound to one address.

A master ``TCPStore`` binds every interface whatever host it is given (torch 2.13: an IPv6
wildcard socket, ``[::]:port``), so on a shared network any host could reach the learner's
rendezvous or the weight group's. Handed a socket already bound (``master_listen_fd``) it
listens on that one instead; torch 2.13's default (libuv) server accepts one, so no older
backend is needed. The learner's process group and the weight group both start their
stores here, on the address their peers connect to: loopback on a single-node run, the
node's cluster address on a multi-node one (docs/security.md, "Ports").
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist


def master_store(host: str, port: int, timeout_s: float, world_size: int | None = None) -> dist.TCPStore:
    """A master ``TCPStore`` listening on ``host`` only, at ``port`` (0: a free port; read it
    from ``.port``). It does not wait for clients; ``timeout_s`` (seconds) bounds its
    operations; ``world_size`` (None: any number) is the number of processes, itself included,
    that will use it. Raises ``OSError`` when ``host`` does not resolve or the port is taken.
    """
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A port given by the caller may have TIME_WAIT connections of a store that just ended;
        # Linux still refuses a second listener on it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen()
        bound = int(sock.getsockname()[1])
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the socket from here on and closes it when it ends
    try:
        return dist.TCPStore(host, bound, world_size, True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise

