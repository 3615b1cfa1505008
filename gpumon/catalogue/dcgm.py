"""dcgm-exporter's default counter set as gpumon metrics: each DCGM field, the gpumon metric (by
constant) its value comes from, and how it is scaled; the compat page (``[prometheus] compat =
"dcgm-exporter"``, :mod:`gpumon.sinks.prometheus.dcgm_compat`) renders it.

The fields are ``etc/default-counters.csv`` of NVIDIA/dcgm-exporter, read at commit d5e5f51,
2026-05-12, with their types and help as that file declares them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumon.catalogue.gpu import (
    ACTIVITY,
    CLOCK,
    ENERGY,
    GPM_PCIE,
    MEM_FREE,
    MEM_RESERVED,
    MEM_USED,
    MIG_ACTIVITY,
    MIG_MEM_TOTAL,
    MIG_MEM_USED,
    NVLINK_BYTES,
    PCIE_REPLAY,
    POWER,
    REMAP,
    REMAP_FAILURE,
    TEMP,
    UTIL,
    XID_TOTAL,
)
from gpumon.model import MetricSpec

MIB = 1024.0 * 1024.0


@dataclass(frozen=True)
class Field:
    """One dcgm-exporter field: where its value comes from in gpumon and how it is scaled."""

    name: str
    type: str  # "gauge" or "counter", as dcgm-exporter declares it
    help: str
    source: MetricSpec  # the gpumon family
    match: tuple[tuple[str, str], ...] = ()  # labels a gpumon sample must have
    scale: float = 1.0
    sum_over: str = ""  # a label summed away (per GPU totals)
    #: Under MIG: "gpu" repeats the GPU's value on each GPU instance (a device-wide field);
    #: "instance" serves the instance's own value from ``mig_source`` (absent without one).
    scope: str = "gpu"
    mig_source: MetricSpec | None = None
    mig_match: tuple[tuple[str, str], ...] = ()
    mig_minus: MetricSpec | None = None  # a family subtracted from ``mig_source`` (free = total - used)




# dcgm-exporter's default counter set, in its file's order. DCGM_FI_DEV_VGPU_LICENSE_STATUS is left
# out: Azure's ND/NC GPUs are passed through, not vGPU, so the field has no value there (as DCGM
# itself reports it blank and dcgm-exporter then skips the series).
FIELDS: tuple[Field, ...] = (
    Field("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).",
          CLOCK, (("clock", "sm"),), 1e-6),
    Field("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).",
          CLOCK, (("clock", "memory"),), 1e-6),
    Field("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).",
          TEMP, (("sensor", "memory"),)),
    Field("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).",
          TEMP, (("sensor", "gpu"),)),
    Field("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", POWER),
    Field("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
          "Total energy consumption since boot (in mJ).", ENERGY, (), 1000.0),
    Field("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.",
          PCIE_REPLAY),
    Field("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).",
          UTIL, (("engine", "gpu"),), 100.0, scope="instance"),
    Field("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).",
          UTIL, (("engine", "memory"),), 100.0, scope="instance"),
    Field("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).",
          UTIL, (("engine", "encoder"),), 100.0, scope="instance"),
    Field("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).",
          UTIL, (("engine", "decoder"),), 100.0, scope="instance"),
    Field("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).",
          MEM_FREE, (), 1 / MIB, scope="instance", mig_source=MIG_MEM_TOTAL, mig_minus=MIG_MEM_USED),
    Field("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).",
          MEM_USED, (), 1 / MIB, scope="instance", mig_source=MIG_MEM_USED),
    Field("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).",
          MEM_RESERVED, (), 1 / MIB, scope="instance"),
    Field("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
          "Total number of NVLink bandwidth counters for all lanes.",
          NVLINK_BYTES, (), 1.0, "direction"),
    Field("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
          "Number of remapped rows for uncorrectable errors",
          REMAP, (("cause", "uncorrectable"),)),
    Field("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors",
          REMAP, (("cause", "correctable"),)),
    Field("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed",
          REMAP_FAILURE),
    Field("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.",
          ACTIVITY, (("activity", "graphics"),), scope="instance", mig_source=MIG_ACTIVITY,
          mig_match=(("activity", "graphics"),)),
    Field("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active.",
          ACTIVITY, (("activity", "tensor"),), scope="instance", mig_source=MIG_ACTIVITY,
          mig_match=(("activity", "tensor"),)),
    Field("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
          "Ratio of cycles the device memory interface is active sending or receiving data.",
          ACTIVITY, (("activity", "dram_bandwidth"),), scope="instance",
          mig_source=MIG_ACTIVITY, mig_match=(("activity", "dram_bandwidth"),)),
    Field("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", "The rate of data transmitted over the PCIe bus - including "
          "both protocol headers and data payloads - in bytes per second.",
          GPM_PCIE, (("direction", "tx"),)),
    Field("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", "The rate of data received over the PCIe bus - including "
          "both protocol headers and data payloads - in bytes per second.",
          GPM_PCIE, (("direction", "rx"),)),
)
XID_FIELD = "DCGM_FI_DEV_XID_ERRORS"
XID_HELP = "Value of the last XID error encountered."
XID_SOURCE = XID_TOTAL
"""The family DCGM_FI_DEV_XID_ERRORS is made from: the last XID whose count rose."""
