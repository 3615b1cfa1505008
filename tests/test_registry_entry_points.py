"""Third-party collectors and sinks plug in through entry points, without touching gpumon."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import clean_env, write_distribution


def test_a_plugin_installed_as_a_distribution_is_found_and_runs(tmp_path):
    write_distribution(tmp_path, "acme-probe", "[gpumon.collectors]\nacme = acme_probe:RackProbe\n",
                       {"acme_probe.py": '''
        from gpumon.collectors.base import Collector
        from gpumon.config import Option, SectionSchema
        from gpumon.model import Collection, MetricSpec, MetricType

        TEMP = MetricSpec("acme_rack_temperature_celsius", MetricType.GAUGE, "Rack inlet.", "celsius")

        class RackProbe(Collector):
            name = "acme"
            options = SectionSchema("acme", "Acme rack probe.", (Option("offset", float, 0.0, "Offset."),))

            @classmethod
            def metrics(cls):
                return (TEMP,)

            def collect(self):
                result = Collection()
                result.add(TEMP, [TEMP.sample(21.5 + self.cfg.offset)])
                return result
    '''})
    env = clean_env(PYTHONPATH=str(tmp_path), GPUMON_ACME_OFFSET="1.0")
    result = subprocess.run([sys.executable, "-m", "gpumon", "once", "--collectors", "acme", "--format", "json"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    metric = next(m for m in doc["metrics"] if m["name"] == "acme_rack_temperature_celsius")
    assert metric["samples"][0]["value"] == 22.5  # its own config section works from the environment
    assert [c["name"] for c in doc["collectors"]] == ["acme"]


def test_a_broken_plugin_is_reported_and_the_rest_keeps_working(tmp_path):
    write_distribution(tmp_path, "broken-probe", "[gpumon.collectors]\nbroken = broken_probe:Probe\n"
                       "[gpumon.sinks]\nghost = notinstalled.sub:Sink\n",
                       {"broken_probe.py": "raise RuntimeError('half-installed')\n"})
    env = clean_env(PYTHONPATH=str(tmp_path))
    result = subprocess.run([sys.executable, "-m", "gpumon", "once", "--format", "json", "--sysfs-root", str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "plugin 'broken' cannot be loaded" in result.stderr
    assert "plugin 'ghost' cannot be loaded" in result.stderr  # a.b with a missing parent a
    status = {c["name"]: c for c in json.loads(result.stdout)["collectors"]}
    assert not status["broken"]["ok"] and "half-installed" in status["broken"]["error"]
    explicit = subprocess.run([sys.executable, "-m", "gpumon", "once", "--collectors", "broken"],
                              env=env, capture_output=True, text=True, timeout=60)
    assert explicit.returncode == 1 and "half-installed" in explicit.stderr
