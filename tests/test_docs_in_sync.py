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


def test_cli_reference_readme_commands_and_alert_table_are_generated():
    """docs/cli.md, the README's command table and docs/dashboards.md's alert table are made from the
    argument parser and the rule file: a new flag, subcommand or alert cannot go undocumented."""
    from gpumon.confdoc import outputs

    stale = [os.path.relpath(path, REPO) for path, text in outputs(REPO).items()
             if read(os.path.relpath(path, REPO)) != text]
    assert not stale, f"{', '.join(stale)} stale: run python -m gpumon.confdoc"


def test_every_alert_and_subcommand_is_in_the_docs():
    import yaml

    from gpumon import cli

    rules = yaml.safe_load(read("deploy", "prometheus", "alerting-rules.yaml"))
    alerts = [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]
    assert "GpumonGpuFabricUnhealthy" in alerts
    dashboards = read("docs", "dashboards.md")
    assert all(f"| {alert} |" in dashboards for alert in alerts)
    cli.build_parser()
    readme, reference = read("README.md"), read("docs", "cli.md")
    for name, parser in cli._SUBCOMMANDS.items():
        assert f"| `gpumon {name}` |" in readme and f"## `gpumon {name}`" in reference
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in ("-h", "--help") or f"`{flag}" in reference, f"gpumon {name} {flag} missing from docs/cli.md"
