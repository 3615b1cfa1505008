"""AzNHC fault codes on the verdict: /health and `gpumon health --format json|nhc`, the health_changed
event, the NodeCondition messages and the Azure Logs event rows."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from gpumon.health import faultcodes
from gpumon.health.actions.kubernetes import conditions
from gpumon.health.catalogue import RULE_BY_ID, XID_POLICY, Level
from gpumon.health.stage import Verdict
from gpumon.health.state import Active, HealthState, boot_id
from gpumon.model import Event, Severity
from gpumon.sinks.azure_monitor.rows import RowBuilder
from tests.conftest import REPO, clean_env
from tests.fakes.logs_ingestion import load_declarations, validate_row
from tests.support.health_stage import Clock, Host, stage, until

# The table (AzNHC's nhc_fault_dictionary.cfg, see ../shared/reference/wave3.md section 2)
EXPECTED = {
    "ib.port.flapping": ("NHC2005", "Resource.Hpc.Unhealthy.IBPortFlapping"),
    "ib.port.down": ("NHC2004", "Resource.Hpc.Unhealthy.IBPortDown"),
    "ib.port.missing": ("NHC2002", "Resource.Hpc.Unhealthy.MissingIB"),
    "gpu.missing": ("NHC2009", "Resource.Hpc.Unhealthy.HpcMissingGpu"),
    "gpu.row_remap.failure": ("NHC2007", "Resource.Hpc.Unhealthy.HpcRowRemapFailure"),
    "gpu.xid.95": ("NHC2011", "Resource.Hpc.Unhealthy.XID95UncontainedECCError"),
    "gpu.xid.94": ("NHC2012", "Resource.Hpc.Unhealthy.XID94ContainedECCError"),
    "gpu.xid.79": ("NHC2013", "Resource.Hpc.Unhealthy.XID79FallenOffBus"),
    "gpu.xid.48": ("NHC2014", "Resource.Hpc.Unhealthy.XID48DoubleBitECC"),
    "gpu.fabric.health": ("NHC2016", "Resource.Hpc.Unhealthy.NvLink"),
    "gpu.ecc.uncorrectable": ("NHC2019", "Resource.Hpc.Unhealthy.DBEOverLimit"),
    "gpu.retired_pages.full": ("NHC2018", "Resource.Hpc.Unhealthy.ECCPageRetirementTableFull"),
}


@pytest.mark.parametrize("rule", sorted(EXPECTED))
def test_each_rule_carries_its_aznhc_code_and_impact_category(rule) -> None:
    fc = faultcodes.for_rule(rule)
    assert fc is not None and (fc.code, fc.category) == EXPECTED[rule]


def test_every_mapped_rule_exists_and_unmapped_rules_have_no_code() -> None:
    known = set(RULE_BY_ID) | {f"gpu.xid.{x}" for x in XID_POLICY}
    assert set(faultcodes.RULE_CODES) <= known
    assert all(code in faultcodes.FAULT_CODES for code in faultcodes.RULE_CODES.values())
    assert faultcodes.for_rule("collector.down") is None and faultcodes.for_rule("gpu.model") is None
    assert len(faultcodes.FAULT_CODES) == 22


def test_a_gpu_whose_page_retirement_table_is_full_is_unhealthy_with_nhc2018() -> None:
    # A GPU before Ampere (V100, T4) retires at most 64 pages; NVML fields 29/30 (sbe/dbe) feed the series.
    from gpumon.catalogue import gpu as gpu_metrics
    from gpumon.health.rules import Evaluator, Thresholds
    from gpumon.model import MetricFamily, Sample, Snapshot

    pages = {("0", "sbe"): 40, ("0", "dbe"): 24, ("1", "sbe"): 62, ("1", "dbe"): 1}
    fam = MetricFamily(gpu_metrics.RETIRED, tuple(Sample((("gpu", g), ("cause", c)), v)
                                                  for (g, c), v in sorted(pages.items())))
    found = {f.subject: f for f in Evaluator(Thresholds()).evaluate(Snapshot("n", 0.0, (fam,), (), ()), 0.0)
             if f.rule == "gpu.retired_pages.full"}
    full, short = found[(("gpu", "0"),)], found[(("gpu", "1"),)]
    assert (full.level, full.action) == (Level.UNHEALTHY, "replace_hardware") and "64 pages retired" in full.reason
    assert short.level == Level.OK                       # 63: one page left
    assert faultcodes.nhc_line(full.rule, full.reason).endswith("FaultCode: NHC2018")


def test_an_xid_79_finding_and_its_event_carry_nhc2013(tmp_path) -> None:
    host, clock = Host(tmp_path), Clock()
    s = stage(tmp_path, clock)
    s.update(host.snapshot())
    host.sim.apply({"action": "xid", "gpu": 3, "xid": 79})
    # the lost GPU may be judged a run before its XID 79 arrives: wait for the XID's own finding
    result = until(s, host, lambda r: any(f["rule"] == "gpu.xid.79" for f in r.verdict.findings))
    xid = next(f for f in result.verdict.findings if f["rule"] == "gpu.xid.79")
    assert xid["fault_code"] == "NHC2013"
    assert xid["impact_category"] == "Resource.Hpc.Unhealthy.XID79FallenOffBus"
    (event,) = result.events
    assert "NHC2013" in event.attributes["fault_codes"]
    assert "XID 79. FaultCode: NHC2013" in event.message
    doc = json.loads(json.dumps(result.verdict.as_dict()))  # what /health and --format json print
    assert {f["rule"]: f["fault_code"] for f in doc["findings"]}["gpu.xid.79"] == "NHC2013"
    # a rule AzNHC has no code for says so rather than inventing one
    assert all("fault_code" in f for f in doc["findings"])


def finding(rule: str, reason: str, subject: dict[str, str] | None = None) -> dict:
    a = Active(rule, [list(p) for p in (subject or {}).items()], int(Level.UNHEALTHY), "reboot", reason, False,
               1.0, 1.0)
    return a.as_dict()


def test_node_condition_messages_end_with_the_fault_code_as_aks_writes_them() -> None:
    verdict = Verdict(Level.UNHEALTHY, "reboot", (finding("gpu.missing", "7 of 8 GPUs of a ND H100 v5 present"),
                                                  finding("collector.down", "collector nvml is down: x")), "", 1.0)
    by_type = {c["type"]: c for c in conditions(verdict, {}, 2.0)}
    assert by_type["GPUMissing"]["message"] == "7 of 8 GPUs of a ND H100 v5 present. FaultCode: NHC2009"
    assert by_type["GpumonUnhealthy"]["message"] == "collector nvml is down: x"  # no code: no suffix


def test_azure_event_rows_carry_a_faultcode_column_the_dcr_declares() -> None:
    row = RowBuilder("node-1").event_row(Event(
        "health_changed", Severity.CRITICAL, {}, "node health ok -> unhealthy",
        {"previous": "ok", "current": "unhealthy", "fault_codes": ["NHC2013", "NHC2005"]}, time=1_700_000_000.0))
    assert row["FaultCode"] == "NHC2013,NHC2005"
    assert validate_row(row, load_declarations()["Custom-GpuMonEvents_CL"]) is None


def nhc(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumon", "health", "--simulate", "nd-h100-v5", "--format", "nhc",
                           *extra], env=clean_env(GPUMON_DAEMON_STATE_DIR=str(tmp_path / "state")),
                          capture_output=True, text=True, timeout=60)


def test_format_nhc_prints_healthy_then_nhc_error_lines_with_the_fault_code(tmp_path) -> None:
    healthy = nhc(tmp_path)
    assert healthy.returncode == 0, healthy.stderr
    assert re.fullmatch(r"\S+ \| Healthy\n", healthy.stdout), healthy.stdout
    host = healthy.stdout.split(" | ")[0]
    state_dir = tmp_path / "state" / "simulate" / "nd-h100-v5" / "state"
    os.makedirs(state_dir, exist_ok=True)
    sticky = Active("gpu.xid.79", [["gpu", "3"]], 2, "reboot", "GPU 3: XID 79", True, 1.0, 1.0)
    (state_dir / "health.json").write_text(HealthState(boot_id(), {sticky.key: sticky}).to_json())
    failed = nhc(tmp_path)
    assert failed.returncode == 1, failed.stderr
    assert failed.stdout == f"{host} | ERROR:  nhc:  Health check failed:  gpu.xid.79: GPU 3: XID 79. " \
                            "FaultCode: NHC2013\n"


def test_the_fault_code_table_in_the_docs_is_the_generated_one() -> None:
    path = os.path.join(REPO, "docs", "health-actions.md")
    with open(path, encoding="utf-8") as fh:
        assert faultcodes.markdown() in fh.read(), "regenerate with python -m gpumon.health.faultcodes"
