"""The config the face loads: the [daemon] section plus each installed plugin's, names checked."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumon import imds, registry
from gpumon.config import DAEMON, FLAG_KEYS, Config, ConfigError, SectionSchema, load
from gpumon.health.settings import HEALTH
from gpumon.health.settings import check_config as check_health_config

if TYPE_CHECKING:
    from gpumon.collectors.base import Collector
    from gpumon.sinks.base import Sink


def schemas() -> list[SectionSchema]:
    """The [daemon] section plus the section each installed collector and sink declares."""
    found = [DAEMON, HEALTH, imds.OPTIONS]
    plugins: list[tuple[str, Callable[[str], type[Collector] | type[Sink]]]] = [
        (name, registry.collector_class) for name in registry.available_collectors()]
    plugins += [(name, registry.sink_class) for name in registry.available_sinks()]
    for name, lookup in plugins:
        try:
            options = lookup(name).options
        except registry.BrokenPlugin as exc:  # one broken plugin must not take the others down
            print(f"gpumon: warning: plugin '{name}' cannot be loaded: {exc}", file=sys.stderr)
            continue
        if options is not None:
            found.append(options)
    return found


def load_config(args: argparse.Namespace) -> Config:
    flags = {key: getattr(args, key, None) for key in FLAG_KEYS}
    config = load(schemas(), args.config, os.environ, flags)
    _check_names(config, "collectors", registry.available_collectors() + ["auto"])
    _check_names(config, "sinks", registry.available_sinks())
    check_health_config(config)
    return config


def _check_names(config: Config, key: str, known: list[str]) -> None:
    where = config.origin("daemon", key)
    for name in config.daemon[key]:
        if name not in known:
            raise ConfigError(where, f"[daemon] {key}", f"unknown name {name!r} (known: {', '.join(known)})")
    names = list(config.daemon[key])
    if len(set(names)) != len(names):
        raise ConfigError(where, f"[daemon] {key}", f"names a plugin twice: {', '.join(names)}")

