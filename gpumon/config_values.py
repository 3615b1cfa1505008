"""Config values: coercing a TOML or environment value to an option's type, the reusable checks
(regex, readable file, listen address), and the bounded repr every error message shows a value with.

The schema and the loader that use them are ``gpumon.config``'s (which re-exports the names plugins
import from it).
"""

from __future__ import annotations

import math
import os
import re
import reprlib
import stat
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

INT_LIMIT = 1 << 63
"""Integers outside a signed 64-bit range are rejected before anything compares or stores them."""

_shown = reprlib.Repr()
_shown.maxstring, _shown.maxother, _shown.maxlong, _shown.maxlevel = 60, 60, 40, 3


class TableList(list):
    """The type of an option that is an array of TOML tables (``xids = [{ xid = 999, ... }]``); in
    the environment, the same array in TOML's inline syntax. Its ``check`` validates each table."""


class IntList(list):
    """The type of an option that is a list of integers (``[13, 31, 43]``; ``13,31,43`` in the
    environment)."""


KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
          list: "a list of strings", TableList: "an array of tables", IntList: "a list of integers"}
"""How an error message names a type without showing the value."""


def shown(value: Any) -> str:
    """A bounded repr for error messages: a 400-digit integer or a list nested 500 deep must not
    turn one error line into a page (or into a RecursionError)."""
    return _shown.repr(value)


def coerce(kind: type, value: Any) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"must be true or false (got {shown(value)})")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer (got {shown(value)})")
        if not -INT_LIMIT <= value < INT_LIMIT:
            raise ValueError(f"is out of range (got {shown(value)})")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"must be a number (got {shown(value)})")
        if isinstance(value, int) and not -INT_LIMIT <= value < INT_LIMIT:
            raise ValueError(f"is out of range (got {shown(value)})")  # float() of it may overflow
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number (got {shown(value)})")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"must be a string (got {shown(value)})")
        if "\x00" in value:
            raise ValueError("must not contain NUL characters")
        return value
    if kind is TableList:
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ValueError(f"must be an array of tables (got {shown(value)})")
        return [dict(v) for v in value]
    if kind is IntList:
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                  and -INT_LIMIT <= v < INT_LIMIT for v in value):
            raise ValueError(f"must be a list of integers (got {shown(value)})")
        return list(value)
    if kind is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"must be a list of strings (got {shown(value)})")
        return list(value)
    raise TypeError(f"unsupported option type {kind}")  # pragma: no cover - schema bug


def from_text(kind: type, text: str) -> Any:
    """Parse an environment variable's text into the option's type."""
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"must be true or false (got {text!r})")
    if kind is int:
        try:
            return int(text.strip())
        except ValueError:
            raise ValueError(f"must be an integer (got {text!r})") from None
    if kind is float:
        try:
            return float(text.strip())
        except ValueError:
            raise ValueError(f"must be a number (got {text!r})") from None
    if kind is IntList:
        try:
            return [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"must be integers separated by commas (got {text!r})") from None
    if kind is TableList:
        try:
            return tomllib.loads(f"v = {text}")["v"]
        except (tomllib.TOMLDecodeError, RecursionError, ValueError) as exc:
            raise ValueError(f"must be an array of tables in TOML's inline syntax: {exc}") from None
    return text


def regex_check(value: str) -> str | None:
    """``re.compile`` raises more than ``re.error``: nesting too deep, a repeat count too large."""
    try:
        re.compile(value)
    except (re.error, RecursionError, OverflowError, ValueError) as exc:
        return f"not a valid regular expression: {exc}"
    return None


def readable_file_check(value: str) -> str | None:
    """For options naming a file gpumon reads (web config, certificates): empty means unset; else it
    must be a readable regular file. A FIFO or a device would block the read forever, a directory
    fails later with a less clear message."""
    if not value:
        return None
    try:
        st = os.stat(value)
    except OSError as exc:
        return f"cannot use {value}: {exc.strerror or exc}"
    if not stat.S_ISREG(st.st_mode):
        return f"{value} is {file_kind(st.st_mode)}, not a regular file"
    if not os.access(value, os.R_OK):
        return f"cannot read {value}: permission denied"
    return None


def file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def listen_check(value: str) -> str | None:
    try:
        parse_listen(value)
    except ValueError as exc:
        return str(exc)
    return None


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``[v6]:PORT`` -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"must be HOST:PORT (got {value!r})")
    port_num = int(port)
    if not 0 <= port_num <= 65535:
        raise ValueError(f"port must be 0-65535 (got {port_num})")
    host = host.strip("[]") or "0.0.0.0"
    return host, port_num


def format_listen(host: str, port: int) -> str:
    """The inverse of :func:`parse_listen`: ``HOST:PORT``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
