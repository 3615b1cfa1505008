"""Config layering (defaults < TOML < environment < flags) and one clear error per mistake."""

from __future__ import annotations

import string
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon.cli import schemas
from gpumon.config import ConfigError, load
from tests.conftest import clean_env


def write(tmp_path, text: str):
    path = tmp_path / "gpumon.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_file(tmp_path, monkeypatch):
    monkeypatch.setattr("gpumon.config.DEFAULT_CONFIG_PATH", str(tmp_path / "absent.toml"))
    config = load(schemas(), None, {}, {})
    assert config.daemon.collectors == ["auto"]
    assert config.daemon.sinks == ["prometheus"]
    assert config["prometheus"].listen == "0.0.0.0:9470"
    assert config.source == "(defaults)"


def test_default_file_is_read_when_present(tmp_path, monkeypatch):
    path = write(tmp_path, "[daemon]\ninterval = 3\n")
    monkeypatch.setattr("gpumon.config.DEFAULT_CONFIG_PATH", path)
    assert load(schemas(), None, {}, {}).daemon.interval == 3.0


def test_layers_later_wins(tmp_path):
    path = write(tmp_path, '[daemon]\ninterval = 5\nlog_level = "debug"\n[prometheus]\nlisten = ":1000"\n')
    env = {"GPUMON_DAEMON_INTERVAL": "7", "GPUMON_PROMETHEUS_LISTEN": "127.0.0.1:2000"}
    config = load(schemas(), path, env, {"interval": "9"})
    assert config.daemon.interval == 9.0
    assert config.daemon.log_level == "debug"
    assert config["prometheus"].listen == "127.0.0.1:2000"
    assert config.origins["daemon.interval"] == "flag --interval"
    assert config.origins["prometheus.listen"] == "environment variable GPUMON_PROMETHEUS_LISTEN"


def test_env_lists_and_bools(tmp_path):
    config = load(schemas(), None, {"GPUMON_DAEMON_COLLECTORS": "nvml, infiniband"}, {}, )
    assert config.daemon.collectors == ["nvml", "infiniband"]


@pytest.mark.parametrize("text, key, fragment", [
    ("[daemon]\ninterval = 0\n", "[daemon] interval", "must be >= 0.05"),
    ("[daemon]\ninterval = \"fast\"\n", "[daemon] interval", "must be a number"),
    ("[daemon]\nbogus = 1\n", "[daemon] bogus", "unknown key"),
    ("[nonsense]\nx = 1\n", "[nonsense]", "unknown section"),
    ("[daemon]\nlog_level = \"loud\"\n", "[daemon] log_level", "not one of"),
    ("[daemon]\ncollectors = \"nvml\"\n", "[daemon] collectors", None),
    ("[daemon]\ncollectors = [1, 2]\n", "[daemon] collectors", "list of strings"),
    ("[prometheus]\nlisten = \"nohost\"\n", "[prometheus] listen", None),
    ("[prometheus]\nlisten = \":99999\"\n", "[prometheus] listen", "0-65535"),
    ("daemon = 3\n", "[daemon]", "must be a table"),
    ("[daemon\n", "(syntax)", "not valid TOML"),
])
def test_bad_file_names_key_and_file(tmp_path, text, key, fragment):
    path = write(tmp_path, text)
    try:
        load(schemas(), path, {}, {})
    except ConfigError as exc:
        assert exc.source == path and exc.key == key
        if fragment:
            assert fragment in exc.message
    else:
        # a plain string for a list is accepted as a comma list; every other case must fail
        assert key == "[daemon] collectors" and "nvml" in text


def test_bad_environment_is_named():
    with pytest.raises(ConfigError) as err:
        load(schemas(), None, {"GPUMON_DAEMON_DEADLINE": "-1"}, {})
    assert err.value.source == "environment variable GPUMON_DAEMON_DEADLINE"
    with pytest.raises(ConfigError) as err:
        load(schemas(), None, {"GPUMON_DAEMON_INTERVL": "1"}, {})
    assert "GPUMON_DAEMON_INTERVL" in str(err.value) and "unknown key" in str(err.value)


def test_kubernetes_service_links_are_not_config():
    env = {"GPUMON_SERVICE_HOST": "10.0.0.1", "GPUMON_PORT": "tcp://10.0.0.1:9470",
           "GPUMON_PORT_9470_TCP_ADDR": "10.0.0.1"}
    assert load(schemas(), None, env, {}).daemon.interval == 10.0


def test_missing_file():
    with pytest.raises(ConfigError, match="no such file"):
        load(schemas(), "/nonexistent/gpumon.toml", {}, {})


@pytest.mark.parametrize("args, env, fragment", [
    (["--config", "/nonexistent.toml"], {}, "/nonexistent.toml: (file): no such file"),
    (["--interval", "soon"], {}, "flag --interval: [daemon] interval: must be a number"),
    (["--collectors", "gpu"], {}, "[daemon] collectors: unknown name 'gpu'"),
    (["--sinks", "kafka"], {}, "[daemon] sinks: unknown name 'kafka'"),
    ([], {"GPUMON_PROMETHEUS_LISTEN": "x:y"}, "GPUMON_PROMETHEUS_LISTEN"),
    (["--log-format", "xml"], {}, "[daemon] log_format"),
    (["--config", "/etc/passwd/gpumon.toml"], {}, "/etc/passwd/gpumon.toml: (file): Not a directory"),
    (["--sinks", "prometheus,prometheus"], {}, "[daemon] sinks: names a plugin twice"),
])
def test_cli_exits_2_with_one_line(args, env, fragment):
    # check: the command that takes every flag, --sinks included (once starts no sink)
    result = subprocess.run([sys.executable, "-m", "gpumon", "check", *args], env=clean_env(**env),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr


SCHEMAS = schemas()
KEYS = [(s.name, o.key) for s in SCHEMAS for o in s.options]
toml_scalars = st.one_of(
    st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.booleans(), st.text(string.printable, max_size=20),
    st.lists(st.text(string.ascii_letters, max_size=8), max_size=3),
)


def _toml(value) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KEYS + [("daemon", "nope"), ("zzz", "a")]), toml_scalars),
                max_size=6))
def test_fuzz_file_loads_or_config_error(tmp_path_factory, entries):
    sections: dict[str, dict[str, object]] = {}
    for (section, key), value in entries:
        sections.setdefault(section, {})[key] = value
    text = "".join(f"[{s}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in kv.items()) for s, kv in sections.items())
    path = tmp_path_factory.mktemp("fuzz") / "c.toml"
    path.write_text(text)
    try:
        config = load(SCHEMAS, str(path), {}, {})
    except ConfigError as exc:
        assert str(path) in str(exc) and exc.key
    else:
        for section, kv in sections.items():
            for key in kv:
                assert key in config[section]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(KEYS), st.text(max_size=30))
def test_fuzz_environment_loads_or_config_error(key, text):
    section, option = key
    if "\x00" in text:
        return  # the OS cannot put NUL into an environment variable
    var = f"GPUMON_{section.upper()}_{option.upper()}"
    try:
        load(SCHEMAS, None, {var: text}, {})
    except ConfigError as exc:
        assert var in str(exc)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_raw_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("raw") / "c.toml"
    path.write_bytes(data)
    try:
        load(SCHEMAS, str(path), {}, {})
    except ConfigError as exc:
        assert str(path) in str(exc)
