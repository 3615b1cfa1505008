"""Drain this node in Slurm while the verdict asks for it; resume it only if gpumon drained it.

DRAIN (not DOWN) lets the running job finish and keeps new ones off. Ownership is read back from
Slurm itself, never remembered: a drain whose reason starts with ``gpumon:`` is ours, any other
(an operator's maintenance, NHC's) is left alone both ways, so gpumon neither overwrites an
operator's reason nor resumes a node someone else took out.
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass

from gpumon.health.actions.process import ActionError, clean_environment, run_bounded
from gpumon.health.actions.settings import ActionSettings
from gpumon.health.catalogue import REMEDIATION_ACTIONS, Level
from gpumon.health.stage import Verdict

log = logging.getLogger("gpumon.health.actions")
PREFIX = "gpumon:"
DRAIN_ACTIONS = REMEDIATION_ACTIONS
REASON_MAX = 200  # Slurm keeps longer reasons, but sinfo and squeue users read the first words
_REASON_LINE = re.compile(r"^\s*Reason=(?P<reason>.*?)(?: \[[^\[\]]*@[^\[\]]*\])?\s*$")


@dataclass(frozen=True)
class NodeState:
    flags: frozenset[str]  # e.g. {"IDLE", "DRAIN"} from State=IDLE+DRAIN
    reason: str

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags

    @property
    def ours(self) -> bool:
        return self.drained and self.reason.startswith(PREFIX)


def wants_drain(verdict: Verdict) -> bool:
    return verdict.level is Level.UNHEALTHY and verdict.action in DRAIN_ACTIONS


def drain_reason(verdict: Verdict) -> str:
    """``gpumon: <rule>: <reason>`` of the finding that set the node's action, on one line."""
    chosen = next((f for f in verdict.findings
                   if f.get("severity") == Level.UNHEALTHY.label and f.get("action") == verdict.action),
                  verdict.findings[0] if verdict.findings else {})
    text = f"{PREFIX} {chosen.get('rule', 'health')}: {chosen.get('reason', '') or verdict.action}"
    return " ".join(text.split())[:REASON_MAX]


def parse_show_node(text: str) -> NodeState:
    """``scontrol show node`` (multi-line form): the State flags and the Reason without its [user@time]."""
    flags: frozenset[str] = frozenset()
    reason = ""
    for line in text.splitlines():
        match = _REASON_LINE.match(line)
        if match:
            reason = match.group("reason")
            continue
        for token in line.split():
            if token.startswith("State="):
                flags = frozenset(token[len("State="):].replace("*", "").upper().split("+"))
    return NodeState(flags, reason)


class SlurmAction:
    kind = "slurm"

    def __init__(self, settings: ActionSettings) -> None:
        self.node = settings.slurm_node_name()
        self.scontrol = settings.scontrol
        self.timeout = settings.timeout

    def act(self, verdict: Verdict) -> None:
        state = self.show()
        if wants_drain(verdict):
            reason = drain_reason(verdict)
            if state.drained and not state.ours:
                log.info("health: Slurm node %s is already drained by someone else (%s); left as it is",
                         self.node, state.reason)
            elif not state.ours or state.reason != reason:
                self._scontrol("update", f"nodename={self.node}", "state=drain", f"reason={reason}")
                log.warning("health: drained Slurm node %s: %s", self.node, reason)
        elif state.ours:
            self._scontrol("update", f"nodename={self.node}", "state=resume")
            log.warning("health: resumed Slurm node %s (gpumon had drained it: %s)", self.node, state.reason)

    def show(self) -> NodeState:
        return parse_show_node(self._scontrol("show", "node", self.node))

    def _scontrol(self, *args: str) -> str:
        out = run_bounded([self.scontrol, *args], self.timeout, env=clean_environment(("SLURM_",)))
        if out.returncode != 0:
            detail = (out.stderr or out.stdout).strip().splitlines()
            raise ActionError(f"scontrol {args[0]} {self.node} exited {out.returncode}: "
                              f"{detail[-1] if detail else 'no output'}")
        return out.stdout


def check(settings: ActionSettings) -> list[str]:
    if not settings.slurm:
        return []
    if shutil.which(settings.scontrol) is None:
        return [f"[health] slurm is on but {settings.scontrol} was not found on PATH: the node cannot be "
                f"drained (install Slurm's client, or set [health] scontrol)"]
    return []
