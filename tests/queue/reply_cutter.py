"""A TCP proxy in front of a real redis-server that loses one reply: the write happened in
Redis, the client never hears of it and retries on a new connection (what a dropped link or
a socket timeout after the write does)."""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit, urlunsplit


class ReplyCutter:
    """Forwards every connection to ``redis_url``'s server. After :meth:`arm`, the first
    script call (``EVALSHA``) is forwarded, and
    Redis's reply to it is thrown away and the client's connection closed. A ``NOSCRIPT``
    reply (the script was not cached yet; redis-py loads it and calls again) is passed on and
    the cut waits for the next such request. ``cuts`` counts the replies lost."""

    def __init__(self, redis_url: str) -> None:
        parts = urlsplit(redis_url)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._listener = socket.create_server(("127.0.0.1", 0))
        port = self._listener.getsockname()[1]
        netloc = parts.netloc.rsplit(":", 1)[0] + f":{port}"
        self.url = urlunsplit(parts._replace(netloc=netloc))
        """``redis_url`` through the proxy."""
        self.cuts = 0
        self._armed = False
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self) -> None:
        """Lose the reply to the next script call."""
        with self._lock:
            self._armed = True

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self._upstream)
            cut = threading.Event()  # set: lose the next reply on this connection
            threading.Thread(target=self._requests, args=(client, server, cut), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client, cut), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, cut: threading.Event) -> None:
        while data := _recv(client):
            with self._lock:
                if self._armed and b"EVALSHA" in data:
                    self._armed = False
                    cut.set()
            if not _send(server, data):
                break
        server.close()

    def _replies(self, server: socket.socket, client: socket.socket, cut: threading.Event) -> None:
        while data := _recv(server):
            if cut.is_set():
                if data.startswith(b"-NOSCRIPT"):
                    cut.clear()
                    self.arm()
                else:
                    self.cuts += 1
                    for sock in (client, server):
                        _close(sock)
                    return
            if not _send(client, data):
                break
        client.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:  # the other side closed it
        return b""


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False


def _close(sock: socket.socket) -> None:
    """Shut down (wakes a thread blocked reading it, sends the FIN), then close."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
