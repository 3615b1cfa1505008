"""The Prometheus exporter-toolkit web-config file: TLS, mutual TLS and basic auth.

Users already have this YAML for node_exporter (``--web.config.file``); gpumon reads the same file.
Supported: ``tls_server_config`` (cert_file, key_file, client_auth_type, client_ca_file,
min_version, max_version) and ``basic_auth_users`` (bcrypt hashes). Keys the toolkit knows but
gpumon cannot honour are rejected by name rather than silently ignored.
"""

from __future__ import annotations

import base64
import contextlib
import enum
import errno
import hashlib
import hmac
import logging
import math
import os
import re
import ssl
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import yaml

from gpumon.config import ConfigError, readable_file_check
from gpumon.sinks.common import read_regular_file

log = logging.getLogger("gpumon.sinks.prometheus")

_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_UNSUPPORTED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")
_TLS_VERSIONS = {
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# bcrypt of a random throwaway password, cost 10 like the toolkit's examples
_DUMMY_HASH = b"$2b$10$kI36ojRi3GAG92aQ09UgFev/w3towOacoYL9N9S.60bC/Cd.FCh3u"
_BCRYPT = re.compile(r"^\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}$")
_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version",
             "cipher_suites", "curve_preferences", "prefer_server_cipher_suites"}


class Auth(enum.Enum):
    """What a request's credentials earned it."""

    OK = "ok"
    DENIED = "denied"
    THROTTLED = "throttled"
    """The source spent its failure budget: answered 429 without a bcrypt check."""
    PENDING = "pending"
    """Only a bcrypt check can tell (``WebConfig.check``); the source's budget paid for it."""


class FailureLimiter:
    """A token bucket per source address and user name for failed password checks.

    Each failure costs a full bcrypt check (~65 ms of CPU at cost 10), so a wrong-password flood from
    one address would otherwise keep cores busy and slow every valid scrape. Keyed by user too, an
    attacker guessing other names cannot spend a valid user's budget. At most ``sources`` keys are
    remembered (least recently seen forgotten first), so the table cannot balloon.
    """

    def __init__(self, per_minute: float, sources: int = 4096) -> None:
        self.rate = per_minute / 60.0
        self.burst = float(max(1, round(per_minute / 6)))  # ten seconds' worth at once
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._sources = sources
        self._lock = threading.Lock()

    def take(self, source: str, now: float | None = None) -> bool:
        """Spend one check for ``source``; False when its budget is spent (refilled at ``rate``)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, at = self._buckets.pop(source, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            allowed = tokens >= 1.0
            self._buckets[source] = (tokens - 1.0 if allowed else tokens, now)
            if len(self._buckets) > self._sources:
                self._buckets.popitem(last=False)
            return allowed

    def refund(self, source: str) -> None:
        """Give the check back: it succeeded, and only failures are limited."""
        with self._lock:
            if source in self._buckets:
                tokens, at = self._buckets[source]
                self._buckets[source] = (min(self.burst, tokens + 1.0), at)

    @property
    def retry_after(self) -> int:
        """Whole seconds until a spent source may try again (the ``Retry-After`` of a 429)."""
        return max(1, math.ceil(1.0 / self.rate))


@dataclass
class WebConfig:
    ssl_context: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    """Extra response headers from ``http_server_config.headers``."""
    files: tuple[str, ...] = ()
    """The web-config file and every file it names: a change to any of them is a new config."""
    _ok_cache: set[bytes] = field(default_factory=set, repr=False)
    _cache_key: bytes = field(default_factory=lambda: os.urandom(32), repr=False)
    _store: VerifiedStore | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def auth_required(self) -> bool:
        return bool(self.users)

    def authorized(self, header: str | None) -> bool:
        """Check an ``Authorization`` header with no failure limit (``verify`` for a request)."""
        return self.verify(header) is Auth.OK

    def remember(self, store: VerifiedStore) -> None:
        """Key the verified-credentials cache with ``store``'s key and load what it kept, so a
        scraper verified before a restart is not checked (nor limited) again after it."""
        if not self.users:
            return
        key = store.key()
        if key is None:
            return
        with self._lock:
            self._cache_key, self._store = key, store
            self._ok_cache = set(store.load())

    def verify(self, header: str | None, source: str = "", limiter: FailureLimiter | None = None) -> Auth:
        """Check an ``Authorization`` header: ``screen`` then, when that cannot tell, ``check``."""
        verdict = self.screen(header, source, limiter)
        return self.check(header, source, limiter) if verdict is Auth.PENDING else verdict

    def screen(self, header: str | None, source: str = "", limiter: FailureLimiter | None = None) -> Auth:
        """What can be told without bcrypt: no credentials (DENIED), credentials verified before
        (OK: remembered under an HMAC, never the password), a spent budget (THROTTLED); else
        PENDING, with one check taken from the budget of ``source`` and the user name."""
        if not self.users:
            return Auth.OK
        credentials = _credentials(header)
        if credentials is None:
            return Auth.DENIED
        if self._digest(*credentials) in self._ok_cache:
            return Auth.OK
        if limiter is not None and not limiter.take(self._budget(source, credentials[0])):
            return Auth.THROTTLED
        return Auth.PENDING

    def check(self, header: str | None, source: str = "", limiter: FailureLimiter | None = None) -> Auth:
        """The bcrypt check after ``screen`` said PENDING (it blocks: a worker thread's job). A
        good pair is remembered and its check refunded: only failures are limited."""
        credentials = _credentials(header)
        if credentials is None:
            return Auth.DENIED
        user, password = credentials
        if not _bcrypt_ok(password, self.users.get(user)):
            return Auth.DENIED
        digest = self._digest(user, password)
        with self._lock:
            if len(self._ok_cache) >= 64:
                self._ok_cache.clear()
            self._ok_cache.add(digest)
            kept, store = set(self._ok_cache), self._store
        if store is not None:
            store.save(kept)
        if limiter is not None:
            limiter.refund(self._budget(source, user))
        return Auth.OK

    def _digest(self, user: str, password: str) -> bytes:
        """HMAC of the pair and the user's hash: a changed hash (a new password) forgets it."""
        hashed = self.users.get(user, b"")
        return hmac.new(self._cache_key, f"{user}:{password}:".encode() + hashed, hashlib.sha256).digest()

    def _budget(self, source: str, user: str) -> str:
        """The limiter's key: the source and the user name (every unknown name shares one budget,
        so made-up names cannot grow the table)."""
        return f"{source} {user if user in self.users else ''}"


class VerifiedStore:
    """Credentials verified once, kept across restarts: a random key and the HMAC digests made
    with it, both 0600 files in the state directory (never a password). Anyone who can read them
    can test guesses at SHA-256 speed rather than bcrypt's, so the directory must stay the
    daemon's own (the unit's ``StateDirectoryMode=0700``). When the directory cannot hold them,
    the key lives in memory only and a restart checks again (logged once)."""

    KEY = "prometheus-auth.key"
    DIGESTS = "prometheus-auth.verified"

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._key: bytes | None = None
        self._tried = False
        self._lock = threading.Lock()

    def key(self) -> bytes | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    self._key = self._load_or_make_key()
                except OSError as exc:
                    log.warning("verified basic-auth credentials will not survive a restart: %s "
                                "(checked again, once, after each start)", exc)
            return self._key

    def _load_or_make_key(self) -> bytes:
        path = os.path.join(self.directory, self.KEY)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            return _private_file(path, 32)
        key = os.urandom(32)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key)
        return key

    def load(self) -> list[bytes]:
        path = os.path.join(self.directory, self.DIGESTS)
        try:
            data = _private_file(path, None)
        except OSError:
            return []
        return [data[i:i + 32] for i in range(0, len(data) - len(data) % 32, 32)][:64]

    def save(self, digests: set[bytes]) -> None:
        path = os.path.join(self.directory, self.DIGESTS)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(b"".join(sorted(digests)))
            os.replace(tmp, path)
        except OSError as exc:
            log.debug("could not keep verified credentials in %s: %s", path, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _private_file(path: str, size: int | None) -> bytes:
    """A regular file of ours that nobody else can read (``size`` bytes when given): anything else
    is refused, so a planted or widened file cannot choose the key."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise OSError(errno.EPERM, f"{path} must be a regular file of this user, mode 0600")
        data = fh.read(64 * 32 + 1)
    if size is not None and len(data) != size:
        raise OSError(errno.EINVAL, f"{path} is not a {size}-byte key")
    return data


def _credentials(header: str | None) -> tuple[str, str] | None:
    """(user, password) from a ``Basic`` header, or None when there is none to check. The scheme
    is case-insensitive (RFC 7235, section 2.1): ``basic`` and ``BASIC`` are Basic."""
    scheme, _, token = (header or "").strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, _, password = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    return user, password


_BCRYPT_SLOTS = threading.BoundedSemaphore(2)
"""bcrypt releases the GIL: without a bound, N concurrent checks would take N cores."""


def _bcrypt_ok(password: str, hashed: bytes | None) -> bool:
    """bcrypt-check the password; an unknown user spends the same time against a dummy hash, so
    timing does not reveal valid user names."""
    import bcrypt

    with _BCRYPT_SLOTS:
        try:
            ok = bcrypt.checkpw(password.encode("utf-8"), hashed or _DUMMY_HASH)
        except ValueError:
            ok = False
    return ok and hashed is not None


def file_stamp(paths: tuple[str, ...]) -> tuple[tuple[str, tuple[int, int, int] | None], ...]:
    """Identity of each file (mtime, size, inode; None when missing): a certificate renewed in place,
    or a Kubernetes secret whose symlink is swapped, changes it."""
    out: list[tuple[str, tuple[int, int, int] | None]] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append((path, None))
        else:
            out.append((path, (st.st_mtime_ns, st.st_size, st.st_ino)))
    return tuple(out)


def load_web_config(path: str) -> WebConfig:
    """Parse and validate the file; every problem is a ConfigError naming the key and the file."""
    try:  # without blocking, and only a regular file: a FIFO must not hold start-up or a reload
        text = read_regular_file(path).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(path, "(file)", "no such web config file") from None
    except OSError as exc:
        raise ConfigError(path, "(file)", exc.strerror or str(exc)) from None
    except UnicodeDecodeError:
        raise ConfigError(path, "(file)", "not UTF-8") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(path, "(syntax)", f"not valid YAML: {exc}".splitlines()[0]) from None
    if doc is None:
        return WebConfig(files=(os.path.abspath(path),))
    if not isinstance(doc, dict):
        raise ConfigError(path, "(top level)", "must be a mapping")
    unknown = set(doc) - {"tls_server_config", "basic_auth_users", "http_server_config"}
    if unknown:
        raise ConfigError(path, sorted(unknown)[0], "unknown key (known: tls_server_config, "
                          "basic_auth_users, http_server_config)")
    http = doc.get("http_server_config") or {}
    if not isinstance(http, dict) or http.get("http2") is True or set(http) - {"http2", "headers"}:
        raise ConfigError(path, "http_server_config", "only http2: false and headers are supported")
    config = WebConfig()
    headers = http.get("headers") or {}
    if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and not set(k + v) & {"\r", "\n", "\0"}
            for k, v in headers.items()):
        raise ConfigError(path, "http_server_config.headers",
                          "must map header names to single-line strings")
    config.headers = {str(k): v for k, v in headers.items()}
    config.files = (os.path.abspath(path),)
    if doc.get("tls_server_config") is not None:
        config.ssl_context = _tls_context(path, doc["tls_server_config"])
        config.files += _named_files(path, doc["tls_server_config"])
    users = doc.get("basic_auth_users") or {}
    if not isinstance(users, dict):
        raise ConfigError(path, "basic_auth_users", "must map user names to bcrypt hashes")
    for user, hashed in users.items():
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            raise ConfigError(path, f"basic_auth_users.{user}",
                              "must be a bcrypt hash ($2y$10$ and 53 characters; htpasswd -nBC 10)")
        config.users[str(user)] = hashed.encode("ascii")
    return config


def _tls_context(path: str, tls: Any) -> ssl.SSLContext:
    if not isinstance(tls, dict):
        raise ConfigError(path, "tls_server_config", "must be a mapping")
    unknown = set(tls) - _TLS_KEYS
    if unknown:
        raise ConfigError(path, f"tls_server_config.{sorted(unknown)[0]}", "unknown key")
    for unsupported in ("cipher_suites", "curve_preferences"):
        if tls.get(unsupported):
            raise ConfigError(path, f"tls_server_config.{unsupported}",
                              "not supported; OpenSSL's defaults for the TLS version are used")
    cert, key = tls.get("cert_file"), tls.get("key_file")
    if not isinstance(cert, str) or not isinstance(key, str) or not cert or not key:
        raise ConfigError(path, "tls_server_config.cert_file", "cert_file and key_file are both required")
    base = os.path.dirname(os.path.abspath(path))
    cert, key = (os.path.join(base, str(p)) for p in (cert, key))  # relative to the file, as the toolkit
    for name, named in (("cert_file", cert), ("key_file", key)):
        problem = readable_file_check(named)  # OpenSSL would block on a FIFO
        if problem:
            raise ConfigError(path, f"tls_server_config.{name}", problem)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _version(path, tls, "min_version", "TLS12")
    if tls.get("max_version"):
        context.maximum_version = _version(path, tls, "max_version", "TLS13")
        if context.maximum_version < context.minimum_version:
            raise ConfigError(path, "tls_server_config.max_version", "is lower than min_version: no "
                              "handshake could succeed")
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(path, "tls_server_config.cert_file", f"cannot load certificate/key: {exc}") from None
    auth = tls.get("client_auth_type") or "NoClientCert"
    if not isinstance(auth, str):
        raise ConfigError(path, "tls_server_config.client_auth_type", "must be a string")
    if auth in _UNSUPPORTED_CLIENT_AUTH:
        raise ConfigError(path, "tls_server_config.client_auth_type",
                          f"{auth} is not supported; use VerifyClientCertIfGiven or RequireAndVerifyClientCert")
    if auth not in _CLIENT_AUTH:
        raise ConfigError(path, "tls_server_config.client_auth_type",
                          f"{auth!r} is not one of {', '.join(_CLIENT_AUTH)}")
    context.verify_mode = _CLIENT_AUTH[auth]
    if context.verify_mode != ssl.CERT_NONE:
        ca = tls.get("client_ca_file")
        if not ca:
            raise ConfigError(path, "tls_server_config.client_ca_file", f"required with {auth}")
        problem = readable_file_check(os.path.join(base, str(ca)))
        if problem:
            raise ConfigError(path, "tls_server_config.client_ca_file", problem)
        try:
            context.load_verify_locations(os.path.join(base, str(ca)))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(path, "tls_server_config.client_ca_file", f"cannot load: {exc}") from None
    return context


def _named_files(path: str, tls: dict) -> tuple[str, ...]:
    """Certificate, key and client CA, as absolute paths (the validated ``tls`` mapping)."""
    base = os.path.dirname(os.path.abspath(path))
    return tuple(os.path.join(base, str(tls[key])) for key in ("cert_file", "key_file", "client_ca_file")
                 if tls.get(key))


def _version(path: str, tls: dict, key: str, default: str) -> ssl.TLSVersion:
    value = tls.get(key) or default
    if not isinstance(value, str) or value not in _TLS_VERSIONS:
        raise ConfigError(path, f"tls_server_config.{key}", f"{value!r} is not one of TLS12, TLS13")
    return _TLS_VERSIONS[value]
