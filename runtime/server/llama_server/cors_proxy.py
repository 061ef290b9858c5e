"""llama-server's CORS proxy (``--ui-mcp-proxy``; tools/server/server-cors-proxy.h).

A browser page (llama.cpp's web UI, for its MCP servers) cannot call a server that sends no
CORS headers; ``GET|POST /cors-proxy?url=URL`` makes the call from here and answers with the
target's status, content type, ``Location`` (a redirect is not followed here: the page
follows it, through the proxy again) and body (streamed, so an SSE answer flows as it
comes). Only the headers the page names as ``x-llama-server-proxy-header-NAME: VALUE`` reach the target (as
``NAME: VALUE``): the page's own Authorization, cookies and API key never do. Without the
flag the route is 403, as llama-server answers.

Any web page the user opens can send requests here, so the proxy must not be a way into the
machine or its network: the target's host is resolved once, every address it resolves to must
be a public one (not loopback, private, shared, link-local such as the cloud metadata service
169.254.169.254, multicast, unspecified or reserved; IPv4-mapped, 6to4, Teredo and NAT64
IPv6 addresses are judged by the IPv4 address inside), and the connection goes to exactly
those addresses (no second lookup a DNS answer could change). Every spelling of an address
(``2130706433``, ``0177.0.0.1``, ``0x7f.1``, ``0``, ``[::ffff:127.0.0.1]``) resolves to the
address it names, so each is judged by that. Local names are refused before any lookup, as
llama-server refuses them: ``localhost``, ``local``, ``localdomain``, ``internal``,
``home.arpa`` and names under them, ``metadata.goog``. ``--ui-mcp-proxy-allow`` names hosts,
addresses or networks that may be reached although internal. As llama-server answers: a
malformed URL, a refused target and a name that does not resolve are 400s; an unreachable
target is a 502 here.
"""
from __future__ import annotations

import http.client
import ipaddress
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from runtime.server.errors import APIError

PREFIX = "x-llama-server-proxy-header-"
TIMEOUT_S = 600              # llama-server's read and write timeouts
CHUNK = 64 << 10             # bytes per read of the target's answer

router = APIRouter()

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def proxy_allow_list(text: str) -> tuple[str, ...]:
    """``--ui-mcp-proxy-allow``'s entries: networks (CIDR or single addresses, normalised)
    and host names (lower case); ValueError for an entry that is neither."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        try:
            out.append(str(ipaddress.ip_network(entry.strip("[]"), strict=False)))
        except ValueError:
            if not all(c.isalnum() or c in "-._" for c in entry):
                raise ValueError(f"--ui-mcp-proxy-allow: {entry!r} is not a host name, an "
                                 "address or a network") from None
            out.append(entry.lower().rstrip("."))
    return tuple(out)


def _embedded_v4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, 6to4, Teredo client, NAT64)."""
    if ip.version != 6:
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def internal_kind(ip: IPAddress) -> str | None:
    """What makes ``ip`` internal ("loopback", "private", ...), or None for a public one."""
    inner = _embedded_v4(ip)
    if inner is not None:
        kind = internal_kind(inner)
        return f"{kind}, inside {ip}" if kind else None
    for kind, flag in (("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback),
                       ("link-local, where cloud metadata services live", ip.is_link_local),
                       ("multicast", ip.is_multicast), ("private", ip.is_private),
                       ("reserved", ip.is_reserved),
                       ("site-local", getattr(ip, "is_site_local", False))):
        if flag:
            return kind
    if not ip.is_global:                    # shared (100.64/10), documentation, ...
        return "not publicly routable"
    return None


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    host: str
    addresses: tuple[tuple[int, tuple], ...]     # (family, sockaddr) vetted to connect to


def _bad_url(message: str) -> APIError:
    return APIError(400, message, param="url", code="invalid_value")


# names llama-server's proxy refuses (and the names under them), before any lookup
LOCAL_SUFFIXES = ("localhost", "local", "localdomain", "internal", "home.arpa")
METADATA_NAMES = frozenset({"metadata.google.internal", "metadata.goog"})


def _authority_error(url: str) -> str | None:
    """What llama-server's syntax check refuses in the authority (the part after ``//``): a
    query or fragment straight after the host, text after a bracketed address, an empty port;
    None when it is well-formed."""
    rest = url.partition("://")[2]
    end = next((i for i, c in enumerate(rest) if c in "/?#"), len(rest))
    if end < len(rest) and rest[end] != "/":
        return "target URL query or fragment must follow a path"
    authority = rest[:end].rpartition("@")[2]
    if authority.startswith("[") and "]" in authority:
        after = authority[authority.index("]") + 1:]
        if after and not after.startswith(":"):
            return "invalid bracketed target URL authority"
    if authority.endswith(":"):
        return "invalid target URL port"
    return None


def parse_target(url: str) -> tuple[str, str, int]:
    """(url with a path, host, port) of a well-formed http(s) URL; else a 400."""
    if not url:
        raise _bad_url("missing target URL: send /cors-proxy?url=URL")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise _bad_url("invalid target URL: it holds whitespace or control characters")
    if (problem := _authority_error(url)) is not None:
        raise _bad_url(problem)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise _bad_url(f"invalid target URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise _bad_url(f"unsupported URL scheme in target URL: {parts.scheme or '(none)'}")
    if not parts.hostname:
        raise _bad_url("invalid target URL: missing host")
    if parts.password is not None or parts.username is not None:
        raise _bad_url("authentication in target URL is not supported")
    if port == 0:
        raise _bad_url("invalid target URL: port 0")
    host = parts.hostname
    if not all(c.isalnum() or c in "-._:" for c in host):
        raise _bad_url(f"invalid target URL: {host!r} is not a host name")
    url = url if parts.path else url.replace(parts.netloc, parts.netloc + "/", 1)
    return url, host, port or (443 if parts.scheme == "https" else 80)


def _refused(message: str) -> APIError:
    return APIError(400, f"the CORS proxy does not reach internal targets: {message}; start "
                         "the server with --ui-mcp-proxy-allow naming it to allow it",
                    param="url", code="proxy_target_forbidden")


def resolve_target(url: str, allow: tuple[str, ...]) -> Target:
    """The target, its addresses resolved and vetted: a 400 when malformed, when its host is
    a local name or any address is internal (unless ``allow`` names it), or when the host
    does not resolve (as llama-server answers each)."""
    url, host, port = parse_target(url)
    name = host.lower().rstrip(".")
    allowed_name = name in allow
    if not allowed_name and (name in METADATA_NAMES or any(
            name == s or name.endswith("." + s) for s in LOCAL_SUFFIXES)):
        raise _refused(f"{host} is a local or metadata host name")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise APIError(400, f"cannot resolve the target host {host} "
                            f"({getattr(exc, 'strerror', None) or exc})", param="url",
                       code="invalid_value") from None
    addresses = tuple((family, sockaddr) for family, _, _, _, sockaddr in infos)
    if allowed_name:
        return Target(url, host, addresses)
    # proxy_allow_list writes networks normalised ("a.b.c.d/n"), host names without a "/"
    networks = [ipaddress.ip_network(a) for a in allow if "/" in a]
    for _, sockaddr in addresses:
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
        kind = internal_kind(ip)
        if kind and not any(ip.version == n.version and ip in n for n in networks):
            raise _refused(f"{host} is {ip} ({kind})")
    return Target(url, host, addresses)


class _KeepErrors(urllib.request.HTTPErrorProcessor):
    """Hand 4xx/5xx answers back as answers (the page sees the target's status)."""

    def http_response(self, request, response):
        return response

    https_response = http_response


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect goes back to the page as it came (the page decides where to go)."""

    def redirect_request(self, *args, **kwargs):
        return None


def _opener(target: Target) -> urllib.request.OpenerDirector:
    """urllib connecting only to the target's vetted addresses (Host and TLS name stay the
    URL's host); the environment's proxies are not used."""
    def connect(address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, source_address=None):
        error: OSError | None = None
        for family, sockaddr in target.addresses:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                if timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:
                    sock.settimeout(timeout)
                sock.connect(sockaddr)
                return sock
            except OSError as exc:
                sock.close()
                error = exc
        raise error or OSError("no address to connect to")

    def pinned(cls):
        def make(host, **kwargs):
            conn = cls(host, **kwargs)
            conn._create_connection = connect
            return conn
        return make

    class Http(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(pinned(http.client.HTTPConnection), req)

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req):
            kwargs = {"context": self._context}
            if hasattr(self, "_check_hostname"):
                kwargs["check_hostname"] = self._check_hostname
            return self.do_open(pinned(http.client.HTTPSConnection), req, **kwargs)

    return urllib.request.build_opener(urllib.request.ProxyHandler({}), Http, Https,
                                       _KeepErrors, _NoRedirect)


def _chunks(response) -> Iterator[bytes]:
    try:
        while chunk := response.read1(CHUNK):
            yield chunk
    finally:
        response.close()


@router.api_route("/cors-proxy", methods=["GET", "POST"])
async def cors_proxy(request: Request) -> StreamingResponse:
    settings = request.app.state.settings
    if not settings.cors_proxy:
        raise APIError(403, "The CORS proxy is off: start the server with --ui-mcp-proxy.",
                       code="forbidden")
    raw = request.query_params.get("url", "")
    target = await anyio.to_thread.run_sync(resolve_target, raw, settings.cors_proxy_allow)
    headers = {k[len(PREFIX):]: v for k, v in request.headers.items()
               if k.startswith(PREFIX) and len(k) > len(PREFIX)}
    body = await request.body() if request.method == "POST" else None
    try:
        outgoing = urllib.request.Request(target.url, data=body, headers=headers,
                                          method=request.method)
    except ValueError as exc:
        raise _bad_url(f"invalid target URL: {exc}") from None
    try:
        response = await anyio.to_thread.run_sync(
            lambda: _opener(target).open(outgoing, timeout=TIMEOUT_S))
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise APIError(502, f"cannot reach {target.url}: {reason}", code="proxy_error",
                       error_type="server_error") from None
    except ValueError as exc:            # http.client's checks of the URL and headers
        raise _bad_url(f"invalid target URL or header: {exc}") from None
    media_type = response.headers.get("content-type")
    # a redirect goes back as it came (_NoRedirect): with its target, for the page to follow
    location = response.headers.get("location")
    # a sync iterator: Starlette reads it on its thread pool, chunk by chunk
    return StreamingResponse(_chunks(response), status_code=response.status,
                             media_type=media_type,
                             headers={"Location": location} if location else None)
