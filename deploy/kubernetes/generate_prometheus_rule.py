#!/usr/bin/env python3
"""Writes deploy/kubernetes/prometheus-rules/prometheusrule.yaml: every group of every rule file under
deploy/prometheus/ as one Prometheus Operator PrometheusRule, so the operator's Prometheus evaluates the
same recording and alerting rules as a hand-configured one.

    python deploy/kubernetes/generate_prometheus_rule.py           # rewrite the resource
    python deploy/kubernetes/generate_prometheus_rule.py --check   # exit 1 if the committed one is stale
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)  # runnable from a checkout

import yaml  # noqa: E402

from gpumon.generated import sync  # noqa: E402
from gpumon.rulefiles import rule_groups  # noqa: E402

OUTPUT = os.path.join(HERE, "prometheus-rules", "prometheusrule.yaml")
COMMAND = "python deploy/kubernetes/generate_prometheus_rule.py"
HEADER = f"""\
# Generated from the rule files in deploy/prometheus/ by {COMMAND}; do not edit.
# kube-prometheus-stack selects PrometheusRules by the Helm release label by default
# (ruleSelector: {{matchLabels: {{release: <release name>}}}}); set it to yours, or set
# prometheus.prometheusSpec.ruleSelectorNilUsesHelmValues=false to select every PrometheusRule.
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL, descriptions) as literal blocks, as in the rule files themselves."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def build(root: str = ROOT) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "gpumon", "labels": {"release": "kube-prometheus-stack"}},
        "spec": {"groups": rule_groups(root)},
    }


def render(root: str = ROOT) -> str:
    return HEADER + yaml.dump(build(root), Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed resource is stale")
    args = parser.parse_args(argv)
    return sync({OUTPUT: render()}, args.check, COMMAND)


if __name__ == "__main__":
    sys.exit(main())
