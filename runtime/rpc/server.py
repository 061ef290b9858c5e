"""``moe-offload rpc-server``: llama.cpp's RPC server (``ggml_backend_rpc_start_server``) from
our patched build, offering one local device to a remote llama.cpp.

SECURITY: ggml-rpc has NO authentication and NO encryption. Whoever can connect can allocate
this machine's memory and run graphs on it. It binds 127.0.0.1 by default; bind anything else
only on a network you trust (or through an SSH tunnel).
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

from runtime.errors import UserError
from runtime.device_names import is_loopback, parse_port
from runtime.units import format_size

NO_AUTH_WARNING = ("ggml-rpc has no authentication and no encryption: anyone who can reach "
                   "this port can use this machine's memory and compute")


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 50052
    threads: int | None = None
    cache_dir: str | None = None
    device: str = "cpu"


def check_host(host: str) -> str:
    """ggml-rpc binds an IPv4 literal (inet_addr); "localhost" is 127.0.0.1."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        socket.inet_aton(host)
        if host.count(".") == 3:
            return host
    except OSError:
        pass
    raise UserError(f"--host {host}: not an IPv4 address (ggml-rpc binds IPv4 only, "
                    "e.g. 127.0.0.1 or 0.0.0.0)")


def _check_free(host: str, port: int) -> None:
    """Fail with one line now rather than inside ggml (which only says it could not)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as exc:
        raise UserError(f"{host}:{port}: cannot listen there ({exc.strerror or exc})") from None
    finally:
        s.close()


def _line_buffered_c_stdout() -> None:
    import ctypes  # noqa: PLC0415

    try:
        libc = ctypes.CDLL(None)
        stdout = ctypes.c_void_p.in_dll(libc, "stdout")
        libc.setvbuf(stdout, None, 1, 0)              # _IOLBF
    except (OSError, ValueError, AttributeError):
        pass


def _wait_listening(host: str, port: int, done: threading.Event, timeout: float = 30.0) -> None:
    """Until the port accepts a connection (ggml binds after its banner). The connection is
    one empty client session for ggml: it sees it close and accepts the next."""
    target = "127.0.0.1" if host == "0.0.0.0" else host
    deadline = time.monotonic() + timeout
    while not done.is_set() and time.monotonic() < deadline:
        try:
            socket.create_connection((target, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)


def rpc_library_dir() -> str:
    """The patched build (every build has the RPC backend); UserError (saying how to build
    it) otherwise."""
    from runtime.native import lib_dir_for  # noqa: PLC0415

    lib = lib_dir_for()
    if not os.path.isfile(os.path.join(lib, "libggml-rpc.so")):
        raise UserError(f"{lib}: a llama.cpp build without ggml's RPC backend: run "
                        "`moe-offload native build` (a few minutes, once)")
    return lib


def run_server(settings: ServerSettings) -> int:
    """Serve until Ctrl-C (then one line, status 130) or until ggml's loop gives up (1)."""
    from runtime.native import llama_lib  # noqa: PLC0415
    from runtime.rpc import backend  # noqa: PLC0415

    host = check_host(settings.host)
    port = parse_port(str(settings.port), "--port")
    threads = settings.threads if settings.threads is not None else (os.cpu_count() or 1)
    if threads < 1:
        raise UserError(f"--threads {threads}: must be at least 1")
    cache_dir = None
    if settings.cache_dir is not None:
        cache_dir = os.path.abspath(os.path.expanduser(settings.cache_dir))
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--cache {settings.cache_dir}: cannot create ({exc.strerror})") from None
    _check_free(host, port)
    llama_lib.select_library_dir(rpc_library_dir())
    llama_lib.set_logging(False)
    dev = backend.local_device(settings.device)
    free, total = backend.device_memory(dev)
    print(f"rpc-server: serving {settings.device} [{backend.device_description(dev)}] on "
          f"{host}:{port}: offering {format_size(free)} free of {format_size(total)}, "
          f"{threads} thread(s){', tensor cache ' + cache_dir if cache_dir else ''}", flush=True)
    print(f"rpc-server: use it as [devices] \"rpc:{host}:{port}\" = \"80%\" "
          "(or a size) in a residency config", flush=True)
    if not is_loopback(host):
        bar = "!" * 78
        sys.stderr.write(f"{bar}\nWARNING: listening on {host}:{port}, not loopback. "
                         f"{NO_AUTH_WARNING}. Use only on a network you trust.\n{bar}\n")
        sys.stderr.flush()
    done = threading.Event()

    def serve() -> None:
        try:
            backend.serve_forever(f"{host}:{port}", cache_dir, threads, dev)
        finally:
            done.set()

    _line_buffered_c_stdout()             # ggml's own banner and per-client lines, as they come
    thread = threading.Thread(target=serve, name="ggml-rpc-server", daemon=True)
    thread.start()
    try:
        _wait_listening(host, port, done)
        print(f"rpc-server: listening on {host}:{port} (Ctrl-C stops it)", flush=True)
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        sys.stdout.flush()
        sys.stderr.write("rpc-server: stopped (Ctrl-C)\n")
        sys.stderr.flush()
        os._exit(130)          # ggml's accept loop has no stop: end the process here
    raise UserError(f"rpc-server: ggml-rpc stopped serving {host}:{port} (see its output above)")
