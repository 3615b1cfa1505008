"""gpumon_collector_state: every collector's state (ok, down, unavailable) and why, from a fixed
vocabulary, on the page: an unmounted /host/sys, a host without an HCA, a hung and a raising
collector each read differently."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumon.collectors.base import Context
from gpumon.collectors.infiniband import InfinibandCollector
from gpumon.model import Snapshot
from gpumon.selfmetrics import REASONS, STATES, reason_code
from gpumon.simulate.sysfs import build_tree
from tests.conftest import wait_for
from tests.support import loop as loops
from tests.support.loop import Scripted, latest

loop_of = loops.loop_of  # the fixture, shared with this module

STATE_LINE = re.compile(r'^gpumon_collector_state\{collector="([^"]+)",state="([^"]+)",reason="([^"]+)"\} 1$', re.M)


def states(snapshot: Snapshot) -> dict[str, tuple[str, str]]:
    fam = snapshot.family("gpumon_collector_state")
    if fam is None:
        return {}
    assert all(s.value == 1 for s in fam.samples)
    return {s.label("collector"): (s.label("state"), s.label("reason")) for s in fam.samples}


def page_states(page: str) -> dict[str, tuple[str, str]]:
    return {m[0]: (m[1], m[2]) for m in STATE_LINE.findall(page)}


@pytest.mark.parametrize("message, code", [
    ("no /host/sys/class/infiniband (no InfiniBand driver loaded)", "driver_not_loaded"),
    ("/sys/class/infiniband has no devices (no RDMA-capable NIC)", "no_source"),
    ("NVML init failed: NVML Shared Library Not Found (library_not_found)", "library_not_found"),
    ("nvidia-ml-py (module pynvml) is not installed", "library_not_found"),
    ("NVML init failed: Driver Not Loaded (driver_not_loaded)", "driver_not_loaded"),
    ("NVML init failed: Insufficient Permissions (no_permission)", "no_permission"),
    ("cannot list /sys/class/infiniband: Permission denied", "no_permission"),
    ("NVML init failed: Unknown Error (unknown)", "init_failed"),
    ("NVML reports no GPUs", "no_source"),
    ("probe did not answer within 10 s", "deadline_exceeded"),
    ("probe failed: KeyError: 'x'", "error"),
])
def test_messages_map_onto_the_fixed_vocabulary(message, code):
    assert reason_code(message) == code


@given(st.text(max_size=80))
def test_any_message_gives_a_known_reason(message):
    assert reason_code(message) in REASONS


def test_probe_reasons_of_a_real_collector(tmp_path):
    """The words the IB collector really uses: no class/infiniband vs an empty one."""
    none = InfinibandCollector(Context("h", sysfs_root=str(tmp_path))).probe()
    assert reason_code(none.reason) == "driver_not_loaded"
    (tmp_path / "class" / "infiniband").mkdir(parents=True)
    empty = InfinibandCollector(Context("h", sysfs_root=str(tmp_path))).probe()
    assert reason_code(empty.reason) == "no_source"


def test_ok_down_unavailable_and_back(loop_of):  # noqa: F811 - the fixture by its name
    good, bad, gone, hung = Scripted("good"), Scripted("bad"), Scripted("gone"), Scripted("hung")
    loop, sink = loop_of(good, bad, gone, hung, deadline=0.3)
    wait_for(lambda: set(states(latest(sink))) == {"good", "bad", "gone", "hung"})
    assert set(states(latest(sink)).values()) == {("ok", "none")}
    bad.mode, gone.mode, hung.mode = "raise", "unavailable", "hang"
    want = {"good": ("ok", "none"), "bad": ("down", "error"), "gone": ("unavailable", "driver_not_loaded"),
            "hung": ("down", "deadline_exceeded")}
    wait_for(lambda: states(latest(sink)) == want, timeout=5)
    bad.mode = gone.mode = hung.mode = "ok"
    hung.release.set()
    wait_for(lambda: set(states(latest(sink)).values()) == {("ok", "none")}, timeout=5)
    for state, reason in want.values():
        assert state in STATES and reason in REASONS


def test_live_page_tells_a_host_without_ib_from_a_working_one(gpumon_run, tmp_path):
    bare = gpumon_run("--sysfs-root", str(tmp_path), "--collectors", "auto")
    page = page_states(bare.metrics())
    assert page["infiniband"] == ("unavailable", "driver_not_loaded")
    assert page["linkflap"] == ("unavailable", "driver_not_loaded")
    assert page["nvml"][0] == "unavailable" and page["nvml"][1] in REASONS
    bare.stop()
    build_tree("hbv4", str(tmp_path / "sys"))
    ib = gpumon_run("--sysfs-root", str(tmp_path / "sys"), "--collectors", "infiniband", "--interval", "0.2")
    wait_for(lambda: page_states(ib.metrics()).get("infiniband") == ("ok", "none"))
    assert 'gpumon_collector_up{collector="infiniband"} 1' in ib.metrics()  # kept as it was
