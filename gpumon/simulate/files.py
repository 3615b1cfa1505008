"""Replace a file of a simulated host whole, so a reader sees the old content or the new, never a torn one.

The temporary name is hidden (a leading dot: a sysfs directory listing, such as ``hw_counters/``, never
shows it as a counter) and unique to the writing process and thread: a reload applies the simulation
again while the running one's updater still writes the same tree, and two writers sharing one temporary
name would rename each other's file away.
"""

from __future__ import annotations

import os
import threading


def replace_file(path: str, content: str | bytes, encoding: str = "utf-8") -> None:
    """Write ``content`` to ``path`` through a temporary file in the same directory and ``os.replace``."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp.{os.getpid()}.{threading.get_ident()}")
    data = content.encode(encoding) if isinstance(content, str) else content
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
