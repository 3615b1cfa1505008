"""Verdicts built by hand for the health-action tests, shaped as :class:`HealthStage` makes them."""

from __future__ import annotations

from gpumon.health.catalogue import Level, worst_action
from gpumon.health.stage import Verdict

REASONS = {"gpu.lost": "GPU 0 fell off the bus", "gpu.xid.48": "XID 48 (double-bit ECC) on GPU 0",
           "ib.port.down": "mlx5_ib0 port 1 is DOWN", "gpu.thermal_slowdown": "GPU 0 slowed down for temperature",
           "ib.port.flapping": "mlx5_ib0 port 1 flapped 5 times in 24 h"}


def _subject(rule: str, gpu: str) -> dict[str, str]:
    return {"device": "mlx5_ib0", "port": "1"} if rule.startswith("ib.") else {"gpu": gpu}


def verdict(level: str, *findings: tuple[str, str], gpu: str = "0", time: float = 1_000_000.0) -> Verdict:
    """A verdict at ``level`` ("ok", "degraded", "unhealthy") with findings given as (rule, action)."""
    lvl = {"ok": Level.OK, "degraded": Level.DEGRADED, "unhealthy": Level.UNHEALTHY}[level]
    found = tuple({"rule": rule, "subject": _subject(rule, gpu), "severity": lvl.label, "action": action,
                   "reason": REASONS.get(rule, f"{rule} on GPU {gpu}"), "sticky": False, "since": time,
                   "last_seen": time} for rule, action in findings)
    return Verdict(lvl, worst_action([a for _, a in findings]) if findings else "none", found, "ND H100 v5", time)
