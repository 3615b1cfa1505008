"""``[attribution] labels = true``: the attribution labels on every per-GPU series, as a stage."""

from __future__ import annotations

import dataclasses

from gpumon import attribution_labels
from gpumon.model import Snapshot
from gpumon.stages.base import Books


class AttributionRelabel:
    """Every per-GPU family (the health stage's too, so it runs after it) gets ``namespace``,
    ``pod``, ``container`` and ``job_id`` from the snapshot's allocation family; a snapshot without
    one (the attribution collector not running, or down) passes as it is."""

    name = "relabel"

    def __call__(self, snapshot: Snapshot, books: Books) -> Snapshot:
        allocation = snapshot.family(attribution_labels.ALLOCATION_FAMILY)
        if allocation is None:
            return snapshot
        return dataclasses.replace(snapshot, families=attribution_labels.relabel(snapshot.families, allocation))
