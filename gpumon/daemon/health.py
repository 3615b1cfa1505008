"""The daemon's health stage: built from ``[health]`` with its actions, the VM size it learns from
IMDS, and the verdict the Prometheus endpoint serves."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpumon import imds
from gpumon.collectors.base import Context
from gpumon.config import Config
from gpumon.health.actions.settings import ActionSettings
from gpumon.health.settings import action_settings, actions_on, health_settings
from gpumon.health.stage import HealthStage

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
    stage = HealthStage(state_dir or ctx.state_dir, health_settings(section), vm_size=_vm_size_of(ctx),
                        persist=persist, boot=ctx.simulation.boot_id if ctx.simulation is not None else None)
    settings = with_imds(action_settings(section), config)
    if act and actions_on(settings):
        from gpumon.health.actions import HealthActions

        stage.attach(HealthActions(settings, ctx.state_dir, _ghr_credential(settings)))
    return stage


def with_imds(settings: ActionSettings, config: Config) -> ActionSettings:
    """The actions' settings with ``[azure]``'s IMDS (the one shared client ``azure_ghr`` asks)."""
    azure = imds.OPTIONS.settings_of(config.sections.get("azure"))
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


class _VmSize:
    """Where the health stage learns the VM size: IMDS's ``vmSize`` (a simulated host serves its
    profile's), asked on a thread of its own so the loop never waits on IMDS. None while unknown (no
    inventory rules, no baseline taken), "" once IMDS is known absent (off Azure: the baseline). A
    failure that is not "not on Azure" (a timeout at boot, a 5xx, a 429) leaves it unknown and is
    asked again after ASK_AGAIN seconds: one bad moment never holds the node to a baseline."""

    ASK_AGAIN = 10.0

    def __init__(self, ctx: Context) -> None:
        self._azure = ctx.config.sections.get("azure")
        self._size: str | None = None
        self._asking = False
        self._next_ask = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> str | None:
        with self._lock:
            if self._size is None and not self._asking and time.monotonic() >= self._next_ask:
                self._asking = True
                threading.Thread(target=self._ask, name="health-imds", daemon=True).start()
            return self._size

    def _ask(self) -> None:
        from gpumon import imds

        size: str | None
        again = 0.0
        try:
            size = imds.configured(self._azure).instance().vm_size
        except imds.ImdsError as exc:
            # off Azure (nothing answers): no size, for good; anything else: still unknown, ask again
            size, again = ("", 0.0) if exc.reason == "unreachable" else (None, self.ASK_AGAIN)
        except Exception:  # noqa: BLE001 - a bug here must not stop the stage from learning the size
            log.debug("health: asking IMDS for the VM size failed", exc_info=True)
            size, again = None, self.ASK_AGAIN
        with self._lock:
            self._size, self._asking = size, False
            self._next_ask = time.monotonic() + again


def _vm_size_of(ctx: Context) -> Callable[[], str | None]:
    return _VmSize(ctx)


def endpoint_verdict(loop: Loop | None) -> dict | None:
    """The running loop's health verdict for the endpoint (None before its first evaluation)."""
    if loop is None or loop.health is None:
        return None
    verdict = loop.health.verdict()
    return verdict.as_dict() if verdict.time else None
