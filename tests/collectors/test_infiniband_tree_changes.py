"""The IB tree changing under the collectors: a FIFO where an identity file should be never holds a
collector thread, and a port that goes away and comes back unchanged is read again."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from gpumon.collectors.base import Context
from gpumon.collectors.infiniband import InfinibandCollector
from gpumon.collectors.linkflap import LinkflapCollector
from gpumon.config import Section
from gpumon.model import Collection
from gpumon.simulate.sysfs import build_tree

GUID = "0015:5dff:fe34:003a"


def device_dir(root: str, device: str = "mlx5_0") -> str:
    return os.path.realpath(os.path.join(root, "class", "infiniband", device))


def make(tmp_path, kind: type, profile: str = "plain-mlx5"):
    fabric = build_tree(profile, str(tmp_path / "sys"))
    ctx = Context("host", sysfs_root=fabric.root, state_dir=str(tmp_path / "state"))
    return kind(ctx, Section(kind.name, {})), fabric


def collect_within(collector, seconds: float = 5.0) -> Collection:
    """Run collect() on its own thread; a run that blocks fails the test instead of hanging it."""
    result: list[Collection] = []
    thread = threading.Thread(target=lambda: result.append(collector.collect()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "collect() blocked"
    assert result, "collect() raised"
    return result[0]


def labels_of(coll: Collection, name: str) -> list[dict[str, str]]:
    fam = next((f for f in coll.families if f.name == name), None)
    return [dict(s.labels) for s in fam.samples] if fam is not None else []


def replace_with_fifo(path: str):
    os.unlink(path)
    os.mkfifo(path)
    return path


@pytest.fixture
def unblock():
    """Opens every FIFO a test made for writing at teardown, so a regressed (blocked) open returns."""
    fifos: list[str] = []
    yield fifos.append
    for path in fifos:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass


@pytest.mark.parametrize("kind", [InfinibandCollector, LinkflapCollector])
def test_a_fifo_as_node_guid_does_not_block_the_collector(tmp_path, unblock, kind):
    collector, fabric = make(tmp_path, kind)
    unblock(replace_with_fifo(os.path.join(device_dir(fabric.root), "node_guid")))
    coll = collect_within(collector)
    assert labels_of(coll, "gpumon_ib_link_flaps_total" if kind is LinkflapCollector else "gpumon_ib_port_up")
    collector.close()


def test_node_guid_fixed_after_a_fifo_is_read_on_the_next_run(tmp_path, unblock):
    ib, fabric = make(tmp_path, InfinibandCollector)
    path = os.path.join(device_dir(fabric.root), "node_guid")
    unblock(replace_with_fifo(path))
    coll = collect_within(ib)
    assert [info["node_guid"] for info in labels_of(coll, "gpumon_ib_port_info")] == [""]
    assert coll.errors.get("read", 0) >= 1  # counted, and logged once
    os.unlink(path)
    with open(path, "w", encoding="ascii") as fh:
        fh.write(GUID + "\n")
    coll = collect_within(ib)
    assert [info["node_guid"] for info in labels_of(coll, "gpumon_ib_port_info")] == [GUID]
    ib.close()


def two_port_device(fabric) -> str:
    """Give the fixture's HCA a second port, so netdevs are matched to ports by dev_port."""
    ports = os.path.join(device_dir(fabric.root), "ports")
    shutil.copytree(os.path.join(ports, "1"), os.path.join(ports, "2"))
    net = os.path.join(device_dir(fabric.root), "device", "net")
    return os.path.join(net, sorted(os.listdir(net))[0], "dev_port")


@pytest.mark.parametrize("kind", [InfinibandCollector, LinkflapCollector])
def test_a_fifo_as_dev_port_does_not_block_the_collector(tmp_path, unblock, kind):
    collector, fabric = make(tmp_path, kind)
    unblock(replace_with_fifo(two_port_device(fabric)))
    coll = collect_within(collector)
    name = "gpumon_ib_link_flaps_total" if kind is LinkflapCollector else "gpumon_ib_port_info"
    assert sorted(labels["port"] for labels in labels_of(coll, name)) == ["1", "2"]
    collector.close()


@pytest.mark.parametrize("kind", [InfinibandCollector, LinkflapCollector])
def test_a_port_that_goes_away_and_comes_back_unchanged_is_read_again(tmp_path, kind):
    collector, fabric = make(tmp_path, kind)
    name = "gpumon_ib_link_flaps_total" if kind is LinkflapCollector else "gpumon_ib_port_up"
    assert [labels["port"] for labels in labels_of(collector.collect(), name)] == ["1"]
    ports = os.path.join(device_dir(fabric.root), "ports")
    aside = os.path.join(str(tmp_path), "port-1-aside")
    os.rename(os.path.join(ports, "1"), aside)
    collector.collect()  # notices the files are gone
    assert labels_of(collector.collect(), name) == []
    os.rename(aside, os.path.join(ports, "1"))
    assert [labels["port"] for labels in labels_of(collector.collect(), name)] == ["1"]
    collector.close()
