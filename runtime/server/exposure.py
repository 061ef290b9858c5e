"""The warning ``serve`` prints when it listens beyond this machine.

On 127.0.0.1 only local programs reach the server. On any other address (``0.0.0.0``: every
interface) anyone on the network can run the model, read ``/slots`` and ``/props``, and with
``--ui-mcp-proxy`` make the server fetch URLs; without ``--api-key`` nothing stops them.
"""
from __future__ import annotations

import ipaddress

BAR = "!" * 78


def is_loopback(address: str) -> bool:
    """True for ``localhost`` and addresses in 127.0.0.0/8 or ``::1`` (IPv4-mapped too)."""
    if address == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(address.strip("[]").split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def exposure_warning(addresses: list[str], api_key: bool, cors_proxy: bool) -> str | None:
    """The text to print for the addresses the server listens on; None on loopback only."""
    exposed = [a for a in addresses if not is_loopback(a)]
    if not exposed:
        return None
    where = ", ".join(("every interface (" + a + ")") if a in ("0.0.0.0", "::") else a
                      for a in exposed)
    lines = [f"WARNING: serving on {where}, not only this machine: anyone who can reach the "
             "port can use the model."]
    if api_key:
        lines.append("Requests need the API key; it travels in clear text over plain HTTP "
                     "(put TLS in front on an untrusted network).")
    else:
        lines += ["NO --api-key: ANYONE ON THE NETWORK CAN GENERATE, READ /slots AND /props, "
                  "AND SAVE OR RESTORE SLOTS.",
                  "Set --api-key KEY (or MOE_OFFLOAD_API_KEY), or bind --host 127.0.0.1."]
    if cors_proxy:
        lines.append("--ui-mcp-proxy is on: clients can make this server fetch public URLs "
                     "for them.")
    # louder without a key: a framed block
    return "\n".join(lines) if api_key else "\n".join([BAR, *lines, BAR])
