#!/usr/bin/env python3
"""Writes the straggler groups of deploy/prometheus/job-rules.yaml from job-signals.yaml: one group per
signal (each member's value, the job's median, MAD and spread), the score in shards of the members, the
host roll-up with the alert, and the stalled GPUs in the same shards; and above them the member table in
the GPU shards. The host cohorts, the stall roll-up with its alert and the lemon groups are written by hand.

Why so many groups: Prometheus evaluates the rules of one group one after another, and each rule is one
query on one core; groups run side by side. At 1,000 hosts a single straggler group took 8.8 s per
evaluation (docs/job-health.md, Cost); split by signal and by shard of members, each group holds a
fraction of the series and they share the server's cores.

    python deploy/prometheus/generate_job_rules.py           # rewrite the generated part
    python deploy/prometheus/generate_job_rules.py --check   # exit 1 if the committed one is stale
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)  # runnable from a checkout

import yaml  # noqa: E402

from gpumon.generated import splice, sync  # noqa: E402

SIGNALS = os.path.join(HERE, "job-signals.yaml")
RULES = os.path.join(HERE, "job-rules.yaml")
COMMAND = "python deploy/prometheus/generate_job_rules.py"
BLOCK = "straggler"
MEMBERS_BLOCK = "members"
VALUE = "gpumon_job:straggler_signal:value"
# The labels a job's signal is summarised by, and the ones a member's value is matched to them on.
PER_JOB = "cluster, cohort, job_id, scope, model, signal"
MATCH = "cluster, cohort, model, signal"
MEMBER_GPU = "gpumon_job:gpu_member:info"
MEMBER_HOST = "gpumon_job:host_cohort:info"


# The member table (job-rules.yaml says what each label means); SHARD: the shard's matcher on `gpu`.
MEMBERS = """\
label_replace(label_replace(
label_replace(
  label_replace(
    label_join(
      max by (cluster, job, instance, gpu, gpu_instance, job_id, cohort, model) (
        (
          label_replace(gpumon_gpu_allocation_info{job_id!="", SHARD}, "cohort", "$1", "job_id", "(.+)")
          or
          label_replace(
            label_join(
              label_replace(
                label_replace(gpumon_gpu_allocation_info{job_id="", pod!="", SHARD}, "owner", "$1", "pod", "(.+)"),
                "owner", "$1", "pod",
                "(.+?)(?:-(?:master|worker|launcher|chief|ps|evaluator|driver|executor|leader))?(?:-[0-9]+)+(?:-[a-z0-9]{5})?"),
              "job_id", "/", "namespace", "owner"),
            "cohort", "$1", "job_id", "(.+)")
        )
        * on (cluster, job, instance, gpu) group_left (model)
          max by (cluster, job, instance, gpu, model) (gpumon_gpu_info{SHARD})
        or
        label_replace(
          max by (cluster, job, instance, gpu, model) (gpumon_gpu_info{SHARD})
            unless on (cluster, job, instance, gpu) gpumon_gpu_allocation_info{SHARD},
          "cohort", "host:$1", "instance", "(.*)")
      ),
      "model", " MIG ", "model", "gpu_instance"),
    "model", "$1", "model", "(.*) MIG "),
  "model", "$1 MIG", "model", "(.*) MIG .+"),
  "scope", "job", "", ""),
"scope", "idle", "cohort", "host:.*")"""


@dataclass(frozen=True)
class Signal:
    name: str
    member: str  # gpu | port
    worse: str  # higher | lower
    unit: str
    floor: float
    relative: float
    idle: bool
    expr: str
    mig: str
    sparse: bool


def _signal(raw: dict[str, Any], where: str) -> Signal:
    known = {"name", "member", "worse", "unit", "floor", "relative", "idle", "expr", "mig", "sparse"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    for key in ("name", "member", "worse", "unit", "floor", "expr"):
        if key not in raw:
            raise ValueError(f"{where}: missing key {key!r}")
    if raw["member"] not in ("gpu", "port"):
        raise ValueError(f"{where}: member must be gpu or port, not {raw['member']!r}")
    if raw["worse"] not in ("higher", "lower"):
        raise ValueError(f"{where}: worse must be higher or lower, not {raw['worse']!r}")
    if raw.get("mig") and raw["member"] != "gpu":
        raise ValueError(f"{where}: mig is for gpu signals only")
    if raw.get("sparse") and (raw["worse"] != "higher" or raw.get("relative")):
        raise ValueError(f"{where}: a sparse signal is one where higher is worse, with no relative floor")
    return Signal(name=str(raw["name"]), member=raw["member"], worse=raw["worse"], unit=str(raw["unit"]),
                  floor=float(raw["floor"]), relative=float(raw.get("relative", 0.0)),
                  idle=bool(raw.get("idle", False)), expr=str(raw["expr"]).strip(), mig=str(raw.get("mig") or "").strip(),
                  sparse=bool(raw.get("sparse", False)))


def load(path: str = SIGNALS) -> dict[str, Any]:
    """The table, checked: an error names the file and the entry."""
    with open(path, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    signals = [_signal(raw, f"{path}: signals[{i}]") for i, raw in enumerate(doc["signals"])]
    names = [s.name for s in signals]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a signal name is used twice")
    for kind in ("gpu", "port"):
        digits = "".join(doc["shards"][kind])
        if sorted(digits) != sorted(set(digits)) or set(digits) != set("0123456789"):
            raise ValueError(f"{path}: shards.{kind} must hold every digit 0-9 once, not {doc['shards'][kind]}")
    return {"signals": signals, "alert": doc["alert"], "interval": str(doc["interval"]), "shards": doc["shards"],
            "named_above": float(doc["named_above"]), "stall": _stall(doc["stall"], f"{path}: stall")}


STALL_KEYS = ("window", "activity_below", "busy_from", "power_share_below", "memory_above_bytes")


def _stall(raw: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or set(raw) != set(STALL_KEYS):
        got = ", ".join(sorted(raw)) if isinstance(raw, dict) else repr(raw)
        raise ValueError(f"{where}: needs exactly {', '.join(STALL_KEYS)} (got {got})")
    out: dict[str, Any] = {"window": str(raw["window"])}
    if not re.fullmatch(r"[0-9]+[smh]", out["window"]):
        raise ValueError(f"{where}.window: a Prometheus duration such as 2m, not {raw['window']!r}")
    for key in STALL_KEYS[1:]:
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{where}.{key}: a number above 0, not {value!r}")
        out[key] = float(value)
    return out


def _num(value: float) -> str:
    return f"{value:g}"


def _indent(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "\n".join(pad + line if line else line for line in text.splitlines())


def _value_expr(s: Signal) -> str:
    """The member's value with its job's labels, oriented so that higher is worse. For a GPU, the member
    table is the left (many) side and the value the right, so that the result carries the member's labels
    and nothing of the source series; the rule's static labels add ``signal`` (and ``model`` for ports)."""
    scope = "" if s.idle else ', scope="job"'
    if s.member == "gpu":
        body = (f"topk by (cluster, job, instance, gpu) (1, {MEMBER_GPU}{{gpu_instance=\"\"{scope}}})\n"
                f"  * on (cluster, job, instance, gpu) group_left ()\n  (\n{_indent(s.expr, 4)}\n  )")
        if s.mig:
            body = (f"(\n{_indent(body, 2)}\n)\nor\n"
                    f"topk by (cluster, job, instance, gpu, gpu_instance) (1, {MEMBER_GPU}{{gpu_instance!=\"\"{scope}}})\n"
                    f"  * on (cluster, job, instance, gpu, gpu_instance) group_left ()\n  {s.mig}")
    else:
        host = MEMBER_HOST + ("" if s.idle else '{scope="job"}')
        body = (f"(\n{_indent(s.expr, 2)}\n  and on (cluster, job, instance, device, port) "
                f"gpumon_ib_port_info{{link_layer=\"InfiniBand\"}}\n)\n"
                f"* on (cluster, job, instance) group_left (cohort, job_id, scope) {host}")
    if s.sparse:
        return f"(\n{_indent(body, 2)}\n)\n> 0"
    return f"-(\n{_indent(body, 2)}\n)" if s.worse == "lower" else body


def _members_expr(s: Signal) -> str:
    """How many members each job has for the signal, by (cluster, cohort, model)."""
    scope = "" if s.idle else '{scope="job"}'
    if s.member == "gpu":
        return f"count by (cluster, cohort, model) ({MEMBER_GPU}{scope})"
    host = MEMBER_HOST + scope
    return (f"label_replace(\n  count by (cluster, cohort) (\n"
            f"    gpumon_ib_port_info{{link_layer=\"InfiniBand\"}}\n"
            f"      * on (cluster, job, instance) group_left (cohort) {host}\n  ),\n"
            f"  \"model\", \"InfiniBand\", \"\", \"\")")


def _rule(kind: str, name: str, expr: str, labels: dict[str, str] | None = None) -> str:
    """One rule. Static ``labels`` keep rules that record the same name in several groups apart, as
    promtool's duplicate-rule check asks (``signal``: the value it already has; ``shard``)."""
    text = f"- {kind}: {name}\n  expr: |\n{_indent(expr, 4)}\n" if "\n" in expr else f"- {kind}: {name}\n  expr: {expr}\n"
    if labels:
        text += "  labels:\n" + "".join(f"    {k}: {v}\n" for k, v in labels.items())
    return text


def _group(comment: str, name: str, interval: str, rules: list[str]) -> str:
    """A rule group of the generated part: its comment lines, name, interval and ``rules`` (:func:`_rule`'s)."""
    return (f"{comment}\n- name: {name}\n  interval: {interval}\n  rules:\n"
            + "\n".join(_indent(r.rstrip("\n"), 4) for r in rules))


def _signal_group(s: Signal, interval: str, named_above: float) -> str:
    only = f'{{signal="{s.name}"}}'
    spread = f"clamp_min(1.4826 * gpumon_job:straggler_signal:mad{only}, {_num(s.floor)})"
    if s.relative:
        relative = f"abs(gpumon_job:straggler_signal:median{only}) * {_num(s.relative)}"
        spread = f"{spread} > {relative}\nor {relative}"
    floors = (f"max(1.4826 x MAD, {_num(s.floor)} {s.unit}" + (f", {_num(s.relative)} x |median|)" if s.relative else ")"))
    mine = {"signal": s.name}
    median = f"quantile by ({PER_JOB}) (0.5, {VALUE}{only})"
    mad = (f"quantile by ({PER_JOB}) (0.5,\n  abs({VALUE}{only} - on ({MATCH}) group_left "
           f"gpumon_job:straggler_signal:median{only})\n)")
    if s.sparse:
        # 0 while at most half of the job's members are above 0 (their median over all members)
        zero = f"count by ({PER_JOB}) ({VALUE}{only}) * 0"
        majority = (f"count by (cluster, cohort, model) ({VALUE}{only}) * 2\n"
                    f"  > on (cluster, cohort, model)\n{_indent(_members_expr(s), 2)}")
        median = f"{median}\n  and on (cluster, cohort, model) (\n{_indent(majority, 4)}\n  )\nor {zero}"
        mad = f"{mad}\n  and on ({MATCH}) gpumon_job:straggler_signal:median{only} > 0\nor {zero}"
    rules = [
        _rule("record", VALUE, _value_expr(s), {**mine, "model": "InfiniBand"} if s.member == "port" else mine),
        _rule("record", "gpumon_job:straggler_signal:median", median, mine),
        _rule("record", "gpumon_job:straggler_signal:mad", mad, mine),
        f"# The spread the distance is measured in: {floors}.\n"
        + _rule("record", "gpumon_job:straggler_signal:scale", spread, mine),
        "# Past it, a member's signal is named in its score.\n"
        + _rule("record", "gpumon_job:straggler_signal:named_above",
                f"gpumon_job:straggler_signal:median{only} + {_num(named_above)} * gpumon_job:straggler_signal:scale{only}", mine),
    ]
    comment = (f"# {s.name} ({s.unit}, {'lower' if s.worse == 'lower' else 'higher'} is worse"
               f"{'; also among idle GPUs' if s.idle else ''}): each member's value, the job's median and spread.")
    return _group(comment, f"gpumon-job-signal-{s.name.replace('_', '-')}", interval, rules)


def _shard_matchers(label: str, digits: list[str]) -> list[tuple[str, str]]:
    """(name part, matcher) per shard; the last also takes labels that do not end in a digit."""
    out = []
    for i, part in enumerate(digits):
        if i < len(digits) - 1:
            out.append((part, f'{label}=~".*[{part}]"'))
        else:
            others = "".join(d for d in "0123456789" if d not in part)
            out.append((part, f'{label}!="", {label}!~".*[{others}]"'))
    return out


def _score_group(kind: str, part: str, matcher: str, interval: str) -> str:
    # Each member's distance from its job's median on every signal, in robust standard deviations.
    value = f"{VALUE}{{{matcher}}}"
    named = f"{value} > on ({MATCH}) group_left gpumon_job:straggler_signal:named_above"
    distance = ("(\n  {value}\n    - on (" + MATCH + ") group_left gpumon_job:straggler_signal:median\n)\n"
                "/ on (" + MATCH + ") group_left gpumon_job:straggler_signal:scale")
    expr = (f"max without (cohort, scope) (\n"
            f"  topk by (cluster, job, instance, gpu, gpu_instance, device, port, cohort) (1,\n"
            f"{_indent(distance.format(value=f'({named})'), 4)}\n  )\n)\n"
            f"or ignoring (signal)\n"
            f"max without (cohort, scope, signal) (\n{_indent(distance.format(value=value), 2)}\n)")
    members = "GPUs whose index" if kind == "gpu" else "InfiniBand ports whose device name"
    rule = _rule("record", "gpumon_job:straggler_score", expr, {"shard": f"{kind}s-{part}"})
    return _group(f"# Scores of the {members} ends in {', '.join(part)}.", f"gpumon-job-score-{kind}s-{part}",
                  interval, [rule])


STALL_SHARD = "gpumon_job_host:stalled_shard:bool"


def _stall_group(part: str, matcher: str, interval: str, stall: dict[str, Any]) -> str:
    """1 when every GPU of the shard that a job holds on the host is stalled, 0 when one is not. The
    stall group of job-rules.yaml takes the minimum over the shards."""
    window, m = stall["window"], matcher

    def avg(metric: str, labels: str, drop: str) -> str:
        inner = f"{labels}, {m}" if labels else m
        return f"max without ({drop}) (avg_over_time({metric}{{{inner}}}[{window}]))"

    on = "on (cluster, job, instance, gpu)"
    utilization = avg("gpumon_gpu_utilization_ratio", 'engine="gpu"', "uuid, engine")
    activity = avg("gpumon_gpu_activity_ratio", 'activity="sm"', "uuid, activity")
    power = avg("gpumon_gpu_power_watts", "", "uuid")
    quiet = (f"(\n  {activity}\n"
             f"  or {utilization}\n) < {_num(stall['activity_below'])}\n"
             f"or {utilization} >= {_num(stall['busy_from'])}")
    processes = f"max without (uuid) (gpumon_gpu_compute_processes{{{m}}})"
    stalled = (f"(\n{_indent(quiet, 2)}\n)\n"
               f"and {on}\n  (\n    {power}\n"
               f"      / max without (uuid) (gpumon_gpu_power_limit_watts{{{m}}} > 0)\n"
               f"  ) < {_num(stall['power_share_below'])}\n"
               f"and {on} {processes} > 0\n"
               f"and {on} max without (uuid) (gpumon_gpu_memory_used_bytes{{{m}}}) > {stall['memory_above_bytes']:.0f}")
    expr = (f"min by (cluster, job_id, instance) (\n"
            f"  {MEMBER_GPU}{{scope=\"job\", {m}}}\n    * {on} group_left ()\n    (\n"
            f"      (\n{_indent(stalled, 8)}\n      ) * 0 + 1\n"
            f"      or {processes} * 0\n    )\n)")
    comment = (f"# Stalled GPUs among those whose index ends in {', '.join(part)}: 1 when all that a job holds on\n"
               f"# the host are, 0 when one is not.")
    return _group(comment, f"gpumon-job-stall-gpus-{part}", interval,
                  [_rule("record", STALL_SHARD, expr, {"shard": f"gpus-{part}"})])


def _member_group(part: str, matcher: str, interval: str) -> str:
    """The member table of the GPUs whose index ends in ``part``: at 8,000 GPUs one table of them all was
    the slowest job group (docs/job-health.md, Cost). The ``shard`` label keeps the groups' rules apart."""
    rule = _rule("record", MEMBER_GPU, MEMBERS.replace("SHARD", matcher), {"shard": f"gpus-{part}"})
    return _group(f"# Members among the GPUs whose index ends in {', '.join(part)}.",
                  f"gpumon-job-members-gpus-{part}", interval, [rule])


def render_members(table: dict[str, Any]) -> str:
    parts = [_member_group(part, matcher, table["interval"])
             for part, matcher in _shard_matchers("gpu", table["shards"]["gpu"])]
    return "\n\n".join(_indent(p, 2) for p in parts)


ALERT = """\
- alert: GpumonJobStraggler
  expr: max without (shard) (gpumon_job:straggler_score) > {threshold}
  for: {for_}
  labels:
    severity: warning
  annotations:
    summary: >-
      {{{{ if $labels.job_id }}}}Job {{{{ $labels.job_id }}}}{{{{ else }}}}Idle GPUs{{{{ end }}}}: {{{{ if $labels.gpu }}}}GPU {{{{ $labels.gpu }}}}{{{{ else }}}}port {{{{ $labels.device }}}}/{{{{ $labels.port }}}}{{{{ end }}}}
      on {{{{ $labels.instance }}}} lags on {{{{ $labels.signal }}}}
    description: >-
      {{{{ $labels.signal }}}} of {{{{ if $labels.gpu }}}}GPU {{{{ $labels.gpu }}}}{{{{ else }}}}port {{{{ $labels.device }}}}/{{{{ $labels.port }}}}{{{{ end }}}}
      on {{{{ $labels.instance }}}} sits {{{{ printf "%.1f" $value }}}} robust standard deviations (1.4826 x MAD)
      on the bad side of the median of {{{{ if $labels.job_id }}}}job {{{{ $labels.job_id }}}}{{{{ else }}}}the host's idle GPUs{{{{ end }}}}
      ({{{{ $labels.model }}}}). A synchronous job runs at the pace of its slowest rank.
    runbook: |
      1. Open the Job dashboard (Stragglers and stalls) or run `gpumon job JOB_ID --prometheus URL`.
      2. sm_clock, power, sm_activity or *_violation: the GPU is throttled (power cap, heat, hardware
         slowdown): check its temperatures and clock-event reasons on the Node dashboard.
      3. ib_xmit_wait, ib_errors: the port is congested or erroring: check the cable and the switch port on
         the InfiniBand fabric dashboard (several ports of one switch: the switch).
      4. pcie_replay, pcie_throughput, nvlink_throughput: a link problem of the GPU (reseat, or report the host).
      5. Persistent: drain the host and requeue the job without it."""


def render_block(table: dict[str, Any]) -> str:
    interval = table["interval"]
    parts = [_signal_group(s, interval, table["named_above"]) for s in table["signals"]]
    for kind, label in (("gpu", "gpu"), ("port", "device")):
        parts += [_score_group(kind, part, matcher, interval)
                  for part, matcher in _shard_matchers(label, table["shards"][kind])]
    rollup = _group(
        "# The worst GPU or port of each host of a job, with that member's signal; and the alert.",
        "gpumon-job-straggler", interval,
        [_rule("record", "gpumon_job_host:straggler_score",
               "max without (gpu, gpu_instance, device, port, model, shard) (\n"
               "  topk by (cluster, job_id, instance) (1, gpumon_job:straggler_score)\n)"),
         ALERT.format(threshold=_num(float(table["alert"]["threshold"])), for_=table["alert"]["for"])])
    parts.append(rollup)
    parts += [_stall_group(part, matcher, interval, table["stall"])
              for part, matcher in _shard_matchers("gpu", table["shards"]["gpu"])]
    # the groups sit in job-rules.yaml's `groups:` list, two spaces in
    return "\n\n".join(_indent(p, 2) for p in parts)


def render(rules_text: str, table: dict[str, Any]) -> str:
    text = splice(rules_text, MEMBERS_BLOCK, render_members(table), comment="#")
    return splice(text, BLOCK, render_block(table), comment="#")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if job-rules.yaml is stale")
    parser.add_argument("--signals", default=SIGNALS, help="the table to read (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        table = load(args.signals)
    except (ValueError, KeyError, TypeError, yaml.YAMLError) as exc:
        where = "" if str(exc).startswith(args.signals) else f"{args.signals}: "
        print(f"{where}{exc}", file=sys.stderr)
        return 2
    with open(RULES, encoding="utf-8") as fh:
        current = fh.read()
    return sync({RULES: render(current, table)}, args.check, COMMAND)


if __name__ == "__main__":
    sys.exit(main())
