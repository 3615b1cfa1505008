"""`[attribution] labels = true` and GPU events naming their holders: gpumon.attribution_labels on
hand-built families and on a whole simulated ND H100 v5 snapshot."""

from __future__ import annotations

import time

from gpumon import attribution_labels as al
from gpumon import cli, config, daemon
from gpumon.collectors.attribution import ALLOCATION
from gpumon.model import Event, MetricFamily, MetricSpec, MetricType, Severity
from tests.conftest import clean_env

UTIL = MetricSpec("gpumon_gpu_utilization_ratio", MetricType.GAUGE, "u", "ratio", ("gpu", "uuid", "engine"))
MIG = MetricSpec("gpumon_gpu_mig_activity_ratio", MetricType.GAUGE, "m", "ratio", ("gpu", "uuid", "gpu_instance"))
PORT = MetricSpec("gpumon_ib_port_up", MetricType.GAUGE, "p", "", ("device", "port"))


def alloc(*rows: tuple[str, str, str, str, str, str]) -> MetricFamily:
    """(gpu, gpu_instance, namespace, pod, container, job_id) rows as the collector publishes them."""
    return MetricFamily(ALLOCATION, tuple(ALLOCATION.sample(1, g, f"GPU-{g}", gi, ns, pod, c, job)
                                          for g, gi, ns, pod, c, job in rows))


def series(fam: MetricFamily) -> set[tuple[tuple[str, str], ...]]:
    return {s.labels for s in fam.samples}


def test_every_per_gpu_series_gets_its_holders_one_copy_each_and_empties_when_unheld() -> None:
    util = MetricFamily(UTIL, (UTIL.sample(0.5, "0", "GPU-0", "gpu"), UTIL.sample(0.1, "1", "GPU-1", "gpu")))
    allocation = alloc(("0", "", "ml", "a", "main", ""), ("0", "", "ml", "b", "main", ""))
    out, = al.relabel([util], allocation)
    assert out.spec.labels == UTIL.labels + al.LABELS
    assert series(out) == {
        (("gpu", "0"), ("uuid", "GPU-0"), ("engine", "gpu"), ("namespace", "ml"), ("pod", "a"),
         ("container", "main"), ("job_id", "")),
        (("gpu", "0"), ("uuid", "GPU-0"), ("engine", "gpu"), ("namespace", "ml"), ("pod", "b"),
         ("container", "main"), ("job_id", "")),
        (("gpu", "1"), ("uuid", "GPU-1"), ("engine", "gpu"), ("namespace", ""), ("pod", ""),
         ("container", ""), ("job_id", "")),
    }
    assert sorted(s.value for s in out.samples) == [0.1, 0.5, 0.5]


def test_mig_holders_apply_to_their_instance_and_to_the_gpus_series() -> None:
    mig = MetricFamily(MIG, (MIG.sample(0.3, "3", "GPU-3", "1"), MIG.sample(0.4, "3", "GPU-3", "2")))
    util = MetricFamily(UTIL, (UTIL.sample(0.7, "3", "GPU-3", "gpu"),))
    allocation = alloc(("3", "1", "ml", "small", "c", ""), ("3", "2", "ml", "other", "c", ""))
    out_mig, out_util = al.relabel([mig, util], allocation)
    pods_by_instance = {(s.label("gpu_instance"), s.label("pod")) for s in out_mig.samples}
    assert pods_by_instance == {("1", "small"), ("2", "other")}
    assert {s.label("pod") for s in out_util.samples} == {"small", "other"}


def test_one_holder_of_two_instances_is_one_copy_of_the_gpus_series() -> None:
    util = MetricFamily(UTIL, (UTIL.sample(0.7, "3", "GPU-3", "gpu"),))
    out, = al.relabel([util], alloc(("3", "1", "ml", "p", "c", ""), ("3", "2", "ml", "p", "c", "")))
    assert len(out.samples) == 1 and out.samples[0].label("pod") == "p"


def test_families_without_gpu_and_the_allocation_family_itself_are_untouched() -> None:
    port = MetricFamily(PORT, (PORT.sample(1, "mlx5_0", "1"),))
    allocation = alloc(("0", "", "ml", "a", "main", ""))
    out_port, out_alloc = al.relabel([port, allocation], allocation)
    assert out_port is port and out_alloc is allocation


def test_the_same_inputs_give_the_same_objects_back() -> None:
    """Cheap: a family the loop hands again, under the same allocation set, is not rebuilt."""
    util = MetricFamily(UTIL, (UTIL.sample(0.5, "0", "GPU-0", "gpu"),))
    first, = al.relabel([util], alloc(("0", "", "ml", "a", "main", "")))
    again, = al.relabel([util], alloc(("0", "", "ml", "a", "main", "")))  # an equal, new allocation family
    assert again is first
    moved, = al.relabel([util], alloc(("0", "", "ml", "b", "main", "")))
    assert moved.samples[0].label("pod") == "b"


def xid(gpu: str, **subject: str) -> Event:
    return Event("gpu_xid", Severity.ERROR, {"gpu": gpu, "uuid": f"GPU-{gpu}", **subject},
                 f"GPU {gpu}: XID 79", {"xid": 79})


def test_gpu_events_name_their_holders_in_attributes_and_message() -> None:
    allocation = alloc(("2", "", "ml", "train-0", "main", ""), ("5", "", "", "", "", "4242"))
    held, by_job, unheld = al.enrich([xid("2"), xid("5"), xid("6")], allocation)
    assert held.attributes == {"xid": 79, "namespace": "ml", "pod": "train-0", "container": "main"}
    assert held.message == "GPU 2: XID 79 (namespace=ml pod=train-0 container=main)"
    assert by_job.attributes["job_id"] == "4242" and "pod" not in by_job.attributes
    assert by_job.message.endswith("(job_id=4242)")
    assert unheld.message == "GPU 6: XID 79" and unheld.attributes == {"xid": 79}
    assert al.enrich([held], allocation)[0] is held  # enriched once only


def test_events_without_a_gpu_or_with_several_holders() -> None:
    flap = Event("ib_link_flap", Severity.WARNING, {"device": "mlx5_0", "port": "1"}, "flap")
    allocation = alloc(("1", "", "ml", "a", "main", ""), ("1", "", "", "", "", "77"))
    out_flap, shared = al.enrich([flap, xid("1")], allocation)
    assert out_flap is flap
    assert shared.attributes["pod"] == "a," and shared.attributes["job_id"] == ",77"
    mig = al.enrich([xid("1", gpu_instance="2")], alloc(("1", "1", "ml", "x", "c", ""),
                                                        ("1", "2", "ml", "y", "c", "")))[0]
    assert mig.attributes["pod"] == "y"


def test_the_allocation_family_name_is_the_collectors() -> None:
    assert ALLOCATION.name == al.ALLOCATION_FAMILY


def simulated_snapshot(tmp_path, pods: int):
    environ = clean_env(GPUMON_DAEMON_STATE_DIR=str(tmp_path))  # IMDS on a closed loopback port
    cfg = config.load(cli.schemas(), None, environ, {"simulate": "nd-h100-v5"})
    ctx = daemon.make_context(cfg)
    assert ctx.simulation is not None
    for gpu in range(pods):
        ctx.simulation.apply({"action": "allocate", "gpu": gpu, "namespace": "ml", "pod": f"train-{gpu}",
                              "container": "main"})
    return daemon.collect_once(cfg, daemon.plan_collectors(ctx.config, ctx), ctx)


def test_an_nd_h100_v5_with_eight_pods_keeps_its_series_count_and_relabels_cheaply(tmp_path) -> None:
    """The figure in docs/collectors/attribution.md: one pod per GPU adds labels, not series."""
    snapshot = simulated_snapshot(tmp_path, pods=8)
    allocation = snapshot.family(al.ALLOCATION_FAMILY)
    assert allocation is not None and len(allocation.samples) == 8
    before = sum(len(f.samples) for f in snapshot.families)
    relabelled = al.relabel(snapshot.families, allocation)
    assert sum(len(f.samples) for f in relabelled) == before
    per_gpu = [f for f in relabelled if "pod" in f.spec.labels]
    assert per_gpu and all(s.label("pod") == f"train-{s.label('gpu')}" for f in per_gpu for s in f.samples)
    start = time.process_time()
    for _ in range(20):
        al.relabel(snapshot.families, allocation)
    assert (time.process_time() - start) / 20 < 0.005  # the loop's second look costs lookups only
