"""A PCI sysfs tree laid out as the kernel lays it out (bus/pci/devices links into
devices/pci0000:00/<root port>/<switch up>/<switch down>/<endpoint>, class/infiniband/<dev>/device),
with aer_dev_* files from tests/fixtures/aer (format: linux Documentation/ABI/testing/
sysfs-bus-pci-devices-aer_stats): GPUs, the HCA and the bridges above them."""

from __future__ import annotations

import os
import shutil

from tests.conftest import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures", "aer")


ROOT_PORT = "devices/pci0000:00/0000:00:01.0"


SWITCH = f"{ROOT_PORT}/0000:01:00.0/0000:02:00.0"


FUNCTIONS = {  # sysfs path -> (vendor, class)
    ROOT_PORT: ("0x8086", "0x060400"),
    f"{ROOT_PORT}/0000:01:00.0": ("0x1000", "0x060400"),
    SWITCH: ("0x1000", "0x060400"),
    f"{SWITCH}/0000:3b:00.0": ("0x10de", "0x030200"),       # H100 SXM: 3D controller
    f"{ROOT_PORT}/0000:01:00.0/0000:02:01.0": ("0x1000", "0x060400"),
    f"{ROOT_PORT}/0000:01:00.0/0000:02:01.0/0000:3c:00.0": ("0x15b3", "0x020700"),  # ConnectX-7 IB
    "devices/pci0000:80/0000:80:02.0": ("0x10de", "0x030000"),   # a VGA GPU straight on the root complex
    "devices/pci0000:80/0000:80:03.0": ("0x8086", "0x010802"),   # an NVMe drive: not watched
}


def build(root, aer: bool = True) -> None:
    for rel, (vendor, cls) in FUNCTIONS.items():
        path = root / rel
        path.mkdir(parents=True, exist_ok=True)
        (path / "vendor").write_text(vendor + "\n")
        (path / "class").write_text(cls + "\n")
        if aer:
            for name in ("aer_dev_correctable", "aer_dev_nonfatal", "aer_dev_fatal"):
                shutil.copy(os.path.join(FIXTURES, name), path / name)
        links = root / "bus" / "pci" / "devices"
        links.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(path, links), links / path.name)
    if aer:
        for severity, n in (("cor", 7), ("fatal", 0), ("nonfatal", 1)):
            (root / ROOT_PORT / f"aer_rootport_total_err_{severity}").write_text(f"{n}\n")
    ib = root / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:01:00.0" / "0000:02:01.0" / "0000:3c:00.0" / "infiniband" / "mlx5_0"
    ib.mkdir(parents=True)
    os.symlink("../..", ib / "device")
    (root / "class" / "infiniband").mkdir(parents=True)
    os.symlink(os.path.relpath(ib, root / "class" / "infiniband"), root / "class" / "infiniband" / "mlx5_0")
