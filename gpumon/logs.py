"""Log set-up: plain text for a terminal or journald, one JSON object per line for log pipelines.

A log line often quotes text from outside (a kernel-log record, an IMDS Scheduled Event, a receiver's
answer, a pod name): whoever wrote that text must not be able to start a line of their own. The text
format writes every control character of a message as ``\\xNN`` (``\\uNNNN`` for the Unicode line
separators), as the kernel does in /dev/kmsg; JSON escapes them by itself.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys

from gpumon.model import Event, Severity

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """``text`` with every control character (C0, DEL, C1, U+2028/U+2029) written as an escape, so
    that it stays one line whatever it quotes."""
    if not _CONTROL.search(text):
        return text
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                        else f"\\u{ord(m.group()):04x}", text)


class TextFormatter(logging.Formatter):
    """The plain-text line, its message escaped by :func:`escape_controls` (a traceback that follows
    it keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        record.message = escape_controls(message)
        try:
            return super().formatMessage(record)
        finally:
            record.message = message


class JsonFormatter(logging.Formatter):
    """Events carry their fields in ``record.event``; they become top-level keys of the line."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        event = getattr(record, "event", None)
        if event:
            doc.update({k: v for k, v in event.items() if k not in ("message", "time")})
            doc["event_time"] = event.get("time")
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup(level: str = "info", fmt: str = "text", stream=None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


_event_log = logging.getLogger("gpumon.event")
_LEVELS = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING,
           Severity.ERROR: logging.ERROR, Severity.CRITICAL: logging.CRITICAL}


def log_event(event: Event) -> None:
    """Every event is also one structured log line (``extra`` carries the fields for JSON logs)."""
    subject = " ".join(f"{k}={v}" for k, v in event.subject.items())
    _event_log.log(_LEVELS[event.severity], "%s %s: %s", event.kind, subject, event.message,
                   extra={"event": event.as_dict()})
