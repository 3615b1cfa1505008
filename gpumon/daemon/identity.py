"""Whether ``gpumon run`` needs the host identity provider, and the one it builds: only where a sink
or the health stage reads ``Snapshot.identity``, so a host that runs neither never asks IMDS for it."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from gpumon.config import Config
from gpumon.daemon.health import wants_identity
from gpumon.identity import IdentityProvider
from gpumon.sinks.base import Sink

log = logging.getLogger("gpumon.daemon")


def identity_provider(config: Config, running: Iterable[str], sinks: Iterable[Sink]) -> IdentityProvider | None:
    """The provider for the config in effect (``ctx.config``: a simulated host's own IMDS and KVP
    pool), or None where nothing reads the identity. ``running``: the collectors the plan runs. A
    sink's deprecated IMDS keys (``[otel] imds_url``) are honoured here, for the one provider."""
    overrides: dict[str, Any] = {}
    wanted = wants_identity(config, running)
    for sink in sinks:
        own = sink.identity_overrides()
        if own is None:
            continue
        wanted = True
        for key, value in own.items():
            if key in overrides and overrides[key] != value:
                log.warning("[%s] sets the deprecated IMDS key for [azure] %s to %r, another sink to %r: gpumon "
                            "asks one IMDS, and takes %r (set [azure] %s instead)", sink.name, key, value,
                            overrides[key], value, key)
            overrides[key] = value
    return IdentityProvider.from_config(config, overrides) if wanted else None
