"""The rows of one section of ``gpumon once --format table``.

A type of its own, below everything: the report builds the built-in collectors' sections
(:mod:`gpumon.report.tables`) and prints them, and a plugin's collector may still build its own in
``summarize`` (:class:`gpumon.collectors.base.Collector`), importing it from :mod:`gpumon.plugin`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Table:
    """Rows for ``gpumon once --format table``: one row per GPU, per port, and so on."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
