"""Who may call the residency control routes (pure logic, no vLLM).

The control routes change what the GPU holds, so they are closed by default:

* a configured control token (``X-Reap-Control-Token``) is required when set;
* else vLLM's ``--api-key`` (``Authorization: Bearer``) guards them too;
* else the server is open only to loopback callers (``reap-swap serve`` refuses
  a non-loopback bind without a token), and the ``Host`` header must name a
  loopback host, which defeats DNS rebinding from a browser.

Browser requests are refused whatever the credentials: no page of ours ever
calls these routes, and a cross-site form POST must not reach them.
Secrets are compared as sha256 digests with ``hmac.compare_digest``, so
neither their content nor their length leaks through timing.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from typing import Iterable, Mapping

from .errors import HTTPError

TOKEN_HEADER = "x-reap-control-token"
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; False for "" / 0.0.0.0 / :: (every interface)."""
    if not host:
        return False
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """``127.0.0.1:8000`` -> ``127.0.0.1``; ``[::1]:8000`` -> ``::1``."""
    h = host_header.strip()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


@dataclass(frozen=True)
class ControlAuth:
    control_token: bytes | None = None
    api_keys: tuple[bytes, ...] = ()

    @classmethod
    def create(cls, control_token: str | None, api_keys: Iterable[str | None] = ()) -> "ControlAuth":
        return cls(_digest(control_token) if control_token else None, tuple(_digest(k) for k in api_keys if k))

    @property
    def closed(self) -> bool:
        """A credential is required (else only loopback callers are served)."""
        return self.control_token is not None or bool(self.api_keys)

    def check(self, headers: Mapping[str, str]) -> None:
        """Raise the HTTPError a request with these (lower-case) headers deserves, if any."""
        fetch_site = headers.get("sec-fetch-site", "").lower()
        if headers.get("origin") is not None or fetch_site in ("cross-site", "same-site"):
            raise HTTPError(403, "control routes do not accept browser requests", "cross_origin_refused")
        if self.control_token is not None:
            given = headers.get(TOKEN_HEADER, "")
            if not given:
                raise HTTPError(401, f"control endpoints need the {TOKEN_HEADER} header", "missing_control_token")
            if not hmac.compare_digest(_digest(given), self.control_token):
                raise HTTPError(403, "control token does not match", "invalid_control_token")
            return
        if self.api_keys:
            scheme, _, key = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not key:
                raise HTTPError(401, "control endpoints need the server's API key (Authorization: Bearer ...)", "missing_api_key")
            given_digest = _digest(key.strip())
            ok = False
            for digest in self.api_keys:  # no early exit: every key is compared
                ok |= hmac.compare_digest(given_digest, digest)
            if not ok:
                raise HTTPError(401, "API key does not match", "invalid_api_key")
            return
        if not is_loopback(host_name(headers.get("host", ""))):
            raise HTTPError(
                403, "this server has no control token: control routes answer loopback hosts only", "non_loopback_host"
            )
