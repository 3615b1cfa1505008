"""The option groups the sinks share are named the same in every section (`ca_file`, `cert_file`,
`key_file`, the spool, the backoff, the Azure credential), and a key's old name still works as a
deprecated alias: the value counts under the new key, one warning is logged, an error names the key
as written, and setting both in one section is refused."""

from __future__ import annotations

import logging

import pytest

from gpumon.cli import schemas
from gpumon.config import ConfigError, Section, load
from gpumon.sinks.azure_monitor import OPTIONS as AZURE
from gpumon.sinks.otel.settings import OPTIONS as OTEL
from gpumon.sinks.otel.settings import resolve_settings
from gpumon.sinks.remote_write.sink import OPTIONS as REMOTE_WRITE

ALIASES = [
    ("azure_monitor", "ca_bundle", "ca_file"),
    ("otel", "certificate", "ca_file"),
    ("otel", "client_certificate", "cert_file"),
    ("otel", "client_key", "key_file"),
]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """The warning is once per process: each test starts with none given yet."""
    monkeypatch.setattr("gpumon.config._warned", set())


def _load(tmp_path, text: str, environ: dict[str, str] | None = None):
    path = tmp_path / "gpumon.toml"
    path.write_text(text)
    return load(schemas(), str(path), environ or {}, {})


def test_the_shared_groups_have_the_same_keys_in_every_sink():
    keys = {schema.name: {opt.key for opt in schema.options} for schema in (AZURE, OTEL, REMOTE_WRITE)}
    assert all("ca_file" in found for found in keys.values())
    assert {"cert_file", "key_file", "backoff_initial", "backoff_max"} <= keys["otel"] & keys["remote_write"]
    credential = {"credential", "client_id", "tenant_id", "client_secret", "audience", "spool_dir", "spool_max_bytes"}
    assert credential <= keys["azure_monitor"] & keys["remote_write"]
    ca = [schema.option("ca_file") for schema in (AZURE, OTEL, REMOTE_WRITE)]
    assert all(opt is not None and opt.type is str and opt.default == "" for opt in ca)


@pytest.mark.parametrize(("section", "old", "new"), ALIASES)
def test_an_old_name_in_the_file_still_works_with_one_warning(tmp_path, caplog, section, old, new):
    pem = tmp_path / "ca.pem"
    pem.write_text("x\n")
    with caplog.at_level(logging.WARNING, logger="gpumon.config"):
        config = _load(tmp_path, f'[{section}]\n{old} = "{pem}"\n')
        _load(tmp_path, f'[{section}]\n{old} = "{pem}"\n')  # a reload: not warned again
    assert config[section][new] == str(pem) and config[section][old] == str(pem)
    assert config.origin(section, new) == str(tmp_path / "gpumon.toml")
    warned = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert warned == [f"[{section}] {old} is deprecated (honoured for now): use [{section}] {new}"]


def test_an_old_name_in_the_environment_still_works(tmp_path, caplog):
    pem = tmp_path / "ca.pem"
    pem.write_text("x\n")
    with caplog.at_level(logging.WARNING, logger="gpumon.config"):
        config = _load(tmp_path, "", {"GPUMON_OTEL_CERTIFICATE": str(pem)})
    assert config["otel"].ca_file == str(pem)
    assert resolve_settings(OTEL.settings_of(config["otel"]), "metrics", {}).certificate == str(pem)
    assert "[otel] certificate is deprecated" in caplog.text


def test_an_error_names_the_key_as_written(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, f'[azure_monitor]\nca_bundle = "{tmp_path / "absent.pem"}"\n')
    assert err.value.key == "[azure_monitor] ca_bundle" and "no such file" in err.value.message


def test_both_names_in_one_section_is_an_error(tmp_path):
    pem = tmp_path / "ca.pem"
    pem.write_text("x\n")
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, f'[otel]\nca_file = "{pem}"\ncertificate = "{pem}"\n')
    assert err.value.key == "[otel] certificate" and "keep ca_file" in err.value.message


def test_a_section_handed_to_a_sink_with_an_old_name_is_read(caplog):
    with caplog.at_level(logging.WARNING, logger="gpumon.config"):
        settings = AZURE.settings_of(Section("azure_monitor", {"ca_bundle": "/etc/ca.pem"}))
    assert settings.ca_file == "/etc/ca.pem"
    assert "[azure_monitor] ca_bundle is deprecated" in caplog.text


def test_the_reference_lists_each_alias():
    from pathlib import Path

    reference = (Path(__file__).resolve().parent.parent.parent / "docs" / "configuration.md").read_text()
    for section, old, new in ALIASES:
        row = next(line for line in reference.splitlines()
                   if line.startswith(f"| `{new}` |") and f"GPUMON_{section.upper()}_" in line)
        assert f"Deprecated alias: `{old}`" in row
