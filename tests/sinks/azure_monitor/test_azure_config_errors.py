"""Azure Monitor config mistakes end `gpumon run` (and `check`) with exit 2 and a line that names the
key and the file or variable it came from; they are not start-up failures (exit 1)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpumon.config import DAEMON, ConfigError, load
from gpumon.sinks.azure_monitor import OPTIONS, AzureMonitorSink
from tests.conftest import clean_env

DCR = "dcr-00000000000000000000000000000001"


def run(config: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumon", *args, "--config", config, "--listen", "127.0.0.1:0"],
                          env=clean_env(**env), capture_output=True, text=True, timeout=60)


def write_config(tmp_path, azure: str, daemon: str = "") -> str:
    path = tmp_path / "gpumon.toml"
    path.write_text(f'[daemon]\nsinks = ["azure_monitor"]\ncollectors = []\nstate_dir = "{tmp_path / "state"}"\n'
                    f"{daemon}\n[azure_monitor]\n{azure}\n")
    return str(path)


@pytest.mark.parametrize(("azure", "key", "words"), [
    (f'endpoint = "http://ingest.example"\ndcr_immutable_id = "{DCR}"', "endpoint", "https://"),
    ('endpoint = "https://ingest.example"', "dcr_immutable_id", "is required"),
    (f'endpoint = "https://ingest.example"\ndcr_immutable_id = "{DCR}"\ncredential = "service_principal"\n'
     'tenant_id = "t"\nclient_id = "c"', "client_secret", "service_principal"),
    (f'endpoint = "https://ingest.example"\ndcr_immutable_id = "{DCR}"\nca_bundle = "/nonexistent/ca.pem"',
     "ca_bundle", "no such file"),
])
def test_run_exits_2_naming_the_key_and_the_file(tmp_path, azure, key, words):
    config = write_config(tmp_path, azure)
    result = run(config, "run")
    assert result.returncode == 2, result.stderr
    assert f"{config}: [azure_monitor] {key}: " in result.stderr and words in result.stderr


def test_unwritable_spool_dir_exits_2_naming_the_key_and_the_file(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    config = write_config(tmp_path, f'endpoint = "https://ingest.example"\ndcr_immutable_id = "{DCR}"\n'
                                    f'spool_dir = "{blocker / "spool"}"')
    result = run(config, "run")
    assert result.returncode == 2, result.stderr
    assert f"{config}: [azure_monitor] spool_dir: " in result.stderr
    assert f"{blocker} is not a directory" in result.stderr


def test_default_spool_dir_under_an_unusable_state_dir_names_state_dir_as_the_cause(tmp_path):
    blocker = tmp_path / "state-file"
    blocker.write_text("x")
    config = write_config(tmp_path, f'endpoint = "https://ingest.example"\ndcr_immutable_id = "{DCR}"')
    result = run(config, "check", GPUMON_DAEMON_STATE_DIR=str(blocker))
    assert result.returncode == 2, result.stderr
    assert "environment variable GPUMON_DAEMON_STATE_DIR: [azure_monitor] spool_dir: " in result.stderr
    assert "under [daemon] state_dir" in result.stderr


def test_a_value_from_the_environment_is_named_by_its_variable(tmp_path):
    config = load([DAEMON, OPTIONS], None, environ={"GPUMON_AZURE_MONITOR_ENDPOINT": "ftp://x",
                                                    "GPUMON_AZURE_MONITOR_DCR_IMMUTABLE_ID": DCR,
                                                    "GPUMON_DAEMON_STATE_DIR": str(tmp_path)})
    with pytest.raises(ConfigError) as caught:
        AzureMonitorSink.validate(config)
    assert str(caught.value).startswith("environment variable GPUMON_AZURE_MONITOR_ENDPOINT: "
                                        "[azure_monitor] endpoint: must be an https:// URL")


def test_a_good_config_validates(tmp_path):
    config = load([DAEMON, OPTIONS], None, environ={"GPUMON_AZURE_MONITOR_ENDPOINT": "https://x.example",
                                                    "GPUMON_AZURE_MONITOR_DCR_IMMUTABLE_ID": DCR,
                                                    "GPUMON_DAEMON_STATE_DIR": str(tmp_path / "new" / "state")})
    AzureMonitorSink.validate(config)  # raises nothing, and creates nothing
    assert not (tmp_path / "new").exists()
