"""Connection and request guards for `corelm serve`.

guarded_protocol: uvicorn's HTTP protocol with a request-header deadline (uvicorn itself only times out
idle keep-alive connections, so a client that sends nothing, or a header line now and then, would hold
its connection for ever) and a cap on the connections one peer address may hold (so one client cannot
take every slot of --max-connections and lock the others out).

HostGuard: an ASGI middleware that answers 400 to a Host header naming neither an IP address, a
localhost name, nor a name the user allowed. A web page that rebinds its own DNS name to 127.0.0.1
(DNS rebinding) sends its own name as Host, so it cannot reach a local server this way.
"""
from __future__ import annotations

import collections
import ipaddress
import json
import logging
import time
from typing import Iterable, Optional

log = logging.getLogger("corelm.server")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64
LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _raw_response(status: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "unavailable_error" if status.startswith("503")
                                 else "invalid_request_error", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


_TOO_MANY = _raw_response("503 Service Unavailable", "Too many connections from this client.", "too_many_connections")
_HEADER_TIMEOUT = _raw_response("408 Request Timeout", "The request headers did not arrive in time.",
                                "request_timeout")


def guarded_protocol(header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
                     max_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT, base=None):
    """A uvicorn HTTP protocol class (Config(http=...)): a request's headers must be complete within
    `header_timeout` seconds of the connection opening or of the previous response ending (else a 408
    when part of a request came, and the connection is closed), and one peer address holds at most
    `max_per_client` connections (more are answered 503 and closed at once). Each call makes a class
    with its own per-peer counts, so give each server its own."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base
    counts: "collections.Counter[str]" = collections.Counter()
    warned = [0.0]

    class GuardedHTTPProtocol(base):
        _peer: Optional[str] = None
        _timer = None
        _cycle = None
        _partial = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = self.client[0] if self.client else None     # None: a unix socket
            if peer is not None:
                if counts[peer] >= max_per_client:
                    now = time.monotonic()
                    if now - warned[0] > 10:                     # a flood gets one line per 10 s
                        warned[0] = now
                        log.warning("a client holds %d connections, the most one may hold; refusing more",
                                    max_per_client)
                    transport.write(_TOO_MANY)
                    transport.close()
                    return
                counts[peer] += 1
                self._peer = peer
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._peer is not None:
                counts[self._peer] -= 1
                if counts[self._peer] <= 0:
                    del counts[self._peer]
                self._peer = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._started():
                self._partial = self._partial or bool(data)

        def on_response_complete(self) -> None:
            self._arm()                   # the next request's headers get the same deadline
            super().on_response_complete()
            self._started()               # a pipelined request may have started already

        def _started(self) -> bool:
            """Whether a new request's headers are complete (the protocol made a new cycle); disarms."""
            if self.cycle is not None and self.cycle is not self._cycle:
                self._cycle = self.cycle
                self._disarm()
                return True
            return self._timer is None

        def _arm(self) -> None:
            self._disarm()
            self._partial = False
            self._timer = self.loop.call_later(header_timeout, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            if self.transport is None or self.transport.is_closing():
                return
            if self._partial:
                self.transport.write(_HEADER_TIMEOUT)
            self.transport.close()

    return GuardedHTTPProtocol


def _host_name(header: str) -> Optional[str]:
    """The name in a Host header, without its port and trailing dot, lowercased; None if malformed."""
    host = header.strip().lower()
    if host.startswith("["):                    # [IPv6]:port
        end = host.find("]")
        rest = host[end + 1:]
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return host[1:end]
    name, _, port = host.partition(":")
    if port and not port.isdigit():
        return None
    return name.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class HostGuard:
    """ASGI middleware: requests whose Host is not an IP address, a localhost name (localhost,
    *.localhost), or one of `allowed_hosts` ("*.example.com" allows its subdomains, "*" any host) get a
    400 in OpenAI's error envelope. IP addresses pass: DNS rebinding needs a name the attacker controls."""

    def __init__(self, app, allowed_hosts: Iterable[str] = ()):
        self.app = app
        names = {h.strip().lower().rstrip(".") for h in allowed_hosts if h and h.strip()}
        self.any = "*" in names
        self.suffixes = tuple(n[1:] for n in names if n.startswith("*."))     # ".example.com"
        self.names = frozenset(n for n in names if not n.startswith("*"))

    def allowed(self, header: Optional[str]) -> bool:
        if self.any:
            return True
        if not header:
            return False
        name = _host_name(header)
        if not name:
            return False
        return (_is_ip(name) or name in LOCAL_NAMES or name.endswith(".localhost") or name in self.names
                or name.endswith(self.suffixes))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.any:
            return await self.app(scope, receive, send)
        host = None
        for key, value in scope.get("headers") or ():
            if key == b"host":
                host = value.decode("latin-1")
                break
        if self.allowed(host):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": "Invalid Host header.", "type": "invalid_request_error",
                                     "param": None, "code": "invalid_host"}}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
