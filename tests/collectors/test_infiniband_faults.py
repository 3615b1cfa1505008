"""Per-file faults cost one value (counted, logged once), never the run; devices come and go;
attributes are opened once and re-read with pread."""

from __future__ import annotations

import errno
import logging
import os
import shutil

import pytest

from gpumon.collectors.base import CollectorUnavailable, Context
from gpumon.collectors.infiniband import InfinibandCollector
from gpumon.config import Section
from gpumon.simulate.sysfs import build_tree
from gpumon.sources import ib_sysfs as ibmod
from gpumon.sources.ib_sysfs import on_sysfs
from tests.conftest import values

KEY = ("mlx5_0", "1")




def setup(tmp_path, profile: str = "plain-mlx5", **options):
    fabric = build_tree(profile, str(tmp_path / "sys"))
    ctx = Context("host", sysfs_root=str(tmp_path / "sys"), state_dir=str(tmp_path / "state"))
    return InfinibandCollector(ctx, Section("infiniband", options)), fabric


def counter_path(fabric, name: str, device: str = "mlx5_0") -> str:
    """The path as the collector sees it: through the class/infiniband symlink."""
    return os.path.join(fabric.root, "class", "infiniband", device, "ports", "1", "counters", name)


def overwrite(path: str, content: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(content)


@pytest.mark.parametrize(("content", "reason"), [
    ("", "empty"),
    ("\n", "empty"),
    ("N/A (no PMA)\n", "no_pma"),
    ("12abc\n", "parse"),
    ("-5\n", "parse"),
    ("0x10\n", "parse"),
    ("1e3\n", "parse"),
    ("256\n", "absurd"),  # link_downed is 8-bit
    ("99999999999999999999999999\n", "absurd"),
])
def test_bad_counter_content_costs_that_value_only(tmp_path, content, reason) -> None:
    ib, fabric = setup(tmp_path)
    overwrite(counter_path(fabric, "link_downed"), content)
    coll = ib.collect()
    assert coll.errors == {reason: 1}
    assert KEY not in values(coll, "gpumon_ib_port_link_downed_total")
    assert values(coll, "gpumon_ib_port_symbol_errors_total")[KEY] >= 0
    assert len(values(coll, "gpumon_ib_hw_stat_total")) == 21


@pytest.mark.parametrize(("file", "content", "reason", "metric"), [
    ("state", "9: WEIRD\n", "absurd", "gpumon_ib_port_state"),
    ("state", "ACTIVE\n", "parse", "gpumon_ib_port_state"),
    ("phys_state", "", "empty", "gpumon_ib_port_phys_state"),
    ("rate", "fast\n", "parse", "gpumon_ib_port_rate_bytes_per_second"),
    ("rate", "999999999 Gb/sec (4X XDR)\n", "absurd", "gpumon_ib_port_rate_bytes_per_second"),
])
def test_bad_port_attribute(tmp_path, file, content, reason, metric) -> None:
    ib, fabric = setup(tmp_path)
    overwrite(os.path.join(fabric.port_dir("mlx5_0"), file), content)
    coll = ib.collect()
    assert coll.errors == {reason: 1}
    assert KEY not in values(coll, metric)
    assert values(coll, "gpumon_ib_port_data_received_bytes_total")[KEY] > 0


def test_fractional_rate_is_fine(tmp_path) -> None:
    ib, fabric = setup(tmp_path)
    overwrite(os.path.join(fabric.port_dir("mlx5_0"), "rate"), "2.5 Gb/sec (1X SDR)\n")
    assert values(ib.collect(), "gpumon_ib_port_rate_bytes_per_second")[KEY] == 2.5e9 / 8


def test_a_directory_in_place_of_a_file(tmp_path) -> None:
    ib, fabric = setup(tmp_path)
    path = counter_path(fabric, "symbol_error")
    os.unlink(path)
    os.mkdir(path)
    coll = ib.collect()
    assert coll.errors == {"read": 1}
    assert KEY in values(coll, "gpumon_ib_port_link_downed_total")


def test_a_fifo_in_place_of_a_file_does_not_block(tmp_path) -> None:
    ib, fabric = setup(tmp_path)
    path = counter_path(fabric, "symbol_error")
    os.unlink(path)
    os.mkfifo(path)
    coll = ib.collect()
    assert coll.errors == {"read": 1}


@pytest.mark.parametrize(("code", "reason"), [
    (errno.EINVAL, "unsupported"), (errno.ENOSYS, "unsupported"), (errno.EOPNOTSUPP, "unsupported"),
    (errno.EIO, "read"),
])
def test_read_errors_from_the_kernel(tmp_path, monkeypatch, code, reason) -> None:
    """Only the read of the one target file fails, as a restricted PF's would; this host's
    filesystem cannot make read() itself fail with these codes."""
    ib, fabric = setup(tmp_path)
    target = os.path.realpath(counter_path(fabric, "port_xmit_discards"))
    real_pread = os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}") == target:
            raise OSError(code, os.strerror(code))
        return real_pread(fd, n, offset)

    monkeypatch.setattr(ibmod.os, "pread", pread)
    coll = ib.collect()
    assert coll.errors == {reason: 1}
    assert KEY not in values(coll, "gpumon_ib_port_transmit_discards_total")
    assert KEY in values(coll, "gpumon_ib_port_receive_errors_total")


def test_permission_denied(tmp_path, monkeypatch) -> None:
    """Tests run as root, where chmod 000 does not deny; fail the one open() instead."""
    ib, fabric = setup(tmp_path)
    target = counter_path(fabric, "port_rcv_errors")
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if path == target:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(ibmod.os, "open", fake_open)
    coll = ib.collect()
    assert coll.errors == {"permission": 1}
    assert KEY not in values(coll, "gpumon_ib_port_receive_errors_total")


def test_file_vanishing_between_runs_triggers_a_new_walk(tmp_path) -> None:
    ib, fabric = setup(tmp_path)
    ib.collect()
    os.unlink(counter_path(fabric, "VL15_dropped"))
    coll = ib.collect()
    assert coll.errors == {"vanished": 1}
    coll = ib.collect()  # the new walk no longer expects the file
    assert coll.errors == {}
    assert KEY not in values(coll, "gpumon_ib_port_vl15_dropped_total")


def test_fault_is_counted_every_run_but_logged_once(tmp_path, caplog) -> None:
    ib, fabric = setup(tmp_path)
    overwrite(counter_path(fabric, "symbol_error"), "garbage\n")
    with caplog.at_level(logging.WARNING, logger="gpumon.collectors.infiniband"):
        for _ in range(3):
            assert ib.collect().errors == {"parse": 1}
    lines = [r for r in caplog.records if "symbol_error" in r.getMessage()]
    assert len(lines) == 1


def test_devices_vanish_and_reappear(tmp_path) -> None:
    ib, fabric = setup(tmp_path, "nd-a100-v4")
    assert len(values(ib.collect(), "gpumon_ib_port_up")) == 9
    fabric.unplug("mlx5_ib6")
    coll = ib.collect()
    assert ("mlx5_ib6", "1") not in values(coll, "gpumon_ib_port_up")
    assert len(values(coll, "gpumon_ib_port_up")) == 8
    fabric.replug("mlx5_ib6")
    assert ("mlx5_ib6", "1") in values(ib.collect(), "gpumon_ib_port_up")


def test_dangling_device_link_is_skipped(tmp_path) -> None:
    ib, fabric = setup(tmp_path, "nd-a100-v4")
    shutil.rmtree(fabric.device_dir("mlx5_ib2"))
    coll = ib.collect()
    assert ("mlx5_ib2", "1") not in values(coll, "gpumon_ib_port_up")
    assert len(values(coll, "gpumon_ib_port_up")) == 8


def test_missing_static_attribute_leaves_an_empty_label(tmp_path) -> None:
    ib, fabric = setup(tmp_path)
    os.unlink(os.path.join(fabric.device_dir("mlx5_0"), "fw_ver"))
    coll = ib.collect()
    assert coll.errors == {"vanished": 1}
    fam = next(f for f in coll.families if f.name == "gpumon_ib_port_info")
    assert fam.samples[0].label("fw_version") == ""


def test_no_driver_and_no_devices(tmp_path) -> None:
    ctx = Context("host", sysfs_root=str(tmp_path / "nothing"))
    ib = InfinibandCollector(ctx)
    probe = ib.probe()
    assert not probe.available and "no InfiniBand driver loaded" in probe.reason
    with pytest.raises(CollectorUnavailable):
        ib.collect()
    os.makedirs(tmp_path / "nothing" / "class" / "infiniband")
    assert "has no devices" in ib.probe().reason
    with pytest.raises(CollectorUnavailable):
        ib.collect()


def test_whole_tree_going_away_is_unavailable_then_recovers(tmp_path) -> None:
    ib, fabric = setup(tmp_path, "hbv4")
    assert ib.probe().available
    ib.collect()
    for device in list(fabric.devices):
        fabric.unplug(device)
    with pytest.raises(CollectorUnavailable):
        ib.collect()
    fabric.replug("mlx5_ib0")
    assert ("mlx5_ib0", "1") in values(ib.collect(), "gpumon_ib_port_up")


def test_pread_mode_opens_each_file_once_and_reads_fresh_content(tmp_path, monkeypatch) -> None:
    ib, fabric = setup(tmp_path, read_mode="pread")
    opens: list[str] = []
    real_open = os.open

    def spy(path, flags, *args, **kwargs):
        opens.append(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(ibmod.os, "open", spy)
    ib.collect()
    first = len(opens)
    # discovery reads 5 static files (fw_ver, board_id, hca_type, node_guid, link_layer) once;
    # every run: state, phys_state, rate, 21 counters/, 21 hw_counters/ (not lifespan).
    assert first == 5 + 3 + 21 + 21
    assert len(set(opens)) == first  # each file read at most once per run
    path = counter_path(fabric, "symbol_error")
    with open(path, "r+", encoding="ascii") as fh:  # in place, as sysfs content changes
        fh.truncate()
        fh.write("4242\n")
    coll = ib.collect()
    assert len(opens) == first  # nothing reopened
    assert values(coll, "gpumon_ib_port_symbol_errors_total")[KEY] == 4242
    ib.close()


def test_pread_mode_reopens_after_an_error(tmp_path, monkeypatch) -> None:
    ib, fabric = setup(tmp_path, read_mode="pread")
    ib.collect()
    target = os.path.realpath(counter_path(fabric, "symbol_error"))
    real_pread = os.pread
    fail = {"left": 1}

    def pread(fd: int, n: int, offset: int) -> bytes:
        if fail["left"] and os.readlink(f"/proc/self/fd/{fd}") == target:
            fail["left"] -= 1
            raise OSError(errno.EIO, "I/O error")
        return real_pread(fd, n, offset)

    monkeypatch.setattr(ibmod.os, "pread", pread)
    assert ib.collect().errors == {"read": 1}
    opens: list[str] = []
    real_open = os.open
    monkeypatch.setattr(ibmod.os, "open", lambda p, f, *a, **k: opens.append(p) or real_open(p, f, *a, **k))
    coll = ib.collect()
    assert coll.errors == {} and opens == [counter_path(fabric, "symbol_error")]
    ib.close()


def test_auto_mode_uses_pread_only_on_sysfs(tmp_path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / / rw - overlay overlay rw\n"
        "23 22 0:22 / /sys rw,nosuid - sysfs sysfs rw\n"
        "24 22 0:23 / /host\\040sys rw - sysfs sysfs rw\n"
        "25 23 0:24 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    assert on_sysfs("/sys/class", str(mountinfo))
    assert on_sysfs("/host sys/class", str(mountinfo))
    assert not on_sysfs("/sys/fs/cgroup/x", str(mountinfo))
    assert not on_sysfs(str(tmp_path), str(mountinfo))
    assert not on_sysfs("/sys", str(tmp_path / "missing"))
    ib, _ = setup(tmp_path)
    assert ib._cached is False  # a tmp tree: files get replaced, so open per read
