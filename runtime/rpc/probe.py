"""A short-timeout client of ggml-rpc's protocol (proto 7.x of the llama.cpp we build).

Used before llama.cpp's own client connects (``config check``, planning at load): ggml-rpc's
client blocks on an unreachable host and an rpc-server serves ONE client at a time, so a
remote that is down or busy must be found here, with a timeout, not inside llama.cpp.

Wire format (ggml/src/ggml-rpc/ggml-rpc.cpp, packed little-endian structs):
request ``| cmd u8 | size u64 | data |``, response ``| size u64 | data |``.
"""
from __future__ import annotations

import socket
import struct
import time
from dataclasses import asdict, dataclass

from runtime.errors import UserError
from runtime.device_names import RpcDevice

PROTO_MAJOR = 7
CMD_ALLOC_BUFFER, CMD_BUFFER_GET_BASE, CMD_FREE_BUFFER = 0, 3, 4
CMD_SET_TENSOR, CMD_GET_DEVICE_MEMORY, CMD_HELLO, CMD_DEVICE_COUNT = 6, 11, 14, 15
CONN_CAPS = 24                 # RPC_CONN_CAPS_SIZE: zeros = plain TCP
RPC_TENSOR_BYTES = 296         # sizeof(rpc_tensor), packed
GGML_TYPE_F32 = 0


class RemoteUnreachable(UserError):
    """A remote that cannot be used now; the message is one line naming it."""


@dataclass(frozen=True)
class RemoteInfo:
    """What a remote device reported, and the link to it as measured."""

    device: str                 # rpc:host:port[/N]
    proto: str                  # "7.0.0"
    n_devices: int              # devices the rpc-server offers
    free_bytes: int
    total_bytes: int
    rtt_s: float                # median request round trip (a tiny request), seconds
    bandwidth_bps: float | None  # bytes/s of a bulk upload; None when not probed

    def to_dict(self) -> dict:
        return asdict(self)


class _Conn:
    def __init__(self, dev: RpcDevice, timeout: float):
        self.dev = dev
        self.sock = socket.create_connection((dev.host, dev.port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, cmd: int, payload: bytes = b"") -> None:
        self.sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)

    def recv_exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the remote closed the connection")
            out += chunk
        return bytes(out)

    def call(self, cmd: int, payload: bytes, reply: int) -> bytes:
        self.send(cmd, payload)
        size = struct.unpack("<Q", self.recv_exact(8))[0]
        if size != reply:
            raise ConnectionError(f"unexpected reply size {size} (wanted {reply})")
        return self.recv_exact(reply)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _tensor(buffer: int, data: int, nbytes: int) -> bytes:
    """An F32 rpc_tensor of ``nbytes`` over a remote buffer (for the bandwidth probe)."""
    n = nbytes // 4
    head = struct.pack("<QIQ4I4II", 1, GGML_TYPE_F32, buffer, n, 1, 1, 1, 4, nbytes, nbytes,
                       nbytes, 0)
    body = head + b"\0" * (64 + 4) + b"\0" * (80 + 8 + 8) + struct.pack("<Q", data)
    body += b"\0" * 64 + b"\0" * 4
    assert len(body) == RPC_TENSOR_BYTES, len(body)
    return body


def probe(dev: RpcDevice, *, timeout: float = 3.0, rtt_samples: int = 5,
          bandwidth_bytes: int = 0) -> RemoteInfo:
    """Connect, HELLO, count devices, read the device's memory, time ``rtt_samples`` tiny
    round trips, and (``bandwidth_bytes`` > 0) upload that many bytes into a scratch buffer
    it frees after. RemoteUnreachable (one line) when any of it fails within ``timeout``."""
    where = dev.name
    try:
        conn = _Conn(dev, timeout)
    except socket.timeout:
        raise RemoteUnreachable(f"{where}: unreachable (no answer within {timeout:g} s)") from None
    except OSError as exc:
        raise RemoteUnreachable(f"{where}: unreachable ({exc.strerror or exc}); is "
                                "`moe-offload rpc-server` running there?") from None
    try:
        try:
            rsp = conn.call(CMD_HELLO, b"\0" * CONN_CAPS, 4 + CONN_CAPS)
        except socket.timeout:
            raise RemoteUnreachable(
                f"{where}: accepted the connection but did not answer within {timeout:g} s "
                "(an rpc-server serves one client at a time: busy with another?)") from None
        major, minor, patch = rsp[0], rsp[1], rsp[2]
        if major != PROTO_MAJOR:
            raise RemoteUnreachable(f"{where}: RPC protocol {major}.{minor}.{patch}, this "
                                    f"build speaks {PROTO_MAJOR}.x")
        n_devices = struct.unpack("<I", conn.call(CMD_DEVICE_COUNT, b"", 4))[0]
        if dev.index >= n_devices:
            raise RemoteUnreachable(f"{where}: the server offers {n_devices} device(s) "
                                    f"(0..{n_devices - 1}), not device {dev.index}")
        rtts = []
        free = total = 0
        for _ in range(max(1, rtt_samples)):
            t0 = time.perf_counter()
            free, total = struct.unpack("<QQ", conn.call(CMD_GET_DEVICE_MEMORY,
                                                          struct.pack("<I", dev.index), 16))
            rtts.append(time.perf_counter() - t0)
        bandwidth = _bandwidth(conn, dev.index, bandwidth_bytes) if bandwidth_bytes else None
        rtts.sort()
        return RemoteInfo(dev.name, f"{major}.{minor}.{patch}", n_devices, free, total,
                          rtts[len(rtts) // 2], bandwidth)
    except (ConnectionError, socket.timeout, OSError, struct.error) as exc:
        if isinstance(exc, RemoteUnreachable):
            raise
        raise RemoteUnreachable(f"{where}: the RPC exchange failed ({exc})") from None
    finally:
        conn.close()


def _bandwidth(conn: _Conn, index: int, nbytes: int) -> float:
    """bytes/s of one SET_TENSOR of ``nbytes`` (timed to the reply of the request after it)."""
    nbytes -= nbytes % 4
    remote_ptr, _size = struct.unpack("<QQ", conn.call(CMD_ALLOC_BUFFER,
                                                       struct.pack("<IQ", index, nbytes), 16))
    if remote_ptr == 0:
        raise ConnectionError(f"the remote could not allocate {nbytes} bytes")
    try:
        base = struct.unpack("<Q", conn.call(CMD_BUFFER_GET_BASE, struct.pack("<Q", remote_ptr),
                                             8))[0]
        payload = _tensor(remote_ptr, base, nbytes) + b"\0" + struct.pack("<Q", 0)
        data = bytes(nbytes)
        t0 = time.perf_counter()
        conn.send(CMD_SET_TENSOR, payload + data)      # no reply: the next call waits for it
        conn.call(CMD_GET_DEVICE_MEMORY, struct.pack("<I", index), 16)
        return nbytes / max(time.perf_counter() - t0, 1e-9)
    finally:
        conn.send(CMD_FREE_BUFFER, struct.pack("<Q", remote_ptr))
