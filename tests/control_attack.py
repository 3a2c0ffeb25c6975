"""An intruder on the weight-sync control socket of a live run (issue 30), for end-to-end tests.

It knows what the network shows: the sender's address, and the bytes a server sends to it,
read off the server process's socket calls with ``strace`` (a passive tap). It does not know
the run's secret.
"""

from __future__ import annotations

import re
import subprocess
import time

import zmq

from async_rl.sync.auth import HEADER_BYTES, RunSecret, Sealer, new_connection_id
from async_rl.sync.control import MAX_TO_SENDER_BYTES, Hello, decode, encode

_SEND = re.compile(r'(?:sendto|write)\(\d+, "((?:\\x[0-9a-f]{2})+)"')


def tap_frame(server_pid: int, timeout_s: float = 30.0) -> bytes:
    """One sealed control frame (a Hello heartbeat, sent every 5 s while the server waits, a
    Ready or an Ack of an update) as server process ``server_pid`` writes it to the sender's
    TCP connection."""
    tap = subprocess.Popen(["strace", "-f", "-qq", "-p", str(server_pid), "-e", "trace=sendto,write", "-s", "8192", "-xx"],
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    try:
        assert tap.stderr is not None
        for line in tap.stderr:
            if time.monotonic() > deadline:
                break
            match = _SEND.search(line)
            if match is None:
                continue
            data = bytes.fromhex(match.group(1).replace("\\x", ""))
            # ZMTP 3: a final short message frame is 0x00, its length, its bytes.
            if len(data) > HEADER_BYTES + 2 and data[0] == 0 and data[1] == len(data) - 2:
                frame = data[2:]
                try:
                    decode(frame[HEADER_BYTES:])
                    return frame
                except Exception:  # noqa: BLE001 - another write of the process that looks alike
                    continue
    finally:
        tap.kill()
        tap.wait()
    raise TimeoutError(f"no control message from pid {server_pid} within {timeout_s} s")


def attack(address: str, captured: bytes) -> dict[str, int]:
    """Send the control socket at ``address`` garbage, a Hello claiming ``server-0`` sealed with
    another secret, an oversized frame and a copy of ``captured``; returns the drop counts
    each must add at least (``sync/control_dropped/<reason>``)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    try:
        sock.send(b"\x00garbage")
        forged = Sealer(RunSecret.generate(), "to_sender", MAX_TO_SENDER_BYTES).seal(encode(Hello("server-0", 1, None)), new_connection_id())
        sock.send(forged)
        sock.send(b"x" * (MAX_TO_SENDER_BYTES + 1))
        sock.send(captured)
        time.sleep(1.0)  # let ZeroMQ deliver before the socket closes
    finally:
        sock.close()
    return {"unauthenticated": 2, "oversized": 1, "replayed": 1}
