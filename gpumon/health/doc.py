"""The rule, XID and VM-size tables of docs/health.md, generated from the data (a test keeps them in
sync): ``python -m gpumon.health.doc``."""

from __future__ import annotations

from gpumon.health.catalogue import RULES, XID_POLICY
from gpumon.health.skus import SKUS


def markdown() -> str:
    rules = ["| Rule | Severity | Action | Sticky | When |", "|---|---|---|---|---|"]
    rules += [f"| `{r.id}` | {r.level.label} | `{r.action}` | {'yes' if r.sticky else 'no'} | {r.summary} |"
              for r in RULES]
    xids = ["| XID | Severity | Action | Sticky |", "|---|---|---|---|"]
    xids += [f"| {k} | {v.level.label} | `{v.action}` | {'yes' if v.sticky else 'no'} |"
             for k, v in sorted(XID_POLICY.items())]
    skus = ["| VM size | `vmSize` (regular expression) | GPUs | GPU model (NVML name contains) | IB ports | "
            "IB rate | PCIe |", "|---|---|---|---|---|---|---|"]
    for e in SKUS:
        pcie = f"Gen{e.pcie_gen} x{e.pcie_width}" if e.pcie_gen else "not checked"
        rate = f"{e.ib_rate_gbps} Gb/s" if e.ib_rate_gbps else "-"
        skus.append(f"| {e.family} | `{e.pattern}` | {e.gpus} | {e.gpu_model or '-'} | {e.ib_ports} | {rate} | "
                    f"{pcie} |")
    return "\n\n".join("\n".join(t) for t in (rules, xids, skus)) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
