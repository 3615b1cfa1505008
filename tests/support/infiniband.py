"""The infiniband collector on a simulated host's sysfs tree."""

from __future__ import annotations

from gpumon.collectors.base import Context
from gpumon.collectors.infiniband import InfinibandCollector
from gpumon.config import Section
from gpumon.simulate.sysfs import build_tree


def collector(tmp_path, profile: str, **options) -> tuple[InfinibandCollector, object]:
    fabric = build_tree(profile, str(tmp_path / "sys"))
    ctx = Context("host", sysfs_root=str(tmp_path / "sys"), state_dir=str(tmp_path / "state"))
    cfg = Section("infiniband", options) if options else None
    return InfinibandCollector(ctx, cfg), fabric
