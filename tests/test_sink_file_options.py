"""Sink options that name a file are checked when the config loads: a file that is not there, a
directory or a FIFO is a config error naming the section and key (exit 2, or a refused reload), never
a sink that blocks on a read or a thread that dies on its first export. Empty means unset."""

from __future__ import annotations

import os

import pytest

from gpumon.cli import schemas
from gpumon.config import ConfigError, load

FILE_OPTIONS = [
    ("otel", "certificate"),
    ("otel", "client_certificate"),
    ("otel", "client_key"),
]


def _load(tmp_path, section: str, key: str, value: str):
    path = tmp_path / "gpumon.toml"
    path.write_text(f"[{section}]\n{key} = {value!r}\n")
    return load(schemas(), str(path), {}, {})


@pytest.mark.parametrize(("section", "key"), FILE_OPTIONS)
def test_a_file_option_naming_no_file_is_a_config_error(tmp_path, section, key):
    missing = str(tmp_path / "absent.pem")
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, section, key, missing)
    assert err.value.key == f"[{section}] {key}" and missing in err.value.message


@pytest.mark.parametrize(("section", "key"), FILE_OPTIONS)
def test_a_file_option_naming_a_fifo_is_refused_without_blocking(tmp_path, section, key):
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, section, key, fifo)
    assert "FIFO" in err.value.message


@pytest.mark.parametrize(("section", "key"), FILE_OPTIONS)
def test_a_file_option_left_empty_or_naming_a_file_loads(tmp_path, section, key):
    regular = tmp_path / "file.pem"
    regular.write_text("x\n")
    assert _load(tmp_path, section, key, "")[section][key] == ""
    assert _load(tmp_path, section, key, str(regular))[section][key] == str(regular)
