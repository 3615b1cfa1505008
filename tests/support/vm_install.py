"""deploy/vm/install.sh run as a test runs it: with this machine's pip configuration hidden, so the
installer's pip sees only its own --pip-arg."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


SCRIPT = REPO / "deploy" / "vm" / "install.sh"


def installer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment minus this machine's pip configuration: the installer's pip sees only --pip-arg."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, **(extra or {})}


def run_install(*args: str, env: dict[str, str] | None = None, script: Path = SCRIPT,
                timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(script), *args],
        capture_output=True, text=True, timeout=timeout, check=False, env=installer_env(env),
    )
