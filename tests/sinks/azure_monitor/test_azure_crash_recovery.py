"""Outage, then kill -9 in the middle of an upload, then a restart: every row produced arrives."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.conftest import REPO
from tests.fakes.logs_ingestion import IngestionServer

STREAMS = ("Custom-GpuMonGpu_CL", "Custom-GpuMonEvents_CL")


def start_child(srv: IngestionServer, state: str, produced: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.azure_crash_child", state, srv.endpoint, srv.ca_path,
                             srv.dcr_id, produced], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    return proc


def produced_ids(path: str) -> set[str]:
    with open(path, encoding="utf-8") as fh:
        return {line.strip() for line in fh if len(line.strip()) == 36}  # a torn last line is not a row


def delivered(srv: IngestionServer) -> set[str]:
    return {row["RowId"] for stream in STREAMS for row in srv.rows(stream)}


def test_nothing_lost_across_outage_and_sigkill_mid_upload(tmp_path):
    state, produced = str(tmp_path / "state"), str(tmp_path / "produced.txt")
    with IngestionServer() as srv:
        srv.refuse()  # the outage: rows pile up in the spool
        child = start_child(srv, state, produced)
        try:
            assert srv.wait_for(lambda s: len(produced_ids(produced)) >= 40, timeout=20)
            srv.fail(0, hang=True)  # the next upload is left hanging...
            srv.resume()
            assert srv.wait_for(lambda s: s.hung_count() >= 1, timeout=20)
            child.send_signal(signal.SIGKILL)  # ...and the process dies in the middle of it
            child.wait(timeout=10)
        finally:
            if child.poll() is None:
                child.kill()
            child.stdout.close()
        srv.release_hung()
        before_restart = produced_ids(produced)
        assert not before_restart <= delivered(srv)  # the outage really held rows back

        child = start_child(srv, state, produced)
        try:
            assert srv.wait_for(lambda s: before_restart <= delivered(s), timeout=30)
        finally:
            child.send_signal(signal.SIGTERM)
            assert child.wait(timeout=15) == 0
            child.stdout.close()
        everything = produced_ids(produced)
        assert srv.wait_for(lambda s: everything <= delivered(s), timeout=10), \
            f"{len(everything - delivered(srv))} rows never arrived"
        rows = [r for stream in STREAMS for r in srv.rows(stream)]
        assert len(rows) >= len(everything)  # at least once; duplicates are allowed and carry the same RowId
