"""The configuration reference and the example file are generated from the schemas and must match."""

from __future__ import annotations

import os
import sys

from gpumon.cli import schemas
from gpumon.confdoc import example_toml, reference_markdown
from gpumon.config import load
from tests.conftest import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts), encoding="utf-8") as fh:
        return fh.read()


def test_configuration_reference_documents_every_key():
    assert read("docs", "configuration.md") == reference_markdown(schemas()), (
        "docs/configuration.md is stale: run python -m gpumon.confdoc")


def test_example_shows_every_default_and_loads():
    assert read("examples", "gpumon.toml") == example_toml(schemas()), (
        "examples/gpumon.toml is stale: run python -m gpumon.confdoc")
    path = os.path.join(REPO, "examples", "gpumon.toml")
    config = load(schemas(), path, {}, {})
    document = tomllib.loads(read("examples", "gpumon.toml"))
    for schema in schemas():
        for option in schema.options:
            assert document[schema.name][option.key] == option.default
            assert config[schema.name][option.key] == option.default
