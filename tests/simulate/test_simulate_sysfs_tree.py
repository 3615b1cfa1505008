"""The simulated sysfs trees: real layout with symlinks, the profiles' shapes, and live behaviour."""

from __future__ import annotations

import os

import pytest

from gpumon.simulate.sysfs import PROFILES, UnknownTreeProfile, build_tree


def read(path: str) -> str:
    with open(path, encoding="ascii") as fh:
        return fh.read().strip()


def ports_of(root: str) -> dict[str, str]:
    base = os.path.join(root, "class", "infiniband")
    return {d: read(os.path.join(base, d, "ports", "1", "link_layer")) for d in sorted(os.listdir(base))}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_profile_has_the_real_layout(tmp_path, profile) -> None:
    root = str(tmp_path)
    build_tree(profile, root)
    base = os.path.join(root, "class", "infiniband")
    for device in os.listdir(base):
        link = os.path.join(base, device)
        assert os.path.islink(link)
        assert os.readlink(link).startswith("../../devices/pci")
        assert os.path.realpath(link).endswith(f"/infiniband/{device}")
        for name in ("fw_ver", "board_id", "hca_type", "node_guid"):
            assert read(os.path.join(link, name))
        assert len(read(os.path.join(link, "node_guid")).split(":")) == 4
        port = os.path.join(link, "ports", "1")
        assert read(os.path.join(port, "state")) == "4: ACTIVE"
        assert read(os.path.join(port, "phys_state")) == "5: LinkUp"
        assert read(os.path.join(port, "rate")).endswith(")")
        assert "link_downed" in os.listdir(os.path.join(port, "counters"))
        nets = os.listdir(os.path.join(link, "device", "net"))
        assert len(nets) == 1
        assert os.path.islink(os.path.join(root, "class", "net", nets[0]))
        assert read(os.path.join(link, "device", "net", nets[0], "carrier_changes")).isdigit()


def test_azure_profiles_shapes(tmp_path) -> None:
    a100 = ports_of(build_tree("nd-a100-v4", str(tmp_path / "a")).root)
    assert a100 == {**{f"mlx5_ib{i}": "InfiniBand" for i in range(8)}, "mlx5_an0": "Ethernet"}
    h100 = build_tree("nd-h100-v5", str(tmp_path / "h"))
    assert read(os.path.join(h100.port_dir("mlx5_ib0"), "rate")) == "400 Gb/sec (4X NDR)"
    assert read(os.path.join(h100.port_dir("mlx5_an0"), "rate")) == "100 Gb/sec (4X EDR)"
    a100_rate = read(os.path.join(str(tmp_path / "a"), "class/infiniband/mlx5_ib3/ports/1/rate"))
    assert a100_rate == "200 Gb/sec (4X HDR)"
    assert read(os.path.join(str(tmp_path / "a"), "class/infiniband/mlx5_an0/ports/1/rate")).startswith("40 ")
    assert set(ports_of(build_tree("hbv4", str(tmp_path / "b")).root)) == {"mlx5_ib0", "mlx5_an0"}
    assert set(ports_of(build_tree("plain-mlx5", str(tmp_path / "p")).root)) == {"mlx5_0"}


def test_fault_profiles(tmp_path) -> None:
    old = build_tree("old-kernel-no-pma", str(tmp_path / "o"))
    counters = os.path.join(old.port_dir("mlx5_0"), "counters")
    assert {read(os.path.join(counters, n)) for n in os.listdir(counters)} == {"N/A (no PMA)"}
    sat = build_tree("saturated-link-downed", str(tmp_path / "s"))
    assert read(os.path.join(sat.port_dir("mlx5_ib0"), "counters", "link_downed")) == "255"
    bare = build_tree("no-hw-counters", str(tmp_path / "n"))
    assert not os.path.exists(os.path.join(bare.port_dir("mlx5_0"), "hw_counters"))
    with pytest.raises(UnknownTreeProfile):
        build_tree("nd-z100", str(tmp_path / "z"))


@pytest.mark.parametrize("count", [1, 9, 18, 36])
def test_ports_scales_the_ib_devices(tmp_path, count) -> None:
    fabric = build_tree("nd-h100-v5", str(tmp_path), ports=count)
    assert len(fabric.port_keys) == count + 1  # plus mlx5_an0
    assert len(os.listdir(os.path.join(str(tmp_path), "class", "infiniband"))) == count + 1


def test_tick_grows_traffic_and_narrow_counters_stick_at_their_maximum(tmp_path) -> None:
    fabric = build_tree("plain-mlx5", str(tmp_path))
    counters = os.path.join(fabric.port_dir("mlx5_0"), "counters")
    before = int(read(os.path.join(counters, "port_xmit_data")))
    fabric.tick(1.0)
    after = int(read(os.path.join(counters, "port_xmit_data")))
    # 200 Gb/s at 35 % +-20 % load: about 2.2 GB/s in 4-byte words.
    assert 200e9 / 8 * 0.2 / 4 < after - before < 200e9 / 8 * 0.5 / 4
    fabric.set_counter("mlx5_0", 1, "port_xmit_wait", (1 << 32) - 10)
    fabric.tick(10.0)
    assert int(read(os.path.join(counters, "port_xmit_wait"))) == (1 << 32) - 1
    for _ in range(300):
        fabric.flap("mlx5_0", 1)
    assert read(os.path.join(counters, "link_downed")) == "255"
    assert read(os.path.join(counters, "link_error_recovery")) == "0"  # a flap is a failed recovery


def test_flap_bumps_counters_without_touching_state(tmp_path) -> None:
    fabric = build_tree("hbv4", str(tmp_path))
    pdir = fabric.port_dir("mlx5_ib0")
    ndir = fabric.netdev_dir("mlx5_ib0")
    carrier = int(read(os.path.join(ndir, "carrier_changes")))
    fabric.flap("mlx5_ib0", 1)
    assert read(os.path.join(pdir, "state")) == "4: ACTIVE"
    assert read(os.path.join(pdir, "counters", "link_downed")) == "1"
    assert int(read(os.path.join(ndir, "carrier_changes"))) == carrier + 2


def test_timed_and_open_ended_port_down(tmp_path) -> None:
    fabric = build_tree("hbv4", str(tmp_path))
    pdir = fabric.port_dir("mlx5_ib0")
    data = os.path.join(pdir, "counters", "port_rcv_data")
    fabric.set_down("mlx5_ib0", 1, seconds=3)
    assert (read(os.path.join(pdir, "state")), read(os.path.join(pdir, "phys_state"))) == ("1: DOWN", "2: Polling")
    frozen = read(data)
    fabric.tick(2)
    assert read(os.path.join(pdir, "state")) == "1: DOWN" and read(data) == frozen
    fabric.tick(1)
    assert read(os.path.join(pdir, "state")) == "4: ACTIVE"
    fabric.set_down("mlx5_ib0", 1, seconds=0)
    fabric.tick(1000)
    assert read(os.path.join(pdir, "state")) == "1: DOWN"
    fabric.set_up("mlx5_ib0", 1)
    assert read(os.path.join(pdir, "state")) == "4: ACTIVE"
    assert read(os.path.join(pdir, "counters", "link_downed")) == "2"
    assert read(os.path.join(fabric.netdev_dir("mlx5_ib0"), "carrier_changes")) == str(2 + 4)


def test_unplug_and_replug(tmp_path) -> None:
    fabric = build_tree("nd-a100-v4", str(tmp_path))
    fabric.unplug("mlx5_ib5")
    assert "mlx5_ib5" not in os.listdir(os.path.join(str(tmp_path), "class", "infiniband"))
    fabric.tick(1)  # an absent device is not written
    assert not os.path.exists(fabric.device_dir("mlx5_ib5"))
    fabric.replug("mlx5_ib5")
    assert read(os.path.join(str(tmp_path), "class/infiniband/mlx5_ib5/ports/1/state")) == "4: ACTIVE"


def test_writes_are_replacements_so_a_reader_never_sees_a_torn_value(tmp_path) -> None:
    fabric = build_tree("plain-mlx5", str(tmp_path))
    path = os.path.join(fabric.port_dir("mlx5_0"), "counters", "port_rcv_data")
    inode = os.stat(path).st_ino
    fabric.tick(1)
    assert os.stat(path).st_ino != inode
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".tmp")]
