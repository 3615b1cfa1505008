"""A simulated host's kernel log and PCI tree: `--simulate` points the kmsg collector at the host's log,
which injected faults write the drivers' lines to (recognised as a real host's are), and the aer
collector at PCI functions whose aer_dev_* counters the `aer` action grows; a daemon restart keeps
both, a reboot starts them again."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from gpumon import cli, config, daemon
from gpumon.collectors.aer import AerCollector
from gpumon.collectors.base import Context
from gpumon.collectors.kmsg import KmsgCollector
from gpumon.simulate import HOSTS, Simulation
from gpumon.sources import driver_log
from gpumon.sources.pci_aer import parse_stats
from tests.conftest import clean_env, values


@pytest.fixture
def host(tmp_path):
    """The daemon's view of a simulated ND H100 v5: its context and its kmsg and aer collectors."""
    cfg = config.load(cli.schemas(), None, clean_env(GPUMON_DAEMON_STATE_DIR=str(tmp_path)),
                      {"simulate": "nd-h100-v5"})
    ctx = daemon.make_context(cfg)
    try:
        yield ctx, KmsgCollector(ctx, ctx.config.sections["kmsg"]), AerCollector(ctx)
    finally:
        ctx.simulation.stop()


def records(sim: Simulation) -> list:
    """The host's log as the kernel would hand it out, record by record."""
    from gpumon.sources.kmsg import KmsgReader

    reader = KmsgReader(sim.kernel_log.path, first_start="all", boot_id_path=sim.boot_id_path)
    try:
        return reader.read().records
    finally:
        reader.close()


def test_the_kmsg_collector_reads_the_simulated_log_and_faults_print_the_drivers_lines(host):
    ctx, kmsg, _aer = host
    sim = ctx.simulation
    assert ctx.config.sections["kmsg"]["path"] == sim.kernel_log.path == os.path.join(sim.home, "kmsg")
    assert kmsg.probe().available
    kmsg.collect()                                       # the first run starts at the end of the log
    sim.apply({"action": "xid", "gpu": 3, "xid": 48})
    sim.apply({"action": "xid", "gpu": 2, "xid": 79})
    sim.apply({"action": "flap", "device": "mlx5_ib0"})
    sim.apply({"action": "port_down", "device": "mlx5_an0", "seconds": 1})
    sim.step(2)                                          # the timed port-down runs out: Link up
    out = kmsg.collect()
    kinds = values(out, "gpumon_kmsg_records_total")
    assert {k: kinds[(k,)] for k in ("xid", "gpu_off_bus", "netdev_link_down", "netdev_link_up",
                                     "netdev_link_ready")} == {"xid": 2, "gpu_off_bus": 1, "netdev_link_down": 1,
                                                               "netdev_link_up": 1, "netdev_link_ready": 1}
    lines = [r.message for r in records(sim)]
    # GPU 3 is NVML's 00000004:00:00.0 on this profile; its idle process holds it
    bus_id, _device, pid, name = sim.nvml.pci(3)
    assert bus_id == "00000004:00:00.0"
    assert lines[0].startswith(f"NVRM: Xid (PCI:0004:00:00): 48, pid={pid}, name={name}, An uncorrectable")
    assert lines[1] == "NVRM: Xid (PCI:0003:00:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    assert lines[2] == "NVRM: GPU 0003:00:00.0: GPU has fallen off the bus."
    assert lines[3:] == ["IPv6: ADDRCONF(NETDEV_CHANGE): ib0: link becomes ready",
                         "mlx5_core 7870:00:02.0 enP30832s1: Link down",
                         "mlx5_core 7870:00:02.0 enP30832s1: Link up",
                         "IPv6: ADDRCONF(NETDEV_CHANGE): enP30832s1: link becomes ready"]
    xid = driver_log.recognise(lines[0])
    assert xid is not None and xid.kind == "xid" and xid.attrs["xid"] == 48
    assert [r.level for r in records(sim)[:3]] == [4, 4, 3] and {r.facility for r in records(sim)} == {0}
    assert [r.seq for r in records(sim)] == list(range(len(lines)))


def test_the_log_runs_on_across_a_restart_and_starts_again_at_a_reboot(host):
    ctx, kmsg, _aer = host
    sim = ctx.simulation
    sim.apply({"action": "xid", "gpu": 0, "xid": 13})
    again = Simulation("nd-h100-v5", sim.workdir, hostname="t", home=sim.home)  # the daemon restarted
    try:
        again.apply({"action": "xid", "gpu": 0, "xid": 31})
        assert [r.seq for r in records(again)] == [0, 1]
        kmsg.collect()
        again.reboot()
        assert records(again) == []
        again.apply({"action": "xid", "gpu": 1, "xid": 31})
        [record] = records(again)
        assert record.seq == 0 and "(PCI:0002:00:00): 31," in record.message
    finally:
        again.stop()
    # the collector's position belongs to the simulated host's boot: after the reboot it reads from 0
    reborn = KmsgCollector(ctx, ctx.config.sections["kmsg"])
    assert reborn.reader.boot != kmsg.reader.boot
    reborn.reader.first_start = "all"
    assert values(reborn.collect(), "gpumon_kmsg_records_total")[("xid",)] == 1


def test_the_aer_action_counts_at_a_gpu_or_an_hca_and_prints_the_kernels_report(host):
    ctx, _kmsg, aer = host
    sim = ctx.simulation
    assert aer.probe().available
    out = aer.collect()
    totals = values(out, "gpumon_pcie_aer_errors_total")
    assert len(totals) == (8 + 9) * 3 and set(totals.values()) == {0}          # 8 GPUs, 9 HCA functions
    roles = {labels[1] for labels in totals}
    assert roles == {"gpu", "hca"}                                             # no bridge on an Azure VM
    sim.apply({"action": "aer", "gpu": 3, "severity": "correctable", "type": "BadTLP"})
    sim.apply({"action": "aer", "device": "mlx5_ib1", "severity": "fatal", "type": "MalfTLP", "count": 2})
    out = aer.collect()
    totals = values(out, "gpumon_pcie_aer_errors_total")
    assert totals[("00000004:00:00.0", "gpu", "", "correctable")] == 1
    assert totals[("00000102:00:00.0", "hca", "mlx5_ib1", "fatal")] == 2
    assert sum(totals.values()) == 3
    assert values(out, "gpumon_pcie_aer_error_types_total") == {
        ("00000004:00:00.0", "gpu", "", "correctable", "BadTLP"): 1,
        ("00000102:00:00.0", "hca", "mlx5_ib1", "fatal", "MalfTLP"): 2}
    gpu_dir = os.path.join(sim.sysfs_root, "bus", "pci", "devices", "0004:00:00.0")
    with open(os.path.join(gpu_dir, "aer_dev_correctable"), encoding="ascii") as fh:
        stats = parse_stats(fh.read())
    assert list(stats) == ["RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr",
                           "HeaderOF", "TOTAL_ERR_COR"] and stats["BadTLP"] == stats["TOTAL_ERR_COR"] == 1
    report = [(r.level, r.message, r.fields) for r in records(sim)]
    assert report[:4] == [
        (6, "nvidia 0004:00:00.0: AER: Corrected error message received from 0004:00:00.0",
         {"SUBSYSTEM": "pci", "DEVICE": "+pci:0004:00:00.0"}),
        (4, "nvidia 0004:00:00.0: PCIe Bus Error: severity=Corrected, type=Data Link Layer, (Receiver ID)",
         {"SUBSYSTEM": "pci", "DEVICE": "+pci:0004:00:00.0"}),
        (4, "nvidia 0004:00:00.0:   device [10de:2330] error status/mask=00000040/0000e000",
         {"SUBSYSTEM": "pci", "DEVICE": "+pci:0004:00:00.0"}),
        (4, "nvidia 0004:00:00.0:    [ 6] BadTLP                 (First)",
         {"SUBSYSTEM": "pci", "DEVICE": "+pci:0004:00:00.0"})]
    assert report[5][1] == ("mlx5_core 0102:00:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), "
                            "type=Transaction Layer, (Receiver ID)") and report[5][0] == 3


def test_aer_counts_survive_a_restart_and_a_reboot_zeroes_them(host):
    ctx, _kmsg, _aer = host
    sim = ctx.simulation
    sim.apply({"action": "aer", "gpu": 0, "severity": "nonfatal", "type": "CmpltTO", "count": 5})
    again = Simulation("nd-h100-v5", sim.workdir + "-restarted", hostname="t", home=sim.home)
    try:
        path = os.path.join(again.sysfs_root, "bus", "pci", "devices", "0001:00:00.0", "aer_dev_nonfatal")
        with open(path, encoding="ascii") as fh:
            assert parse_stats(fh.read())["TOTAL_ERR_NONFATAL"] == 5
        again.reboot()
        with open(path, encoding="ascii") as fh:
            assert parse_stats(fh.read())["TOTAL_ERR_NONFATAL"] == 0
    finally:
        again.stop()


@pytest.mark.parametrize(("command", "error"), [
    ({"action": "aer", "severity": "correctable", "type": "BadTLP"}, "names a gpu or a device"),
    ({"action": "aer", "gpu": 1, "device": "mlx5_ib0", "severity": "correctable", "type": "BadTLP"},
     "names a gpu or a device"),
    ({"action": "aer", "gpu": 1, "severity": "correctable", "type": "CmpltTO"}, "a correctable error is one of"),
    ({"action": "aer", "gpu": 1, "severity": "bad", "type": "BadTLP"}, "severity is one of"),
    ({"action": "aer", "device": "mlx5_ib9", "severity": "fatal", "type": "MalfTLP"}, "no HCA mlx5_ib9"),
    ({"action": "aer", "gpu": 8, "severity": "fatal", "type": "MalfTLP"}, "no GPU 8"),
])
def test_a_bad_aer_command_is_refused_and_counts_nothing(host, command, error):
    ctx, _kmsg, _aer = host
    with pytest.raises(ValueError, match=error):
        ctx.simulation.apply(command)
    assert records(ctx.simulation) == []


def test_a_garbled_line_in_the_simulated_log_is_no_record(host):
    """The log is read through the same parser as the device: what is not a record is counted, the
    records after it still read."""
    ctx, kmsg, _aer = host
    with open(ctx.simulation.kernel_log.path, "ab") as fh:
        fh.write(b"junk without a header\n")
    ctx.simulation.apply({"action": "xid", "gpu": 0, "xid": 43})
    kmsg.reader.first_start = "all"
    out = kmsg.collect()
    assert values(out, "gpumon_kmsg_records_total")[("xid",)] == 1
    assert out.errors == {"garbled": 1}


@pytest.mark.parametrize("profile", sorted(HOSTS))
def test_every_profile_has_a_kernel_log_and_its_gpus_and_hcas_on_the_pci_tree(tmp_path, profile):
    sim = Simulation(profile, str(tmp_path / profile), hostname="t")
    try:
        ctx = Context(hostname="t", sysfs_root=sim.sysfs_root, state_dir=str(tmp_path), simulation=sim)
        aer = AerCollector(ctx)
        assert aer.probe().available and os.path.isfile(sim.kernel_log.path)
        roles = Counter(labels[1] for labels in values(aer.collect(), "gpumon_pcie_function_info"))
        hcas = len(sim.fabric.devices) if sim.fabric is not None else 0
        assert roles == Counter({"gpu": HOSTS[profile].gpu_count, "hca": hcas}) - Counter()
    finally:
        sim.stop()
