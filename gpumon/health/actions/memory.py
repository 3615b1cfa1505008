"""What a health action remembers across restarts: one JSON object in the state directory, read
forgivingly (a missing or damaged file is an empty memory) and replaced whole by rename."""

from __future__ import annotations

import json
import os
from typing import Any


def load(path: str) -> dict[str, Any]:
    """The object saved at ``path``; {} when there is none. Raises OSError or ValueError when the file
    exists but cannot be read or parsed (the caller says what forgetting it costs)."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        return {}
    return doc if isinstance(doc, dict) else {}


def save(path: str, doc: dict[str, Any]) -> None:
    """Replace ``path`` with ``doc`` (a reader never sees half a file). Raises OSError."""
    tmp = f"{path}.tmp.{os.getpid()}"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, sort_keys=True)
    os.replace(tmp, path)
