"""Snapshots -> interval rows: min/avg/max, counter increases across resets, rates, splits, events."""

from __future__ import annotations

import json

from gpumon.model import Event, MetricFamily, MetricSpec, MetricType, Severity, Snapshot
from gpumon.sinks.azure_monitor.rows import GPU, IB, RowBuilder
from tests.fakes.logs_ingestion import load_declarations, validate_row
from tests.support.declared_hints import hinted

POWER = hinted(MetricSpec("gpumon_gpu_power_watts", MetricType.GAUGE, "p", "watts", ("gpu", "uuid")))
ENERGY = hinted(MetricSpec("gpumon_gpu_energy_joules_total", MetricType.COUNTER, "e", "joules",
                           ("gpu", "uuid")))
INFO = hinted(MetricSpec("gpumon_gpu_info", MetricType.INFO, "i", "", ("gpu", "uuid", "model", "pci_bus_id")))
RX = hinted(MetricSpec("gpumon_ib_port_data_received_bytes_total", MetricType.COUNTER, "rx", "bytes",
                       ("device", "port")))
HW = hinted(MetricSpec("gpumon_ib_hw_stat_total", MetricType.COUNTER, "hw", "",
                       ("device", "port", "counter")))
FLAPPING = hinted(MetricSpec("gpumon_ib_port_flapping", MetricType.GAUGE, "f", "", ("device", "port")))
UNKNOWN = MetricSpec("gpumon_gpu_something_new", MetricType.GAUGE, "?", "", ("gpu", "uuid"))
DECLS = load_declarations()


def snap(*families: MetricFamily, events: tuple[Event, ...] = ()) -> Snapshot:
    return Snapshot("node-1", 1_700_000_000.0, tuple(families), events, ())


def fam(spec: MetricSpec, *samples) -> MetricFamily:
    return MetricFamily(spec, tuple(spec.sample(v, *labels) for v, *labels in samples))


def test_gauge_min_avg_max_and_counter_increase_with_reset():
    b = RowBuilder("node-1")
    for t, (power, energy) in enumerate([(100, 1000), (300, 1500), (200, 200)]):  # energy reset at t=2
        b.add(snap(fam(POWER, (power, "0", "GPU-a")), fam(ENERGY, (energy, "0", "GPU-a"))), float(t))
    rows = b.close_interval(1_700_000_060.0, 60.0)
    (row,) = rows[GPU]
    assert (row["PowerWattsMin"], row["PowerWattsAvg"], row["PowerWattsMax"]) == (100, 200, 300)
    assert row["EnergyJoulesIncrease"] == 500 + 200  # up 500, then a reset counted from zero
    assert row["EnergyJoulesTotal"] == 200
    assert row["Gpu"] == 0 and row["Uuid"] == "GPU-a" and row["Samples"] == 3
    assert row["TimeGenerated"] == "2023-11-14T22:14:20.000Z"

    b.add(snap(fam(POWER, (50, "0", "GPU-a")), fam(ENERGY, (260, "0", "GPU-a"))), 3.0)
    (row2,) = b.close_interval(1_700_000_120.0, 60.0)[GPU]
    assert row2["EnergyJoulesIncrease"] == 60  # measured from the previous interval's last value
    assert row2["PowerWattsMin"] == row2["PowerWattsMax"] == 50
    assert row2["RowId"] != row["RowId"]


def test_same_family_object_is_counted_once():
    b = RowBuilder("node-1")
    power = fam(POWER, (100, "0", "GPU-a"))
    for t in range(5):  # the loop re-publishes a collector's unchanged result with other collectors' news
        b.add(snap(power), float(t))
    b.add(snap(fam(POWER, (400, "0", "GPU-a"))), 5.0)
    (row,) = b.close_interval(1_700_000_060.0, 60.0)[GPU]
    assert row["PowerWattsAvg"] == 250 and row["Samples"] == 2


def test_rate_split_flag_and_info_columns_on_port_rows():
    b = RowBuilder("node-1")
    for t, (rx, oob) in enumerate([(0, 5), (4000, 7), (10000, 7)]):
        b.add(snap(fam(RX, (rx, "mlx5_ib0", "1")),
                   fam(HW, (oob, "mlx5_ib0", "1", "out_of_buffer"), (1, "mlx5_ib0", "1", "firmware_new_thing")),
                   fam(FLAPPING, (1 if t == 2 else 0, "mlx5_ib0", "1"))), t * 2.0)
    (row,) = b.close_interval(1_700_000_060.0, 4.0)[IB]
    assert row["DataReceivedBytesIncrease"] == 10000
    assert row["DataReceivedBytesPerSecond"] == 2500  # 10000 bytes over the 4 s between first and last
    assert row["OutOfBufferIncrease"] == 2
    assert row["Flapping"] is True
    assert row["Device"] == "mlx5_ib0" and row["Port"] == 1
    assert validate_row(row, DECLS["Custom-GpuMonInfiniBand_CL"]) is None


def test_info_labels_and_vm_identity_fill_string_columns_and_unknown_metrics_are_listed():
    b = RowBuilder("node-1")
    b.vm = {"vm_id": "vm-1", "vm_size": "Standard_ND96isr_H100_v5", "region": "eastus2"}
    b.add(snap(fam(INFO, (1, "0", "GPU-a", "NVIDIA H100 80GB HBM3", "00000000:18:00.0")),
               fam(POWER, (100, "0", "GPU-a")), fam(UNKNOWN, (1, "0", "GPU-a"))), 0.0)
    (row,) = b.close_interval(1_700_000_060.0, 60.0)[GPU]
    assert row["Model"] == "NVIDIA H100 80GB HBM3" and row["PciBusId"] == "00000000:18:00.0"
    assert (row["VmId"], row["VmSize"], row["Region"]) == ("vm-1", "Standard_ND96isr_H100_v5", "eastus2")
    assert b.unmapped == {"gpumon_gpu_something_new"}
    assert validate_row(row, DECLS["Custom-GpuMonGpu_CL"]) is None


def test_gpu_without_samples_in_the_interval_gets_no_row():
    b = RowBuilder("node-1")
    b.add(snap(fam(POWER, (100, "0", "GPU-a"), (100, "1", "GPU-b"))), 0.0)
    assert len(b.close_interval(1_700_000_060.0, 60.0)[GPU]) == 2
    b.add(snap(fam(POWER, (100, "0", "GPU-a"))), 1.0)  # GPU 1 fell off the bus
    assert [r["Gpu"] for r in b.close_interval(1_700_000_120.0, 60.0)[GPU]] == [0]


def test_event_row_flattens_subject_and_keeps_attributes():
    b = RowBuilder("node-1")
    event = Event("ib_link_flap", Severity.WARNING, {"device": "mlx5_ib3", "port": "1"}, "flap",
                  {"signals": ["link_downed", "state"], "nan": float("nan")}, time=1_700_000_000.5)
    row = b.event_row(event)
    assert row["Kind"] == "ib_link_flap" and row["Severity"] == "warning"
    assert row["Device"] == "mlx5_ib3" and row["Port"] == 1
    assert row["Attributes"] == {"signals": ["link_downed", "state"], "nan": None}
    assert row["TimeGenerated"] == "2023-11-14T22:13:20.500Z"
    json.dumps(row, allow_nan=False)
    assert validate_row(row, DECLS["Custom-GpuMonEvents_CL"]) is None


def test_zero_increases_are_left_out_unless_asked_for():
    for omit, expected in ((True, None), (False, 0)):
        b = RowBuilder("node-1", omit_zero_increases=omit)
        for t in range(2):
            b.add(snap(fam(RX, (4096, "mlx5_ib0", "1"))), float(t))
        (row,) = b.close_interval(1_700_000_060.0, 60.0)[IB]
        assert row.get("DataReceivedBytesIncrease") == expected
        assert row["DataReceivedBytesPerSecond"] == 0  # rates stay: avg() over time must see the zeros


def test_static_columns_repeat_hourly_or_on_change():
    limit = hinted(MetricSpec("gpumon_gpu_power_limit_watts", MetricType.GAUGE, "l", "watts",
                              ("gpu", "uuid")))
    b = RowBuilder("node-1", static_every=3600)
    seen = []
    for minute, watts in enumerate([700, 700, 700, 650]):
        b.add(snap(fam(INFO, (1, "0", "GPU-a", "H100", "00:18")), fam(limit, (watts, "0", "GPU-a")),
                   fam(POWER, (300, "0", "GPU-a"))), float(minute))
        (row,) = b.close_interval(1_700_000_000.0 + 60 * minute, 60.0)[GPU]
        seen.append((row.get("Model"), row.get("PowerLimitWatts"), row["PowerWattsAvg"]))
    assert seen == [("H100", 700, 300), (None, None, 300), (None, None, 300), ("H100", 650, 300)]
    b.add(snap(fam(INFO, (1, "0", "GPU-a", "H100", "00:18")), fam(limit, (650, "0", "GPU-a"))), 9.0)
    (row,) = b.close_interval(1_700_000_000.0 + 3600 + 180, 60.0)[GPU]
    assert row["Model"] == "H100"  # an hour later they come again unchanged


ALLOC = MetricSpec("gpumon_gpu_allocation_info", MetricType.INFO, "a", "",
                   ("gpu", "uuid", "gpu_instance", "namespace", "pod", "container", "job_id"))


def test_gpu_rows_name_every_holder_of_the_interval_comma_joined():
    b = RowBuilder("node-1")
    held = fam(ALLOC, (1, "0", "GPU-a", "", "ml", "train-0", "main", ""), (1, "1", "GPU-b", "", "", "", "", "4242"))
    b.add(snap(held, fam(POWER, (100, "0", "GPU-a"), (90, "1", "GPU-b"), (80, "2", "GPU-c"))), 0.0)
    shared = fam(ALLOC, (1, "0", "GPU-a", "", "ml", "train-1", "main", ""))  # train-0 left, train-1 came
    b.add(snap(shared, fam(POWER, (100, "0", "GPU-a"), (90, "1", "GPU-b"), (80, "2", "GPU-c"))), 1.0)
    rows = {r["Gpu"]: r for r in b.close_interval(1_700_000_060.0, 60.0)[GPU]}
    assert (rows[0]["Namespace"], rows[0]["Pod"], rows[0]["Container"]) == ("ml,ml", "train-0,train-1", "main,main")
    assert "JobId" not in rows[0]
    assert rows[1]["JobId"] == "4242" and "Pod" not in rows[1]
    assert not {"Namespace", "Pod", "Container", "JobId"} & set(rows[2])
    assert all(validate_row(r, DECLS["Custom-GpuMonGpu_CL"]) is None for r in rows.values())
    b.add(snap(fam(POWER, (100, "0", "GPU-a"))), 2.0)  # next interval: nobody holds GPU 0 any more
    (row,) = b.close_interval(1_700_000_120.0, 60.0)[GPU]
    assert row["Pod"] == "train-1"  # it held the GPU when the interval began
    b.add(snap(fam(POWER, (100, "0", "GPU-a"))), 3.0)
    (row,) = b.close_interval(1_700_000_180.0, 60.0)[GPU]
    assert "Pod" not in row


def test_relabelled_copies_of_a_series_count_once():
    """[attribution] labels = true: two holders make two copies of each series; the row is the same."""
    from gpumon.attribution_labels import relabel

    held = fam(ALLOC, (1, "0", "GPU-a", "", "ml", "a", "main", ""), (1, "0", "GPU-a", "", "ml", "b", "main", ""))
    plain, copied = RowBuilder("node-1"), RowBuilder("node-1")
    for t, (power, energy) in enumerate([(100, 1000), (300, 1500)]):
        families = (held, fam(POWER, (power, "0", "GPU-a")), fam(ENERGY, (energy, "0", "GPU-a")))
        plain.add(snap(*families), float(t))
        copied.add(snap(*relabel(families, held)), float(t))
    (want,) = plain.close_interval(1_700_000_060.0, 60.0)[GPU]
    (got,) = copied.close_interval(1_700_000_060.0, 60.0)[GPU]
    assert len(relabel((fam(POWER, (1, "0", "GPU-a")),), held)[0].samples) == 2
    for key in ("PowerWattsAvg", "EnergyJoulesIncrease", "EnergyJoulesTotal", "Samples", "Pod"):
        assert got[key] == want[key], key
    assert got["Pod"] == "a,b"


def test_event_rows_carry_the_holders_of_the_gpu():
    b = RowBuilder("node-1")
    event = Event("gpu_xid", Severity.ERROR, {"gpu": "3", "uuid": "GPU-d"}, "GPU 3: XID 79 (pod=train-0)",
                  {"xid": 79, "namespace": "ml", "pod": "train-0", "container": "main"})
    row = b.event_row(event)
    assert (row["Namespace"], row["Pod"], row["Container"]) == ("ml", "train-0", "main") and "JobId" not in row
    assert validate_row(row, DECLS["Custom-GpuMonEvents_CL"]) is None
