"""The text log format writes one line per record whatever the message quotes: a control character
from outside text (a kernel-log record, an IMDS event, a receiver's answer) is escaped; JSON lines
escape them by themselves."""

from __future__ import annotations

import io
import json
import logging

from gpumon import logs


def _emit(fmt: str, message: str, *args: object) -> str:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        logs.setup("info", fmt, stream)
        logging.getLogger("gpumon.test").warning(message, *args)
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
    return stream.getvalue()


def test_a_quoted_newline_cannot_start_a_text_line_of_its_own():
    out = _emit("text", "scheduled event: %s", "Reboot\n2026-01-01 00:00:00,000 CRITICAL gpumon.health: ok\r\x1b[2K\u2028")
    assert out.count("\n") == 1 and out.endswith("\n")
    assert r"Reboot\x0a2026-01-01 00:00:00,000 CRITICAL gpumon.health: ok\x0d\x1b[2K\u2028" in out


def test_json_lines_keep_the_text_and_stay_one_line():
    out = _emit("json", "event: %s", "a\nb")
    assert out.count("\n") == 1 and json.loads(out)["message"] == "event: a\nb"
