"""The health stage of the loop: each Snapshot in, the node's verdict, its series and events out.

Not a collector (it reads no source): the loop feeds it every composed Snapshot. It applies the
rules, keeps sticky and held verdicts (:mod:`gpumon.health.state`), compares the node with what its
VM size should have (:mod:`gpumon.health.skus`, or the first healthy run as a baseline on a size it
does not know) and reports each change of the verdict once as a ``health_changed`` event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpumon.catalogue import gpu as gpu_metrics
from gpumon.catalogue import host as host_metrics
from gpumon.catalogue import infiniband as ib_metrics
from gpumon.catalogue.daemon import ACTION_FAILURES, ACTION_RUNS, GHR_REPORTS
from gpumon.catalogue.daemon import HEALTH_STATE as STATE
from gpumon.catalogue.daemon import NODE_HEALTH as NODE
from gpumon.health.catalogue import REMEDIATION_ACTIONS, Level, worst_action
from gpumon.health.faultcodes import with_code
from gpumon.health.rules import Evaluator, Finding, History, Thresholds
from gpumon.health.skus import Expected, expected_for
from gpumon.health.state import Active, HealthState, StateStore, boot_id
from gpumon.model import Event, MetricFamily, Sample, Severity, Snapshot

log = logging.getLogger(__name__)

SAVE_EVERY = 60.0
_SEVERITY = {Level.OK: Severity.INFO, Level.DEGRADED: Severity.WARNING, Level.UNHEALTHY: Severity.CRITICAL}


@dataclass(frozen=True)
class Verdict:
    level: Level
    action: str
    findings: tuple[dict[str, Any], ...]
    sku: str
    time: float
    #: findings (sticky ones, mostly) about a GPU this host no longer has (another UUID at that index,
    #: or none): listed for the operator to read and clear, counted in neither the level nor the action
    stale: tuple[dict[str, Any], ...] = ()
    facts: dict[str, Any] = field(default_factory=dict, compare=False)
    """What the actions may tell others about the hardware, not part of the verdict itself:
    ``gpus`` (index -> uuid, serial, pci_bus_id, as last seen: a lost GPU drops out of NVML's
    answers) and ``physical_host`` (the KVP pool's name of the Azure host)."""

    @property
    def budget_spent(self) -> bool:
        """Whether the node's remediation budget is spent: an action that files (a report, a ticket)
        files nothing more; the node waits for its hardware to be replaced."""
        return any(f.get("rule") == "node.remediation_budget" for f in self.findings)

    def as_dict(self) -> dict[str, Any]:
        return {"status": {Level.OK: "healthy"}.get(self.level, self.level.label), "level": int(self.level),
                "action": self.action, "sku": self.sku, "time": self.time, "findings": list(self.findings),
                "stale": list(self.stale)}


@dataclass
class HealthResult:
    families: tuple[MetricFamily, ...]
    events: tuple[Event, ...]
    verdict: Verdict


@dataclass
class HealthSettings:
    thresholds: Thresholds = field(default_factory=Thresholds)
    hold_seconds: float = 300.0
    vm_size: str = ""


class HealthStage:
    """Thread-safe: the loop calls :meth:`update`; the endpoint and actions read :meth:`verdict`."""

    def __init__(self, state_dir: str, settings: HealthSettings,
                 clock: Callable[[], float] = time.time, boot: str | None = None, persist: bool = True) -> None:
        """``boot``: this boot's id (default: the kernel's; a simulated host's own). The VM size comes
        from the host identity the loop stamps on each snapshot (``[health] vm_size`` over it)."""
        self.settings = settings
        self.persist = persist  # ``gpumon once`` and ``gpumon health`` read the state, never write it
        self._clock = clock
        self._store = StateStore(state_dir, read_only=not persist)
        self._lock = threading.Lock()
        self._state = self._store.load()
        current_boot = boot_id() if boot is None else boot
        if self._state.boot_id and self._state.boot_id != current_boot:
            log.info("health: the host rebooted since the last verdict; sticky verdicts cleared")
            self._state.active.clear()
        self._state.boot_id = current_boot
        if persist:
            self._restored(clock())
        self._evaluator = Evaluator(settings.thresholds, history=History.from_dict(self._state.history))
        self._energy: dict[str, float] = {}
        self._saved_at = 0.0
        self._verdict = Verdict(Level.OK, "none", (), "", 0.0)
        self._gpus: dict[str, dict[str, str]] = {}
        self._physical_host = ""
        # a verdict restored from the state file asked for its remediation before the restart
        self._remediating = _remediation(self._make_verdict("", 0.0))
        self._node_key: tuple[int, tuple[str, ...]] | None = None
        self._actions: Any = None
        self._last_levels: tuple[dict, tuple[MetricFamily, ...]] | None = None

    def attach(self, actions: Any) -> None:
        """Hand every verdict to ``actions`` (``on_verdict``, ``stats``, ``close``: the health actions'
        runner); their counts join the health series."""
        self._actions = actions

    def close(self) -> None:
        if self._actions is not None:
            self._actions.close()

    def verdict(self) -> Verdict:
        with self._lock:
            return self._verdict

    def _restored(self, now: float) -> None:
        """The daemon starting: the verdicts it loads from the state directory say so (here, in
        /health and in ``gpumon health``) until it sees their condition itself."""
        for a in self._state.active.values():
            a.restored = True
        if self._state.active:
            log.warning("health: %d verdict(s) restored from %s (same boot; not seen again yet): %s",
                        len(self._state.active), self._store.path,
                        "; ".join(f"{a.rule}{_subject_text(a.subject)} {Level(a.level).label} ({a.reason}), "
                                  f"first seen {age_text(now - a.since)} ago"
                                  for a in sorted(self._state.active.values(), key=lambda a: a.key)))

    # -- the inventory to compare with ------------------------------------------------------------
    def _expected(self, snapshot: Snapshot, findings_unhealthy: bool) -> tuple[Expected | None, str]:
        # The VM size is worth asking IMDS for only while the GPUs are read: the SKU table is about GPU
        # VMs, and without GPUs the baseline (or [health] vm_size) holds the InfiniBand ports.
        size = self.settings.vm_size or (vm_size_of(snapshot) if _inventory_judged(snapshot) else "")
        if size is None:  # not known yet (IMDS has not answered): no inventory, and no baseline taken
            return None, ""
        sku = expected_for(size) if size else None
        if sku is not None:
            return sku, sku.family
        if self._state.baseline is not None and self._state.baseline.get("vm_size", size) != size:
            log.info("health: the VM size changed (%s -> %s): the baseline is taken again",
                     self._state.baseline.get("vm_size"), size)
            self._state.baseline = None
        if self._state.baseline is None and not findings_unhealthy and _settled(snapshot):
            self._state.baseline = {**_baseline(snapshot), "vm_size": size}
            log.info("health: no inventory known for VM size %r; this run is the baseline: %s",
                     size, self._state.baseline)
        if self._state.baseline is None:
            return None, ""
        b = self._state.baseline
        return Expected("baseline", "", int(b["gpus"]), str(b["gpu_model"]), int(b["ib_ports"]),
                        int(b["ib_rate_gbps"]), b.get("pcie_gen"), b.get("pcie_width")), "baseline"

    # -- one snapshot -----------------------------------------------------------------------------
    def update(self, snapshot: Snapshot) -> HealthResult:
        with self._lock:
            now = self._clock()
            if self._store.changed_elsewhere():
                self._reload_active()
            self._clear_reset_gpus(snapshot, now)
            self._learn_facts(snapshot)
            # the baseline is taken from a run with nothing unhealthy (judged by the rules that need
            # no inventory), so a node that starts broken is not taken as the norm
            self._evaluator.expected, sku = self._expected(snapshot, self._verdict.level is Level.UNHEALTHY
                                                           or self._unhealthy_without_inventory(snapshot, now))
            findings = self._evaluator.evaluate(snapshot, now)
            gpus = _gpus_present(snapshot)
            changed = self._apply(findings, now, gpus or {})
            self._mark_stale(gpus)
            verdict = self._make_verdict(sku, now)
            changed |= self._count_remediation(verdict, now)
            events = self._transition(verdict)
            self._verdict = verdict
            if changed or events or now - self._saved_at >= SAVE_EVERY:
                self._save(now)
            families = self._families(findings, verdict)
        if self._actions is not None:
            try:  # returns at once: the actions run on their own threads
                self._actions.on_verdict(verdict)
            except Exception:
                log.exception("health: handing the verdict to the actions failed")
            families += self._action_families()
        return HealthResult(families, events, verdict)

    def _action_families(self) -> tuple[MetricFamily, ...]:
        stats = self._actions.stats()
        families: tuple[MetricFamily, ...] = (
            MetricFamily(ACTION_RUNS, tuple(ACTION_RUNS.sample(v["runs"], k) for k, v in sorted(stats.items()))),
            MetricFamily(ACTION_FAILURES, tuple(ACTION_FAILURES.sample(v["failures"], k)
                                                for k, v in sorted(stats.items()))))
        outcomes_of = getattr(self._actions, "outcomes", None)
        outcomes = outcomes_of().get("azure_ghr") if outcomes_of is not None else None
        if outcomes:
            families += (MetricFamily(GHR_REPORTS, tuple(GHR_REPORTS.sample(n, outcome)
                                                         for outcome, n in sorted(outcomes.items()))),)
        return families

    def _unhealthy_without_inventory(self, snapshot: Snapshot, now: float) -> bool:
        if self._state.baseline is not None or self._evaluator.expected is not None:
            return False
        probe = Evaluator(self.settings.thresholds, history=History())
        return any(f.level is Level.UNHEALTHY for f in probe.evaluate(snapshot, now))

    def _apply(self, findings: list[Finding], now: float, gpus: dict[str, str]) -> bool:
        active = self._state.active
        changed = False
        seen = set()
        for f in findings:
            seen.add(f.key)
            current = active.get(f.key)
            if f.level > Level.OK:
                if current is None:
                    gpu = dict(f.subject).get("gpu")
                    active[f.key] = Active(f.rule, [list(p) for p in f.subject], int(f.level), f.action, f.reason,
                                           f.sticky, now, now, gpus.get(gpu, "") if gpu else "")
                    changed = True
                else:
                    changed |= current.level != int(f.level)
                    current.level, current.action, current.reason, current.last_seen = (
                        int(f.level), f.action, f.reason, now)
                    current.restored = False  # seen again: a live finding now
        for key, a in list(active.items()):
            if a.sticky or key in seen and a.last_seen == now:
                continue
            if now - a.last_seen >= self.settings.hold_seconds:
                del active[key]
                changed = True
        return changed

    def _count_remediation(self, verdict: Verdict, now: float) -> bool:
        """Remember each verdict that newly asks for the node to be taken out (a drain, a report), for
        the remediation budget; none once the budget is spent (nothing is filed again)."""
        wants, was = _remediation(verdict), self._remediating
        self._remediating = wants
        if not wants or was or any(a.rule == "node.remediation_budget" for a in self._state.active.values()):
            return False
        self._evaluator.history.remediations.append(now)
        return True

    def _clear_reset_gpus(self, snapshot: Snapshot, now: float) -> None:
        """A GPU whose energy counter went backwards was reset (or its driver reloaded): its sticky
        verdicts are repaired, and the repair is remembered (a fault that keeps coming back after
        resets is ``gpu.reset.repeated``)."""
        fam = snapshot.family(gpu_metrics.ENERGY.name)
        if fam is None:
            return
        for s in fam.samples:
            gpu = s.label("gpu") or ""
            before = self._energy.get(gpu)
            self._energy[gpu] = s.value
            if before is not None and s.value < before:
                gone = [k for k, a in self._state.active.items() if ["gpu", gpu] in a.subject]
                for key in gone:
                    del self._state.active[key]
                if gone:
                    log.info("health: GPU %s was reset; cleared %s", gpu, ", ".join(gone))
                    if any(not k.startswith("gpu.reset.repeated|") for k in gone):
                        self._evaluator.history.reset_times.setdefault(gpu, []).append(now)

    def _mark_stale(self, gpus: dict[str, str] | None) -> None:
        """A finding about a GPU index this host no longer has, or that now holds a GPU with another
        UUID, is stale: it says nothing about this hardware (a verdict restored on another machine's
        disk image, a GPU replaced while the node was down). Unknown while the GPU collector is down."""
        for a in self._state.active.values():
            gpu = next((v for k, v in a.subject if k == "gpu"), None)
            if gpus is None or gpu is None or not gpu.isdigit():
                a.stale = ""
            elif gpu not in gpus:
                a.stale = f"this host has no GPU {gpu} now"
            elif a.uuid and gpus[gpu] and gpus[gpu] != a.uuid:
                a.stale = f"GPU {gpu} is {gpus[gpu]} now; the finding was about {a.uuid}"
            else:
                a.stale = ""

    def _reload_active(self) -> None:
        with self._store.locked():
            saved = self._store.load()
        self._drop_cleared(saved, keep_unsaved=False)

    def _drop_cleared(self, saved: HealthState, keep_unsaved: bool) -> None:
        """Take ``gpumon health clear`` from the saved file: the verdicts it removed go, and their
        windows start afresh (a cleared ib.port.flapping comes back only on new flaps; clearing the
        remediation budget, after the hardware was replaced, starts its count again)."""
        if any(a.rule == "node.remediation_budget" and k not in saved.active for k, a in self._state.active.items()):
            self._evaluator.history.remediations.clear()
        kept = {}
        for key, a in self._state.active.items():
            if key in saved.active or (keep_unsaved and not a.sticky):
                kept[key] = a
            else:
                self._evaluator.history.forget(a.rule, a.subject)
        self._state.active = kept

    def _make_verdict(self, sku: str, now: float) -> Verdict:
        ordered = sorted(self._state.active.values(), key=lambda a: (-a.level, a.key))
        active = [a for a in ordered if not a.stale]
        level = Level(max((a.level for a in active), default=0))
        action = worst_action([a.action for a in active if a.level == level]) if active else "none"
        facts = {"gpus": {k: dict(v) for k, v in self._gpus.items()}, "physical_host": self._physical_host}
        return Verdict(level, action, tuple(a.as_dict(now) for a in active), sku, now,
                       tuple(a.as_dict(now) for a in ordered if a.stale), facts)

    def _learn_facts(self, snapshot: Snapshot) -> None:
        info = snapshot.family(gpu_metrics.INFO_SPEC.name)
        for s in info.samples if info else ():
            self._gpus[s.label("gpu") or ""] = {k: s.label(k) or "" for k in ("uuid", "serial", "pci_bus_id")}
        host = snapshot.family(host_metrics.HOST_INFO.name)
        for s in host.samples if host else ():
            self._physical_host = s.label("physical_host") or self._physical_host

    def _transition(self, verdict: Verdict) -> tuple[Event, ...]:
        key = (int(verdict.level), tuple(sorted(k for k, a in self._state.active.items() if not a.stale)))
        previous, self._node_key = self._node_key, key
        if previous is None and verdict.level is Level.OK:
            return ()  # a healthy start is not a change
        if previous == key:
            return ()
        was = Level(previous[0]) if previous else Level.OK
        reasons = "; ".join(with_code(f["reason"], f.get("fault_code"))
                            + (f" (restored from the state directory, first seen "
                               f"{age_text(f['age_seconds'])} ago)" if f["restored"] else "")
                            for f in verdict.findings) or "all rules ok"
        message = f"node health {was.label} -> {verdict.level.label} (action {verdict.action}): {reasons}"
        return (Event("health_changed", _SEVERITY[verdict.level], {}, message,
                      {"previous": was.label, "current": verdict.level.label, "action": verdict.action,
                       "fault_codes": list(dict.fromkeys(f["fault_code"] for f in verdict.findings
                                                         if f.get("fault_code"))),
                       "findings": [dict(f) for f in verdict.findings]}),)

    def _save(self, now: float) -> None:
        if not self.persist:
            return
        self._state.history = self._evaluator.history.as_dict()
        try:
            with self._store.locked():
                if self._store.changed_elsewhere():
                    self._drop_cleared(self._store.load(), keep_unsaved=True)
                self._store.save(self._state)
            self._saved_at = now
        except OSError as exc:
            if self._saved_at >= 0:
                log.warning("health: cannot save %s (%s); verdicts will not survive a restart",
                            self._store.path, exc)
            self._saved_at = -1.0

    def _families(self, findings: list[Finding], verdict: Verdict) -> tuple[MetricFamily, ...]:
        levels: dict[tuple[str, str, str, str], float] = {}
        for f in findings:
            subject = dict(f.subject)
            levels[(f.rule, subject.get("gpu", ""), subject.get("device", ""), subject.get("port", ""))] = 0.0
        for a in self._state.active.values():
            if a.stale:  # about hardware this host no longer has: no series for it
                continue
            subject = {k: v for k, v in a.subject}
            levels[(a.rule, subject.get("gpu", ""), subject.get("device", ""), subject.get("port", ""))] = a.level
        if self._last_levels is not None and self._last_levels[0] == levels:
            return self._last_levels[1]  # nothing moved: the same families (the renderer keeps its text)
        samples = tuple(Sample(tuple(zip(STATE.labels, key)), float(value)) for key, value in sorted(levels.items()))
        families = (MetricFamily(STATE, samples), MetricFamily(NODE, (Sample((), float(verdict.level)),)))
        self._last_levels = (levels, families)
        return families


def _gpus_present(snapshot: Snapshot) -> dict[str, str] | None:
    """GPU index -> UUID ("" when a lost GPU never told it) of the GPUs this host has now; None while
    that is unknown (the GPU collector is down or not running)."""
    status = next((s for s in snapshot.collectors if s.name == "nvml"), None)
    if status is None or (status.available and not status.ok):
        return None
    gpus: dict[str, str] = {}
    for name in (gpu_metrics.INFO_SPEC.name, gpu_metrics.LOST.name):
        fam = snapshot.family(name)
        for s in fam.samples if fam else ():
            gpu = s.label("gpu") or ""
            gpus[gpu] = gpus.get(gpu) or s.label("uuid") or ""
    return gpus


def _subject_text(subject: list[list[str]]) -> str:
    return "".join(f" {k}={v}" for k, v in subject)


def age_text(seconds: float) -> str:
    """``3d4h``, ``2h05m``, ``4m10s``, ``12s``: how long ago, for people."""
    s = int(max(0.0, seconds))
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _remediation(verdict: Verdict) -> bool:
    """Whether ``verdict`` takes the node out of service (Slurm drains it; a report files it)."""
    return verdict.level is Level.UNHEALTHY and verdict.action in REMEDIATION_ACTIONS


def _settled(snapshot: Snapshot) -> bool:
    """Whether this run can be the baseline: the GPU collector up (a driver still loading at boot
    must not make "no GPUs" the norm), InfiniBand up or without any source."""
    status = {s.name: s for s in snapshot.collectors}
    nvml, ib = status.get("nvml"), status.get("infiniband")
    return bool(snapshot.families) and (nvml is None or nvml.ok) and (ib is None or ib.ok or not ib.available)


def _baseline(snapshot: Snapshot) -> dict[str, Any]:
    """What this node has now, as the inventory to hold it to from here on."""
    def values(name: str) -> list[float]:
        fam = snapshot.family(name)
        return [s.value for s in fam.samples] if fam else []

    info = snapshot.family(gpu_metrics.INFO_SPEC.name)
    models = sorted({s.label("model") or "" for s in info.samples}) if info else []
    ports = snapshot.family(ib_metrics.SPEC_INFO.name)
    ib = [s for s in ports.samples if s.label("link_layer") == "InfiniBand"] if ports else []
    ib_keys = {(s.label("device"), s.label("port")) for s in ib}
    rates = snapshot.family(ib_metrics.SPEC_RATE.name)
    ib_rates = [s.value * 8 / 1e9 for s in rates.samples if (s.label("device"), s.label("port")) in ib_keys] \
        if rates else []
    widths, gens = values(gpu_metrics.PCIE_WIDTH.name), values(gpu_metrics.PCIE_GEN_MAX.name)
    return {"gpus": len(info.samples) if info else 0, "gpu_model": models[0] if len(models) == 1 else "",
            "ib_ports": len(ib), "ib_rate_gbps": int(min(ib_rates)) if ib_rates else 0,
            "pcie_gen": int(min(gens)) if gens else None, "pcie_width": int(min(widths)) if widths else None}


__all__ = ["age_text", "HealthResult", "HealthSettings", "HealthStage", "HealthState", "Verdict", "NODE", "STATE"]


INVENTORY_COLLECTORS = frozenset({"nvml"})
"""The collectors for whose sake IMDS is asked for the VM size: the GPU inventory (``gpu.missing``,
``gpu.model``, PCIe width). With only the InfiniBand collectors, ``ib.port.missing`` and
``ib.port.rate`` hold the ports to the baseline, or to the SKU ``[health] vm_size`` names: an
InfiniBand-only host (off Azure, or an HB-series VM) asks IMDS nothing."""


def vm_size_of(snapshot: Snapshot) -> str | None:
    """The VM size the snapshot's host identity gives: None while the provider has not learnt it (no
    inventory, no baseline taken), "" off Azure; a snapshot no loop stamped is held to the baseline."""
    return snapshot.identity.vm_size() if snapshot.identity is not None else ""


def _inventory_judged(snapshot: Snapshot) -> bool:
    return any(c.name in INVENTORY_COLLECTORS and c.available for c in snapshot.collectors)
