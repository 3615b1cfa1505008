"""What each Azure GPU and HPC VM size should have: the expected inventory, as data.

Matched on IMDS ``compute.vmSize`` (case-insensitive; constrained-core variants such as
``Standard_HB176-96rs_v4`` match their family). Facts from the Azure size pages
(learn.microsoft.com/azure/virtual-machines/sizes/gpu-accelerated/* and .../high-performance-compute/*:
GPU count and model, "InfiniBand: ... 8x400 Gigabit NDR") and the GPUs' own PCIe specifications.
``gpu_model`` is a substring of the name NVML reports (``nvmlDeviceGetName``); ``ib_rate_gbps`` is per
InfiniBand port; a ``None`` PCIe figure is not checked (GB200's GPUs hang off Grace by NVLink-C2C).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Expected:
    family: str
    pattern: str  # a regular expression over vmSize
    gpus: int
    gpu_model: str = ""
    ib_ports: int = 0
    ib_rate_gbps: int = 0
    pcie_gen: int | None = None
    pcie_width: int | None = None

    def matches(self, vm_size: str) -> bool:
        return re.fullmatch(self.pattern, vm_size, flags=re.IGNORECASE) is not None

    def as_dict(self) -> dict[str, object]:
        return {"family": self.family, "gpus": self.gpus, "gpu_model": self.gpu_model,
                "ib_ports": self.ib_ports, "ib_rate_gbps": self.ib_rate_gbps,
                "pcie_gen": self.pcie_gen, "pcie_width": self.pcie_width}


SKUS: tuple[Expected, ...] = (
    Expected("ND H100 v5", r"Standard_ND96isr_H100_v5", 8, "H100 80GB HBM3", 8, 400, 5, 16),
    Expected("ND H200 v5", r"Standard_ND96isr_H200_v5", 8, "H200", 8, 400, 5, 16),
    Expected("ND A100 v4", r"Standard_ND96asr_v4", 8, "A100-SXM4-40GB", 8, 200, 4, 16),
    Expected("NDm A100 v4", r"Standard_ND96amsr_A100_v4", 8, "A100-SXM4-80GB", 8, 200, 4, 16),
    Expected("NC H100 v5 (1 GPU)", r"Standard_NC40ads_H100_v5", 1, "H100 NVL", 0, 0, 5, 16),
    Expected("NC H100 v5 (2 GPUs)", r"Standard_NC80adis_H100_v5", 2, "H100 NVL", 0, 0, 5, 16),
    Expected("NC A100 v4 (1 GPU)", r"Standard_NC24ads_A100_v4", 1, "A100 80GB PCIe", 0, 0, 4, 16),
    Expected("NC A100 v4 (2 GPUs)", r"Standard_NC48ads_A100_v4", 2, "A100 80GB PCIe", 0, 0, 4, 16),
    Expected("NC A100 v4 (4 GPUs)", r"Standard_NC96ads_A100_v4", 4, "A100 80GB PCIe", 0, 0, 4, 16),
    Expected("ND GB200 v6", r"Standard_ND128isr_NDR_GB200_v6", 4, "GB200", 4, 400, None, None),
    Expected("HBv4", r"Standard_HB176(-\d+)?rs_v4", 0, "", 1, 400),
    Expected("HX", r"Standard_HX176(-\d+)?rs", 0, "", 1, 400),
    Expected("HBv3", r"Standard_HB120(-\d+)?rs_v3", 0, "", 1, 200),
    Expected("HBv2", r"Standard_HB120(-\d+)?rs_v2", 0, "", 1, 200),
)


def expected_for(vm_size: str) -> Expected | None:
    """The expected inventory of a VM size, or None for a size gpumon has no data for."""
    for sku in SKUS:
        if sku.matches(vm_size):
            return sku
    return None
