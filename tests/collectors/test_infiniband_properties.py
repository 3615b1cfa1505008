"""Property tests over file contents and tree shapes: the collectors never raise, every bad value
is counted, every good value is exported."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumon.collectors.base import CollectorUnavailable, Context
from gpumon.collectors.infiniband import PMA_COUNTERS, InfinibandCollector
from gpumon.collectors.linkflap import LinkflapCollector
from gpumon.simulate.sysfs import build_tree
from gpumon.sources.ib_sysfs import HW_COUNTER_WIDTHS

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DIGITS = re.compile(r"[0-9]+")
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30)


def good_counter(width: int):
    return st.integers(0, (1 << width) - 1).flatmap(
        lambda n: st.sampled_from([f"{n}\n", f"{n}", f" {n} \n"]).map(lambda text: ("good", text, n)))


def bad_counter(width: int):
    return st.one_of(
        st.sampled_from(["", "\n", "N/A (no PMA)\n", "-1\n", "0x1f\n", "1.5\n", "12 34\n"]),
        TEXT.filter(lambda t: DIGITS.fullmatch(t.strip()) is None),
        st.integers(1 << width, 1 << 80).map(lambda n: f"{n}\n"),
    ).map(lambda text: ("bad", text, None))


PMA_FILES = [(c.file, c.metric, c.width, c.scale) for c in PMA_COUNTERS]
HW_FILES = sorted(HW_COUNTER_WIDTHS)


@st.composite
def contents(draw):
    """A subset of the port's counter files, each given good or bad content."""
    chosen = {}
    for file, metric, width, scale in draw(st.lists(st.sampled_from(PMA_FILES), unique=True, max_size=8)):
        chosen[("counters", file)] = (metric, scale, draw(st.one_of(good_counter(width), bad_counter(width))))
    for file in draw(st.lists(st.sampled_from(HW_FILES), unique=True, max_size=5)):
        chosen[("hw_counters", file)] = (file, 1, draw(st.one_of(good_counter(32), bad_counter(32))))
    return chosen


def by_labels(coll, name: str) -> dict[tuple, float]:
    for fam in coll.families:
        if fam.name == name:
            return {tuple(v for _, v in s.labels): s.value for s in fam.samples}
    return {}


@SETTINGS
@given(contents())
def test_every_bad_value_counted_every_good_value_exported(chosen) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fabric = build_tree("plain-mlx5", tmp)
        pdir = fabric.port_dir("mlx5_0")
        for (sub, file), (_, _, (_, text, _)) in chosen.items():
            with open(os.path.join(pdir, sub, file), "w", encoding="utf-8") as fh:
                fh.write(text)
        coll = InfinibandCollector(Context("h", sysfs_root=tmp, state_dir=os.path.join(tmp, "s"))).collect()
        bad = sum(1 for _, _, (kind, _, _) in chosen.values() if kind == "bad")
        assert sum(coll.errors.values()) == bad
        hw = by_labels(coll, "gpumon_ib_hw_stat_total")
        for (sub, file), (metric, scale, (kind, _, value)) in chosen.items():
            if sub == "counters":
                exported = by_labels(coll, metric).get(("mlx5_0", "1"))
            else:
                exported = hw.get(("mlx5_0", "1", file))
            if kind == "good":
                assert exported == float(value * scale), (file, exported)  # samples are float64
            else:
                assert exported is None, file
        # Every file not touched is still there.
        assert len(hw) == 21 - sum(1 for (sub, _), (_, _, (k, _, _)) in chosen.items()
                                   if sub == "hw_counters" and k == "bad")


STATE_TEXT = st.one_of(
    st.sampled_from(["4: ACTIVE\n", "1: DOWN\n", "2: INIT", "5: LinkUp\n", "2: Polling\n", "7: Phy Test\n"]),
    TEXT,
)


@SETTINGS
@given(STATE_TEXT, STATE_TEXT, st.one_of(st.sampled_from(["400 Gb/sec (4X NDR)\n", "2.5 Gb/sec (1X SDR)"]), TEXT))
def test_state_and_rate_files_never_break_a_run(state, phys, rate) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fabric = build_tree("plain-mlx5", tmp)
        pdir = fabric.port_dir("mlx5_0")
        for name, text in (("state", state), ("phys_state", phys), ("rate", rate)):
            with open(os.path.join(pdir, name), "w", encoding="utf-8") as fh:
                fh.write(text)
        ctx = Context("h", sysfs_root=tmp, state_dir=os.path.join(tmp, "s"))
        coll = InfinibandCollector(ctx).collect()
        exported = sum(1 for n in ("gpumon_ib_port_state", "gpumon_ib_port_phys_state",
                                   "gpumon_ib_port_rate_bytes_per_second") if by_labels(coll, n))
        assert exported + sum(coll.errors.values()) == 3
        assert by_labels(coll, "gpumon_ib_port_data_received_bytes_total")
        watch = LinkflapCollector(ctx).collect()
        assert len(by_labels(watch, "gpumon_ib_link_flaps_total")) == 1


NAME = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
FILE_KIND = st.sampled_from(["value", "missing", "dir", "empty", "junk"])


@st.composite
def trees(draw):
    devices = {}
    for name in draw(st.lists(NAME, unique=True, max_size=4)):
        shape = draw(st.sampled_from(["normal", "dangling", "ports_file", "no_ports", "plain_dir"]))
        ports = draw(st.lists(st.sampled_from(["1", "2", "3", "x"]), unique=True, max_size=3))
        files = {f: draw(FILE_KIND) for f in ("state", "phys_state", "rate", "link_layer",
                                              "counters/link_downed", "counters/port_rcv_data",
                                              "hw_counters/out_of_buffer")}
        devices[name] = (shape, ports, files, draw(st.booleans()))
    return devices


def write_tree(root: str, devices) -> int:
    """Write a tree; return how many port directories the collector can find."""
    base = os.path.join(root, "class", "infiniband")
    os.makedirs(base)
    findable = 0
    for name, (shape, ports, files, with_net) in devices.items():
        real = os.path.join(root, "devices", "pci0000:00", name, "infiniband", name)
        link = os.path.join(base, name)
        if shape == "dangling":
            os.symlink(os.path.relpath(real, base), link)
            continue
        target = link if shape == "plain_dir" else real
        os.makedirs(target)
        if shape != "plain_dir":
            os.symlink(os.path.relpath(real, base), link)
        if shape == "ports_file":
            Path(target, "ports").touch()
            continue
        if shape == "no_ports":
            continue
        if with_net:
            os.makedirs(os.path.join(target, "device", "net", "ib0"))
        for port in ports:
            pdir = os.path.join(target, "ports", port)
            os.makedirs(os.path.join(pdir, "counters"))
            os.makedirs(os.path.join(pdir, "hw_counters"))
            findable += port.isdigit()
            for rel, kind in files.items():
                path = os.path.join(pdir, rel)
                if kind == "dir":
                    os.makedirs(path)
                elif kind != "missing":
                    text = {"value": {"state": "4: ACTIVE", "phys_state": "5: LinkUp",
                                      "rate": "200 Gb/sec (4X HDR)", "link_layer": "InfiniBand"}.get(rel, "7"),
                            "empty": "", "junk": "\x00\xff?"}[kind]
                    with open(path, "w", encoding="utf-8", errors="surrogateescape") as fh:
                        fh.write(text + "\n")
        if not ports:
            os.makedirs(os.path.join(target, "ports"))
    return findable


@SETTINGS
@given(trees())
def test_any_tree_shape_is_collected_without_raising(devices) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        findable = write_tree(tmp, devices)
        ctx = Context("h", sysfs_root=tmp, state_dir=os.path.join(tmp, "s"))
        for collector in (InfinibandCollector(ctx), LinkflapCollector(ctx)):
            try:
                coll = collector.collect()
            except CollectorUnavailable:
                assert not devices
                continue
            for fam in coll.families:
                for sample in fam.samples:
                    assert tuple(k for k, _ in sample.labels) == fam.spec.labels
            name = "gpumon_ib_port_info" if isinstance(collector, InfinibandCollector) \
                else "gpumon_ib_link_flaps_total"
            assert len(by_labels(coll, name)) == findable
            collector.close()
