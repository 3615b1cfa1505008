"""The sections of ``gpumon once --format table`` (gpumon/report/tables.py): one per built-in collector,
looked up by name, and a plugin collector's own ``summarize`` asked for one the report does not know."""

from __future__ import annotations

import time

from gpumon import registry
from gpumon.collectors.base import Collector
from gpumon.model import CollectorStatus, Snapshot
from gpumon.report import as_table
from gpumon.report.tables import BUILTIN, infiniband_table, nvml_table, table_for
from gpumon.table import Table
from tests.conftest import write_distribution
from tests.support.infiniband import collector
from tests.support.nvml import rig

RACK = """
    from gpumon.plugin import Collector, Table

    class Rack(Collector):
        name = "acme_rack_table"

        @classmethod
        def summarize(cls, snapshot):
            return Table("Rack inlets", ("sensor", "celsius"), (("inlet-a", "24.5"),))
"""


def test_summary_table_has_one_row_per_gpu_and_fits_100_columns() -> None:
    fake, c, _ = rig()
    c.collect()
    fake.set_lost(5, xid=False)
    out = c.collect()
    snap = Snapshot("h", 0.0, tuple(out.families), (), ())
    table = nvml_table(snap)
    assert table is not None and len(table.rows) == 8
    assert all(len(r) == len(table.columns) for r in table.rows)
    widths = [max(len(str(x)) for x in col) for col in zip(table.columns, *table.rows)]
    assert sum(widths) + 2 * (len(widths) - 1) <= 100, widths
    row0 = dict(zip(table.columns, table.rows[0]))
    assert row0["Model"] == "H100 80GB HBM3" and row0["Power"].endswith("/700W")
    assert dict(zip(table.columns, table.rows[5]))["Util"] == "LOST"
    assert nvml_table(Snapshot("h", 0.0, (), (), ())) is None
    c.close()


def test_summarize_one_row_per_port_within_100_columns(tmp_path) -> None:
    ib, fabric = collector(tmp_path, "saturated-link-downed", )
    fabric.set_counter("mlx5_ib0", 1, "symbol_error", 12)
    snap = Snapshot("h", time.time(), tuple(ib.collect().families), (), ())
    table = infiniband_table(snap)
    assert table is not None and len(table.rows) == 1
    row = dict(zip(table.columns, table.rows[0]))
    assert row["port"] == "mlx5_ib0/1" and row["netdev"] == "ib0" and row["state"] == "IB ACTIVE"
    assert row["rate"] == "400G"
    assert "downed=255" in row["errors"] and "sym=12" in row["errors"]
    widths = [max(len(c), *(len(r[i]) for r in table.rows)) for i, c in enumerate(table.columns)]
    assert sum(widths) + 2 * (len(widths) - 1) <= 100
    assert infiniband_table(Snapshot("h", 0, (), (), ())) is None


def test_the_tables_are_the_reports_and_keyed_by_built_in_collector_names() -> None:
    assert set(BUILTIN) <= set(registry.BUILTIN_COLLECTORS)
    assert table_for("nvml") is nvml_table and table_for("acme_rack_table") is None
    for name in registry.BUILTIN_COLLECTORS:  # no built-in collector builds a section of its own
        assert registry.collector_class(name).summarize.__func__ is Collector.summarize.__func__, name


def test_a_plugin_collectors_summarize_is_asked_for_a_collector_the_report_has_no_table_for(
        tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(write_distribution(
        tmp_path, "acme-rack-table", "[gpumon.collectors]\nacme_rack_table = acme_rack_table:Rack\n",
        {"acme_rack_table.py": RACK})))
    ok = (CollectorStatus("acme_rack_table", True, 0.001), CollectorStatus("nvml", True, 0.001))
    text = as_table(Snapshot("h", 0.0, (), (), ok))
    assert "Rack inlets" in text and "inlet-a  24.5" in text
    assert "GPUs (NVML)" not in text  # the report's nvml table: nothing of nvml in the snapshot
    assert isinstance(registry.collector_class("acme_rack_table").summarize(Snapshot("h", 0, (), (), ())), Table)
