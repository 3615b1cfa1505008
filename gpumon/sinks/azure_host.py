"""The Azure host facts a sink puts on its data, from the same sources as ``gpumon_host_info``.

IMDS through the one shared client ``[azure]`` configures (:func:`gpumon.imds.configured`), so the
``host_info`` and ``azure_events`` collectors and every sink ask one IMDS once; the physical host's
name from the Hyper-V KVP pool ``[host_info] kvp_pool`` names. Both come from the Config in effect
(``SinkContext.config``): a simulated host's own IMDS and pool, never the link-local address.

The sinks' own IMDS keys (``[otel] imds_url``/``imds_timeout``, ``[azure_monitor] imds_url``) are
deprecated aliases of ``[azure] imds_url``/``imds_timeout``: honoured where they are set, with a
warning, and an empty ``imds_url`` still switches the sink's IMDS look-up off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpumon import imds
from gpumon.config import SectionSchema
from gpumon.imds import AzureInstance, ImdsClient, ImdsError
from gpumon.sources import kvp

log = logging.getLogger("gpumon.sinks")


@dataclass(frozen=True)
class HostFacts:
    """What IMDS and the KVP pool said; ``instance`` None where IMDS did not answer."""

    instance: AzureInstance | None
    physical_host: str = ""


def _explicit(config: Any, sink: str, settings: Any, schema: SectionSchema[Any], key: str) -> bool:
    """Whether ``[sink] key`` was set (config file or variable), not just left at its default."""
    if config is not None and f"{sink}.{key}" in config.origins:
        return True
    option = schema.option(key)
    return option is not None and getattr(settings, key) != option.default


def imds_client(ctx: Any, sink: str, settings: Any, schema: SectionSchema[Any],
                aliases: Mapping[str, str]) -> ImdsClient | None:
    """The shared IMDS client for a sink, or None where the sink's ``imds_url`` alias is set empty.

    ``settings``: the sink's parsed settings (``schema.settings_of``; a section given instead is
    parsed here). ``aliases``: the sink's deprecated key -> the ``[azure]`` key it stands for."""
    if settings is None or isinstance(settings, Mapping):
        settings = schema.settings_of(settings)
    config = getattr(ctx, "config", None)
    azure = dict(config.sections.get("azure") or {}) if config is not None else {}
    overrides = {azure_key: getattr(settings, key) for key, azure_key in aliases.items()
                 if _explicit(config, sink, settings, schema, key)}
    if overrides.get("imds_url") == "":
        return None
    if overrides:
        log.warning("%s is deprecated (honoured for now): gpumon asks one IMDS, set in [azure]",
                    ", ".join(f"[{sink}] {key}: use [azure] {azure_key}" for key, azure_key in aliases.items()
                              if azure_key in overrides))
    return imds.configured({**azure, **overrides})


def kvp_pool(ctx: Any) -> str:
    """The KVP pool the config in effect names (``[host_info] kvp_pool``; empty: not read)."""
    config = getattr(ctx, "config", None)
    section = config.sections.get("host_info") if config is not None else None
    return str(section.get("kvp_pool", kvp.DEFAULT_POOL)) if section is not None else kvp.DEFAULT_POOL


def physical_host(pool: str) -> str:
    """The physical host's name from the pool; empty where there is none or it cannot be read now."""
    if not pool:
        return ""
    try:
        return kvp.physical_host(kvp.read_pool(pool))
    except OSError:
        return ""


def facts(client: ImdsClient | None, pool: str) -> HostFacts:
    """IMDS (cached by the shared client) and the KVP pool, now. Never raises."""
    instance = None
    if client is not None:
        try:
            instance = client.instance()
        except ImdsError:  # the client logs it once
            instance = None
    return HostFacts(instance, physical_host(pool))
