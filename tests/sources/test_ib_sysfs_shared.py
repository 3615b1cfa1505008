"""The InfiniBand sysfs library serves both IB collectors: one device filter and read mode in
[infiniband] for both (the [linkflap] copies still honoured, with a warning), and no collector or
sink reaches into a collector for what the library knows."""

from __future__ import annotations

import ast
import logging
import os

from gpumon.collectors.base import Context
from gpumon.collectors.infiniband import OPTIONS as IB_OPTIONS
from gpumon.collectors.linkflap import OPTIONS as LINKFLAP_OPTIONS
from gpumon.collectors.linkflap import LinkflapCollector
from gpumon.config import DAEMON, load
from gpumon.model import Collection
from gpumon.simulate.sysfs import build_tree
from gpumon.sources import ib_sysfs
from tests.conftest import REPO


def watched_devices(tmp_path, toml: str, environ: dict[str, str] | None = None) -> set[str]:
    fabric = build_tree("nd-h100-v5", str(tmp_path / "sys"))
    path = tmp_path / "gpumon.toml"
    path.write_text(toml)
    config = load([DAEMON, IB_OPTIONS, LINKFLAP_OPTIONS], str(path), environ=environ or {})
    ctx = Context("host", sysfs_root=fabric.root, state_dir=str(tmp_path / "state"), config=config)
    watcher = LinkflapCollector(ctx, config["linkflap"])
    coll: Collection = watcher.collect()
    watcher.close()
    fam = next(f for f in coll.families if f.name == "gpumon_ib_link_flaps_total")
    return {dict(s.labels)["device"] for s in fam.samples}


def test_the_infiniband_device_filter_applies_to_the_watcher(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="gpumon.collectors.linkflap"):
        devices = watched_devices(tmp_path, '[infiniband]\ninclude_devices = "^mlx5_ib[0-3]$"\n'
                                            'exclude_devices = "ib2"\n')
    assert devices == {"mlx5_ib0", "mlx5_ib1", "mlx5_ib3"}
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]


def test_a_linkflap_copy_is_still_honoured_with_a_warning_naming_the_new_key(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="gpumon.collectors.linkflap"):
        devices = watched_devices(tmp_path, '[infiniband]\nexclude_devices = "^mlx5_an"\n',
                                  environ={"GPUMON_LINKFLAP_EXCLUDE_DEVICES": "^mlx5_ib[1-7]$"})
    assert devices == {"mlx5_ib0", "mlx5_an0"}
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(warnings) == 1 and "[infiniband] exclude_devices" in warnings[0]


def test_library_quirks_without_a_collector():
    assert ib_sysfs.saturated(255, 8) and not ib_sysfs.saturated(254, 8)
    assert not ib_sysfs.saturated((1 << 64) - 1, 64)  # 64-bit counters wrap, never stick
    assert ib_sysfs.counter_width("port_xmit_wait", hw=False) == 32
    assert ib_sysfs.counter_width("out_of_buffer", hw=True) == 32
    assert ib_sysfs.counter_width("np_cnp_sent", hw=True) == 64
    assert ib_sysfs.PMA_BY_FILE["port_rcv_data"].scale == 4


def imports_of(path: str) -> set[str]:
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_ib_modules_import_no_collector_but_their_own_base():
    for module in ("collectors/infiniband.py", "collectors/linkflap.py", "sinks/azure_monitor/rows.py",
                   "simulate/sysfs.py", "sources/ib_sysfs.py", "flaps.py"):
        found = imports_of(os.path.join(REPO, "gpumon", module))
        bad = sorted(m for m in found if m.startswith("gpumon.collectors.")
                     and not m.startswith("gpumon.collectors.base"))
        assert not bad, f"gpumon/{module} imports {bad}"
