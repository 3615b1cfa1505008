"""`gpumon once --collectors infiniband --sysfs-root <tree>` on every fixture gives what the files imply."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from gpumon.simulate.sysfs import PROFILES, build_tree
from tests.conftest import clean_env


def once_json(tree: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "gpumon", "once", "--format", "json", "--collectors",
                             "infiniband", "--sysfs-root", tree], env=clean_env(GPUMON_DAEMON_STATE_DIR=tree),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def samples(doc: dict, name: str) -> dict[tuple[str, str], dict]:
    for metric in doc["metrics"]:
        if metric["name"] == name:
            return {(s["labels"]["device"], s["labels"]["port"]): s for s in metric["samples"]}
    return {}


def read(path: str) -> str:
    with open(path) as fh:
        return fh.read().strip()


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_values_follow_the_files(tmp_path, profile):
    fabric = build_tree(profile, str(tmp_path))
    doc = once_json(str(tmp_path))
    assert {c["name"]: c["ok"] for c in doc["collectors"]}["infiniband"]
    tx = samples(doc, "gpumon_ib_port_data_transmitted_bytes_total")
    rate = samples(doc, "gpumon_ib_port_rate_bytes_per_second")
    info = samples(doc, "gpumon_ib_port_info")
    assert len(info) == len(fabric.port_keys)
    for device, port in fabric.port_keys:
        key = (device, str(port))
        base = fabric.port_dir(device, port)
        gbps = float(re.match(r"([\d.]+) Gb/sec", read(os.path.join(base, "rate"))).group(1))
        assert rate[key]["value"] == gbps * 1e9 / 8
        xmit = read(os.path.join(base, "counters", "port_xmit_data"))
        if xmit.isdigit():
            assert tx[key]["value"] == 4 * int(xmit)  # PMA data counters count 4-byte words
        else:  # "N/A (no PMA)": skipped and counted, not exported as zero
            assert key not in tx
        assert info[key]["labels"]["link_layer"] == read(os.path.join(base, "link_layer"))
    if profile == "old-kernel-no-pma":
        errors = samples_by_reason(doc)
        assert sum(errors.values()) > 0


def samples_by_reason(doc: dict) -> dict[str, float]:
    for metric in doc["metrics"]:
        if metric["name"] == "gpumon_collector_errors_total":
            return {s["labels"]["reason"]: s["value"] for s in metric["samples"]
                    if s["labels"]["collector"] == "infiniband"}
    return {}


def test_saturated_counters_are_flagged(tmp_path):
    build_tree("saturated-link-downed", str(tmp_path))
    doc = once_json(str(tmp_path))
    flagged = {(s["labels"]["device"], s["labels"]["counter"]) for m in doc["metrics"]
               if m["name"] == "gpumon_ib_port_saturated" for s in m["samples"] if s["value"] == 1}
    assert ("mlx5_0", "link_downed") in flagged or ("mlx5_ib0", "link_downed") in flagged
