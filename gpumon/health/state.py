"""The health verdicts that outlive a restart: sticky findings, transient ones in their hold time,
and the rules' history, in ``<state_dir>/health.json``.

Written atomically (temporary file, fsync, rename) under an flock, so ``gpumon health clear`` from
another process and the daemon never lose each other's change. A file that does not parse is set
aside (renamed ``health.json.corrupt-<time>``), logged once, and gpumon starts from the current
signals. The boot id (``/proc/sys/kernel/random/boot_id``) is kept: a new boot clears every sticky
verdict, as a reboot is the repair most of them ask for.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gpumon.health import faultcodes
from gpumon.health.catalogue import Level
from gpumon.sources.kmsg import boot_id as boot_id  # the stage compares it with the saved one

log = logging.getLogger(__name__)
STATE_FILE = "health.json"
LOCK_FILE = "health.lock"


@dataclass
class Active:
    """A finding that is (or, for a sticky one, was) present, with when it started and was last seen."""

    rule: str
    subject: list[list[str]]
    level: int
    action: str
    reason: str
    sticky: bool
    since: float
    last_seen: float
    #: the GPU's UUID when the finding is about one (a verdict about another GPU at that index is stale)
    uuid: str = ""
    #: carried over a restart of the daemon (loaded from the state directory) and not seen since
    restored: bool = False
    #: why the finding no longer describes this host ("" while it does); such a one counts nowhere
    stale: str = ""

    @property
    def key(self) -> str:
        return self.rule + "".join(f"|{k}={v}" for k, v in self.subject)

    def as_dict(self, now: float | None = None) -> dict[str, Any]:
        fc = faultcodes.for_rule(self.rule)
        out = {"rule": self.rule, "subject": {k: v for k, v in self.subject}, "severity": Level(self.level).label,
               "action": self.action, "reason": self.reason, "sticky": self.sticky,
               "since": self.since, "last_seen": self.last_seen, "restored": self.restored,
               "fault_code": fc.code if fc else None, "impact_category": fc.category if fc else None}
        if now is not None:
            out["age_seconds"] = round(max(0.0, now - self.since), 1)
        if self.uuid:
            out["uuid"] = self.uuid
        if self.stale:
            out["stale"] = self.stale
        return out

    def saved(self) -> dict[str, Any]:
        """What ``health.json`` keeps (whether it is stale is judged again from the hardware)."""
        return {k: v for k, v in vars(self).items() if k != "stale"}


@dataclass
class HealthState:
    boot_id: str = ""
    active: dict[str, Active] = field(default_factory=dict)
    history: dict[str, Any] = field(default_factory=dict)
    baseline: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps({"version": 1, "boot_id": self.boot_id,
                           "active": [a.saved() for a in self.active.values()],
                           "history": self.history, "baseline": self.baseline}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HealthState:
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("version") != 1:
            raise ValueError("not a version 1 health state")
        active = {}
        for item in doc.get("active") or []:
            a = Active(str(item["rule"]), [[str(k), str(v)] for k, v in item["subject"]], int(item["level"]),
                       str(item["action"]), str(item["reason"]), bool(item["sticky"]), float(item["since"]),
                       float(item["last_seen"]), str(item.get("uuid", "")), bool(item.get("restored", False)))
            active[a.key] = a
        history = doc.get("history") if isinstance(doc.get("history"), dict) else {}
        baseline = doc.get("baseline") if isinstance(doc.get("baseline"), dict) else None
        return cls(str(doc.get("boot_id", "")), active, history or {}, baseline)


class StateStore:
    """Reads and writes the health state of one state directory."""

    def __init__(self, state_dir: str, read_only: bool = False) -> None:
        self.dir = state_dir
        self.path = os.path.join(state_dir, STATE_FILE)
        self.read_only = read_only  # ``gpumon once`` and ``gpumon health``: never rename or write
        self._stamp: tuple[int, int] | None = None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        os.makedirs(self.dir, exist_ok=True)
        fd = os.open(os.path.join(self.dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def load(self) -> HealthState:
        """The saved state; an absent file is an empty state, a corrupt one is set aside."""
        try:
            with open(self.path, encoding="utf-8") as fh:
                text = fh.read(16 << 20)
            self._stamp = self._current_stamp()
        except FileNotFoundError:
            return HealthState()
        except OSError as exc:
            log.warning("health: cannot read %s (%s); starting from the current signals", self.path, exc)
            return HealthState()
        try:
            return HealthState.from_json(text)
        except (ValueError, KeyError, TypeError) as exc:
            if self.read_only:
                log.warning("health: %s is not a health state (%s); judging from the current signals",
                            self.path, exc)
                return HealthState()
            aside = f"{self.path}.corrupt-{int(time.time())}"
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            log.warning("health: %s is not a health state (%s); kept as %s, starting from the current "
                        "signals", self.path, exc, aside)
            return HealthState()

    def save(self, state: HealthState) -> None:
        tmp = f"{self.path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(state.to_json())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self._stamp = self._current_stamp()

    def changed_elsewhere(self) -> bool:
        """Whether another process (``gpumon health clear``) rewrote the file since we last did."""
        return self._current_stamp() != self._stamp

    def _current_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns)


def clear(state_dir: str, rule_or_key: str | None) -> list[str]:
    """Clear verdicts, sticky or held: every one (``None``), those of a rule id, or one key; returns
    the keys. A cleared finding's window (the flaps or IB errors counted towards it) starts afresh,
    here and in a running daemon (which sees the file change), so only new flaps or errors bring it
    back; a condition still present (a lost GPU, a port down) comes back at the next evaluation."""
    from gpumon.health.rules import History

    store = StateStore(state_dir)
    with store.locked():
        state = store.load()
        gone = [k for k, a in state.active.items()
                if rule_or_key is None or rule_or_key in (a.rule, k)]
        history = History.from_dict(state.history)
        for key in gone:
            history.forget(state.active[key].rule, state.active[key].subject)
            del state.active[key]
        if any(k.startswith("node.remediation_budget") for k in gone):
            state.history["remediations"] = []  # the hardware was replaced: the budget starts again
        if gone:
            state.history = {**state.history, **history.as_dict()}
            store.save(state)
    return gone
