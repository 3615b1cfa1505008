"""The plugin contract end to end: the plugin shown in docs/architecture.md, built from exactly the
files the document shows into a real package, installed with pip beside an editable gpumon in a
fresh venv, and run through ``gpumon once`` (table, json, prometheus), ``gpumon run`` and every sink.

One venv for the module. It is made without pip and sees the running interpreter's site-packages
through a ``.pth`` file, so gpumon's dependencies, pip and setuptools come from there whether the
tests run from a venv, a pyenv build or the system Python; nothing is fetched (``--no-index``).
"""

from __future__ import annotations

import json
import os
import re
import site
import subprocess
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpumon.model import MetricFamily, MetricSpec, MetricType, Sample, Snapshot
from gpumon.sinks.azure_monitor.rows import METRICS, RowBuilder
from tests.conftest import REPO, GpumonProcess, clean_env, http_get, wait_for, write_distribution
from tests.fakes.otlp import OtlpHttpReceiver
from tests.fakes.remote_write import Receiver

pytestmark = pytest.mark.timeout(120)

DOC = Path(REPO) / "docs" / "architecture.md"
INLET = "acme_rack_inlet_temperature_celsius"


def plugin_files(doc: Path = DOC) -> dict[str, str]:
    """The files the architecture document shows, by the path in their ``plugin-file`` marker."""
    found = re.findall(r"<!-- plugin-file: (\S+) -->\n```\w*\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)
    return dict(found)


@dataclass
class Venv:
    root: Path
    work: Path

    @property
    def gpumon(self) -> str:
        return str(self.root / "bin" / "gpumon")

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    def env(self, **extra: str) -> dict[str, str]:
        env = clean_env(GPUMON_DAEMON_STATE_DIR=str(self.work / "state"), **extra)
        env.pop("PYTHONPATH", None)
        env.update(extra)
        return env

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.gpumon, *args], env=self.env(**env), cwd=self.work,
                              capture_output=True, text=True, timeout=60)


def pip(python: str, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    done = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--no-build-isolation", "--disable-pip-version-check", *args],
                          env={**env, "PIP_CONFIG_FILE": os.devnull}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=60)
    python = str(root / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                          *site.getsitepackages()])
    Path(purelib, "_running_interpreter_site.pth").write_text("".join(f"{p}\n" for p in ours))
    from tests.support.artefacts import checkout_build_lock

    with checkout_build_lock(tmp_path_factory):  # an editable install writes the checkout's *.egg-info
        pip(python, "-e", REPO)
    package = tmp_path_factory.mktemp("acme-gpumon")
    for name, text in plugin_files().items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    pip(python, str(package))
    work = tmp_path_factory.mktemp("work")
    (work / "rack.txt").write_text("inlet-a 24.5\ninlet-b 36\nnot a reading\n")
    return Venv(root, work)


def page_with(process: GpumonProcess, text: str) -> str | None:
    """The served page once it holds ``text`` (503 until the first snapshot)."""
    status, _, body = http_get(process.url + "/metrics")
    return body.decode() if status == 200 and text in body.decode() else None


def rack(venv: Venv) -> dict[str, str]:
    return {"GPUMON_ACME_RACK_PATH": str(venv.work / "rack.txt")}


def test_the_document_shows_a_whole_package():
    files = plugin_files()
    assert set(files) == {"pyproject.toml", "acme_gpumon/__init__.py", "acme_gpumon/collector.py",
                          "acme_gpumon/sink.py"}
    for name in ("acme_gpumon/collector.py", "acme_gpumon/sink.py"):
        imported = {m for m in re.findall(r"^(?:from|import) (gpumon\S*)", files[name], re.M)}
        assert imported == {"gpumon.plugin"}, f"{name} imports {imported}: a plugin imports gpumon.plugin only"


def test_the_installed_gpumon_is_the_checkout_and_the_plugin_a_distribution(venv):
    out = subprocess.run([venv.python, "-c", textwrap.dedent("""
        import json
        from importlib.metadata import distribution, entry_points
        import gpumon
        print(json.dumps({"gpumon": gpumon.__file__, "dist": distribution("acme-gpumon").version,
                          "collectors": [e.value for e in entry_points(group="gpumon.collectors")],
                          "sinks": [e.value for e in entry_points(group="gpumon.sinks")]}))
    """)], env=venv.env(), cwd=venv.work, capture_output=True, text=True, timeout=30, check=True)
    found = json.loads(out.stdout)
    assert found["gpumon"] == os.path.join(REPO, "gpumon", "__init__.py")
    assert found["dist"] == "1.0"
    assert found["collectors"] == ["acme_gpumon.collector:RackCollector"]
    assert found["sinks"] == ["acme_gpumon.sink:JsonLinesSink"]


def test_once_shows_the_plugins_metrics_and_events_in_json(venv):
    result = venv.run("once", "--collectors", "acme_rack", "--format", "json", **rack(venv),
                      GPUMON_ACME_RACK_THRESHOLD="30")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    inlet = next(m for m in doc["metrics"] if m["name"] == INLET)
    assert (inlet["type"], inlet["unit"], inlet["help"]) == ("gauge", "celsius", "Rack inlet air temperature.")
    assert {s["labels"]["sensor"]: s["value"] for s in inlet["samples"]} == {"inlet-a": 24.5, "inlet-b": 36.0}
    hot = next(m for m in doc["metrics"] if m["name"] == "acme_rack_hot_sensors")
    assert hot["samples"] == [{"labels": {}, "value": 1.0}]
    assert [(e["kind"], e["subject"]) for e in doc["events"]] == [("acme_rack_hot", {"sensor": "inlet-b"})]
    assert [(c["name"], c["ok"]) for c in doc["collectors"]] == [("acme_rack", True)]


def test_once_shows_the_plugins_table_and_exposition(venv):
    table = venv.run("once", "--collectors", "acme_rack", **rack(venv))
    assert table.returncode == 0, table.stderr
    assert "Rack inlets" in table.stdout
    assert re.search(r"^inlet-a\s+24\.5$", table.stdout, re.M), table.stdout
    assert re.search(r"^acme_rack\s+ok\b", table.stdout, re.M), table.stdout
    page = venv.run("once", "--collectors", "acme_rack", "--format", "prometheus", **rack(venv))
    assert page.returncode == 0, page.stderr
    assert f"# TYPE {INLET} gauge" in page.stdout
    assert f'{INLET}{{sensor="inlet-a"}} 24.5' in page.stdout
    # the collector survived the unparsable line and counted it
    assert 'gpumon_collector_errors_total{collector="acme_rack",reason="parse"} 1' in page.stdout


def test_run_publishes_the_plugins_metrics_through_every_sink(venv):
    otlp = OtlpHttpReceiver()
    remote = Receiver()
    jsonl = venv.work / "snapshots.jsonl"
    env = venv.env(**rack(venv), GPUMON_OTEL_ENDPOINT=otlp.endpoint, GPUMON_OTEL_PROTOCOL="http/protobuf",
                   GPUMON_OTEL_AZURE_DETECT="false", GPUMON_REMOTE_WRITE_URL=remote.url,
                   GPUMON_ACME_JSONL_PATH=str(jsonl))
    process = GpumonProcess(["--collectors", "acme_rack", "--sinks", "prometheus,otel,remote_write,acme_jsonl",
                             "--interval", "0.5"], env, command=[venv.gpumon], cwd=str(venv.work))
    try:
        process.wait_ready()
        page = wait_for(lambda: page_with(process, INLET))
        assert f'{INLET}{{sensor="inlet-b"}} 36' in page
        assert 'gpumon_sink_up{sink="acme_jsonl"} 1' in page

        points = otlp.wait(lambda r: {n: m for n, m in r.metric_points().items() if "rack_inlet_temperature" in n})
        metric = next(iter(points.values()))[-1][0]
        values = {p.attributes[0].value.string_value: p.as_double for p in metric.gauge.data_points}
        assert values == {"inlet-a": 24.5, "inlet-b": 36.0}

        def remote_inlets() -> dict[str, float]:
            with remote._lock:
                received = list(remote.received)
            return {dict(labels)["sensor"]: samples[-1][0] for r in received for labels, samples in r.series
                    if dict(labels).get("__name__") == INLET}

        assert wait_for(lambda: len(remote_inlets()) == 2 and remote_inlets()) == {"inlet-a": 24.5, "inlet-b": 36.0}

        def written() -> list[dict]:
            return [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []

        first = wait_for(lambda: next((d for d in written() if any(m["name"] == INLET for m in d["metrics"])), None))
        assert first["collectors"][0]["name"] == "acme_rack"
    finally:
        code, out = process.stop()
        otlp.close()
        remote.close()
    assert code == 0, out


def test_azure_rows_carry_a_plugins_metrics_as_generic_rows():
    """Azure Monitor tables have fixed columns: a plugin's family has none of its own, so the row
    builder lists it as unmapped and sends it as generic GpuMonMetrics_CL rows (Name, Labels, Value)."""
    spec = MetricSpec(INLET, MetricType.GAUGE, "Rack inlet air temperature.", "celsius", ("sensor",))
    snapshot = Snapshot("node-1", 1000.0, (MetricFamily(spec, (Sample((("sensor", "inlet-a"),), 24.5),)),), (), ())
    rows = RowBuilder("node-1")
    rows.add(snapshot, 1000.0)
    assert INLET in rows.unmapped
    (row,) = rows.close_interval(1060.0, 60.0)[METRICS]
    assert (row["Name"], row["Labels"], row["Value"]) == (INLET, {"sensor": "inlet-a"}, 24.5)




def test_a_broken_entry_point_is_an_error_naming_it(venv, tmp_path):
    path = write_distribution(tmp_path / "broken", "acme-broken", "[gpumon.collectors]\nacme_fan = acme_fan:Fan\n",
                              {"acme_fan.py": "raise RuntimeError('half-installed')\n"})
    explicit = venv.run("once", "--collectors", "acme_rack,acme_fan", **rack(venv), PYTHONPATH=str(path))
    assert explicit.returncode == 1
    assert "plugin 'acme_fan' cannot be loaded: acme_fan:Fan: RuntimeError: half-installed" in explicit.stderr
    assert "collector 'acme_fan' is unavailable" in explicit.stderr
    auto = venv.run("once", "--format", "json", "--sysfs-root", str(tmp_path), **rack(venv), PYTHONPATH=str(path))
    assert "plugin 'acme_fan' cannot be loaded" in auto.stderr  # named, while the others keep working
    status = {c["name"]: c for c in json.loads(auto.stdout)["collectors"]}
    assert status["acme_rack"]["ok"] and not status["acme_fan"]["ok"]


def test_a_plugin_taking_a_builtin_name_is_an_error_and_the_builtin_keeps_it(venv, tmp_path):
    path = write_distribution(tmp_path / "clash", "acme-clash",
                              "[gpumon.collectors]\nnvml = acme_gpumon.collector:RackCollector\n"
                              "[gpumon.sinks]\nprometheus = acme_gpumon.sink:JsonLinesSink\n")
    result = venv.run("once", "--collectors", "nvml,acme_rack", "--simulate", "nd-h100-v5", "--format", "json",
                      **rack(venv), PYTHONPATH=str(path))
    assert ("plugin 'nvml' (acme_gpumon.collector:RackCollector, from acme-clash 1.0) is ignored: 'nvml' is "
            "already the collector built-in gpumon.collectors.nvml:NvmlCollector") in result.stderr
    assert "plugin 'prometheus' (acme_gpumon.sink:JsonLinesSink, from acme-clash 1.0) is ignored" in result.stderr
    assert result.stderr.count("plugin 'nvml'") == 1  # once per process, not per lookup
    assert result.returncode == 0, result.stderr
    names = {m["name"] for m in json.loads(result.stdout)["metrics"]}
    assert "gpumon_gpu_temperature_celsius" in names and INLET in names


THIEF = """
    from gpumon.plugin import Collection, Collector, MetricSpec, MetricType

    TEMP = MetricSpec("gpumon_gpu_temperature_celsius", MetricType.GAUGE, "Not ours.", "celsius")

    class Thief(Collector):
        name = "acme_thief"

        @classmethod
        def metrics(cls):
            return (TEMP,)

        def collect(self):
            result = Collection()
            result.add(TEMP, [TEMP.sample(99)])
            return result
"""


def test_a_plugin_declaring_one_of_gpumons_metric_names_is_refused(venv, tmp_path):
    path = write_distribution(tmp_path / "thief", "acme-thief", "[gpumon.collectors]\nacme_thief = acme_thief:Thief\n",
                              {"acme_thief.py": THIEF})
    result = venv.run("once", "--collectors", "acme_thief,acme_rack", "--format", "json", **rack(venv),
                      PYTHONPATH=str(path))
    assert result.returncode == 1
    assert ("collector plugin 'acme_thief' declares gpumon_gpu_temperature_celsius: the 'gpumon_' prefix is "
            "gpumon's own") in result.stderr
    doc = json.loads(result.stdout) if result.stdout.strip() else {"metrics": []}
    assert all(m["name"] != "gpumon_gpu_temperature_celsius" for m in doc["metrics"])


def test_the_prometheus_page_of_a_running_daemon_serves_no_stolen_name(venv, tmp_path):
    """``gpumon run`` with the refused plugin in auto mode: it starts, names the plugin, serves the rest."""
    path = write_distribution(tmp_path / "thief", "acme-thief", "[gpumon.collectors]\nacme_thief = acme_thief:Thief\n",
                              {"acme_thief.py": THIEF})
    process = GpumonProcess(["--sysfs-root", str(tmp_path), "--interval", "0.5"],
                            venv.env(**rack(venv), PYTHONPATH=str(path)), command=[venv.gpumon],
                            cwd=str(venv.work))
    try:
        process.wait_ready()
        page = wait_for(lambda: page_with(process, INLET))
        assert "gpumon_gpu_temperature_celsius" not in page
        assert http_get(process.url + "/healthz")[0] == 200
    finally:
        code, out = process.stop()
    assert code == 0, out
    assert "collector plugin 'acme_thief' declares gpumon_gpu_temperature_celsius" in out
