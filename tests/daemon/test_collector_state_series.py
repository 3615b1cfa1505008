"""gpumon_collector_state: every collector's state (ok, down, unavailable) and why, from a fixed
vocabulary, on the page: an unmounted /host/sys, a host without an HCA, a hung and a raising
collector each read differently."""

from __future__ import annotations

import errno
import re

import pynvml
import pytest

from gpumon.collectors.aer import AerCollector
from gpumon.collectors.base import Availability, Collector, CollectorUnavailable, Context
from gpumon.collectors.infiniband import InfinibandCollector
from gpumon.collectors.kmsg import KmsgCollector
from gpumon.collectors.linkflap import LinkflapCollector
from gpumon.collectors.nvml import NvmlCollector
from gpumon.collectors.xid import XidCollector
from gpumon.config import Section
from gpumon.daemon import plan
from gpumon.model import Snapshot
from gpumon.simulate.nvml import FakeNVML
from gpumon.simulate.sysfs import build_tree
from gpumon.sources import ib_sysfs
from gpumon.stages.selfmetrics import REASONS, STATES
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


@pytest.mark.parametrize(("code", "cause"), [
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver_not_loaded"),
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "library_not_found"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "no_permission"),
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "init_failed"),
    (pynvml.NVML_ERROR_UNKNOWN, "init_failed"),
])
def test_an_nvml_init_failure_gives_its_cause_where_it_is_raised(code, cause):
    """The NVML return code of nvmlInit, not the words of its message, chooses the reason; the probe
    and a run both carry it (and the XID watcher, on the same session, too)."""
    fake = FakeNVML("h100-sxm5-80gb", 1)
    ctx = Context(hostname="test", nvml=fake)
    fake.fail_init(code)
    collector = NvmlCollector(ctx)
    assert collector.probe().cause == cause
    with pytest.raises(CollectorUnavailable) as raised:
        collector.collect()
    assert raised.value.cause == cause
    assert XidCollector(ctx).probe().cause == cause
    collector.close()


def test_a_host_whose_nvml_has_no_gpus_has_no_source():
    fake = FakeNVML("h100-sxm5-80gb", 0)
    collector = NvmlCollector(Context(hostname="test", nvml=fake))
    assert collector.probe().cause == "no_source"
    collector.close()


def test_probe_causes_of_the_sysfs_collectors(tmp_path):
    """No class/infiniband (no driver) vs an empty one (no HCA); no AER-capable function; a missing
    kernel log is an error, as every cause a collector does not give."""
    none = InfinibandCollector(Context("h", sysfs_root=str(tmp_path))).probe()
    assert (none.available, none.cause) == (False, "driver_not_loaded")
    assert LinkflapCollector(Context("h", sysfs_root=str(tmp_path))).probe().cause == "driver_not_loaded"
    assert AerCollector(Context("h", sysfs_root=str(tmp_path))).probe().cause == "no_source"
    (tmp_path / "class" / "infiniband").mkdir(parents=True)
    empty = InfinibandCollector(Context("h", sysfs_root=str(tmp_path))).probe()
    assert (empty.available, empty.cause) == (False, "no_source")
    with pytest.raises(CollectorUnavailable) as raised:
        LinkflapCollector(Context("h", sysfs_root=str(tmp_path))).collect()
    assert raised.value.cause == "no_source"
    kmsg = KmsgCollector(Context("h"), Section("kmsg", {"path": str(tmp_path / "none")}))
    assert (kmsg.probe().available, kmsg.probe().cause) == (False, "error")


def test_a_listing_refused_or_gone_says_so():
    """The errno of a failed listing of class/infiniband, not its words."""
    assert ib_sysfs._listing_cause(PermissionError(errno.EACCES, "Permission denied")) == "no_permission"
    assert ib_sysfs._listing_cause(PermissionError(errno.EPERM, "Operation not permitted")) == "no_permission"
    assert ib_sysfs._listing_cause(FileNotFoundError(errno.ENOENT, "No such file or directory")) == "no_source"
    assert ib_sysfs._listing_cause(OSError(errno.EIO, "Input/output error")) == "error"


def test_the_plan_gives_a_raising_probe_error():
    """(A hung probe: deadline_exceeded, tests/test_daemon_loop.py.)"""
    class Raises(Collector):
        name = "raises"

        def probe(self) -> Availability:
            raise PermissionError("permission denied")

    assert plan._probe(Raises(Context("h")), 5.0)[4] == "error"


def test_the_reasons_are_the_vocabulary_in_its_order():
    assert REASONS == ("none", "no_source", "library_not_found", "driver_not_loaded", "no_permission",
                       "init_failed", "deadline_exceeded", "error")


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
