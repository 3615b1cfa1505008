"""`gpumon run --simulate nd-h100-v5 --sinks azure_monitor` delivers the three tables, schema-valid.

The daemon gets its config from GPUMON_AZURE_MONITOR_* variables and its token from the real
ManagedIdentityCredential talking to a loopback IMDS (AZURE_POD_IDENTITY_AUTHORITY_HOST).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from gpumon.simulate import control
from tests.conftest import REPO
from tests.fakes.imds import ImdsServer
from tests.fakes.logs_ingestion import IngestionServer

GPU, IB, EVENTS = "Custom-GpuMonGpu_CL", "Custom-GpuMonInfiniBand_CL", "Custom-GpuMonEvents_CL"


def test_simulated_h100_host_fills_the_three_tables(tmp_path):
    with IngestionServer() as srv:
        imds = ImdsServer()
        try:
            state = tmp_path / "state"
            env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMON_")}
            # the token from this IMDS stand-in; the VM and placement columns from the simulated host's own
            env.update(GPUMON_AZURE_MONITOR_ENDPOINT=srv.endpoint, GPUMON_AZURE_MONITOR_DCR_IMMUTABLE_ID=srv.dcr_id,
                       GPUMON_AZURE_MONITOR_CA_BUNDLE=srv.ca_path, GPUMON_AZURE_MONITOR_UPLOAD_INTERVAL="1",
                       GPUMON_DAEMON_STATE_DIR=str(state), AZURE_POD_IDENTITY_AUTHORITY_HOST=imds.url)
            proc = subprocess.Popen([sys.executable, "-m", "gpumon", "run", "--simulate", "nd-h100-v5",
                                     "--sinks", "azure_monitor", "--interval", "0.25"],
                                    cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                assert srv.wait_for(lambda s: len(s.rows(GPU)) >= 8 and len(s.rows(IB)) >= 9, timeout=30)
                control(str(state / "simulate" / "nd-h100-v5"), {"action": "xid", "gpu": 3, "xid": 79})
                assert srv.wait_for(lambda s: any(r["Kind"] == "gpu_xid" for r in s.rows(EVENTS)), timeout=20)
            finally:
                proc.send_signal(signal.SIGTERM)
                out, _ = proc.communicate(timeout=20)
            assert proc.returncode == 0, out
        finally:
            imds.close()
        assert {r.status for r in srv.requests()} == {204}  # every row matched the template's declarations
        gpu_rows = srv.rows(GPU)
        assert {r["Gpu"] for r in gpu_rows} == set(range(8))
        assert {(r["Device"], r["Port"]) for r in srv.rows(IB)} >= {(f"mlx5_ib{i}", 1) for i in range(8)}
        last = gpu_rows[-1]
        assert last["VmSize"] == "Standard_ND96isr_H100_v5" and last["Region"] == "eastus2"
        assert last["Zone"] and last["Vmss"] and last["PlacementGroup"] and last["FaultDomain"]
        assert last["PhysicalHost"].startswith("SIM")  # the simulated host's KVP pool
        assert "PowerWattsAvg" in last
        assert all(r["Model"].startswith("NVIDIA H100") for r in gpu_rows[:8])  # static columns on first rows
        xid = next(r for r in srv.rows(EVENTS) if r["Kind"] == "gpu_xid")
        assert xid["Gpu"] == 3 and xid["Severity"] in ("error", "critical")
        assert xid["PlacementGroup"] == last["PlacementGroup"] and xid["PhysicalHost"] == last["PhysicalHost"]
        assert "Bearer " not in out  # no token in the log


def test_gpumon_run_killed_with_sigkill_loses_no_row(tmp_path, gpumon_run):
    """Endpoint down, rows spool up, the daemon is killed -9; after a restart every row arrives."""
    import re

    with IngestionServer() as srv:
        imds = ImdsServer()
        try:
            srv.refuse()
            env = dict(GPUMON_AZURE_MONITOR_ENDPOINT=srv.endpoint, GPUMON_AZURE_MONITOR_DCR_IMMUTABLE_ID=srv.dcr_id,
                       GPUMON_AZURE_MONITOR_CA_BUNDLE=srv.ca_path, GPUMON_AZURE_MONITOR_UPLOAD_INTERVAL="1",
                       GPUMON_AZURE_MONITOR_IMDS_URL=imds.compute_url, AZURE_POD_IDENTITY_AUTHORITY_HOST=imds.url)
            args = ("--simulate", "nd-h100-v5", "--sinks", "azure_monitor,prometheus", "--interval", "0.25")
            first = gpumon_run(*args, env=env)
            control(str(tmp_path / "state" / "simulate" / "nd-h100-v5"), {"action": "xid", "gpu": 1, "xid": 79})

            def queued() -> float:
                match = re.search(r'^gpumon_sink_rows_queued{sink="azure_monitor"} (\S+)$', first.metrics(), re.M)
                return float(match.group(1)) if match else 0.0

            # the XID has reached the sink (its row is spooled) and rows have piled up behind the outage
            assert srv.wait_for(lambda s: 'xid="79"' in first.metrics() and queued() >= 60, timeout=30)
            at_kill = queued()
            first.proc.kill()  # SIGKILL: no flush, no goodbye
            first.proc.communicate(timeout=10)
            srv.resume()
            second = gpumon_run(*args, env=env)
            assert srv.wait_for(lambda s: len({r["RowId"] for st in (GPU, IB, EVENTS) for r in s.rows(st)})
                                >= at_kill, timeout=60)
            assert any(r["Kind"] == "gpu_xid" and r["Gpu"] == 1 for r in srv.rows(EVENTS))
            second.stop()
        finally:
            imds.close()
