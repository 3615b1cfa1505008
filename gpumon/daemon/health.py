"""The daemon's health stage: built from ``[health]`` with its actions (the VM size it reads from the
host identity each snapshot carries), and the verdict the Prometheus endpoint serves."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from gpumon.collectors.base import Context
from gpumon.config import Config
from gpumon.health.actions.settings import ActionSettings
from gpumon.health.settings import action_settings, actions_on, health_settings
from gpumon.health.stage import INVENTORY_COLLECTORS, HealthStage
from gpumon.identity import azure_settings

if TYPE_CHECKING:
    from gpumon.daemon.loop import Loop

log = logging.getLogger(__name__)


def health_stage(config: Config, ctx: Context, persist: bool = True, act: bool = False,
                 state_dir: str | None = None) -> HealthStage | None:
    """The health stage ``[health]`` asks for (None when disabled); with ``act``, the health actions
    it turns on (Slurm drain, NodeConditions, a hook) run on its verdicts."""
    section = config.sections.get("health")
    if section is None or not section["enabled"]:
        return None
    # a simulated host has its own boot id, which its ``reboot`` control action changes (and the
    # daemon then reloads, with a new stage: see Daemon._health_for)
    stage = HealthStage(state_dir or ctx.state_dir, health_settings(section),
                        persist=persist, boot=ctx.simulation.boot_id if ctx.simulation is not None else None)
    settings = with_imds(action_settings(section), config)
    if act and actions_on(settings):
        from gpumon.health.actions import HealthActions

        stage.attach(HealthActions(settings, ctx.state_dir, _ghr_credential(settings)))
    return stage


def with_imds(settings: ActionSettings, config: Config) -> ActionSettings:
    """The actions' settings with ``[azure]``'s IMDS (the one shared client ``azure_ghr`` asks)."""
    azure = azure_settings(config)
    return dataclasses.replace(settings, imds_url=azure.imds_url, imds_timeout=azure.imds_timeout)


@dataclasses.dataclass(frozen=True)
class _ManagedIdentity:
    """The credential options of ``azure_ghr``: always the VM's managed identity."""

    client_id: str
    credential: str = "managed_identity"
    tenant_id: str = ""
    client_secret: str = ""


def _ghr_credential(settings: ActionSettings) -> Any:
    if not settings.azure_ghr:
        return None
    from gpumon.sinks.azure_identity import make_credential

    return make_credential(_ManagedIdentity(settings.azure_ghr_client_id), "[health]")


def endpoint_verdict(loop: Loop | None) -> dict | None:
    """The running loop's health verdict for the endpoint (None before its first evaluation)."""
    if loop is None or loop.health is None:
        return None
    verdict = loop.health.verdict()
    return verdict.as_dict() if verdict.time else None


def wants_identity(config: Config, running: Iterable[str]) -> bool:
    """Whether the health stage will read the VM size from the host identity: ``[health]`` on, no
    ``[health] vm_size`` set, and a collector whose inventory the SKU table judges (the GPUs) among
    ``running``; with only the InfiniBand collectors the baseline holds the ports, IMDS never asked."""
    section = config.sections.get("health")
    if section is None or not section["enabled"]:
        return False
    return not health_settings(section).vm_size and any(name in INVENTORY_COLLECTORS for name in running)
