"""The steps after collection as a list the plan builds: their order, when the health stage judges,
the attribution relabel, and a stage added to the list reaching the sinks."""

from __future__ import annotations

import tempfile

from gpumon.catalogue import gpu, host
from gpumon.cli import schemas
from gpumon.collectors.base import Context
from gpumon.config import load
from gpumon.daemon import Loop, Plan
from gpumon.daemon.plan import make_stages
from gpumon.health.rules import Thresholds
from gpumon.health.stage import HealthResult, HealthSettings, HealthStage
from gpumon.model import MetricFamily, MetricSpec, MetricType, Snapshot
from gpumon.stages import AttributionRelabel, Books, CollectorBook, HealthJudging

STAMP = MetricSpec("gpumon_test_stamp", MetricType.GAUGE, "A stage's own series.")


class Counting:
    """A real health stage, counting its evaluations."""

    def __init__(self) -> None:
        self.stage = HealthStage(tempfile.mkdtemp(), HealthSettings(Thresholds()), persist=False)
        self.updates = 0

    def update(self, snapshot: Snapshot) -> HealthResult:
        self.updates += 1
        return self.stage.update(snapshot)


def config(**env: str):
    return load(schemas(), None, env, {})


def empty() -> Snapshot:
    return Snapshot("h", 0.0, (), (), ())


def books(runs: tuple[int, ...], series: tuple = ((),), reported: bool = True) -> Books:
    return Books({"c": CollectorBook()}, runs=runs, series=series, reported=reported)


def test_the_plan_builds_health_then_relabel_then_self_metrics() -> None:
    health = Counting().stage
    assert [s.name for s in make_stages(config(), None, 5.0)] == ["self_metrics"]
    assert [s.name for s in make_stages(config(), health, 5.0)] == ["health", "self_metrics"]
    assert [s.name for s in make_stages(config(GPUMON_ATTRIBUTION_LABELS="true"), health, 5.0)] == [
        "health", "relabel", "self_metrics"]


def test_health_is_judged_once_every_collector_reported_and_only_on_new_runs() -> None:
    counting = Counting()
    judging = HealthJudging(counting, every=0.0)  # type: ignore[arg-type]
    assert judging(empty(), books((0,), reported=False)) == empty() and counting.updates == 0
    first = judging(empty(), books((1,)))
    assert counting.updates == 1 and first.family("gpumon_node_health") is not None
    again = judging(empty(), books((1,)))   # no new run: the verdict's series stay, not judged again
    assert counting.updates == 1 and again.families == first.families and again.events == ()
    judging(empty(), books((2,), series=((MetricFamily(STAMP, ()),),)))
    assert counting.updates == 2


def test_a_new_run_within_the_interval_is_owed_not_judged() -> None:
    counting = Counting()
    judging = HealthJudging(counting, every=60.0)  # type: ignore[arg-type]
    judging(empty(), books((1,)))
    later = books((2,), series=((MetricFamily(STAMP, ()),),))
    kept = judging(empty(), later)
    assert counting.updates == 1 and later.owed  # the loop composes again within SOFT seconds
    assert kept.family("gpumon_node_health") is not None


def test_the_relabel_passes_a_snapshot_without_allocation_as_it_is() -> None:
    snapshot = empty()
    assert AttributionRelabel()(snapshot, books(())) is snapshot


def test_the_relabel_puts_the_holders_on_per_gpu_series() -> None:
    labels = dict.fromkeys(gpu.POWER.labels, "")
    labels.update(gpu="0")
    power = MetricFamily(gpu.POWER, (gpu.POWER.sample(300.0, *labels.values()),))
    holder = {"gpu": "0", "uuid": "GPU-0", "gpu_instance": "", "namespace": "ml", "pod": "train-0",
              "container": "main", "job_id": ""}
    allocation = MetricFamily(host.ALLOCATION, (host.ALLOCATION.sample(1, *holder.values()),))
    out = AttributionRelabel()(Snapshot("h", 0.0, (power, allocation), (), ()), books(()))
    relabelled = out.family(gpu.POWER.name)
    assert relabelled is not None
    assert [(s.label("namespace"), s.label("pod"), s.label("container")) for s in relabelled.samples] == [
        ("ml", "train-0", "main")]


def test_a_stage_added_to_the_list_reaches_the_snapshot_merged_once() -> None:
    class Stamp:
        name = "stamp"

        def __call__(self, snapshot: Snapshot, books: Books) -> Snapshot:
            extra = (MetricFamily(STAMP, (STAMP.sample(1),)), MetricFamily(STAMP, (STAMP.sample(2),)))
            return Snapshot(snapshot.host, snapshot.time, snapshot.families + extra, snapshot.events,
                            snapshot.collectors)

    loop = Loop(config(), Plan([]), Context(hostname="h"), [])
    loop.stages.insert(0, Stamp())
    snapshot = loop.compose()
    stamps = [f for f in snapshot.families if f.name == STAMP.name]
    assert len(stamps) == 1 and [s.value for s in stamps[0].samples] == [1, 2]
    assert snapshot.seq == 1 and snapshot.family("gpumon_build_info") is not None
