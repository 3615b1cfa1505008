"""Rows the service rejected for good, kept aside in ``<spool_dir>/deadletter.jsonl`` (one JSON line
each: time, stream, reason, row), so that nothing refused is lost without a trace; the file is moved to
``deadletter.jsonl.1`` when it would pass ``DEADLETTER_MAX`` bytes."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

log = logging.getLogger("gpumon.sinks.azure_monitor")

DEADLETTER_MAX = 16 << 20


def write_dead_letter(directory: str, stream: str, row: dict[str, Any], reason: str) -> None:
    """Log the rejected row and append it to the dead-letter file; a failed write is logged, not raised."""
    log.error("azure_monitor: row %s rejected by stream %s, kept in deadletter.jsonl: %s",
              row.get("RowId", "?"), stream, reason)
    path = os.path.join(directory, "deadletter.jsonl")
    line = json.dumps({"time": time.time(), "stream": stream, "reason": reason, "row": row},
                      separators=(",", ":")) + "\n"
    try:
        if os.path.exists(path) and os.path.getsize(path) + len(line) > DEADLETTER_MAX:
            os.replace(path, path + ".1")
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line)
    except OSError as exc:
        log.error("azure_monitor: cannot write %s: %s", path, exc)
