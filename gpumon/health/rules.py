"""Rules over one Snapshot: what is wrong with this node right now, and what to do about it.

Reads only gpumon's own series (the catalogue in :mod:`gpumon.health.catalogue` names the rules);
keeps the little history some rules need (counter totals, flap and error windows) between calls.
Returns every evaluated (rule, subject) pair, ok ones included, so the health series can show 0.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpumon.catalogue import gpu as gpu_metrics
from gpumon.catalogue import host as host_metrics
from gpumon.catalogue import infiniband as ib_metrics
from gpumon.health.catalogue import RECOVERY_ACTIONS, RULE_BY_ID, XID_POLICY, Level, XidPolicy
from gpumon.health.skus import Expected
from gpumon.model import MetricFamily, Sample, Snapshot

Subject = tuple[tuple[str, str], ...]
IB_ERROR_COUNTERS = (ib_metrics.SYMBOL_ERRORS.name, ib_metrics.LINK_ERROR_RECOVERIES.name,
                     ib_metrics.LOCAL_LINK_INTEGRITY_ERRORS.name,
                     ib_metrics.EXCESSIVE_BUFFER_OVERRUN_ERRORS.name)
THERMAL_REASONS = ("hw_thermal_slowdown", "sw_thermal_slowdown")
WATCHED_COLLECTORS = ("nvml", "infiniband")
IB_STATE_ACTIVE = 4
# Page retirement (GPUs before Ampere) supports at most 64 retirements of the frame buffer (NVIDIA, "GPU
# memory error management: row remapping", page retirement vs row remapping); AzNHC's NHC2018
# ECCPageRetirementTableFull is that table full.
RETIRED_PAGES_MAX = 64
# NVLink fabric conditions that stop a GPU's NVLink traffic; the others slow it (nvml.h healthMask)
FABRIC_UNHEALTHY = frozenset({"route_unhealthy", "incorrect_configuration", "gfm_disconnected"})  # /sys/class/infiniband/*/ports/*/state "4: ACTIVE"


@dataclass(frozen=True)
class Finding:
    rule: str
    subject: Subject
    level: Level
    action: str
    reason: str
    sticky: bool = False

    @functools.cached_property
    def key(self) -> str:
        return self.rule + "".join(f"|{k}={v}" for k, v in self.subject)


@dataclass
class Thresholds:
    flap_threshold: int = 5  # NHC2005: 5 flaps in 24 h drains the node
    flap_window: float = 86400.0
    ib_error_threshold: float = 100.0
    ib_error_window: float = 3600.0
    disabled: frozenset[str] = frozenset()
    xids: Mapping[int, XidPolicy | None] = field(default_factory=dict)  # [health] xids; None: not a fault
    xid_repeat: frozenset[int] = frozenset({13, 31, 43})
    xid_repeat_threshold: int = 5
    xid_repeat_window: float = 86400.0
    xid_gpc_threshold: int = 2
    reset_repeat_threshold: int = 3
    reset_repeat_window: float = 7 * 86400.0
    remediation_budget: int = 5
    remediation_window: float = 7 * 86400.0

    def xid_policy(self, xid: int) -> XidPolicy | None:
        """The operator's classification of ``xid`` if any, else the catalogue's."""
        return self.xids[xid] if xid in self.xids else XID_POLICY.get(xid)


@dataclass
class History:
    """What the rules remember between snapshots (and the stage persists)."""

    xid_totals: dict[str, float] = field(default_factory=dict)
    flap_totals: dict[str, float] = field(default_factory=dict)
    flap_times: dict[str, list[float]] = field(default_factory=dict)
    ib_errors: dict[str, collections.deque] = field(default_factory=dict)
    # the rules that remember: when each repeat happened, kept across restarts
    xid_times: dict[str, list[float]] = field(default_factory=dict)  # "<gpu>|<xid>"
    gpc_times: dict[str, list[float]] = field(default_factory=dict)  # "<gpu>|<gpc>"
    reset_times: dict[str, list[float]] = field(default_factory=dict)  # "<gpu>": resets that cleared a fault
    remediations: list[float] = field(default_factory=list)  # verdicts that asked for a drain or a report

    def as_dict(self) -> dict:
        return {"xid_totals": self.xid_totals, "flap_totals": self.flap_totals, "flap_times": self.flap_times,
                "xid_times": self.xid_times, "gpc_times": self.gpc_times, "reset_times": self.reset_times,
                "remediations": self.remediations}

    def forget(self, rule: str, subject: Iterable[Iterable[str]]) -> None:
        """A cleared finding starts its window afresh: the flaps or errors counted so far are forgotten
        (the counter totals stay, so only new flaps or errors count from here on)."""
        key = "|".join(v for _, v in subject)
        if rule == "ib.port.flapping":
            self.flap_times.pop(key, None)
        elif rule == "ib.port.errors":
            self.ib_errors.pop(key, None)

    @classmethod
    def from_dict(cls, doc: Mapping) -> History:
        def floats(value: object) -> dict[str, float]:
            return {str(k): float(v) for k, v in value.items()} if isinstance(value, dict) else {}

        def times(value: object) -> dict[str, list[float]]:
            return ({str(k): [float(t) for t in v] for k, v in value.items() if isinstance(v, list)}
                    if isinstance(value, dict) else {})

        remediations = doc.get("remediations")
        return cls(floats(doc.get("xid_totals")), floats(doc.get("flap_totals")), times(doc.get("flap_times")),
                   xid_times=times(doc.get("xid_times")), gpc_times=times(doc.get("gpc_times")),
                   reset_times=times(doc.get("reset_times")),
                   remediations=[float(t) for t in remediations] if isinstance(remediations, list) else [])


def _recent(times: list[float], now: float, window: float) -> list[float]:
    """The times within ``window`` seconds before ``now``; a clock that jumped back drops none."""
    return [t for t in times if now - t <= window]


def _families(snapshot: Snapshot) -> dict[str, MetricFamily]:
    return {fam.name: fam for fam in snapshot.families}


def _samples(fams: Mapping[str, MetricFamily], name: str) -> tuple[Sample, ...]:
    fam = fams.get(name)
    return fam.samples if fam is not None else ()


def _gpu(sample: Sample) -> Subject:
    labels = sample.labels  # GPU series put gpu first (gpumon's naming rule): no search in the common case
    if labels and labels[0][0] == "gpu":
        return (labels[0],)
    return (("gpu", sample.label("gpu") or ""),)


def _port(sample: Sample) -> Subject:
    labels = sample.labels  # IB series start with device, port
    if len(labels) > 1 and labels[0][0] == "device" and labels[1][0] == "port":
        return (labels[0], labels[1])
    return (("device", sample.label("device") or ""), ("port", sample.label("port") or ""))


class Evaluator:
    """Applies the catalogue to snapshots; ``expected`` is the VM size's inventory (or a baseline)."""

    def __init__(self, thresholds: Thresholds, expected: Expected | None = None,
                 history: History | None = None) -> None:
        self.thresholds = thresholds
        self.expected = expected
        self.history = history or History()

    def evaluate(self, snapshot: Snapshot, now: float) -> list[Finding]:
        fams = _families(snapshot)
        out: list[Finding] = []
        out += self._gpu_rules(fams)
        out += self._xids(fams, now)
        out += self._gpcs(snapshot, fams, now)
        out += self._remembered(now)
        out += self._ib_rules(fams, now)
        out += self._inventory(fams, _judgeable(snapshot))
        out += self._collectors(snapshot)
        off = self.thresholds.disabled
        return [f for f in out if f.rule not in off and not (f.rule.startswith("gpu.xid.") and "gpu.xid" in off)]

    # -- GPUs --------------------------------------------------------------------------------
    def _flag(self, rule: str, subject: Subject, bad: bool, reason: str, action: str | None = None,
              level: Level | None = None) -> Finding:
        spec = RULE_BY_ID[rule]
        if not bad:
            return Finding(rule, subject, Level.OK, "none", "", spec.sticky)
        return Finding(rule, subject, level or spec.level, action or spec.action, reason, spec.sticky)

    def _gpu_rules(self, fams: Mapping[str, MetricFamily]) -> list[Finding]:
        out = []
        for s in _samples(fams, gpu_metrics.LOST.name):
            out.append(self._flag("gpu.lost", _gpu(s), s.value >= 1, f"GPU {s.label('gpu')} fell off the bus "
                                  "(NVML answers GPU_IS_LOST)"))
        for s in _samples(fams, gpu_metrics.REMAP_FAILURE.name):
            out.append(self._flag("gpu.row_remap.failure", _gpu(s), s.value >= 1,
                                  f"GPU {s.label('gpu')}: row remapping failed"))
        retired: dict[Subject, float] = {}
        for s in _samples(fams, gpu_metrics.RETIRED.name):
            retired[_gpu(s)] = retired.get(_gpu(s), 0.0) + s.value
        for subject, pages in sorted(retired.items()):
            out.append(self._flag("gpu.retired_pages.full", subject, pages >= RETIRED_PAGES_MAX,
                                  f"GPU {subject[0][1]}: {int(pages)} pages retired, all its page "
                                  f"retirement table holds ({RETIRED_PAGES_MAX})"))
        for s in _samples(fams, gpu_metrics.REMAP_PENDING.name):
            out.append(self._flag("gpu.row_remap.pending", _gpu(s), s.value >= 1,
                                  f"GPU {s.label('gpu')}: a row remap is pending a GPU reset"))
        for s in _samples(fams, gpu_metrics.RECOVERY.name):
            code = int(s.value)
            out.append(self._flag("gpu.recovery_action", _gpu(s), code > 0,
                                  f"GPU {s.label('gpu')}: the driver asks for recovery action {code}",
                                  action=RECOVERY_ACTIONS.get(code, "reset_gpu"),
                                  level=Level.DEGRADED if code == 3 else None))
        for s in _samples(fams, gpu_metrics.ECC.name):
            if s.label("type") == "uncorrected" and s.label("counter") == "volatile":
                out.append(self._flag("gpu.ecc.uncorrectable", _gpu(s), s.value > 0,
                                      f"GPU {s.label('gpu')}: {int(s.value)} uncorrectable ECC errors since reset"))
        thermal: dict[Subject, bool] = {}
        for s in _samples(fams, gpu_metrics.CLOCK_REASON.name):
            if s.label("reason") in THERMAL_REASONS:
                thermal[_gpu(s)] = thermal.get(_gpu(s), False) or s.value >= 1
        for subject, hot in thermal.items():
            out.append(self._flag("gpu.thermal_slowdown", subject, hot,
                                  f"GPU {subject[0][1]} is slowed down for temperature"))
        out += self._pcie(fams)
        out += self._fabric(fams)
        return out

    def _fabric(self, fams: Mapping[str, MetricFamily]) -> list[Finding]:
        """NVLink fabric (GB200 and later; an H100 with NVSwitch answers COMPLETED and no health)."""
        out = []
        worst: dict[Subject, tuple[Level, list[str]]] = {}
        for s in _samples(fams, gpu_metrics.FABRIC_HEALTH.name):
            level, names = worst.get(_gpu(s), (Level.OK, []))
            if s.value >= 1:
                cond = s.label("condition") or ""
                names.append(cond)
                level = max(level, Level.UNHEALTHY if cond in FABRIC_UNHEALTHY else Level.DEGRADED)
            worst[_gpu(s)] = (level, names)
        for s in _samples(fams, gpu_metrics.FABRIC_SUMMARY.name):
            level, names = worst.get(_gpu(s), (Level.OK, []))
            summary = {2: (Level.UNHEALTHY, "summary unhealthy"), 3: (Level.DEGRADED, "limited capacity")}
            if int(s.value) in summary:
                extra, text = summary[int(s.value)]
                level, names = max(level, extra), [*names, text]
            worst[_gpu(s)] = (level, names)
        for subject, (level, names) in sorted(worst.items()):
            out.append(self._flag("gpu.fabric.health", subject, level > Level.OK,
                                  f"GPU {subject[0][1]}: NVLink fabric {', '.join(names)}", level=level))
        status = {_gpu(s): s.value for s in _samples(fams, gpu_metrics.FABRIC_STATUS.name)}
        for s in _samples(fams, gpu_metrics.FABRIC_STATE.name):
            state, code = int(s.value), status.get(_gpu(s), 0.0)
            bad = state in (1, 2) or (state == 3 and code != 0)
            what = {1: "not started", 2: "in progress"}.get(state, f"completed with NVML error {code:g}")
            out.append(self._flag("gpu.fabric.registration", _gpu(s), bad,
                                  f"GPU {s.label('gpu')}: NVLink fabric registration {what}"))
        return out

    def _pcie(self, fams: Mapping[str, MetricFamily]) -> list[Finding]:
        exp = self.expected
        if exp is None or exp.pcie_width is None or exp.pcie_gen is None:
            return []
        width = {_gpu(s): s.value for s in _samples(fams, gpu_metrics.PCIE_WIDTH.name)}
        gen_max = {_gpu(s): s.value for s in _samples(fams, gpu_metrics.PCIE_GEN_MAX.name)}
        out = []
        for subject in sorted(set(width) | set(gen_max)):
            w, g = width.get(subject), gen_max.get(subject)
            # The current generation drops while a GPU idles (power saving): only its width and its
            # maximum generation say the link trained down.
            bad = (w is not None and w < exp.pcie_width) or (g is not None and g < exp.pcie_gen)
            out.append(self._flag("gpu.pcie.degraded", subject, bad,
                                  f"GPU {subject[0][1]}: PCIe x{w or 0:g} Gen{g or 0:g}max, expected "
                                  f"x{exp.pcie_width} Gen{exp.pcie_gen}"))
        return out

    def _xids(self, fams: Mapping[str, MetricFamily], now: float) -> list[Finding]:
        """An XID whose count rose since the last look (NVML's and the kernel log's counters)."""
        out = []
        t = self.thresholds
        by_bus = _by_bus(fams)
        for name in (gpu_metrics.XID_TOTAL.name, host_metrics.KMSG_XIDS.name):
            for s in _samples(fams, name):
                xid_text = s.label("xid") or ""
                bus = s.label("pci_bus_id")
                gpu = s.label("gpu") or (by_bus.get(bus.lower(), "") if bus else "")
                key = f"{name}|{bus if bus is not None else gpu}|{xid_text}"
                before = self.history.xid_totals.get(key, 0.0)
                self.history.xid_totals[key] = s.value
                if not xid_text.isdigit() or s.value <= before:
                    continue
                where = f"GPU {gpu}" if gpu else f"the GPU at PCI {bus}"
                if int(xid_text) in t.xid_repeat:
                    times = self.history.xid_times.setdefault(f"{gpu or bus or ''}|{xid_text}", [])
                    times += [now] * int(min(s.value - before, t.xid_repeat_threshold))
                policy = t.xid_policy(int(xid_text))
                if policy is None:
                    continue
                out.append(Finding(f"gpu.xid.{xid_text}", (("gpu", gpu or bus or ""),), policy.level,
                                   policy.action, f"{where}: XID {xid_text}", policy.sticky))
        return out

    def _gpcs(self, snapshot: Snapshot, fams: Mapping[str, MetricFamily], now: float) -> list[Finding]:
        """XID 13/31 lines of the kernel log that name a GPC (``gpu_xid`` events with ``gpc``)."""
        by_bus = _by_bus(fams)
        for event in snapshot.events:
            attrs = event.attributes or {}
            if event.kind != "gpu_xid" or "gpc" not in attrs or int(attrs.get("xid", 0)) not in (13, 31):
                continue
            bus = str(event.subject.get("pci_bus_id", ""))
            gpu = str(event.subject.get("gpu", "")) or by_bus.get(bus.lower(), "") or bus
            self.history.gpc_times.setdefault(f"{gpu}|{attrs['gpc']}", []).append(event.time or now)
        return []

    def _remembered(self, now: float) -> list[Finding]:
        """The rules over what the history remembers: repeats of an XID or on a GPC, faults that come
        back after a GPU reset, and the node's remediation budget."""
        t = self.thresholds
        h = self.history
        out = []
        repeated: dict[str, list[str]] = {}
        for key, times in list(h.xid_times.items()):
            h.xid_times[key] = times = _recent(times, now, t.xid_repeat_window)
            gpu, xid = key.rsplit("|", 1)
            if not times:
                del h.xid_times[key]
            elif len(times) >= t.xid_repeat_threshold:
                repeated.setdefault(gpu, []).append(f"XID {xid} {len(times)} times")
            else:
                repeated.setdefault(gpu, [])
        for gpu, what in sorted(repeated.items()):
            out.append(self._flag("gpu.xid.repeated", (("gpu", gpu),), bool(what),
                                  f"GPU {gpu}: {', '.join(what)} in {t.xid_repeat_window / 3600:g} h"))
        gpcs: dict[str, list[str]] = {}
        for key, times in list(h.gpc_times.items()):
            h.gpc_times[key] = times = _recent(times, now, t.xid_repeat_window)
            gpu, gpc = key.rsplit("|", 1)
            if not times:
                del h.gpc_times[key]
            elif len(times) >= t.xid_gpc_threshold:
                gpcs.setdefault(gpu, []).append(f"GPC {gpc} {len(times)} times")
            else:
                gpcs.setdefault(gpu, [])
        for gpu, what in sorted(gpcs.items()):
            out.append(self._flag("gpu.xid.same_gpc", (("gpu", gpu),), bool(what),
                                  f"GPU {gpu}: XID 13/31 on {', '.join(what)} in {t.xid_repeat_window / 3600:g} h"))
        for gpu, times in sorted(h.reset_times.items()):
            h.reset_times[gpu] = times = _recent(times, now, t.reset_repeat_window)
            out.append(self._flag("gpu.reset.repeated", (("gpu", gpu),), len(times) >= t.reset_repeat_threshold,
                                  f"GPU {gpu}: a reset cleared a hardware fault {len(times)} times in "
                                  f"{t.reset_repeat_window / 86400:g} days"))
        h.reset_times = {g: v for g, v in h.reset_times.items() if v}
        h.remediations = _recent(h.remediations, now, t.remediation_window)
        if h.remediations:
            n = len(h.remediations)
            out.append(self._flag("node.remediation_budget", (), n > t.remediation_budget,
                                  f"the node was taken out of service (drain or report) {n} times in "
                                  f"{t.remediation_window / 86400:g} days (budget {t.remediation_budget})"))
        return out

    # -- InfiniBand ---------------------------------------------------------------------------
    def _ib_ports(self, fams: Mapping[str, MetricFamily]) -> set[Subject]:
        """InfiniBand ports (Ethernet ports of the same HCAs, such as mlx5_an0, are not judged)."""
        return {_port(s) for s in _samples(fams, ib_metrics.SPEC_INFO.name) if s.label("link_layer") == "InfiniBand"}

    def _ib_rules(self, fams: Mapping[str, MetricFamily], now: float) -> list[Finding]:
        ports = self._ib_ports(fams)
        out = []
        for s in _samples(fams, ib_metrics.SPEC_STATE.name):
            if _port(s) in ports:
                out.append(self._flag("ib.port.down", _port(s), s.value != IB_STATE_ACTIVE,
                                      f"{s.label('device')}/{s.label('port')} is not ACTIVE (state {s.value:g})"))
        exp = self.expected
        if exp is not None and exp.ib_rate_gbps:
            for s in _samples(fams, ib_metrics.SPEC_RATE.name):
                if _port(s) in ports:
                    gbps = s.value * 8 / 1e9
                    out.append(self._flag("ib.port.rate", _port(s), gbps < exp.ib_rate_gbps,
                                          f"{s.label('device')}/{s.label('port')} runs at {gbps:g} Gb/s, "
                                          f"expected {exp.ib_rate_gbps}"))
        out += self._flaps(fams, ports, now)
        out += self._errors(fams, ports, now)
        return out

    def _flaps(self, fams: Mapping[str, MetricFamily], ports: set[Subject], now: float) -> list[Finding]:
        t = self.thresholds
        out = []
        for s in _samples(fams, ib_metrics.SPEC_FLAPS.name):
            subject = _port(s)
            if subject not in ports:
                continue
            key = "|".join(v for _, v in subject)
            before = self.history.flap_totals.get(key)
            self.history.flap_totals[key] = s.value
            times = [x for x in self.history.flap_times.get(key, []) if now - x <= t.flap_window]
            if before is not None and s.value > before:
                times += [now] * int(min(s.value - before, t.flap_threshold))
            self.history.flap_times[key] = times
            out.append(self._flag("ib.port.flapping", subject, len(times) >= t.flap_threshold,
                                  f"{subject[0][1]}/{subject[1][1]} flapped {len(times)} times in "
                                  f"{t.flap_window / 3600:g} h"))
        return out

    def _errors(self, fams: Mapping[str, MetricFamily], ports: set[Subject], now: float) -> list[Finding]:
        t = self.thresholds
        totals: dict[Subject, float] = {}
        for name in IB_ERROR_COUNTERS:
            for s in _samples(fams, name):
                if _port(s) in ports:
                    totals[_port(s)] = totals.get(_port(s), 0.0) + s.value
        out = []
        for subject, total in sorted(totals.items()):
            key = "|".join(v for _, v in subject)
            window = self.history.ib_errors.setdefault(key, collections.deque())
            window.append((now, total))
            while len(window) > 1 and now - window[0][0] > t.ib_error_window:
                window.popleft()
            grown = total - window[0][1]
            out.append(self._flag("ib.port.errors", subject, grown >= t.ib_error_threshold,
                                  f"{subject[0][1]}/{subject[1][1]}: {grown:g} physical errors in "
                                  f"{t.ib_error_window / 60:g} min"))
        return out

    # -- inventory and collectors -------------------------------------------------------------
    def _inventory(self, fams: Mapping[str, MetricFamily], judgeable: set[str]) -> list[Finding]:
        """Counts against the VM size. A collector that is down says nothing about the hardware (its
        series are withdrawn; ``collector.down`` reports it); one with no source at all (no driver,
        no HCA) means the hardware is missing indeed."""
        exp = self.expected
        if exp is None:
            return []
        out = []
        info = _samples(fams, gpu_metrics.INFO_SPEC.name)
        if "nvml" in judgeable and exp.gpus:
            out.append(self._flag("gpu.missing", (), len(info) < exp.gpus,
                                  f"{len(info)} of {exp.gpus} GPUs of a {exp.family} present"))
        if exp.gpu_model and "nvml" in judgeable:
            wrong = sorted({s.label("model") or "" for s in info} - {""})
            wrong = [m for m in wrong if exp.gpu_model not in m]
            out.append(self._flag("gpu.model", (), bool(wrong),
                                  f"GPU model {', '.join(wrong)}; a {exp.family} has {exp.gpu_model}"))
        if exp.ib_ports and "infiniband" in judgeable:
            ports = self._ib_ports(fams)
            out.append(self._flag("ib.port.missing", (), len(ports) < exp.ib_ports,
                                  f"{len(ports)} of {exp.ib_ports} InfiniBand ports of a {exp.family} present"))
        return out

    def _collectors(self, snapshot: Snapshot) -> list[Finding]:
        out = []
        for status in snapshot.collectors:
            if status.name in WATCHED_COLLECTORS and status.available:
                out.append(self._flag("collector.down", (("collector", status.name),), not status.ok,
                                      f"collector {status.name} is down: {status.error}"))
        return out


def _by_bus(fams: Mapping[str, MetricFamily]) -> dict[str, str]:
    """The kernel log names a GPU by its PCI address: gpumon_gpu_info maps it to the index."""
    return {(s.label("pci_bus_id") or "").lower(): s.label("gpu") or "" for s in _samples(fams, gpu_metrics.INFO_SPEC.name)}


def _judgeable(snapshot: Snapshot) -> set[str]:
    """Collectors whose view of the hardware can be trusted: up, or without any source at all."""
    return {s.name for s in snapshot.collectors if s.ok or not s.available}


def worst(findings: Iterable[Finding]) -> Level:
    return max((f.level for f in findings), default=Level.OK)
