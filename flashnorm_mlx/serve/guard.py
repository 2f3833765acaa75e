"""serve's checks against web pages (docs/serve.md, "Safe by default"):

- Host: a loopback-bound server answers only loopback names (DNS rebinding
  points an attacker's name at 127.0.0.1, and the browser sends that name);
  bound elsewhere, IP literals and localhost; plus --allowed-hosts ("*": any).
- Origin: CORS grants, and requests from a browser are answered, only for
  loopback origins, the page's own origin, and --allowed-origins ("*": any).
- Content-Type: API bodies must be JSON; text/plain and form types are what a
  page may POST cross-origin without a preflight.
- Framing: one Host, one Content-Length of digits, not with Transfer-Encoding
  (RFC 9112 section 6.3): a request read two ways is a 400 and a close.
- The page: served with a Content-Security-Policy (its own scripts and styles
  only, no frames around it) and nosniff.
"""

import ipaddress
from typing import Iterable, Optional, Tuple
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost",)
# The chat page's files: scripts and styles from the page's own origin only
# (a model's reply rendered as HTML cannot run or load anything), no page may
# frame it (clickjacking), and no type guessing.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
}


def _is_loopback(name: str) -> bool:
    if name.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
        return True
    except ValueError:
        return False


def split_host(host: str) -> Tuple[str, Optional[str]]:
    """("name", "port" or None) of a Host header: "[::1]:8080" -> ("[::1]", "8080")."""
    host = host.strip()
    if host.startswith("["):
        name, _, rest = host.partition("]")
        return name + "]", rest[1:] if rest.startswith(":") else None
    name, _, port = host.partition(":") if host.count(":") == 1 else (host, "", "")
    return name, port or None


def host_allowed(host: Optional[str], bound_loopback: bool, allowed: Iterable[str]):
    """Whether a request's Host header may be served. None (HTTP/1.0, no
    header) is allowed: browsers always send one."""
    if host is None:
        return True
    allowed = [a.lower() for a in allowed]
    name, port = split_host(host)
    if port is not None and not port.isdigit():
        return False
    if "*" in allowed or name.lower() in allowed or host.lower() in allowed:
        return True
    if bound_loopback:
        return _is_loopback(name)
    # Rebinding needs a name; an IP literal is the address the client dialled.
    return _is_loopback(name) or _is_ip(name)


def origin_allowed(origin: Optional[str], host: Optional[str], allowed) -> bool:
    """Whether a browser page at `origin` may call the API: a loopback
    origin, the server's own (the chat page: scheme://Host), or one of
    --allowed-origins ("*": any). No Origin header: not a cross-site request."""
    if origin is None:
        return True
    if "*" in allowed or origin in allowed:
        return True
    try:
        parts = urlsplit(origin)
        name = parts.hostname or ""
    except ValueError:
        return False
    if parts.scheme not in ("http", "https"):
        return False
    return _is_loopback(name) or (host is not None and parts.netloc == host)


def is_json(content_type: Optional[str]) -> bool:
    """application/json or application/*+json (parameters ignored); no header
    at all is taken as JSON, as FastAPI does (browsers send one with a body)."""
    if content_type is None:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


def has_body(headers) -> bool:
    return headers.get("Content-Length", "0") != "0" or bool(
        headers.get("Transfer-Encoding")
    )


def framing_error(headers) -> Optional[str]:
    """Why a request's headers frame it ambiguously (a 400), else None."""
    for name in ("Host", "Content-Length"):
        if len(headers.get_all(name) or ()) > 1:
            return f"more than one {name} header"
    length = headers.get("Content-Length")
    if length is not None and not length.strip().isdigit():
        return f"Content-Length must be a number of bytes, not {length[:40]!r}"
    if length is not None and headers.get("Transfer-Encoding"):
        return "Content-Length and Transfer-Encoding together"
    return None


def refusal(headers, server, preflight: bool = False):
    """The 403 RequestError for a request from a foreign Host, or (but for a
    preflight, which just gets no grant) from a foreign page; else None.
    server: its loopback, allowed_hosts and allowed_origins."""
    from .schema import RequestError

    host, origin = headers.get("Host"), headers.get("Origin")
    if not host_allowed(host, server.loopback, server.allowed_hosts):
        return RequestError(
            f"this server does not answer for Host {host!r}; start it with "
            "--allowed-hosts NAME to serve that name",
            status=403,
            code="host_not_allowed",
        )
    if not preflight and not origin_allowed(origin, host, server.allowed_origins):
        return RequestError(
            f"web pages from {origin} may not use this server; start it with "
            "--allowed-origins ORIGIN (or '*') to let them",
            status=403,
            code="origin_not_allowed",
        )
    return None
