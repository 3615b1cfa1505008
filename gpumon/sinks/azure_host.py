"""The sinks' deprecated IMDS keys, and the host facts a sink reads from a Snapshot.

No sink asks IMDS or reads the KVP pool: the one host identity provider (``gpumon.identity``) does,
and the loop stamps its answer on every Snapshot (``Snapshot.identity``). What is left for a sink is
config: its own IMDS keys (``[otel] imds_url``/``imds_timeout``, ``[azure_monitor] imds_url``) are
deprecated aliases of ``[azure] imds_url``/``imds_timeout``, honoured (by the provider) where they
are set, with a warning at every build of the sinks (start, reload), and an empty ``imds_url`` still switches the sink's host facts off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from gpumon.config import Config, SectionSchema
from gpumon.sinks.base import SinkContext

log = logging.getLogger("gpumon.sinks")


def _explicit(config: Config, sink: str, settings: Any, schema: SectionSchema[Any], key: str) -> bool:
    """Whether ``[sink] key`` was set (config file or variable), not just left at its default."""
    if f"{sink}.{key}" in config.origins:
        return True
    option = schema.option(key)
    return option is not None and getattr(settings, key) != option.default


def imds_overrides(ctx: SinkContext, sink: str, settings: Any, schema: SectionSchema[Any],
                   aliases: Mapping[str, str]) -> dict[str, Any] | None:
    """The ``[azure]`` keys a sink's deprecated aliases set (empty: none), or None where the sink's
    ``imds_url`` alias is set empty (its host facts off). A set alias is warned about.

    ``settings``: the sink's parsed settings (``schema.settings_of``; a section given instead is
    parsed here). ``aliases``: the sink's deprecated key -> the ``[azure]`` key it stands for."""
    if settings is None or isinstance(settings, Mapping):
        settings = schema.settings_of(settings)
    overrides = {azure_key: getattr(settings, key) for key, azure_key in aliases.items()
                 if _explicit(ctx.config, sink, settings, schema, key)}
    if overrides.get("imds_url") == "":
        return None
    if overrides:
        log.warning("%s is deprecated (honoured for now): gpumon asks one IMDS, set in [azure]",
                    ", ".join(f"[{sink}] {key}: use [azure] {azure_key}" for key, azure_key in aliases.items()
                              if azure_key in overrides))
    return overrides
