#!/usr/bin/env python3
"""Writes the promtool unit tests of deploy/prometheus/job-rules.yaml (job-*-test.yaml beside this
file): a healthy job, one straggler per signal, stalled jobs, lemons across
a VM reallocation and the edges (one GPU, mixed scrape intervals, a GPU lost, a job that ended, MIG, mixed
models). The series are many and regular, so they are built here rather than typed.

    python deploy/prometheus/tests/generate_job_tests.py           # rewrite the test files
    python deploy/prometheus/tests/generate_job_tests.py --check   # exit 1 if the committed ones are stale
    promtool test rules deploy/prometheus/tests/job-*-test.yaml
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
sys.path.insert(0, os.path.dirname(HERE))  # generate_job_rules, beside the rules

import generate_job_rules  # noqa: E402
import yaml  # noqa: E402

from gpumon.generated import sync  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
STEPS = 20  # 10 minutes of 30 s scrapes
STEP_S = 30
RULE_FILES = ["../recording-rules.yaml", "../job-rules.yaml"]
# fault signals: only members above 0 are recorded (job-signals.yaml, read by the rules' own generator)
SPARSE = {s.name for s in generate_job_rules.load()["signals"] if s.sparse}
Series = dict[str, str]


@functools.cache
def rule_groups(path: str) -> list[dict[str, Any]]:
    """The groups of a rule file (relative to this directory), read once."""
    with open(os.path.join(HERE, path), encoding="utf-8") as fh:
        groups: list[dict[str, Any]] = yaml.safe_load(fh)["groups"]
    return groups


def group_order() -> list[str]:
    """The groups in file order. promtool evaluates groups in no fixed order unless told, and the job
    groups read what the groups before them recorded (Prometheus itself runs them side by side, each
    reading the others' last evaluation)."""
    return [group["name"] for path in RULE_FILES for group in rule_groups(path)]


def sel(name: str, **labels: str) -> str:
    inner = ", ".join(f'{k}="{v}"' for k, v in {"job": "gpumon", **labels}.items())
    return f"{name}{{{inner}}}"


def gauge(value: float, steps: int = STEPS) -> str:
    return f"{value:g}x{steps}"


def counter(rate: float, steps: int = STEPS, step_s: int = STEP_S) -> str:
    return f"0+{rate * step_s:g}x{steps}"


def noise(i: int) -> float:
    """A steady, uneven +-2 % per member, so that a healthy job is not perfectly even."""
    return 1 + 0.01 * ((i * 7) % 5 - 2)


# Each GPU signal: the metric and labels that feed it, healthy value, a straggler's value, gauge or counter.
GPU_SIGNALS: dict[str, tuple[str, dict[str, str], float, float, bool]] = {
    "sm_activity": ("gpumon_gpu_activity_ratio", {"activity": "sm"}, 0.9, 0.63, False),
    "sm_clock": ("gpumon_gpu_clock_hertz", {"clock": "sm"}, 1980e6, 1386e6, False),
    "power": ("gpumon_gpu_power_watts", {}, 650, 455, False),
    "nvlink_throughput": ("gpumon_gpu_nvlink_throughput_bytes_per_second", {"direction": "tx"}, 100e9, 40e9, False),
    "pcie_throughput": ("gpumon_gpu_pcie_bytes_total", {"direction": "tx"}, 20e9, 8e9, True),
    "power_violation": ("gpumon_gpu_clock_event_violation_seconds_total", {"reason": "sw_power_cap"}, 0, 0.5, True),
    "thermal_violation": ("gpumon_gpu_clock_event_violation_seconds_total", {"reason": "hw_thermal_slowdown"},
                          0, 0.5, True),
    "reliability_violation": ("gpumon_gpu_clock_event_violation_seconds_total", {"reason": "reliability"},
                              0, 0.5, True),
    "pcie_replay": ("gpumon_gpu_pcie_replay_total", {}, 0, 1, True),
}
# Each IB port signal: the counters that feed it (rates per second), healthy, straggler.
PORT_SIGNALS: dict[str, tuple[tuple[str, ...], float, float]] = {
    "ib_xmit_wait": (("gpumon_ib_port_transmit_wait_ticks_total",), 1e6, 50e6),
    "ib_errors": (("gpumon_ib_port_symbol_errors_total",), 0, 1),
}
HOSTS = ("node-a", "node-b")
GPUS = 4
PORTS = 4


def members(job_id: str, hosts: tuple[str, ...] = HOSTS, gpus: int = GPUS, model: str = H100,
            steps: int = STEPS, first_gpu: int = 0) -> list[Series]:
    """A Slurm job holding GPUs first_gpu.. of each host, with the GPUs' identity."""
    out = []
    for host in hosts:
        for gpu in range(first_gpu, first_gpu + gpus):
            uuid = f"GPU-{host}-{gpu}"
            out.append({"series": sel("gpumon_gpu_allocation_info", instance=host, gpu=str(gpu), uuid=uuid,
                                      job_id=job_id), "values": gauge(1, steps)})
            out.append({"series": sel("gpumon_gpu_info", instance=host, gpu=str(gpu), uuid=uuid, model=model,
                                      serial=f"SN-{host}-{gpu}"), "values": gauge(1, steps)})
    return out


def gpu_signal(signal: str, host: str, gpu: int, value: float, steps: int = STEPS, step_s: int = STEP_S,
               uuid: str | None = None) -> Series:
    name, labels, _, _, is_counter = GPU_SIGNALS[signal]
    values = counter(value, steps, step_s) if is_counter else gauge(value, steps)
    return {"series": sel(name, instance=host, gpu=str(gpu), uuid=uuid or f"GPU-{host}-{gpu}", **labels),
            "values": values}


def ports(hosts: tuple[str, ...] = HOSTS, bad: tuple[str, str, int] | None = None,
          signals: tuple[str, ...] = tuple(PORT_SIGNALS)) -> list[Series]:
    """Every host's InfiniBand ports (and one Ethernet RDMA port, far off on every signal, that must be ignored)."""
    out = []
    for h, host in enumerate(hosts):
        for p in range(PORTS + 1):
            device = f"mlx5_ib{p}" if p < PORTS else "mlx5_an0"
            layer = "InfiniBand" if p < PORTS else "Ethernet"
            out.append({"series": sel("gpumon_ib_port_info", instance=host, device=device, port="1",
                                      link_layer=layer), "values": gauge(1)})
            for signal in signals:
                names, healthy, straggler = PORT_SIGNALS[signal]
                value = healthy * noise(h * PORTS + p) if p < PORTS else healthy * 40 + 7
                if bad == (signal, host, p):
                    value = straggler
                out += [{"series": sel(n, instance=host, device=device, port="1"), "values": counter(value)}
                        for n in names]
    return out


def healthy_job(job_id: str, bad: tuple[str, str, int] | None = None) -> list[Series]:
    """8 GPUs on 2 hosts with every signal; `bad` = (signal, host, gpu or port) makes one member a straggler."""
    out = members(job_id)
    for h, host in enumerate(HOSTS):
        for gpu in range(GPUS):
            for signal, (_, _, healthy, straggler, _) in GPU_SIGNALS.items():
                value = healthy * noise(h * GPUS + gpu)
                if bad == (signal, host, gpu):
                    value = straggler
                out.append(gpu_signal(signal, host, gpu, value))
    return out + ports(bad=bad if bad and bad[0] in PORT_SIGNALS else None)


def flagged(expected: list[dict[str, str]], eval_time: str = "8m") -> list[dict[str, Any]]:
    """The members whose score passes the alert threshold, exactly these (whichever shard scored them)."""
    return [{"expr": "(max without (shard) (gpumon_job:straggler_score) > 5) * 0 + 1", "eval_time": eval_time,
             "exp_samples": [{"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(e.items())) + "}",
                              "value": 1} for e in expected]}]


def gpu_member(job_id: str, host: str, gpu: int, signal: str, model: str = H100, **extra: str) -> dict[str, str]:
    return {"job": "gpumon", "instance": host, "gpu": str(gpu), "job_id": job_id, "model": model,
            "signal": signal, **extra}


STRAGGLER_ANNOTATIONS = {
    "summary": "Job 4242: GPU 2 on node-b lags on sm_clock",
    "description": ("sm_clock of GPU 2 on node-b sits 9.9 robust standard deviations (1.4826 x MAD) on the bad "
                    "side of the median of job 4242 (NVIDIA H100 80GB HBM3). A synchronous job runs at the pace "
                    "of its slowest rank."),
}


def straggler_tests(runbook: str) -> list[dict[str, Any]]:
    tests: list[dict[str, Any]] = [{
        "name": "healthy job: no score past the threshold, no alert",
        "interval": "30s", "input_series": healthy_job("4242"),
        "promql_expr_test": flagged([]) + [
            # Every member has a value for every signal (9 per GPU, 2 per IB port; Ethernet ports left out).
            {"expr": "count(gpumon_job:straggler_signal:value)", "eval_time": "8m",
             # a sparse signal records only members above 0: in a healthy job, none
             "exp_samples": [{"labels": "{}", "value": 8 * len(set(GPU_SIGNALS) - SPARSE)
                                                     + 8 * len(set(PORT_SIGNALS) - SPARSE)}]},
            {"expr": "count(gpumon_job:straggler_score)", "eval_time": "8m",
             "exp_samples": [{"labels": "{}", "value": 16}]},
            {"expr": "count(gpumon_job_host:straggler_score)", "eval_time": "8m",
             "exp_samples": [{"labels": "{}", "value": 2}]},
            {"expr": "max(abs(gpumon_job:straggler_score)) < bool 1", "eval_time": "8m",
             "exp_samples": [{"labels": "{}", "value": 1}]},
            # no signal stands out, so none is named (the score's labels stay the same evaluation after
            # evaluation)
            {"expr": 'count(gpumon_job:straggler_score{signal!=""})', "eval_time": "8m", "exp_samples": []},
        ],
        "alert_rule_test": [{"eval_time": "8m", "alertname": "GpumonJobStraggler", "exp_alerts": []},
                            {"eval_time": "8m", "alertname": "GpumonJobStalled", "exp_alerts": []}],
    }]
    for signal in GPU_SIGNALS:
        test: dict[str, Any] = {
            "name": f"one GPU lags on {signal}", "interval": "30s",
            "input_series": healthy_job("4242", bad=(signal, "node-b", 2)),
            "promql_expr_test": flagged([gpu_member("4242", "node-b", 2, signal)]) + [
                {"expr": "(gpumon_job_host:straggler_score > 5) * 0 + 1", "eval_time": "8m",
                 "exp_samples": [{"labels": f'{{instance="node-b", job="gpumon", job_id="4242", signal="{signal}"}}',
                                  "value": 1}]}],
        }
        if signal == "sm_clock":
            test["alert_rule_test"] = [
                {"eval_time": "3m", "alertname": "GpumonJobStraggler", "exp_alerts": []},
                {"eval_time": "8m", "alertname": "GpumonJobStraggler", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", **gpu_member("4242", "node-b", 2, signal)},
                    "exp_annotations": {**STRAGGLER_ANNOTATIONS, "runbook": runbook}}]}]
        tests.append(test)
    for signal in PORT_SIGNALS:
        tests.append({
            "name": f"one IB port lags on {signal}", "interval": "30s",
            "input_series": healthy_job("4242", bad=(signal, "node-a", 3)),
            "promql_expr_test": flagged([{"job": "gpumon", "instance": "node-a", "device": "mlx5_ib3", "port": "1",
                                          "job_id": "4242", "model": "InfiniBand", "signal": signal}]),
        })
    return tests


def edge_tests() -> list[dict[str, Any]]:
    tests: list[dict[str, Any]] = []
    # One GPU: nothing to compare with, score 0 and no signal named. The host's other GPUs (in no job) form their own group and
    # are judged on fault signals only: their idle activity is no straggler.
    series = members("77", hosts=("node-c",), gpus=1)
    series += [{"series": sel("gpumon_gpu_info", instance="node-c", gpu=str(g), uuid=f"GPU-node-c-{g}", model=H100,
                              serial=f"SN-node-c-{g}"), "values": gauge(1)} for g in range(1, 4)]
    series += [gpu_signal("sm_activity", "node-c", g, 0.9 if g == 0 else 0.0) for g in range(4)]
    series += [gpu_signal("power_violation", "node-c", g, 0.4 if g == 3 else 0.0) for g in range(1, 4)]
    tests.append({
        "name": "a job of one GPU scores 0; idle GPUs are judged on faults within their host", "interval": "30s",
        "input_series": series,
        "promql_expr_test": [
            {"expr": 'max without (shard) (gpumon_job:straggler_score{job_id="77"})', "eval_time": "8m",
             "exp_samples": [{"labels": f'{{gpu="0", instance="node-c", job="gpumon", job_id="77", model="{H100}"}}',
                              "value": 0}]},
        ] + flagged([{"job": "gpumon", "instance": "node-c", "gpu": "3", "model": H100,
                      "signal": "power_violation"}]) + [
            {"expr": 'count(gpumon_job:straggler_signal:value{cohort="host:node-c", signal="sm_activity"})',
             "eval_time": "8m", "exp_samples": []}],
    })

    # Hosts scraped at different intervals (node-a every 15 s, node-b every 60 s): the same load gives the
    # same values; a straggler on the slow-scraped host is still found.
    def spaced(values: list[float], every: int) -> str:
        return " ".join(f"{v:g}" if i % every == 0 else "_" for i, v in enumerate(values))

    def mixed(bad: bool) -> list[Series]:
        out = members("88", steps=80)
        for h, (host, every) in enumerate((("node-a", 1), ("node-b", 4))):
            for gpu in range(GPUS):
                power = 650 * noise(h * GPUS + gpu)
                replay_rate = 1.0 if bad and host == "node-b" and gpu == 1 else 0.0
                out.append({"series": sel("gpumon_gpu_power_watts", instance=host, gpu=str(gpu),
                                          uuid=f"GPU-{host}-{gpu}"), "values": spaced([power] * 81, every)})
                out.append({"series": sel("gpumon_gpu_pcie_bytes_total", instance=host, gpu=str(gpu),
                                          uuid=f"GPU-{host}-{gpu}", direction="tx"),
                            "values": spaced([i * 15 * 20e9 * noise(gpu) for i in range(81)], every)})
                out.append({"series": sel("gpumon_gpu_pcie_replay_total", instance=host, gpu=str(gpu),
                                          uuid=f"GPU-{host}-{gpu}"),
                            "values": spaced([i * 15 * replay_rate for i in range(81)], every)})
        return out

    tests.append({"name": "hosts scraped every 15 s and every 60 s: no straggler", "interval": "15s",
                  "input_series": mixed(False), "promql_expr_test": flagged([], "15m") + [
                      # power and pcie_throughput; pcie_replay, 0 everywhere, is sparse: not recorded
                      {"expr": "count(gpumon_job:straggler_signal:value)", "eval_time": "15m",
                       "exp_samples": [{"labels": "{}", "value": 8 * 2}]}]})
    tests.append({"name": "hosts scraped every 15 s and every 60 s: a straggler on the slow one",
                  "interval": "15s", "input_series": mixed(True),
                  "promql_expr_test": flagged([gpu_member("88", "node-b", 1, "pcie_replay")], "15m")})

    # A GPU lost mid-job: its series stop at 5 minutes (gpumon_gpu_lost turns 1 and GpumonGpuLost names it);
    # once its last samples leave the 5-minute windows it drops out of the comparison and the rest of the job
    # is judged as before, nobody flagged.
    series = members("99")
    for h, host in enumerate(HOSTS):
        for gpu in range(GPUS):
            lost = host == "node-b" and gpu == 3
            for signal in ("sm_activity", "sm_clock", "power", "pcie_throughput"):
                s = gpu_signal(signal, host, gpu, GPU_SIGNALS[signal][2] * noise(h * GPUS + gpu))
                if lost:  # 10 samples, then none
                    s["values"] = (counter(GPU_SIGNALS[signal][2], 9) if GPU_SIGNALS[signal][4]
                                   else gauge(GPU_SIGNALS[signal][2], 9)) + " _" * (STEPS - 9)
                series.append(s)
            series.append({"series": sel("gpumon_gpu_lost", instance=host, gpu=str(gpu), uuid=f"GPU-{host}-{gpu}"),
                           "values": (f"0x9 1x{STEPS - 9}" if lost else gauge(0))})
    tests.append({"name": "a GPU lost mid-job drops out; the rest of the job is not flagged", "interval": "30s",
                  "input_series": series,
                  "promql_expr_test": flagged([], "10m") + [
                      {"expr": 'count(gpumon_job:straggler_signal:value{instance="node-b", gpu="3"})',
                       "eval_time": "10m", "exp_samples": []},
                      {"expr": 'count(gpumon_job:straggler_score{job_id="99"})',
                       "eval_time": "10m", "exp_samples": [{"labels": "{}", "value": 7}]}]})

    # A job that ended: its allocation goes stale at 5 minutes; a minute later no score names it, and its
    # GPUs are back in their hosts' idle groups.
    series = [s if "allocation" not in s["series"] else {**s, "values": "1x9 stale"} for s in members("4244")]
    series += [gpu_signal("sm_activity", host, gpu, 0.9) for host in HOSTS for gpu in range(GPUS)]
    series += [gpu_signal("pcie_replay", host, gpu, 0) for host in HOSTS for gpu in range(GPUS)]
    tests.append({"name": "stale series after a job ends: no score names the job", "interval": "30s",
                  "input_series": series, "promql_expr_test": [
                      {"expr": 'count(gpumon_job:straggler_score{job_id="4244"})', "eval_time": "4m",
                       "exp_samples": [{"labels": "{}", "value": 8}]},
                      {"expr": 'count(gpumon_job:straggler_score{job_id="4244"})', "eval_time": "6m",
                       "exp_samples": []},
                      {"expr": 'count(gpumon_job_host:straggler_score{job_id="4244"})', "eval_time": "6m",
                       "exp_samples": []},
                      {"expr": 'count by (cohort) (gpumon_job:gpu_member:info)', "eval_time": "6m",
                       "exp_samples": [{"labels": '{cohort="host:node-a"}', "value": 4},
                                       {"labels": '{cohort="host:node-b"}', "value": 4}]}]})

    # MIG: four instances on two MIG GPUs and three whole GPUs in one job. The instances (30 % activity each)
    # are compared with each other, never with the whole GPUs (90 %); one slow instance is named.
    series = []
    for gpu in range(5):
        mig = gpu < 2
        uuid = f"GPU-node-a-{gpu}"
        series.append({"series": sel("gpumon_gpu_info", instance="node-a", gpu=str(gpu), uuid=uuid, model=H100,
                                     serial=f"SN-{gpu}", mig_mode="enabled" if mig else "disabled"),
                       "values": gauge(1)})
        for gi in ((1, 2) if mig else ("",)):
            series.append({"series": sel("gpumon_gpu_allocation_info", instance="node-a", gpu=str(gpu), uuid=uuid,
                                         gpu_instance=str(gi), namespace="ml", pod=f"mig-worker-{gpu}{gi}",
                                         container="main"), "values": gauge(1)})
            if mig:
                value = 0.1 if (gpu, gi) == (1, 2) else 0.3 * noise(gpu * 2 + int(gi))
                series.append({"series": sel("gpumon_gpu_mig_activity_ratio", instance="node-a", gpu=str(gpu),
                                             uuid=uuid, gpu_instance=str(gi), compute_instance="0", activity="sm"),
                               "values": gauge(value)})
        if not mig:
            series.append(gpu_signal("sm_activity", "node-a", gpu, 0.9 * noise(gpu)))
    tests.append({"name": "MIG instances are judged among MIG instances of their model", "interval": "30s",
                  "input_series": series, "promql_expr_test": flagged(
                      [gpu_member("ml/mig", "node-a", 1, "sm_activity", model=f"{H100} MIG", gpu_instance="2")]) + [
                      {"expr": 'count by (model) (gpumon_job:straggler_signal:value{job_id="ml/mig"})',
                       "eval_time": "8m", "exp_samples": [{"labels": f'{{model="{H100}"}}', "value": 3},
                                                           {"labels": f'{{model="{H100} MIG"}}', "value": 4}]}]})

    # Mixed models in one job: A100s run slower clocks than H100s and are never compared with them.
    def mixed_models(bad: bool) -> list[Series]:
        out = members("4246", hosts=("node-a",), model=H100) + members("4246", hosts=("node-b",), model=A100)
        for h, (host, clock) in enumerate((("node-a", 1980e6), ("node-b", 1410e6))):
            for gpu in range(GPUS):
                value = 1000e6 if bad and host == "node-b" and gpu == 0 else clock * noise(h * GPUS + gpu)
                out.append(gpu_signal("sm_clock", host, gpu, value))
        return out

    tests.append({"name": "mixed GPU models in one job are never compared", "interval": "30s",
                  "input_series": mixed_models(False), "promql_expr_test": flagged([]) + [
                      {"expr": 'count by (model) (gpumon_job:straggler_signal:median{job_id="4246"})',
                       "eval_time": "8m", "exp_samples": [{"labels": f'{{model="{A100}"}}', "value": 1},
                                                           {"labels": f'{{model="{H100}"}}', "value": 1}]}]})
    tests.append({"name": "mixed GPU models: a slow A100 is named against the A100s", "interval": "30s",
                  "input_series": mixed_models(True),
                  "promql_expr_test": flagged([gpu_member("4246", "node-b", 0, "sm_clock", model=A100)])})

    # Kubernetes: a job is the pods of one owner in a namespace (replica suffixes stripped).
    series = []
    for i, pod in enumerate(("train-master-0", "train-worker-0", "train-worker-1", "llm-3-x7k2p", "solo")):
        uuid = f"GPU-node-a-{i}"
        series.append({"series": sel("gpumon_gpu_allocation_info", instance="node-a", gpu=str(i), uuid=uuid,
                                     namespace="ml", pod=pod, container="main"), "values": gauge(1)})
        series.append({"series": sel("gpumon_gpu_info", instance="node-a", gpu=str(i), uuid=uuid, model=H100,
                                     serial=f"SN-{i}"), "values": gauge(1)})
    tests.append({"name": "Kubernetes pods are grouped by namespace and owner", "interval": "30s",
                  "input_series": series, "promql_expr_test": [
                      {"expr": "count by (job_id) (gpumon_job:gpu_member:info)", "eval_time": "1m",
                       "exp_samples": [{"labels": '{job_id="ml/llm"}', "value": 1},
                                       {"labels": '{job_id="ml/solo"}', "value": 1},
                                       {"labels": '{job_id="ml/train"}', "value": 3}]}]})
    return tests


STALL_ANNOTATIONS = {
    "summary": "Job 4243 is stalled; node-b went quiet first",
}


def stall_series(job_id: str, drop: dict[str, int], spin: bool) -> list[Series]:
    """2 hosts x 2 GPUs busy (90 % activity, 600 W of 700 W) until each host's drop step, then quiet:
    activity 0 and 90 W, or (spin) utilization 100 % at 90 W with no GPM activity."""
    out = members(job_id, gpus=2, steps=80)
    for host in HOSTS:
        for gpu in range(2):
            labels = {"instance": host, "gpu": str(gpu), "uuid": f"GPU-{host}-{gpu}"}
            d = drop[host]
            if not spin:
                out.append({"series": sel("gpumon_gpu_activity_ratio", activity="sm", **labels),
                            "values": f"0.9x{d - 1} 0x{80 - d}"})
            util = "1x80" if spin else f"1x{d - 1} 0x{80 - d}"
            out.append({"series": sel("gpumon_gpu_utilization_ratio", engine="gpu", **labels), "values": util})
            out.append({"series": sel("gpumon_gpu_power_watts", **labels), "values": f"600x{d - 1} 90x{80 - d}"})
            out.append({"series": sel("gpumon_gpu_power_limit_watts", **labels), "values": "700x80"})
            out.append({"series": sel("gpumon_gpu_compute_processes", **labels), "values": "1x80"})
            out.append({"series": sel("gpumon_gpu_memory_used_bytes", **labels), "values": "60e9x80"})
    return out


def stall_tests(runbook: str, description: str) -> list[dict[str, Any]]:
    return [
        {"name": "a hung job: every GPU idle with memory held; node-b went quiet first", "interval": "30s",
         "input_series": stall_series("4243", {"node-a": 14, "node-b": 10}, spin=False),
         "promql_expr_test": [
             {"expr": "gpumon_job_host:stall_since:timestamp_seconds", "eval_time": "12m",
              "exp_samples": [
                  {"labels": 'gpumon_job_host:stall_since:timestamp_seconds{instance="node-a", job_id="4243"}',
                   "value": 540},
                  {"labels": 'gpumon_job_host:stall_since:timestamp_seconds{instance="node-b", job_id="4243"}',
                   "value": 420}]}],
         "alert_rule_test": [
             {"eval_time": "15m", "alertname": "GpumonJobStalled", "exp_alerts": []},
             {"eval_time": "25m", "alertname": "GpumonJobStalled", "exp_alerts": [{
                 "exp_labels": {"severity": "critical", "job_id": "4243", "instance": "node-b"},
                 "exp_annotations": {**STALL_ANNOTATIONS, "description": description, "runbook": runbook}}]}]},
        {"name": "NCCL spinning: 100 % utilization at idle power", "interval": "30s",
         "input_series": stall_series("4247", {"node-a": 10, "node-b": 12}, spin=True),
         "promql_expr_test": [
             {"expr": 'ALERTS{alertname="GpumonJobStalled", alertstate="firing"}', "eval_time": "25m",
              "exp_samples": [{"labels": 'ALERTS{alertname="GpumonJobStalled", alertstate="firing", '
                                         'instance="node-a", job_id="4247", severity="critical"}', "value": 1}]}]},
        {"name": "a busy job is not stalled", "interval": "30s",
         "input_series": stall_series("4248", {"node-a": 80, "node-b": 80}, spin=False),
         "promql_expr_test": [{"expr": "max(gpumon_job_host:stalled:bool)", "eval_time": "25m",
                               "exp_samples": [{"labels": "{}", "value": 0}]}],
         "alert_rule_test": [{"eval_time": "25m", "alertname": "GpumonJobStalled", "exp_alerts": []}]},
    ]


def load_rules() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rule_groups("../job-rules.yaml") for r in g["rules"] if "alert" in r}


def render(doc: dict[str, Any], header: str) -> str:
    return header + yaml.safe_dump(doc, sort_keys=False, width=120, allow_unicode=True)


HEADER = ("# Generated by deploy/prometheus/tests/generate_job_tests.py; do not edit by hand.\n"
          "# promtool test rules deploy/prometheus/tests/{name}\n")


def suite(name: str, interval: str, tests: list[dict[str, Any]]) -> tuple[str, str]:
    doc = {"rule_files": RULE_FILES, "evaluation_interval": interval, "group_eval_order": group_order(),
           "tests": tests}
    return name, render(doc, HEADER.format(name=name))


LEMON_GROUPS = ("gpumon-job-lemons", "gpumon-job-trends")
LEMON_RULES = "job-lemons-rules.yaml"


def lemon_rules() -> tuple[str, str]:
    """The lemon and trend groups alone, as job-rules.yaml has them: their tests step through 2 days, and with
    every group loaded each of those 577 steps would also evaluate the thirty straggler and stall groups,
    which read nothing the lemon groups do."""
    groups = [g for g in rule_groups("../job-rules.yaml") if g["name"] in LEMON_GROUPS]
    header = ("# Generated by deploy/prometheus/tests/generate_job_tests.py from ../job-rules.yaml (its "
              f"{' and '.join(LEMON_GROUPS)} groups, unchanged); do not edit by hand.\n")
    return LEMON_RULES, render({"groups": groups}, header)


def lemon_suite(tests: list[dict[str, Any]]) -> tuple[str, str]:
    name = "job-lemons-test.yaml"
    doc = {"rule_files": [LEMON_RULES], "evaluation_interval": "5m", "group_eval_order": list(LEMON_GROUPS),
           "tests": tests}
    return name, render(doc, HEADER.format(name=name))


def build() -> list[tuple[str, str]]:
    alerts = load_rules()
    stragglers = straggler_tests(alerts["GpumonJobStraggler"]["annotations"]["runbook"])
    return [
        suite("job-straggler-test.yaml", "30s", stragglers[:8]),
        suite("job-straggler-more-test.yaml", "30s", stragglers[8:]),
        suite("job-edges-test.yaml", "30s", edge_tests()),
        suite("job-stall-test.yaml", "30s",
              stall_tests(alerts["GpumonJobStalled"]["annotations"]["runbook"], STALL_DESCRIPTION)),
        lemon_suite([lemon_test(alerts)]),
        lemon_rules(),
    ]


STALL_DESCRIPTION = ("Every GPU of job 4243 holds processes and memory but is idle (or busy-polling at idle power). "
                     "The first host to go quiet was node-b, at 1970-01-01 00:07:00 +0000 UTC.")


def lemon_series() -> tuple[list[Series], int]:
    """Two days at 5-minute steps. VM node-a sits on physical host PH1 with GPU SN-1 and sees an XID at
    1 h; it is reallocated at 4 h and comes back on PH2 with SN-9. VM node-c lands on PH1 at 6 h, gets SN-1,
    and SN-1 fails again (a row remapped) at 10 h. SN-7 on node-d remaps rows steadily; SN-9 remapped
    20 rows long ago and no more. VM node-f (PH5, SN-6) restarts at 8 h and is back at 8.5 h with a row
    remapped while it was down."""
    steps = 2 * 288
    step_h = 12  # steps per hour

    def span(start_h: float, end_h: float | None, value: Callable[[int], float]) -> str:
        out = []
        for i in range(steps + 1):
            in_span = i >= start_h * step_h and (end_h is None or i < end_h * step_h)
            out.append(f"{value(i):g}" if in_span else ("stale" if end_h is not None and i == end_h * step_h else "_"))
        return " ".join(out)

    def one(v: float) -> Callable[[int], float]:
        return lambda i: v

    out: list[Series] = []

    def vm(host: str, physical: str, serial: str, start: float, end: float | None) -> None:
        out.append({"series": sel("gpumon_host_info", instance=host, vm_id=f"vm-{host}", physical_host=physical),
                    "values": span(start, end, one(1))})
        out.append({"series": sel("gpumon_gpu_info", instance=host, gpu="0", uuid=f"GPU-{serial}", serial=serial,
                                  model=H100), "values": span(start, end, one(1))})

    vm("node-a", "PH1", "SN-1", 0, 4)
    out.append({"series": sel("gpumon_gpu_xid_errors_total", instance="node-a", gpu="0", uuid="GPU-SN-1", xid="79"),
                "values": span(1, 4, one(1))})
    out.append({"series": sel("gpumon_gpu_remapped_rows", instance="node-a", gpu="0", uuid="GPU-SN-1",
                              cause="uncorrectable"), "values": span(0, 4, one(2))})
    vm("node-a", "PH2", "SN-9", 5, None)
    out.append({"series": sel("gpumon_gpu_remapped_rows", instance="node-a", gpu="0", uuid="GPU-SN-9",
                              cause="uncorrectable"), "values": span(5, None, one(0))})
    out.append({"series": sel("gpumon_gpu_remapped_rows", instance="node-a", gpu="0", uuid="GPU-SN-9",
                              cause="correctable"), "values": span(5, None, one(20))})
    # SN-9 also brings 50,000 corrected ECC errors from its life before: not the day's errors.
    out.append({"series": sel("gpumon_gpu_ecc_errors_total", instance="node-a", gpu="0", uuid="GPU-SN-9",
                              type="corrected", counter="aggregate"), "values": span(5, None, one(50000))})
    # SN-8 on node-e: healthy, no XID, no remap, no corrected errors: nothing recorded for it but its rows.
    vm("node-e", "PH4", "SN-8", 0, None)
    out.append({"series": sel("gpumon_gpu_remapped_rows", instance="node-e", gpu="0", uuid="GPU-SN-8",
                              cause="correctable"), "values": span(0, None, one(0))})
    out.append({"series": sel("gpumon_gpu_ecc_errors_total", instance="node-e", gpu="0", uuid="GPU-SN-8",
                              type="corrected", counter="aggregate"), "values": span(0, None, one(0))})
    vm("node-c", "PH1", "SN-1", 6, None)
    out.append({"series": sel("gpumon_gpu_remapped_rows", instance="node-c", gpu="0", uuid="GPU-SN-1",
                              cause="uncorrectable"), "values": span(6, None, lambda i: 3 if i >= 10 * step_h else 2)})
    # SN-6 on node-f: every series gone for the 30 minutes of a restart, one row more when it is back.
    def restarted(value: Callable[[int], float]) -> str:
        down, up = 8 * step_h, int(8.5 * step_h)
        return " ".join("stale" if i == down else "_" if down < i < up else f"{value(i):g}" for i in range(steps + 1))

    out.append({"series": sel("gpumon_host_info", instance="node-f", vm_id="vm-node-f", physical_host="PH5"),
                "values": restarted(one(1))})
    out.append({"series": sel("gpumon_gpu_info", instance="node-f", gpu="0", uuid="GPU-SN-6", serial="SN-6",
                              model=H100), "values": restarted(one(1))})
    out.append({"series": sel("gpumon_gpu_remapped_rows", instance="node-f", gpu="0", uuid="GPU-SN-6",
                              cause="uncorrectable"), "values": restarted(lambda i: 1 if i >= 8 * step_h else 0)})
    # SN-7: 5 rows a day for correctable errors, and corrected ECC errors at a growing rate.
    vm("node-d", "PH3", "SN-7", 0, None)
    out.append({"series": sel("gpumon_gpu_remapped_rows", instance="node-d", gpu="0", uuid="GPU-SN-7",
                              cause="correctable"), "values": span(0, None, lambda i: i // 58)})
    out.append({"series": sel("gpumon_gpu_ecc_errors_total", instance="node-d", gpu="0", uuid="GPU-SN-7",
                              type="corrected", counter="aggregate"),
                "values": span(0, None, lambda i: float(i * i))})
    return out, steps


def lemon_test(alerts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    series, _ = lemon_series()

    def alert(name: str, labels: dict[str, str], annotations: dict[str, str]) -> dict[str, Any]:
        return {"exp_labels": {"severity": alerts[name]["labels"]["severity"], **labels},
                "exp_annotations": {**annotations, "runbook": alerts[name]["annotations"]["runbook"]}}

    test = {
        "name": "a GPU and a host that fail again after a VM reallocation; a GPU that wears", "interval": "5m",
        "input_series": series,
        "promql_expr_test": [
            {"expr": "serial:gpumon_gpu_faults:increase7d > 0", "eval_time": "12h", "exp_samples": [
                {"labels": 'serial:gpumon_gpu_faults:increase7d{instance="node-a", kind="xid", physical_host="PH1", '
                           'serial="SN-1"}', "value": 1},
                {"labels": 'serial:gpumon_gpu_faults:increase7d{instance="node-c", kind="row_remap", '
                           'physical_host="PH1", serial="SN-1"}', "value": 1},
                {"labels": 'serial:gpumon_gpu_faults:increase7d{instance="node-d", kind="row_remap", '
                           'physical_host="PH3", serial="SN-7"}', "value": 2},
                {"labels": 'serial:gpumon_gpu_faults:increase7d{instance="node-f", kind="row_remap", '
                           'physical_host="PH5", serial="SN-6"}', "value": 1}]},
            # Sparse: a GPU with nothing to count (no XID, no remapped row, no corrected error) has no lemon or
            # trend series at all.
            {"expr": 'count by (__name__) ({__name__=~"serial:.+", serial="SN-8"})', "eval_time": "2d",
             "exp_samples": []},
            # The row SN-6 remapped across the restart's gap is counted once, when the VM is back.
            {"expr": 'serial:gpumon_gpu_remapped_rows:increase5m{serial="SN-6"}', "eval_time": "510m",
             "exp_samples": [{"labels": 'serial:gpumon_gpu_remapped_rows:increase5m{instance="node-f", gpu="0", '
                                        'uuid="GPU-SN-6", serial="SN-6", physical_host="PH5"}', "value": 1}]},
            {"expr": 'serial:gpumon_gpu_remapped_rows:increase5m{serial="SN-6"}', "eval_time": "515m",
             "exp_samples": []},
            # The day's corrected ECC errors: SN-7's count was 0 a day ago (its placement was seen then), so the
            # day's rate is its count now over a day (288^2 / 86400); SN-9's lifetime count came with a placement
            # younger than a day, and has not grown since: no rate.
            {"expr": "serial:gpumon_gpu_ecc_corrected:rate1d", "eval_time": "1d", "exp_samples": [
                {"labels": 'serial:gpumon_gpu_ecc_corrected:rate1d{instance="node-d", gpu="0", uuid="GPU-SN-7", '
                           'serial="SN-7", physical_host="PH3"}', "value": 0.96}]},
            {"expr": 'serial:gpumon_gpu_ecc_corrected:rate1d{serial="SN-9"}', "eval_time": "2d", "exp_samples": []},
            {"expr": "physical_host:gpumon_gpu_faults:increase7d > 0", "eval_time": "12h", "exp_samples": [
                {"labels": 'physical_host:gpumon_gpu_faults:increase7d{kind="row_remap", physical_host="PH1"}',
                 "value": 1},
                {"labels": 'physical_host:gpumon_gpu_faults:increase7d{kind="row_remap", physical_host="PH3"}',
                 "value": 2},
                {"labels": 'physical_host:gpumon_gpu_faults:increase7d{kind="row_remap", physical_host="PH5"}',
                 "value": 1},
                {"labels": 'physical_host:gpumon_gpu_faults:increase7d{kind="xid", physical_host="PH1"}',
                 "value": 1}]},
        ],
        "alert_rule_test": [
            {"eval_time": "9h", "alertname": "GpumonGpuLemon", "exp_alerts": []},
            {"eval_time": "12h", "alertname": "GpumonGpuLemon", "exp_alerts": [alert(
                "GpumonGpuLemon", {"serial": "SN-1"}, LEMON_ANNOTATIONS["GpumonGpuLemon"])]},
            {"eval_time": "12h", "alertname": "GpumonHostLemon", "exp_alerts": [alert(
                "GpumonHostLemon", {"physical_host": "PH1"}, LEMON_ANNOTATIONS["GpumonHostLemon"])]},
            {"eval_time": "2d", "alertname": "GpumonGpuRemapTableFilling", "exp_alerts": [alert(
                "GpumonGpuRemapTableFilling", {"instance": "node-d", "gpu": "0", "uuid": "GPU-SN-7", "serial": "SN-7",
                                               "physical_host": "PH3"},
                LEMON_ANNOTATIONS["GpumonGpuRemapTableFilling"])]},
            {"eval_time": "2d", "alertname": "GpumonGpuCorrectedEccRising", "exp_alerts": [alert(
                "GpumonGpuCorrectedEccRising", {"instance": "node-d", "gpu": "0", "uuid": "GPU-SN-7",
                                                "serial": "SN-7", "physical_host": "PH3"},
                LEMON_ANNOTATIONS["GpumonGpuCorrectedEccRising"])]},
        ],
    }
    return test


LEMON_ANNOTATIONS: dict[str, dict[str, str]] = {
    "GpumonGpuLemon": {
        "summary": "GPU serial SN-1 failed under 2 VM placements in 7 days",
        "description": ("The GPU with serial SN-1 reported XIDs or remapped rows under 2 different VMs (instance and "
                        "physical host) within 7 days: it fails again after its VM was reallocated.")},
    "GpumonHostLemon": {
        "summary": "Physical host PH1 failed under 2 VMs in 7 days",
        "description": ("VMs placed on physical host PH1 reported GPU XIDs or remapped rows under 2 different VMs "
                        "within 7 days. When GpumonGpuLemon names one serial on it, the GPU is the likely culprit; "
                        "failures on several GPUs point at the host (board, NVSwitch, power).")},
    "GpumonGpuRemapTableFilling": {
        "summary": "GPU serial SN-7 on node-d remaps rows steadily",
        "description": ("At the slope of the last 3 days the GPU will have remapped 78 rows within 14 days (budget 64). "
                        "Its memory is wearing: the remap table will fill and the next error will be uncontained.")},
    "GpumonGpuCorrectedEccRising": {
        "summary": "Corrected ECC errors of GPU serial SN-7 on node-d keep rising",
        "description": ("2.880 corrected ECC errors per second over the last day (threshold 0.01, about 860 a day), "
                        "and the rate grew over the last 3 days: the memory is wearing and rows will be remapped.")},
}


def outputs() -> dict[str, str]:
    return {os.path.join(HERE, name): text for name, text in build()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed test files are stale")
    args = parser.parse_args(argv)
    return sync(outputs(), args.check, "python deploy/prometheus/tests/generate_job_tests.py")


if __name__ == "__main__":
    sys.exit(main())
