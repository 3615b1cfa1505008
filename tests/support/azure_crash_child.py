"""A process that runs the Azure sink on synthetic snapshots, for the kill -9 test.

    python -m tests.support.azure_crash_child STATE_DIR ENDPOINT CA DCR PRODUCED_FILE

It publishes two GPUs' power and energy every 20 ms (rows every 0.2 s) and an event every tenth
snapshot, and appends to PRODUCED_FILE the RowId of every row once the spool has it, i.e. every row
the sink has promised to deliver. SIGTERM stops it cleanly (the sink flushes); SIGKILL is the test.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

from gpumon.model import Event, MetricFamily, MetricSpec, MetricType, Severity, Snapshot
from gpumon.sinks.azure_monitor import AzureMonitorSink
from gpumon.sinks.base import SinkContext
from tests.fakes.tokens import FakeCredential
from tests.support.declared_hints import hinted

POWER = hinted(MetricSpec("gpumon_gpu_power_watts", MetricType.GAUGE, "p", "watts", ("gpu", "uuid")))
ENERGY = hinted(MetricSpec("gpumon_gpu_energy_joules_total", MetricType.COUNTER, "e", "joules",
                           ("gpu", "uuid")))


class RecordingSink(AzureMonitorSink):
    """Writes down each row the spool accepted, so the parent knows what must arrive."""

    produced = None

    def _append(self, records: list[bytes]) -> None:
        super()._append(records)
        for record in records:
            self.produced.write(json.loads(record)["r"]["RowId"] + "\n")
        self.produced.flush()


def main(state_dir: str, endpoint: str, ca: str, dcr: str, produced_path: str) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cfg = {"endpoint": endpoint, "dcr_immutable_id": dcr, "ca_bundle": ca, "imds_url": "",
           "upload_interval": 0.2, "timeout": 5.0}
    sink = RecordingSink(SinkContext("crash-node", state_dir, "test"), cfg, credential=FakeCredential())
    sink.backoff_min = 0.1
    with open(produced_path, "a", encoding="utf-8") as produced:
        sink.produced = produced
        sink.start()
        print("started", flush=True)
        n = 0
        while not stop.wait(0.02):
            n += 1
            fams = (MetricFamily(POWER, tuple(POWER.sample(300 + n % 7, str(g), f"GPU-{g}") for g in (0, 1))),
                    MetricFamily(ENERGY, tuple(ENERGY.sample(n * 10.0, str(g), f"GPU-{g}") for g in (0, 1))))
            events = ()
            if n % 10 == 0:
                events = (Event("gpu_xid", Severity.ERROR, {"gpu": "0", "uuid": "GPU-0"}, f"xid {n}", {"n": n}),)
            sink.publish(Snapshot("crash-node", time.time(), fams, events, ()))
        sink.stop(5.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:6]))
