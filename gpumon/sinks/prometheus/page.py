"""One snapshot's exposition as the endpoint serves it: text 0.0.4 rendered at publish, the gzip and
OpenMetrics variants built on the first scrape that asks for each."""

from __future__ import annotations

import gzip
import re
import threading

from gpumon.model import MetricFamily
from gpumon.render import Renderer

__all__ = ["Page"]


class Page:
    """One snapshot's exposition in every variant a scraper may ask for, built at most once each.

    ``extra`` is text appended after gpumon's families (dcgm-exporter's names in compat mode), in
    text 0.0.4; OpenMetrics gets it with counters typed ``unknown`` (their names lack ``_total``)."""

    def __init__(self, families: tuple[MetricFamily, ...], text: bytes, extra: str = "") -> None:
        self._families = families
        self._extra = extra
        self._bodies: dict[tuple[bool, bool], bytes] = {(False, False): text + extra.encode("utf-8")}
        self._lock = threading.RLock()  # the gzip variant builds the plain one under the same lock

    def ready(self, openmetrics: bool, gzipped: bool) -> bool:
        """The variant is built: serving it costs no compression or rendering."""
        return (openmetrics, gzipped) in self._bodies

    def body(self, openmetrics: bool, gzipped: bool) -> bytes:
        key = (openmetrics, gzipped)
        found = self._bodies.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._bodies.get(key)
            if found is None:
                if gzipped:
                    found = gzip.compress(self.body(openmetrics, False), 6, mtime=0)
                else:  # OpenMetrics plain: rendered without the shared prefix cache (rarely asked)
                    text = Renderer().render(self._families, openmetrics=True)
                    if self._extra:
                        extra = re.sub(r"^(# TYPE \S+) counter$", r"\1 unknown", self._extra, flags=re.M)
                        text = text[: -len("# EOF\n")] + extra + "# EOF\n"
                    found = text.encode("utf-8")
                self._bodies[key] = found
            return found
