"""A reload that fails to start its new set-up goes back to the old one without leaking the new
health stage's action threads, and keeps the running stage (its memory and its actions)."""

from __future__ import annotations

import socket
import stat
import threading

from gpumon.cli import schemas
from gpumon.config import load
from gpumon.daemon import Daemon


def action_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("gpumon-action-") and t.is_alive())


def test_a_reload_that_cannot_start_rolls_back_without_leaking_action_threads(tmp_path) -> None:
    hook = tmp_path / "hook"
    hook.write_text("#!/bin/sh\ncat > /dev/null\n")
    hook.chmod(hook.stat().st_mode | stat.S_IXUSR)
    env = {"GPUMON_DAEMON_STATE_DIR": str(tmp_path / "state"), "GPUMON_DAEMON_SIMULATE": "hbv4",
           "GPUMON_HEALTH_HOOK": str(hook), "GPUMON_PROMETHEUS_LISTEN": "127.0.0.1:0",
           "GPUMON_AZURE_IMDS_URL": "http://127.0.0.1:1"}
    before = action_threads()
    daemon = Daemon(load(schemas(), None, env, {}))
    daemon.start()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        stage = daemon.loop.health
        assert stage is not None and action_threads() == before + 1
        # a new [health] (a new stage with its own hook thread) and a port that is taken: the new
        # set-up cannot start, the old one comes back
        bad = load(schemas(), None, {**env, "GPUMON_HEALTH_HOLD_SECONDS": "60",
                                     "GPUMON_PROMETHEUS_LISTEN": f"127.0.0.1:{busy.getsockname()[1]}"}, {})
        daemon.reload(bad)
        assert daemon.reloads.as_dict()["failure"] == 1
        assert daemon.loop.health is stage  # the running stage, not a third one
        assert action_threads() == before + 1
    finally:
        busy.close()
        daemon.stop()
    assert action_threads() == before
