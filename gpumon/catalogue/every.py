"""Every metric the catalogue declares, once each, sorted by name: the list the layer test checks
strings against and the docs can be made from (a plugin's metrics are not here: see
:func:`gpumon.confdoc.declared_specs`)."""

from __future__ import annotations

from types import ModuleType

from gpumon.catalogue import daemon, gpu, host, infiniband
from gpumon.model import MetricSpec

MODULES: tuple[ModuleType, ...] = (gpu, infiniband, host, daemon)


def _declared(module: ModuleType) -> list[MetricSpec]:
    out: list[MetricSpec] = []
    for value in vars(module).values():
        if isinstance(value, MetricSpec):
            out.append(value)
        elif isinstance(value, tuple):
            out.extend(v for v in value if isinstance(v, MetricSpec))
    return out


ALL: tuple[MetricSpec, ...] = tuple(sorted({s.name: s for m in MODULES for s in _declared(m)}.values(),
                                           key=lambda s: s.name))
