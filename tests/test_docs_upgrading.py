"""The README's "Upgrading" and CHANGELOG.md say what the code does: the changelog's newest version is
gpumon's, the keys named as deprecated aliases still load, and the renamed metric exists by its new
name only."""

from __future__ import annotations

import re
from pathlib import Path

from gpumon import __version__
from gpumon.cli import schemas
from gpumon.config import load
from tests.conftest import REPO

README = (Path(REPO) / "README.md").read_text(encoding="utf-8")
CHANGELOG = (Path(REPO) / "CHANGELOG.md").read_text(encoding="utf-8")


def upgrading() -> str:
    return README.split("## Upgrading\n", 1)[1].split("\n## ", 1)[0]


def test_the_changelogs_newest_version_is_gpumons():
    versions = re.findall(r"^## (\S+)", CHANGELOG, re.M)
    assert versions and versions[0] == __version__, versions


def test_every_deprecated_alias_the_readme_names_still_loads(tmp_path):
    text = " ".join(upgrading().split())
    aliases = re.search(r"keep working as deprecated aliases, .*?: (.*?)\. Two renames", text)
    assert aliases, "the Upgrading section no longer lists the deprecated aliases"
    named: dict[str, list[str]] = {}
    old_names = re.sub(r"\(now [^)]*\)", "", aliases.group(1))  # the new names are said in brackets
    for match in re.finditer(r"`\[(\w+)\] (\w+)`((?:(?:,| and) `\w+`)*)", old_names):
        section, first, rest = match.groups()
        named.setdefault(section, []).extend([first, *re.findall(r"`(\w+)`", rest)])
    assert named == {"otel": ["imds_url", "imds_timeout"], "azure_monitor": ["imds_url"],
                     "linkflap": ["include_devices", "exclude_devices", "read_mode"]}, named
    values = {"imds_url": '"http://127.0.0.1:9"', "imds_timeout": "1.0", "include_devices": '"^mlx5_ib"',
              "exclude_devices": '"^mlx5_an"', "read_mode": '"open"'}
    config = tmp_path / "gpumon.toml"
    config.write_text("".join(f"[{section}]\n" + "".join(f"{k} = {values[k]}\n" for k in keys)
                              for section, keys in named.items()))
    loaded = load(schemas(), str(config), {}, {})
    assert loaded["linkflap"].include_devices == "^mlx5_ib"
    assert loaded["otel"].imds_url == "http://127.0.0.1:9"


def test_the_renamed_metric_is_documented_by_its_new_name_only():
    metrics = (Path(REPO) / "docs/metrics.md").read_text(encoding="utf-8")
    assert "gpumon_gpu_fabric_health_overall" in metrics
    assert "gpumon_gpu_fabric_health_summary" not in metrics
    assert "`gpumon_gpu_fabric_health_summary` (now\n`gpumon_gpu_fabric_health_overall`)" in upgrading()
