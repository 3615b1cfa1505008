"""The kmsg collector end to end on records in the dev-kmsg format: driver lines become events carrying
the raw line and counters by kind; an XID that NVML's event API also reported (the real xid collector on
the simulated NVML) counts once; mlx5 lines name the IB device of the simulated ND H100 v5 tree; lost
and garbled records are counted; the position survives a restart; a missing log is unavailable (a
simulated host's log: tests/simulate/test_simulate_kernel_sources.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from gpumon.collectors.base import Context
from gpumon.collectors.kmsg import KmsgCollector
from gpumon.collectors.xid import XidCollector
from gpumon.simulate.nvml import FakeNVML
from gpumon.simulate.sysfs import build_tree
from tests.conftest import clean_env, values, wait_for
from tests.fakes.kmsg import OVERRUN
from tests.support.kmsg import rig, usec_ago


def test_xid_line_without_nvml_is_an_event_and_a_counter(tmp_path):
    log, c = rig(tmp_path)
    line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
    log.record(1, line, prio=4, usec=usec_ago(10))
    log.record(2, "EXT4-fs (nvme0n1p1): mounted filesystem", usec=usec_ago(10))
    out = c.collect()
    [event] = out.events
    assert event.kind == "gpu_xid" and event.subject == {"pci_bus_id": "00000000:3B:00.0"}
    assert event.attributes["line"] == line and event.attributes["process"] == "python3"
    assert event.attributes["pid"] == 1234 and abs(event.time - (time.time() - 10)) < 2
    assert values(out, "gpumon_kmsg_xid_errors_total") == {("00000000:3B:00.0", "79"): 1}
    records = values(out, "gpumon_kmsg_records_total")
    assert records[("xid",)] == 1 and records[("other",)] == 1 and records[("sxid",)] == 0


def test_fresh_xid_waits_for_nvml_then_counts_as_the_logs_own(tmp_path):
    log, c = rig(tmp_path)
    log.record(1, "NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=a.out, Graphics Exception", usec=usec_ago(0))
    assert [e for e in c.collect().events if e.kind == "gpu_xid"] == []     # held for the grace period
    out = wait_for(lambda: (lambda o: o if o.events else None)(c.collect()), timeout=5)
    assert out.events[0].attributes["xid"] == 13


def test_an_xid_nvml_reported_counts_once(tmp_path):
    fake = FakeNVML("h100-sxm5-80gb", 4)
    ctx = Context(hostname="test", state_dir=str(tmp_path), nvml=fake)
    x = XidCollector(ctx)
    try:
        x.collect()
        wait_for(lambda: x._watching.is_set(), 5)
        fake.inject_xid(2, 48)
        wait_for(lambda: any(e.kind == "gpu_xid" for e in x.collect().events), 5)
        log, c = rig(tmp_path, ctx)
        bus = fake.nvmlDeviceGetPciInfo_v3(fake.nvmlDeviceGetHandleByIndex(2)).busId
        nvrm = bus[4:].lower()[:-2]             # NVRM prints 0000:bb:dd, no function
        log.record(1, f"NVRM: Xid (PCI:{nvrm}): 48, pid=1, name=x, An uncorrectable double bit error",
                   usec=usec_ago(3))
        log.record(2, f"NVRM: Xid (PCI:{nvrm}): 48, pid=1, name=x, a second one NVML did not see",
                   usec=usec_ago(3))
        out = c.collect()
        assert len([e for e in out.events if e.kind == "gpu_xid"]) == 1
        assert values(out, "gpumon_kmsg_xid_errors_total") == {(bus, "48"): 1}
        assert values(out, "gpumon_kmsg_records_total")[("xid",)] == 2
    finally:
        x.close()


def test_mlx5_sxid_and_ipoib_lines_name_their_devices(tmp_path):
    build_tree("nd-h100-v5", str(tmp_path / "sys"))
    log, c = rig(tmp_path)
    log.record(1, "mlx5_core 0101:00:00.0: poll_health:174:(pid 0): device's health compromised - reached "
                  "miss count", prio=3, usec=usec_ago(5), fields={"SUBSYSTEM": "pci", "DEVICE": "+pci:0101:00:00.0"})
    log.record(2, "IPv6: ADDRCONF(NETDEV_CHANGE): ib0: link becomes ready", usec=usec_ago(5))
    log.record(3, "IPv6: ADDRCONF(NETDEV_CHANGE): veth12ab: link becomes ready", usec=usec_ago(5))
    log.record(4, "nvidia-nvswitch0: SXid (PCI:0000:c6:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
               usec=usec_ago(5))
    out = c.collect()
    kinds = {e.kind: e for e in out.events}
    assert set(kinds) == {"mlx5_health", "netdev_link_ready", "nvswitch_sxid"}
    assert kinds["mlx5_health"].subject == {"pci_bus_id": "00000101:00:00.0", "device": "mlx5_ib0"}
    assert kinds["netdev_link_ready"].subject == {"netdev": "ib0"}
    assert values(out, "gpumon_nvswitch_sxid_errors_total") == {("nvidia-nvswitch0", "00000000:C6:00.0", "20034"): 1}
    assert values(out, "gpumon_kmsg_records_total")[("other",)] == 1      # the veth is not IPoIB


def test_driver_lines_a_process_wrote_are_userspace_records_not_events(tmp_path):
    log, c = rig(tmp_path)
    xid = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
    log.record(1, xid, prio=(1 << 3) | 4, usec=usec_ago(10))     # echo ... > /dev/kmsg: LOG_USER
    log.record(2, xid, prio=(3 << 3) | 3, usec=usec_ago(10))     # <27>: a prefix naming LOG_DAEMON
    log.record(3, "nvidia-nvswitch0: SXid (PCI:0000:c6:00.0): 20034, Fatal, Link 30", prio=12, usec=usec_ago(10))
    log.record(4, xid, prio=4, usec=usec_ago(10))                # the driver's own: facility 0
    out = c.collect()
    assert [e.attributes["seq"] for e in out.events] == [4]
    assert values(out, "gpumon_kmsg_xid_errors_total") == {("00000000:3B:00.0", "79"): 1}
    records = values(out, "gpumon_kmsg_records_total")
    assert (records[("userspace",)], records[("xid",)], records[("sxid",)]) == (3, 1, 0)


def ready(netdev: str) -> str:
    return f"IPv6: ADDRCONF(NETDEV_CHANGE): {netdev}: link becomes ready"


def test_link_ready_names_that_are_no_netdev_or_no_regular_file_are_not_ipoib(tmp_path):
    log, c = rig(tmp_path)
    (tmp_path / "sys" / "escaped").mkdir(parents=True)
    (tmp_path / "sys" / "escaped" / "type").write_text("32\n")          # what ../../escaped would reach
    (tmp_path / "sys" / "class" / "net" / "fifo0").mkdir(parents=True)
    fifo = tmp_path / "sys" / "class" / "net" / "fifo0" / "type"
    os.mkfifo(fifo)                                                      # a blocking open() waits forever
    log.record(1, ready("../../escaped"))
    log.record(2, ready("fifo0"))
    result: list = []
    worker = threading.Thread(target=lambda: result.append(c.collect()), daemon=True)
    worker.start()
    worker.join(timeout=10)
    if worker.is_alive():
        with open(fifo, "w"):                                            # let the stuck open() go
            pass
        worker.join(timeout=10)
    assert result and not result[0].events
    assert values(result[0], "gpumon_kmsg_records_total")[("other",)] == 2


def test_a_netdev_name_that_was_not_ipoib_is_asked_again(tmp_path):
    log, c = rig(tmp_path)
    net = tmp_path / "sys" / "class" / "net" / "ib7"
    net.mkdir(parents=True)
    (net / "type").write_text("1\n")                # a veth that was called ib7 for a while
    log.record(1, ready("ib7"))
    assert c.collect().events == []
    (net / "type").write_text("32\n")               # gone, and the name now is an IPoIB interface
    log.record(2, ready("ib7"))
    assert [e.subject for e in c.collect().events] == [{"netdev": "ib7"}]


def test_lost_garbled_and_unknown_format_driver_lines_are_counted(tmp_path, caplog):
    log, c = rig(tmp_path)
    log.record(1, "first")
    log.raw(OVERRUN)
    log.record(11, "NVRM: Xid (somewhere odd): 13")
    log.raw(b"garbage without header\n")
    log.raw(b"more garbage\n")
    out = c.collect()
    assert values(out, "gpumon_kmsg_lost_records_total") == {(): 9}
    assert out.errors == {"garbled": 2, "unrecognised_driver_line": 1}
    assert sum("not in the dev-kmsg format" in r.getMessage() for r in caplog.records) == 1


def test_position_survives_a_restart(tmp_path):
    log, c = rig(tmp_path)
    log.record(1, "NVRM: Xid (PCI:0000:3b:00): 31, pid=1, name=x, MMU Fault", usec=usec_ago(10))
    assert len(c.collect().events) == 1
    c.close()
    log.record(1, "NVRM: Xid (PCI:0000:3b:00): 31, pid=1, name=x, MMU Fault", usec=usec_ago(10))
    log.record(2, "NVRM: Xid (PCI:0000:3b:00): 43, pid=1, name=x, Reset channel", usec=usec_ago(10))
    again = KmsgCollector(c.ctx)
    again.reader = log.reader(again.reader.state_file)
    assert [e.attributes["xid"] for e in again.collect().events] == [43]


def test_a_read_only_context_reads_from_the_saved_position_and_leaves_it(tmp_path):
    log, c = rig(tmp_path, Context(hostname="test", state_dir=str(tmp_path), persist_state=False))
    state = tmp_path / "kmsg.json"
    state.write_text(json.dumps({"boot_id": c.reader.boot, "seq": 1}))
    log.record(1, "NVRM: Xid (PCI:0000:3b:00): 31, pid=1, name=x, MMU Fault", usec=usec_ago(10))
    log.record(2, "NVRM: Xid (PCI:0000:3b:00): 43, pid=1, name=x, Reset channel", usec=usec_ago(10))
    assert [e.attributes["xid"] for e in c.collect().events] == [43]
    assert json.loads(state.read_text())["seq"] == 1
    assert sorted(os.listdir(tmp_path)) == ["boot_id", "kmsg.json"]


def test_gpumon_once_leaves_the_daemons_kernel_log_position_alone(tmp_path):
    kernel_log = tmp_path / "kmsg"
    kernel_log.write_text("0,7,100,-;a record gpumon once reads\n")    # a file reads as one record, then EOF
    state = tmp_path / "state"
    state.mkdir()
    result = subprocess.run([sys.executable, "-m", "gpumon", "once", "--collectors", "kmsg", "--format", "json"],
                            env=clean_env(GPUMON_KMSG_PATH=str(kernel_log), GPUMON_KMSG_FIRST_START="all",
                                          GPUMON_DAEMON_STATE_DIR=str(state)),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    records = next(m for m in json.loads(result.stdout)["metrics"] if m["name"] == "gpumon_kmsg_records_total")
    assert {s["labels"]["kind"]: s["value"] for s in records["samples"]}["other"] == 1
    assert os.listdir(state) == []


def test_a_reload_counts_an_xid_still_waiting_for_nvml_once(tmp_path):
    log, old = rig(tmp_path)
    xid = "NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=a.out, Graphics Exception"
    log.record(1, "before it", usec=usec_ago(1))
    log.record(2, xid, usec=usec_ago(1))
    log.record(3, "after it", usec=usec_ago(1))
    assert old.collect().events == []                  # held for its grace period; saved position: 1
    old.close()                                        # the stopped loop closes its collectors first
    new = KmsgCollector(old.ctx)
    new.reader = log.reader(new.reader.state_file)
    new.inherit(old)
    for seq, text in ((2, xid), (3, "after it")):      # still in the ring buffer the new reader opens
        log.record(seq, text, usec=usec_ago(1))
    out = wait_for(lambda: (lambda o: o if o.events else None)(new.collect()), timeout=5)
    assert [e.attributes["seq"] for e in out.events] == [2]
    assert values(out, "gpumon_kmsg_xid_errors_total") == {("00000000:3B:00.0", "13"): 1}
    assert values(out, "gpumon_kmsg_records_total")[("xid",)] == 1


def test_a_missing_kernel_log_is_unavailable(tmp_path):
    c = KmsgCollector(Context(hostname="t", state_dir=str(tmp_path)), {"path": str(tmp_path / "no-kmsg")})
    verdict = c.probe()
    assert not verdict.available and "no kernel log" in verdict.reason


def test_a_fifo_kernel_log_cannot_forge_an_xid_or_a_log_line(gpumon_run, tmp_path):
    """`gpumon run` reading a FIFO written as /dev/kmsg hands records out (one record per read, the
    message escaped): a kernel record that quotes an XID is no XID, and a process name holding an
    escaped newline neither hides the real XID nor starts a log line of its own."""
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)   # a writer is there all along: reads get EAGAIN
    try:
        gpumon = gpumon_run("--collectors", "kmsg", "--sinks", "prometheus", "--interval", "0.2",
                            env={"GPUMON_KMSG_PATH": str(fifo), "GPUMON_KMSG_FIRST_START": "all"})

        def count(series: str) -> float:
            for line in gpumon.metrics().splitlines():
                if line.startswith(series + " "):
                    return float(line.split()[-1])
            return 0.0

        def record(seq: int, message: str, kind: str) -> None:  # one at a time: a FIFO keeps no boundaries
            before = count(f'gpumon_kmsg_records_total{{kind="{kind}"}}')
            os.write(writer, f"3,{seq},{usec_ago(10)},-;{message}\n".encode())
            wait_for(lambda: count(f'gpumon_kmsg_records_total{{kind="{kind}"}}') == before + 1, timeout=10)

        record(1, "tmpfs: Unknown parameter 'NVRM: Xid (PCI:0000:3b:00): 79'", "other")
        record(2, r"NVRM: Xid (odd): 31\x0a2026-01-01 00:00:00,000 CRITICAL gpumon.health: forged one", "other")
        record(3, r"NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=a\x0aCRITICAL gpumon.health: forged two, "
                  "Graphics Exception", "xid")
        wait_for(lambda: count('gpumon_kmsg_xid_errors_total{pci_bus_id="00000000:3B:00.0",xid="13"}') == 1,
                 timeout=10)
        page = gpumon.metrics()
        assert 'xid="79"' not in page
        assert count('gpumon_kmsg_records_total{kind="xid"}') == 1
    finally:
        os.close(writer)
    code, output = gpumon.stop()
    assert code == 0, output
    assert "unknown format" in output                                    # the odd line was logged ...
    for line in output.splitlines():                                     # ... on one line, escaped
        assert "forged" not in line or line.index("forged") > line.index(r"\x0a"), line
        assert not line.startswith(("CRITICAL", "2026-01-01")), line
