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
    from gpumon import cli
    from gpumon.rulefiles import rule_groups

    alerts = [r["alert"] for g in rule_groups(REPO) for r in g["rules"] if "alert" in r]
    assert "GpumonGpuFabricUnhealthy" in alerts
    dashboards = read("docs", "dashboards.md")
    assert all(f"| {alert} |" in dashboards for alert in alerts)
    readme, reference = read("README.md"), read("docs", "cli.md")
    for name, parser in cli.build_parser().subcommands.items():
        assert f"| `gpumon {name}` |" in readme and f"## `gpumon {name}`" in reference
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in ("-h", "--help") or f"`{flag}" in reference, f"gpumon {name} {flag} missing from docs/cli.md"


def _sections(text: str) -> tuple[list[str], list[str]]:
    """The table titles of a ``gpumon once`` table and the collectors its last table lists."""
    blocks = [b.splitlines() for b in text.strip().split("\n\n")]
    titles = [b[0] for b in blocks[1:] if b]
    collectors = [line.split()[0] for line in blocks[-1][2:]]
    return titles, collectors


def test_readme_once_sample_shows_what_a_simulated_host_prints(capsys):
    """The README's simulated ``gpumon once`` sample has the tables and the collectors a run has now
    (the values differ run to run; the shape must not drift as collectors are added)."""
    from gpumon import cli

    assert cli.main(["once", "--simulate", "nd-h100-v5"]) == 0
    live = _sections(capsys.readouterr().out)
    readme = read("README.md")
    start = readme.index("$ gpumon once --simulate nd-h100-v5\n")
    sample = readme[start:readme.index("```", start)].split("\n", 1)[1]
    assert _sections(sample) == live, "README's gpumon once sample is stale: paste a fresh run"
    assert "Azure host" in live[0]


def test_readme_once_sample_off_gpu_lists_every_built_in_collector():
    from gpumon.registry import BUILTIN_COLLECTORS

    readme = read("README.md")
    start = readme.index("$ gpumon once\n")
    sample = readme[start:readme.index("```", start)]
    sample = sample[sample.index("gpumon on "):]
    assert _sections(sample)[1] == sorted(BUILTIN_COLLECTORS)


NOT_PATHS = {
    "tests/kql/node_modules": "installed by scripts/test.sh, not committed",
    "gpumon/gpumon": "the job name the Prometheus Operator would give, not a path",
}


def test_every_repository_path_the_docs_name_exists():
    """A file named in backquotes (`tests/...`, `gpumon/...`, `deploy/...`) that was renamed or never
    existed sends the reader nowhere."""
    import glob
    import re

    pages = ["README.md", *glob.glob("docs/**/*.md", root_dir=REPO, recursive=True)]
    pattern = re.compile(r"`((?:tests|gpumon|deploy|dashboards|bench|scripts|docs|examples|systemd)/[\w./-]+)`")
    missing = [(page, m.group(1)) for page in pages for m in pattern.finditer(read(page))
               if m.group(1) not in NOT_PATHS and not os.path.exists(os.path.join(REPO, m.group(1).rstrip(".")))]
    assert not missing, missing


def test_azure_managed_prometheus_imports_every_dashboard():
    page = read("docs", "azure-managed-prometheus.md")
    for name in sorted(os.listdir(os.path.join(REPO, "dashboards", "grafana"))):
        if name.endswith(".json"):
            assert f"`{name}`" in page or f"dashboards/grafana/{name}" in page, name
