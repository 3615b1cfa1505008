"""The daemon's health stage: built from ``[health]`` with its actions, the VM size it learns from
IMDS, and the verdict the Prometheus endpoint serves."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumon.collectors.base import Context
from gpumon.config import Config
from gpumon.health.settings import action_settings, actions_on, health_settings
from gpumon.health.stage import HealthStage

if TYPE_CHECKING:
    from gpumon.daemon.loop import Loop


def health_stage(config: Config, ctx: Context, persist: bool = True, act: bool = False,
                 state_dir: str | None = None) -> HealthStage | None:
    """The health stage ``[health]`` asks for (None when disabled); with ``act``, the health actions
    it turns on (Slurm drain, NodeConditions, a hook) run on its verdicts."""
    section = config.sections.get("health")
    if section is None or not section["enabled"]:
        return None
    stage = HealthStage(state_dir or ctx.state_dir, health_settings(section), vm_size=_vm_size_of(ctx),
                        persist=persist)
    settings = action_settings(section)
    if act and actions_on(settings):
        from gpumon.health.actions import HealthActions

        stage.attach(HealthActions(settings, ctx.state_dir))
    return stage


def _vm_size_of(ctx: Context) -> Callable[[], str | None]:
    """Where the health stage learns the VM size: IMDS's ``vmSize`` (a simulated host serves its
    profile's), asked on a thread of its own so the loop never waits on IMDS; None until IMDS has
    answered or is known absent (then "")."""
    from gpumon import imds

    azure = ctx.config.sections.get("azure") if ctx.config is not None else None
    found: list[str] = []
    asked = threading.Event()

    def ask() -> None:
        try:
            found.append(imds.configured(azure).instance().vm_size)
        except imds.ImdsError:
            found.append("")  # off Azure: the health stage holds the node to its baseline

    def vm_size() -> str | None:
        if not asked.is_set():
            asked.set()
            threading.Thread(target=ask, name="health-imds", daemon=True).start()
        return found[0] if found else None

    return vm_size


def endpoint_verdict(loop: Loop | None) -> dict | None:
    """The running loop's health verdict for the endpoint (None before its first evaluation)."""
    if loop is None or loop.health is None:
        return None
    verdict = loop.health.verdict()
    return verdict.as_dict() if verdict.time else None
