"""One HTTP(S) POST of a remote-write body, bounded by a whole-request deadline.

The standard library's client is enough for one request per interval over a kept-alive connection.
A socket timeout bounds each read, not the request: a receiver that trickles its answer could hold
the uploader for ever, so a timer shuts the socket down at the deadline (and ``abort()`` does the
same at shutdown).
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpumon.sinks.common import (
    MAX_REDIRECTS,
    receiver_text,
    redirect_target,
    retry_after_from_headers,
    secrets_of,
)

PROTOCOL_HEADERS = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
}
_ERROR_BODY_MAX = 1024
_DRAIN_MAX = 64 << 10


class RequestTimeout(OSError):
    """The whole request outlived its deadline (connect, send and answer together)."""


class HeaderError(ValueError):
    """A request header is not valid HTTP (a newline in a token file): a configuration fault. The
    message never holds the header, which may be a credential."""


@dataclass(frozen=True)
class Response:
    status: int
    retry_after: float | None
    text: str
    """The start of the receiver's answer, for the log: it says which sample it refused. Redacted
    (every header value the request carried), one line of printable text (see ``receiver_text``)."""
    redirect: str = ""
    """With a 3xx: why it was not followed (only 307/308 to the same origin are)."""


def basic_authorization(username: str, password: str) -> str:
    token = base64.b64encode(f"{username}:{password}".encode()).decode("ascii")
    return f"Basic {token}"


def tls_context(ca_file: str = "", cert_file: str = "", key_file: str = "") -> ssl.SSLContext:
    """The system's trust store or ``ca_file``; a client certificate for mutual TLS when given."""
    context = ssl.create_default_context(cafile=ca_file or None)
    if cert_file:
        context.load_cert_chain(cert_file, key_file or None)
    return context


class Transport:
    """POSTs bodies to one URL; the connection is kept between requests and dropped on any fault."""

    def __init__(self, url: str, timeout: float, user_agent: str,
                 authorization: Callable[[], str | None] = lambda: None,
                 headers: Mapping[str, str] | None = None, context: ssl.SSLContext | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._origin_url = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
        self._timeout = timeout
        self._authorization = authorization
        self._headers = {**(headers or {}), **PROTOCOL_HEADERS, "User-Agent": user_agent}
        self._context = context if context is not None else (tls_context() if self._https else None)
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._https:
                self._conn = http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout,
                                                         context=self._context)
            else:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        return self._conn

    def post(self, body: bytes) -> Response:
        """Send one body; raises OSError (RequestTimeout past the deadline) when no answer came.

        A kept-alive connection the receiver closed while idle fails at once: that one is retried
        on a fresh connection, within the same deadline. A 307/308 to the same origin is followed
        (at most ``MAX_REDIRECTS`` of them, within the same deadline); any other 3xx is returned."""
        headers = dict(self._headers)
        authorization = self._authorization()  # before the clock starts: a token fetch has its own
        if authorization:
            headers["Authorization"] = authorization
        secrets = secrets_of({k: v for k, v in headers.items()
                              if k not in PROTOCOL_HEADERS and k != "User-Agent"})
        timer = threading.Timer(self._timeout, self.abort)
        timer.daemon = True
        started = time.monotonic()
        timer.start()
        path = self._path
        try:
            for hop in range(MAX_REDIRECTS + 1):
                response, location = self._attempt(path, body, headers, secrets, started)
                if not 300 <= response.status < 400:
                    return response
                current = self._origin_url + path
                target, why = redirect_target(current, response.status, location)
                if target is None or hop == MAX_REDIRECTS:
                    return dataclasses.replace(response, redirect=why or f"more than {MAX_REDIRECTS} redirects")
                parts = urllib.parse.urlsplit(target)
                path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            raise AssertionError("unreachable: the last hop always returns")  # pragma: no cover
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            if time.monotonic() - started >= self._timeout:
                raise RequestTimeout(f"no answer within {self._timeout:g} s") from None
            if isinstance(exc, OSError):
                raise
            raise ConnectionError(f"{type(exc).__name__}: {receiver_text(str(exc), secrets)}") from None
        finally:
            timer.cancel()

    def _attempt(self, path: str, body: bytes, headers: dict[str, str], secrets: tuple[str, ...],
                 started: float) -> tuple[Response, str | None]:
        """One request to ``path``, retried once on a fresh connection when a kept-alive one was
        found closed."""
        with self._lock:
            reused = self._conn is not None and self._conn.sock is not None
        try:
            return self._exchange(path, body, headers, secrets)
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            if not reused or time.monotonic() - started >= self._timeout:
                raise
            return self._exchange(path, body, headers, secrets)

    def _exchange(self, path: str, body: bytes, headers: dict[str, str], secrets: tuple[str, ...]
                  ) -> tuple[Response, str | None]:
        with self._lock:
            conn = self._connection()
        try:
            conn.request("POST", path, body=body, headers=headers)
            response = conn.getresponse()
            text = response.read(_ERROR_BODY_MAX)
        except (OSError, http.client.HTTPException):  # before ValueError: a TLS verify error is both
            self.close()
            raise
        except ValueError:  # http.client quotes the offending header: it may be a credential
            self.close()
            raise HeaderError("a request header is not valid HTTP (a control character or a newline "
                              "in a header or a token file; the header is not shown)") from None
        if not response.isclosed():
            if response.length is not None and response.length <= _DRAIN_MAX:
                response.read()  # drain so the connection can be reused
            else:
                self.close()
        answer = Response(response.status, retry_after_from_headers(response.headers),
                          receiver_text(text, secrets))
        return answer, response.headers.get("Location")

    def abort(self) -> None:
        """Shut the in-flight request's socket down: the blocked call returns at once with an error."""
        with self._lock:
            conn = self._conn
        sock = getattr(conn, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
