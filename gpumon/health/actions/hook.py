"""An operator's executable, given the verdict as JSON on stdin on each transition.

For what gpumon does not do itself (open a ticket, cordon through another tool, page someone). A
non-zero exit is a failure and is retried with backoff like the other actions; one that outlives
``[health] timeout`` is killed with its whole process group.
"""

from __future__ import annotations

import json
import os

from gpumon.health.actions.process import ActionError, clean_environment, run_bounded
from gpumon.health.actions.settings import ActionSettings
from gpumon.health.stage import Verdict


class HookAction:
    kind = "hook"

    def __init__(self, settings: ActionSettings) -> None:
        self.path = settings.hook
        self.timeout = settings.timeout

    def act(self, verdict: Verdict) -> None:
        stdin = (json.dumps(verdict.as_dict(), sort_keys=True) + "\n").encode()
        out = run_bounded([self.path], self.timeout, stdin=stdin,
                          env=clean_environment(extra={"GPUMON_HEALTH_STATUS": verdict.as_dict()["status"],
                                                       "GPUMON_HEALTH_ACTION": verdict.action}))
        if out.returncode != 0:
            last = out.stderr.strip().splitlines()
            raise ActionError(f"hook {self.path} exited {out.returncode}"
                              + (f": {last[-1][:300]}" if last else ""))


def check(settings: ActionSettings) -> list[str]:
    if settings.hook and not (os.path.isfile(settings.hook) and os.access(settings.hook, os.X_OK)):
        return [f"[health] hook {settings.hook} is not an executable file"]
    return []
