"""A live tree under a running `gpumon run`: state flips and counter bumps become flaps and events."""

from __future__ import annotations

import json
import re

from gpumon.simulate.sysfs import build_tree
from tests.conftest import wait_for


def value(page: str, name: str, device: str) -> float | None:
    match = re.search(rf'^{name}{{[^}}]*device="{device}"[^}}]*}} (\S+)$', page, re.M)
    return float(match.group(1)) if match else None


def test_flips_and_bumps_are_counted_once_each_with_events(gpumon_run, tmp_path):
    tree = tmp_path / "sys"
    fabric = build_tree("hbv4", str(tree))
    device, port = fabric.port_keys[0]
    process = gpumon_run("--collectors", "infiniband", "--sysfs-root", str(tree), "--log-format", "json",
                         "--interval", "1", env={"GPUMON_LINKFLAP_FLAP_THRESHOLD": "2"})

    def seen(name: str, expected: float) -> bool:
        return value(process.metrics(), name, device) == expected

    # the infiniband and linkflap collectors publish as each run ends: wait for both first runs
    wait_for(lambda: seen("gpumon_ib_port_up", 1) and value(process.metrics(), "gpumon_ib_link_flaps_total",
                                                            device) is not None)
    assert seen("gpumon_ib_link_flaps_total", 0)

    fabric.set_down(device, port)  # a long outage the 1 s watcher sees
    wait_for(lambda: seen("gpumon_ib_port_up", 0), timeout=5)
    fabric.set_up(device, port)
    wait_for(lambda: seen("gpumon_ib_link_flaps_total", 1), timeout=5)
    assert seen("gpumon_ib_port_flapping", 0)

    fabric.flap(device, port)  # shorter than any poll: only link_downed and carrier_changes move
    wait_for(lambda: seen("gpumon_ib_link_flaps_total", 2), timeout=5)
    wait_for(lambda: seen("gpumon_ib_port_flapping", 1), timeout=5)
    # the same flap seen again by the counter collector later must not be counted twice
    page_runs = process.metrics()
    wait_for(lambda: process.metrics() != page_runs, timeout=5)
    assert seen("gpumon_ib_link_flaps_total", 2)

    code, output = process.stop()
    assert code == 0
    kinds = [json.loads(line).get("kind") for line in output.splitlines() if line.startswith("{")]
    for kind in ("ib_link_down", "ib_link_up", "ib_link_flap", "ib_port_flapping"):
        assert kind in kinds, (kind, kinds)
    assert kinds.count("ib_port_flapping") == 1
