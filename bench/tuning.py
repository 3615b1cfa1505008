"""What each opt-in switch costs on the simulated ND H100 v5: series on the page, CPU per cycle.

Series: the page ``gpumon once --simulate nd-h100-v5 --format prometheus`` prints (the same plan,
collection and renderer, in process), lines that are not comments, for the defaults and for each
switch alone; with ``[prometheus] compat`` the dcgm-exporter lines the Prometheus sink appends are
counted too (``once`` does not print them). ``labels`` adds no series at one instant: it replaces a
GPU's series whenever the job holding it changes, so its figure is the series per GPU that churn.

CPU: process CPU per cycle of one simulated host per switch (every collector once, the snapshot with
the health stage, the page rendered), the fastest of ``BATCHES`` interleaved batches of ``ROUNDS``. The NVML double's own work is included (about
half of the NVML collector's time, see docs/performance.md), so read the differences, not the totals.
``python -m bench.tuning`` writes docs/tuning.md's table from bench/results/tuning.json;
tests/test_docs_tuning.py checks the table is current and the series still what a simulated run exports.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from bench.common import REPO, RESULTS, Options, say
from gpumon.generated import sync

PROFILE = "nd-h100-v5"
ROUNDS = 5
BATCHES = 8
SWITCHES: tuple[tuple[str, dict[str, str]], ...] = (
    ("defaults", {}),
    ("[nvml] nvlink_per_link = true", {"GPUMON_NVML_NVLINK_PER_LINK": "true"}),
    ("[nvml] per_process = true", {"GPUMON_NVML_PER_PROCESS": "true"}),
    ('[prometheus] compat = "dcgm-exporter"', {"GPUMON_PROMETHEUS_COMPAT": "dcgm-exporter"}),
    ("[attribution] labels = true", {"GPUMON_ATTRIBUTION_LABELS": "true"}),
    ("[nvml] gpm = false", {"GPUMON_NVML_GPM": "false"}),
    ("[infiniband] hw_counters = false", {"GPUMON_INFINIBAND_HW_COUNTERS": "false"}),
)
"""(the switch as a config line, its environment form). The last two are opt-outs of defaults."""


def _series(page: str) -> int:
    return sum(1 for line in page.splitlines() if line and not line.startswith("#"))


class Host:
    """One simulated host with ``environ``'s settings, its plan and loop, ready to run cycles."""

    def __init__(self, environ: dict[str, str]) -> None:
        from gpumon import daemon
        from gpumon.cli import schemas
        from gpumon.config import load
        from gpumon.daemon.loop import Loop
        from gpumon.sinks.prometheus.dcgm_compat import DcgmCompat

        self.tmp = tempfile.mkdtemp(prefix="gpumon-tuning-")
        config = load(schemas(), None, environ, {"simulate": PROFILE}).replace("daemon", state_dir=self.tmp)
        ctx = daemon.make_context(config)
        self.plan = daemon.plan_collectors(ctx.config, ctx)
        self.compat = DcgmCompat(ctx.hostname) if config["prometheus"].compat == "dcgm-exporter" else None
        # As `gpumon once` runs it: the health stage's series are on the page too.
        self.loop = Loop(config, self.plan, ctx, [], health=daemon.health_stage(config, ctx, persist=False))

    def cycle(self) -> str:
        """Every collector once, the snapshot, the page: what one collection costs the daemon."""
        from gpumon.daemon.loop import run_collect
        from gpumon.render import Renderer

        for runner in self.loop.runners:
            t0 = time.monotonic()
            result, failure, unavailable = run_collect(runner.collector)
            self.loop.accept(runner, result, failure, unavailable, time.monotonic() - t0)
        snapshot = self.loop.compose()
        return Renderer().render(snapshot.families) + (self.compat.render(snapshot) if self.compat else "")

    def series(self) -> dict[str, int]:
        page = self.cycle()
        per_gpu: dict[str, int] = {}
        for fam in self.loop.compose().families:
            for sample in fam.samples:
                gpu = sample.label("gpu")
                if gpu is not None:
                    per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
        return {"series": _series(page), "series_per_gpu": max(per_gpu.values(), default=0)}

    def close(self) -> None:
        from gpumon.daemon.plan import close_plan

        close_plan(self.plan)
        shutil.rmtree(self.tmp, ignore_errors=True)


def series_by_switch() -> list[tuple[str, dict[str, int]]]:
    """(switch, its series figures) for every switch: what docs/tuning.md's table shows."""
    out = []
    for switch, environ in SWITCHES:
        host = Host(environ)
        try:
            out.append((switch, host.series()))
        finally:
            host.close()
    return out


def run(opts: Options) -> dict[str, Any]:
    batches, per_batch = (1, 2) if opts.smoke else (BATCHES, ROUNDS)
    hosts = [Host(environ) for _, environ in SWITCHES]
    try:
        figures = [host.series() for host in hosts]
        best = [float("inf")] * len(hosts)
        # Interleaved batches, the fastest batch of each: load from other processes only slows one down.
        for _ in range(batches):
            for i, host in enumerate(hosts):
                start = time.process_time()
                for _ in range(per_batch):
                    host.cycle()
                best[i] = min(best[i], (time.process_time() - start) / per_batch * 1000)
    finally:
        for host in hosts:
            host.close()
    rows = []
    for (switch, _), fig, cpu in zip(SWITCHES, figures, best):
        row = {"switch": switch, **fig, "series_added": fig["series"] - figures[0]["series"],
               "cpu_ms_per_cycle": round(cpu, 1), "cpu_ms_added": round(cpu - best[0], 1)}
        rows.append(row)
        say(opts, f"{switch:40} {fig['series']:6} series ({row['series_added']:+}), "
                  f"{row['cpu_ms_per_cycle']:6.1f} ms CPU a cycle ({row['cpu_ms_added']:+.1f})")
    return {"profile": PROFILE, "batches": batches, "cycles_per_batch": per_batch, "switches": rows,
            "summary": f"defaults: {rows[0]['series']} series, {rows[0]['cpu_ms_per_cycle']} ms CPU a cycle"}


DOC = os.path.join(REPO, "docs", "tuning.md")
RESULTS_FILE = os.path.join(RESULTS, "tuning.json")
TABLE_START = "<!-- tuning-table: generated by python -m bench.tuning from bench/results/tuning.json -->\n"
TABLE_END = "<!-- /tuning-table -->\n"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """docs/tuning.md's table from the ``switches`` rows of a tuning result."""
    def signed(n: float) -> str:
        return f"{n:+}" if n else f"{n}"

    lines = ["| Switch | Series | Added | Per GPU | CPU a cycle (ms) | Added (ms) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        switch = row["switch"] if row["switch"] == "defaults" else f"`{row['switch']}`"
        lines.append(f"| {switch} | {row['series']} | {signed(row['series_added'])} | {row['series_per_gpu']} | "
                     f"{row['cpu_ms_per_cycle']} | {signed(row['cpu_ms_added'])} |")
    return "\n".join(lines) + "\n"


def doc_with_table(doc: str, rows: list[dict[str, Any]]) -> str:
    head, rest = doc.split(TABLE_START, 1)
    return head + TABLE_START + markdown_table(rows) + TABLE_END + rest.split(TABLE_END, 1)[1]


def write_docs() -> int:
    """Rewrite docs/tuning.md's table from bench/results/tuning.json (after ``python -m bench tuning``)."""
    with open(RESULTS_FILE, encoding="utf-8") as fh:
        rows = json.load(fh)["switches"]
    with open(DOC, encoding="utf-8") as fh:
        doc = fh.read()
    return sync({DOC: doc_with_table(doc, rows)}, check=False, command="python -m bench.tuning")


if __name__ == "__main__":
    sys.exit(write_docs())
