"""serve's access rules: the API key (compared in constant time) and the
warning for a server other machines can reach without one."""

import hashlib
import hmac
import ipaddress
import threading
from typing import Optional

API_KEY_ENV = "FLASHNORM_MLX_API_KEY"


def bind_warning(host: str, api_key: Optional[str] = None) -> Optional[str]:
    """A warning line when `host` is reachable from other machines and no API
    key guards it, else None."""
    if host == "localhost" or api_key:
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name: assume it is reachable
        pass
    return (
        f"warning: serving on {host}, reachable from other machines, with no "
        f"authentication; set an API key with {API_KEY_ENV}=KEY (kept out of ps) "
        "or --api-key KEY (the default, --host 127.0.0.1, is this machine only)"
    )


def key_matches(header: Optional[str], api_key: str) -> bool:
    """Whether an Authorization header is `Bearer <api_key>`, compared in
    constant time (hmac.compare_digest); anything malformed is False."""
    if not header:
        return False
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return False
    return hmac.compare_digest(given.strip().encode(), api_key.encode())


# The scope of the request this HTTP thread is answering (set by the handler's
# key check), so every route's requests get it without passing it along.
_current = threading.local()


def current_scope() -> Optional[str]:
    return getattr(_current, "scope", None)


def key_scope(header: Optional[str], api_key: Optional[str]) -> Optional[str]:
    """The prompt-cache scope of the key a request sent: a digest of the one of
    `api_key`'s comma-separated keys it matches (every key checked, in
    constant time each), None when it matches none. Requests under different
    keys never share cached prefixes (scheduler.py)."""
    found = None
    for key in (k.strip() for k in (api_key or "").split(",")):
        if key and key_matches(header, key):
            found = "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    _current.scope = found
    return found
