"""Driver lines in the formats the NVIDIA and mlx5 drivers print (tests/fixtures/kmsg/driver_lines.txt
cites where each came from) are recognised as the right kind, with what they name."""

from __future__ import annotations

import os

from gpumon.sources.driver_log import recognise
from gpumon.sources.pci import nvml_bus_id, sysfs_name
from tests.conftest import REPO

FIXTURE = os.path.join(REPO, "tests", "fixtures", "kmsg", "driver_lines.txt")


def fixture_lines() -> list[tuple[str, str]]:
    with open(FIXTURE, encoding="utf-8") as fh:
        return [tuple(line.rstrip("\n").split("\t", 1)) for line in fh if line.strip() and not line.startswith("#")]


def test_every_fixture_line_is_recognised_as_its_kind():
    lines = fixture_lines()
    assert len(lines) >= 20
    for kind, message in lines:
        got = recognise(message)
        assert (got.kind if got else "none") == kind, message


def test_xid_fields_pid_name_and_address():
    msg = recognise("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.")
    assert msg.pci == "0000:3b:00"
    assert msg.attrs == {"xid": 79, "pid": 1234, "process": "python3", "detail": "GPU has fallen off the bus."}
    unknown = recognise("NVRM: Xid (PCI:0000:b7:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
    assert "pid" not in unknown.attrs and "process" not in unknown.attrs
    old = recognise("NVRM: Xid (0000:03:00): 14, Channel 00000001")
    assert old.attrs == {"xid": 14, "detail": "Channel 00000001"}
    gb200 = recognise("NVRM: Xid (PCI:0008:01:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 (0x004505c6)")
    assert gb200.attrs["xid"] == 149 and gb200.attrs["detail"].startswith("NETIR_LINK_EVT Fatal")


def test_a_real_r580_xid_line_names_the_gpu_nvml_names():
    """Read from /dev/kmsg on a real H100 (driver 580.159.04): newer drivers print "channel 0x..." where
    older ones printed "Ch ...". Its address is the one NVML gave that GPU (nvmlDeviceGetPciInfo_v3
    busId "00000000:00:06.0", tests/fixtures/nvml/h100_r580.json), so the two reports are one XID."""
    msg = recognise("NVRM: Xid (PCI:0000:00:06): 31, pid=547, name=python3, channel 0x0000000a, intr 00000000. "
                    "MMU Fault: ENGINE GRAPHICS GPC1 GPCCLIENT_T1_8 faulted @ 0x0_00000000. "
                    "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE")
    assert msg.attrs["xid"] == 31 and msg.attrs["pid"] == 547 and msg.attrs["process"] == "python3"
    assert msg.attrs["detail"].startswith("channel 0x0000000a, intr 00000000. MMU Fault")
    assert nvml_bus_id(msg.pci) == nvml_bus_id("00000000:00:06.0")


def test_sxid_and_mlx5_fields():
    sx = recognise("nvidia-nvswitch0: SXid (PCI:0000:c6:00.0): 20034, Fatal, Link 30 LTSSM Fault Up")
    assert (sx.attrs["switch"], sx.attrs["sxid"], sx.attrs["fatal"]) == ("nvidia-nvswitch0", 20034, 1)
    module = recognise("mlx5_core 0000:5c:00.0: mlx5_port_module_event:1131:(pid 0): Port module event[error]: "
                       "module 0, Cable error, High Temperature")
    assert (module.pci, module.attrs) == ("0000:5c:00.0", {"module": 0, "status": "Cable error",
                                                            "error": "High Temperature"})
    link = recognise("mlx5_core 7870:00:02.0 enP30832s1: Link down")
    assert link.attrs == {"netdev": "enP30832s1"}


def test_pci_addresses_convert_to_the_nvml_and_sysfs_forms():
    assert nvml_bus_id("0000:3b:00") == "00000000:3B:00.0"
    assert nvml_bus_id("PCI:0000:c6:00.0") == "00000000:C6:00.0"
    assert sysfs_name("00000001:00:00.0") == "0001:00:00.0"
    assert nvml_bus_id("junk") == "junk"


def test_only_a_message_that_starts_with_the_driver_text_is_a_driver_line():
    # a kernel record that merely quotes an XID (a mount option, a module parameter) is no XID
    for quoted in ("tmpfs: Unknown parameter 'NVRM: Xid (PCI:0000:3b:00): 79'",
                   "audit: comm=\"NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.\"",
                   "foo: NVRM: GPU at PCI:0000:3b:00: GPU has fallen off the bus.",
                   "bar: nvidia-nvswitch0: SXid (PCI:0000:c6:00.0): 20034, Fatal, Link 30",
                   "baz IPv6: ADDRCONF(NETDEV_CHANGE): ib0: link becomes ready"):
        assert recognise(quoted) is None, quoted


def test_an_escaped_newline_in_the_process_name_stays_inside_the_xid_line():
    # /dev/kmsg writes a newline in comm (set by any CUDA user through prctl) as \x0a: the line is still
    # one XID, matched on the escaped text; the name alone is unescaped (it is a field value)
    msg = recognise(r"NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=a\x0aCRITICAL gpumon.health: ok, Graphics Exception")
    assert msg is not None and msg.kind == "xid" and msg.attrs["xid"] == 13
    assert msg.attrs["process"] == "a\nCRITICAL gpumon.health: ok" and msg.attrs["detail"] == "Graphics Exception"
