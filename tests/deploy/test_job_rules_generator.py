"""The straggler and stalled-GPU groups of job-rules.yaml are generated from job-signals.yaml: current,
complete, sharded without a gap or an overlap, and a bad table is refused with the file and the entry named."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO

HERE = os.path.join(REPO, "deploy", "prometheus")
GENERATOR = os.path.join(HERE, "generate_job_rules.py")
sys.path.insert(0, HERE)
import generate_job_rules as gen  # noqa: E402


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, GENERATOR, *args], capture_output=True, text=True, timeout=60, check=False)


def groups() -> list[dict]:
    with open(gen.RULES, encoding="utf-8") as fh:
        return yaml.safe_load(fh)["groups"]


def test_the_committed_job_rules_are_current() -> None:
    proc = run("--check")
    assert proc.returncode == 0, proc.stderr


def test_every_signal_has_its_group_with_value_median_mad_and_scale() -> None:
    by_name = {g["name"]: g for g in groups()}
    for signal in gen.load()["signals"]:
        group = by_name[f"gpumon-job-signal-{signal.name.replace('_', '-')}"]
        recorded = [r["record"] for r in group["rules"]]
        assert recorded == ["gpumon_job:straggler_signal:value", "gpumon_job:straggler_signal:median",
                            "gpumon_job:straggler_signal:mad", "gpumon_job:straggler_signal:scale",
                            "gpumon_job:straggler_signal:named_above"], group["name"]
        # the static label keeps the rules apart (promtool's duplicate check) and equals what they compute
        assert all(r["labels"]["signal"] == signal.name for r in group["rules"])
        assert all(f'signal="{signal.name}"' in r["expr"] for r in group["rules"][1:])


def _matches(matcher: str, value: str) -> bool:
    """A Prometheus label matcher list on one label (anchored regexes, as Prometheus anchors them)."""
    for op, pattern in re.findall(r'\w+(=~|!~|!=|=)"([^"]*)"', matcher):
        hit = re.fullmatch(pattern, value) is not None if op in ("=~", "!~") else value == pattern
        if hit != (op in ("=~", "=")):
            return False
    return True


@pytest.mark.parametrize("kind, label, values", [
    ("gpu", "gpu", [str(i) for i in range(20)]),
    ("port", "device", [f"mlx5_ib{i}" for i in range(10)] + [f"mlx5_{i}" for i in range(12)] + ["ibp3s0", "mlx5_bond"]),
])
def test_shards_hold_every_member_exactly_once(kind: str, label: str, values: list[str]) -> None:
    shards = gen._shard_matchers(label, gen.load()["shards"][kind])
    for value in values:
        holding = [part for part, matcher in shards if _matches(matcher, value)]
        assert len(holding) == 1, (value, holding)
    assert not any(_matches(matcher, "") for _, matcher in shards)  # a member without the label: not here


def test_each_shard_is_its_own_group_scoring_into_one_name() -> None:
    table = gen.load()
    scores = [g for g in groups() if g["name"].startswith("gpumon-job-score-")]
    assert len(scores) == len(table["shards"]["gpu"]) + len(table["shards"]["port"])
    assert {r["record"] for g in scores for r in g["rules"]} == {"gpumon_job:straggler_score"}
    assert len({r["labels"]["shard"] for g in scores for r in g["rules"]}) == len(scores)


def gpu_shard_groups(prefix: str, record: str) -> list[dict]:
    """The ``prefix<digits>`` groups, one per GPU shard in the table's order, each checked to hold one
    rule that records ``record`` labelled with its shard and reads only its GPUs' series."""
    shards = [g for g in groups() if g["name"].startswith(prefix)]
    matchers = gen._shard_matchers("gpu", gen.load()["shards"]["gpu"])
    assert len(shards) == len(matchers)
    for (part, matcher), group in zip(matchers, shards):
        (rule,) = group["rules"]
        assert rule["record"] == record and rule["labels"] == {"shard": f"gpus-{part}"}
        selectors = re.findall(r"\b(gpumon_\w+)\{([^}]*)\}", rule["expr"])
        assert selectors and all(matcher in labels for _, labels in selectors), group["name"]
    return shards


def test_stalled_gpus_are_judged_in_the_gpu_shards_and_rolled_up_per_host() -> None:
    table = gen.load()
    by_name = {g["name"]: g for g in groups()}
    shards = gpu_shard_groups("gpumon-job-stall-gpus-", gen.STALL_SHARD)
    assert all(f"[{table['stall']['window']}]" in g["rules"][0]["expr"] for g in shards)
    rollup = by_name["gpumon-job-stall"]["rules"][0]
    assert rollup["record"] == "gpumon_job_host:stalled:bool" and gen.STALL_SHARD in rollup["expr"]
    names = list(by_name)
    assert max(names.index(g["name"]) for g in shards) < names.index("gpumon-job-stall")  # promtool's order


def test_the_member_table_is_built_in_the_gpu_shards_before_the_groups_that_read_it() -> None:
    by_name = {g["name"]: g for g in groups()}
    shards = gpu_shard_groups("gpumon-job-members-gpus-", gen.MEMBER_GPU)
    for expr in (g["rules"][0]["expr"] for g in shards):
        # the allocation and the GPU info it joins, each narrowed to the shard's GPUs, none read whole
        assert len(re.findall(r"\bgpumon_gpu_\w+\{", expr)) == 5
        assert not re.search(r"\bgpumon_gpu_\w+(?![\w{])", expr)
    # the host cohorts (all shards' members) stay in the hand-written group, after the shards, and the
    # groups that read the members come after both (the order promtool evaluates them in)
    assert [r["record"] for r in by_name["gpumon-job-members"]["rules"]] == [gen.MEMBER_HOST]
    names = list(by_name)
    readers = [n for n in names if n.startswith(("gpumon-job-signal-", "gpumon-job-stall"))]
    assert max(names.index(g["name"]) for g in shards) < names.index("gpumon-job-members") < min(map(names.index, readers))


@pytest.mark.parametrize("change, named", [
    (lambda d: d["signals"][0].update(colour="red"), "signals[0]: unknown key(s) colour"),
    (lambda d: d["signals"][1].pop("floor"), "signals[1]: missing key 'floor'"),
    (lambda d: d["signals"][2].update(worse="sideways"), "signals[2]: worse must be higher or lower"),
    (lambda d: d["signals"][0].update(sparse=True), "signals[0]: a sparse signal is one where higher is worse"),
    (lambda d: d["shards"].update(gpu=["0123", "4567"]), "shards.gpu must hold every digit 0-9 once"),
    (lambda d: d["stall"].pop("window"), "stall: needs exactly window, activity_below"),
    (lambda d: d["stall"].update(window="two minutes"), "stall.window: a Prometheus duration"),
    (lambda d: d["stall"].update(power_share_below="low"), "stall.power_share_below: a number above 0"),
])
def test_a_bad_table_exits_2_naming_the_file_and_entry(tmp_path, change, named) -> None:
    with open(gen.SIGNALS, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    change(doc)
    bad = tmp_path / "signals.yaml"
    bad.write_text(yaml.safe_dump(doc))
    proc = run("--check", "--signals", str(bad))
    assert proc.returncode == 2
    assert f"{bad}: " in proc.stderr and named in proc.stderr, proc.stderr


def test_yaml_markers_splice_only_the_generated_part() -> None:
    from gpumon.generated import splice

    text = "head\n# generated: x\nold\n# end: x\ntail\n"
    assert splice(text, "x", "new", comment="#") == "head\n# generated: x\nnew\n# end: x\ntail\n"
    with pytest.raises(ValueError):
        splice("no markers", "x", "new", comment="#")
