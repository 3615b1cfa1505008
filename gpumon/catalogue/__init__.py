"""The metric catalogue: every metric gpumon declares, once, as data (ground floor).

- :mod:`.units`: the typed unit of a metric (its Prometheus word and its UCUM code);
- :mod:`.hints`: the types of the sink hints a declaration carries (OpenTelemetry metric, Log
  Analytics columns) and helpers to write them short;
- :mod:`.gpu`, :mod:`.infiniband`, :mod:`.host`, :mod:`.daemon`: the declarations, one constant per
  metric, with their type, unit, help, labels and hints; :mod:`.dcgm`: dcgm-exporter's fields as
  gpumon metrics; :mod:`.every`: all of them.

Collectors, health rules, sinks, the report and the docs refer to a metric by its constant here,
never by a string. This package imports only :mod:`gpumon.model` (and itself); this file imports
nothing, so that :mod:`gpumon.model` can take the hint types without a circle.
"""
