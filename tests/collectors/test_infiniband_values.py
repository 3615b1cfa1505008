"""The infiniband collector gives the values the files imply, on every simulated host."""

from __future__ import annotations

import os

import pytest

from gpumon.collectors.infiniband import HW_COUNTER_SECONDS, PMA_COUNTERS, InfinibandCollector
from gpumon.model import MetricType
from gpumon.simulate.sysfs import PROFILES
from tests.conftest import values
from tests.support.infiniband import collector


def read(path: str) -> str:
    with open(path, encoding="ascii") as fh:
        return fh.read().strip()


@pytest.mark.parametrize("profile", ["nd-h100-v5", "nd-a100-v4", "hbv4", "plain-mlx5", "no-hw-counters"])
def test_every_counter_file_is_exported_in_base_units(tmp_path, profile) -> None:
    ib, fabric = collector(tmp_path, profile)
    coll = ib.collect()
    assert coll.errors == {}
    for device, port in fabric.port_keys:
        key = (device, str(port))
        pdir = fabric.port_dir(device, port)
        for counter in PMA_COUNTERS:
            raw = int(read(os.path.join(pdir, "counters", counter.file)))
            assert values(coll, counter.metric)[key] == raw * counter.scale, counter.file
        hw = values(coll, "gpumon_ib_hw_stat_total")
        hw_dir = os.path.join(pdir, "hw_counters")
        names = sorted(os.listdir(hw_dir)) if os.path.isdir(hw_dir) else []
        for name in names:
            if name != "lifespan":
                assert hw[key + (name,)] == int(read(os.path.join(hw_dir, name)))
        assert (key + ("lifespan",)) not in hw
        rate = read(os.path.join(pdir, "rate"))
        assert values(coll, "gpumon_ib_port_rate_bytes_per_second")[key] == int(rate.split()[0]) * 1e9 / 8
        assert values(coll, "gpumon_ib_port_state")[key] == 4
        assert values(coll, "gpumon_ib_port_phys_state")[key] == 5
        assert values(coll, "gpumon_ib_port_up")[key] == 1
    assert values(coll, "gpumon_ib_port_saturated") == {}


def test_port_data_is_four_times_the_file(tmp_path) -> None:
    ib, fabric = collector(tmp_path, "plain-mlx5")
    fabric.set_counter("mlx5_0", 1, "port_xmit_data", 1000)
    fabric.set_counter("mlx5_0", 1, "port_rcv_data", 250)
    coll = ib.collect()
    assert values(coll, "gpumon_ib_port_data_transmitted_bytes_total")[("mlx5_0", "1")] == 4000
    assert values(coll, "gpumon_ib_port_data_received_bytes_total")[("mlx5_0", "1")] == 1000


def test_info_carries_identity_and_netdev(tmp_path) -> None:
    ib, _ = collector(tmp_path, "nd-h100-v5")
    coll = ib.collect()
    fam = next(f for f in coll.families if f.name == "gpumon_ib_port_info")
    assert fam.spec.type is MetricType.INFO
    by_device = {s.label("device"): dict(s.labels) for s in fam.samples}
    assert by_device["mlx5_ib4"] == {
        "device": "mlx5_ib4", "port": "1", "link_layer": "InfiniBand", "fw_version": "28.39.1002",
        "board_id": "MT_0000000838", "hca_type": "MT4129", "node_guid": "0015:5dff:fe34:043a",
        "netdev": "ib4",
    }
    assert by_device["mlx5_an0"]["link_layer"] == "Ethernet"
    assert by_device["mlx5_an0"]["netdev"] == "enP30832s1"
    assert all(s.value == 1 for s in fam.samples)


def test_series_budget_on_nd_h100_v5(tmp_path) -> None:
    ib, _ = collector(tmp_path, "nd-h100-v5")
    coll = ib.collect()
    series = sum(len(f.samples) for f in coll.families)
    assert series == 433  # 9 ports; documented in docs/collectors/infiniband.md
    lean, _ = collector(tmp_path / "lean", "nd-h100-v5", hw_counters=False)
    assert sum(len(f.samples) for f in lean.collect().families) == 9 * 26


def test_saturated_counters_are_flagged(tmp_path) -> None:
    ib, fabric = collector(tmp_path, "saturated-link-downed")
    coll = ib.collect()
    assert values(coll, "gpumon_ib_port_saturated") == {
        ("mlx5_ib0", "1", "link_downed"): 1,
        ("mlx5_ib0", "1", "port_xmit_discards"): 1,
        ("mlx5_ib0", "1", "port_xmit_wait"): 1,
    }
    assert values(coll, "gpumon_ib_port_link_downed_total")[("mlx5_ib0", "1")] == 255
    fabric.set_counter("mlx5_ib0", 1, "link_downed", 0)  # perfquery -R
    coll = ib.collect()
    assert ("mlx5_ib0", "1", "link_downed") not in values(coll, "gpumon_ib_port_saturated")
    assert values(coll, "gpumon_ib_port_link_downed_total")[("mlx5_ib0", "1")] == 0


def test_hw_queue_counter_at_32_bit_max_is_flagged(tmp_path) -> None:
    ib, fabric = collector(tmp_path, "plain-mlx5")
    fabric.set_counter("mlx5_0", 1, "out_of_buffer", (1 << 32) - 1)
    sat = values(ib.collect(), "gpumon_ib_port_saturated")
    assert sat == {("mlx5_0", "1", "out_of_buffer"): 1}


def test_hw_counters_are_read_every_10_seconds_and_counters_every_run(tmp_path) -> None:
    """At a fast interval counters/ (data, errors, link_downed for flaps) is read every run and
    hw_counters/ at most every HW_COUNTER_SECONDS, its last value exported in between."""
    ib, fabric = collector(tmp_path, "plain-mlx5")
    now = [1000.0]
    ib._clock = lambda: now[0]
    key = ("mlx5_0", "1")
    ib.collect()
    fabric.set_counter("mlx5_0", 1, "out_of_buffer", 7)
    fabric.set_counter("mlx5_0", 1, "port_xmit_data", 1000)
    now[0] += 1.0
    coll = ib.collect()
    assert values(coll, "gpumon_ib_port_data_transmitted_bytes_total")[key] == 4000     # read this run
    assert values(coll, "gpumon_ib_hw_stat_total")[key + ("out_of_buffer",)] != 7      # the last value
    now[0] += HW_COUNTER_SECONDS
    coll = ib.collect()
    assert values(coll, "gpumon_ib_hw_stat_total")[key + ("out_of_buffer",)] == 7


def test_old_kernel_no_pma_keeps_everything_else(tmp_path) -> None:
    ib, _ = collector(tmp_path, "old-kernel-no-pma")
    coll = ib.collect()
    assert coll.errors == {"no_pma": len(PMA_COUNTERS)}
    assert values(coll, "gpumon_ib_port_data_received_bytes_total") == {}
    assert values(coll, "gpumon_ib_port_state") == {("mlx5_0", "1"): 4}
    assert len(values(coll, "gpumon_ib_hw_stat_total")) == 21


def test_include_and_exclude_devices(tmp_path) -> None:
    ib, _ = collector(tmp_path, "nd-h100-v5", include_devices=r"^mlx5_ib[0-3]$", exclude_devices="ib2")
    devices = {k[0] for k in values(ib.collect(), "gpumon_ib_port_up")}
    assert devices == {"mlx5_ib0", "mlx5_ib1", "mlx5_ib3"}
    eth_off, _ = collector(tmp_path / "b", "nd-h100-v5", exclude_devices="^mlx5_an")
    assert "mlx5_an0" not in {k[0] for k in values(eth_off.collect(), "gpumon_ib_port_up")}


def test_down_port_reports_state_and_not_up(tmp_path) -> None:
    ib, fabric = collector(tmp_path, "hbv4")
    fabric.set_down("mlx5_ib0", 1)
    coll = ib.collect()
    key = ("mlx5_ib0", "1")
    assert (values(coll, "gpumon_ib_port_state")[key], values(coll, "gpumon_ib_port_phys_state")[key]) == (1, 2)
    assert values(coll, "gpumon_ib_port_up")[key] == 0


def test_every_metric_produced_is_declared(tmp_path) -> None:
    ib, fabric = collector(tmp_path, "saturated-link-downed")
    declared = {s.name: s for s in InfinibandCollector.metrics()}
    coll = ib.collect()
    for fam in coll.families:
        assert declared[fam.name] == fam.spec
        for sample in fam.samples:
            assert tuple(k for k, _ in sample.labels) == fam.spec.labels
            assert type(sample.value) is float  # renderers rely on it
    assert len(declared) == len(InfinibandCollector.metrics())
    assert sorted(PROFILES)  # every profile is covered by the parametrized tests above


def test_state_texts_the_kernel_prints_parse() -> None:
    from gpumon.sources.ib_sysfs import PHYS_STATE_NAMES, STATE_NAMES, parse_state

    assert parse_state("4: ACTIVE\n", STATE_NAMES) == 4
    assert parse_state("5: LinkUp\n", PHYS_STATE_NAMES) == 5
    assert parse_state("7: Phy Test\n", PHYS_STATE_NAMES) == 7
    assert parse_state("0: <unknown>\n", PHYS_STATE_NAMES) == 0   # what phys_state_show prints for 0
