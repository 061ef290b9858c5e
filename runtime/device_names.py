"""``rpc:HOST:PORT[/N]``: a remote ggml device (the Nth device of an ``rpc-server``)."""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from runtime.errors import UserError

PREFIX = "rpc:"
_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$")
DEFAULT_PORT = 50052


@dataclass(frozen=True)
class RpcDevice:
    """One remote device: ``host:port`` is the rpc-server, ``index`` its device number."""

    host: str
    port: int
    index: int = 0

    @property
    def endpoint(self) -> str:
        """"host:port", as ggml-rpc's ``ggml_backend_rpc_add_server`` wants it."""
        return f"{self.host}:{self.port}"

    @property
    def name(self) -> str:
        """The canonical device name: ``rpc:host:port`` (device 0) or ``rpc:host:port/N``."""
        return f"{PREFIX}{self.endpoint}" + (f"/{self.index}" if self.index else "")

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def is_rpc(device: str) -> bool:
    return device.startswith(PREFIX)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_port(text: str, where: str) -> int:
    if not text.isdigit():
        raise UserError(f"{where}: port {text!r} is not a number")
    port = int(text)
    if not 1 <= port <= 65535:
        raise UserError(f"{where}: port {port} is out of range (1-65535)")
    return port


def check_host(host: str, where: str) -> str:
    if not host:
        raise UserError(f"{where}: no host (expected rpc:HOST:PORT)")
    try:
        ipaddress.IPv4Address(host)
        return host
    except ValueError:
        pass
    if ":" in host:
        raise UserError(f"{where}: {host!r}: IPv6 hosts are not supported by ggml-rpc "
                        "(use an IPv4 address or a host name)")
    if not _HOST_RE.match(host) or ".." in host:
        raise UserError(f"{where}: {host!r} is not a host name or IPv4 address")
    return host


def parse_rpc_device(text: str, where: str = "device") -> RpcDevice:
    """``rpc:HOST:PORT`` or ``rpc:HOST:PORT/N``; UserError naming ``where`` otherwise."""
    if not text.startswith(PREFIX):
        raise UserError(f"{where}: {text!r} is not an rpc:HOST:PORT device")
    rest = text[len(PREFIX):]
    index = 0
    if "/" in rest:
        rest, _, idx = rest.partition("/")
        if not idx.isdigit():
            raise UserError(f"{where}: {text!r}: the device number after '/' must be a "
                            "non-negative integer (rpc:HOST:PORT/N)")
        index = int(idx)
    host, sep, port = rest.rpartition(":")
    if not sep:
        raise UserError(f"{where}: {text!r}: malformed endpoint (expected rpc:HOST:PORT, "
                        "e.g. rpc:192.168.1.20:50052)")
    return RpcDevice(check_host(host, where), parse_port(port, where), index)
