"""Files generated from code (the config reference, the DCR template, the dashboards): write them, or
check that the committed copies are current, which is what the tests and CI do."""

from __future__ import annotations

import sys
from collections.abc import Mapping


def sync(outputs: Mapping[str, str], check: bool, command: str) -> int:
    """Write each path's text, or with ``check`` only report the stale ones; exit code 1 if stale."""
    stale = []
    for path, text in outputs.items():
        try:
            with open(path, encoding="utf-8") as fh:
                current: str | None = fh.read()
        except FileNotFoundError:
            current = None
        if current == text:
            continue
        if check:
            stale.append(path)
        else:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)}; run {command}", file=sys.stderr)
        return 1
    return 0


def splice(text: str, name: str, block: str, comment: str = "<!--") -> str:
    """``text`` with the lines between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``
    replaced by ``block``: a generated part of a page that is otherwise written by hand. With
    ``comment="#"`` the markers are ``# generated: NAME`` and ``# end: NAME`` (YAML)."""
    close = " -->" if comment == "<!--" else ""
    begin, end = f"{comment} generated: {name}{close}", f"{comment} end: {name}{close}"
    head, found, rest = text.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise ValueError(f"no {begin} ... {end} block")
    return f"{head}{begin}\n{block.rstrip()}\n{end}{tail}"
