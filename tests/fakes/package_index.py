"""A package index on loopback: a PEP 503 "simple" tree (one page per normalized project name, links
with ``#sha256=`` fragments, as PEP 503 specifies) over a set of wheel files, served over HTTP and
recording every path pip asks for."""

from __future__ import annotations

import hashlib
import html
import re
import shutil
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def project_of(filename: str) -> str:
    return re.sub(r"[-_.]+", "-", filename.split("-", 1)[0]).lower()


def write_index(root: Path, files: list[Path]) -> Path:
    """A PEP 503 simple/ tree over ``files``, with sha256 fragments, under ``root``."""
    (root / "files").mkdir(parents=True)
    projects: dict[str, list[str]] = {}
    for file in files:
        shutil.copy(file, root / "files" / file.name)
        projects.setdefault(project_of(file.name), []).append(file.name)
    links = []
    for project, names in sorted(projects.items()):
        (root / "simple" / project).mkdir(parents=True)
        anchors = "".join(
            f'<a href="../../files/{html.escape(n)}#sha256={sha256(root / "files" / n)}">{html.escape(n)}</a>\n'
            for n in names)
        (root / "simple" / project / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{anchors}</body></html>\n")
        links.append(f'<a href="{project}/">{project}</a>\n')
    (root / "simple" / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "".join(links) + "</body></html>\n")
    return root


class Index:
    """A loopback HTTP server over an index tree that records every path asked for."""

    def __init__(self, root: Path) -> None:
        self.requests: list[str] = []
        requests = self.requests

        class Handler(SimpleHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                requests.append(self.path)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def asked_for(self, project: str) -> bool:
        return any(path.rstrip("/") in (f"/simple/{project}", f"/simple/{project}/index.html")
                   for path in self.requests)


def serve(root: Path) -> Iterator[Index]:
    index = Index(root)
    index.thread.start()
    try:
        yield index
    finally:
        index.server.shutdown()
        index.server.server_close()
