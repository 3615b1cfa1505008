"""The layer picture of docs/architecture.md, enforced on the import graph (imports inside functions
count; ``if TYPE_CHECKING:`` blocks do not): face -> loop -> stages, collectors, health, sinks -> sources ->
core and the metric catalogue; simulate beside them, reached only from the loop and the face. And
the catalogue's rule, enforced on the source: no metric name is written as a string outside it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from gpumon.catalogue import every
from gpumon.registry import BUILTIN_COLLECTORS
from tests.conftest import REPO
from tests.support.imports import graph

FACE = ("gpumon.cli", "gpumon.cli_commands", "gpumon.cli_config", "gpumon.cli_job", "gpumon.__main__",
        "gpumon.report", "gpumon.confdoc")
LOOP = ("gpumon.daemon", "gpumon.registry")

COLLECTOR_MODULES = frozenset(target.partition(":")[0] for target in BUILTIN_COLLECTORS.values())
"""Modules a built-in collector is registered from; every other module in collectors/ is a helper."""

SELF_CONTAINED = ("gpumon.model", "gpumon.config", "gpumon.config_values", "gpumon.table", "gpumon.backoff",
                  "gpumon.catalogue.hints", "gpumon.catalogue.units")
"""The core types, the catalogue's hint and unit types and the one backoff, which every layer may
import; they import nothing of gpumon (but the model names the hint types its specs carry)."""
MODEL_MAY_IMPORT = frozenset({"gpumon.catalogue.hints"})
CONFIG_MAY_IMPORT = frozenset({"gpumon.config_values"})
"""The config's schema and loader use its value coercion and checks (and re-export them)."""

IMDS_CLIENT = "gpumon.imds"
IMDS_FREE = ("gpumon.sinks", "gpumon.stages", "gpumon.health", "gpumon.daemon", "gpumon.selfmetrics")
"""Packages that read the host identity from the snapshot and never ask IMDS themselves."""
IMDS_ONE_OFF = frozenset({"gpumon.health.actions.azure_ghr"})
"""Asks IMDS once per report, on the actions' worker, for the resource id at that moment: no refresh."""

KNOWN_BREACHES: set[tuple[str, str]] = set()
"""Edges that break a rule today, each to be removed by its module's owner; a fixed one must leave."""


def inside(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def breaches() -> dict[str, set[tuple[str, str]]]:
    """Every edge that breaks a rule, by rule."""
    found: dict[str, set[tuple[str, str]]] = {}

    def breach(rule: str, source: str, target: str) -> None:
        found.setdefault(rule, set()).add((source, target))

    for source, targets in graph().items():
        for target in targets:
            upward = inside(target, *FACE, *LOOP)
            if inside(source, "gpumon.collectors"):
                if target in COLLECTOR_MODULES and target != source:
                    breach("collectors import no collector module (helpers in collectors/ are fine)", source, target)
                if upward or inside(target, "gpumon.sinks", "gpumon.health", "gpumon.simulate"):
                    breach("collectors import no sink, health, simulate, loop or face module", source, target)
            if inside(source, "gpumon.sinks") and (
                    upward or inside(target, "gpumon.collectors", "gpumon.health", "gpumon.simulate")):
                breach("sinks import no collector, health, simulate, loop or face module", source, target)
            if inside(source, "gpumon.health") and (
                    upward or inside(target, "gpumon.collectors", "gpumon.simulate")
                    or (inside(target, "gpumon.sinks") and target != "gpumon.sinks.common")):
                breach("health imports no collector, simulate, loop or face module, of sinks only common",
                       source, target)
            if inside(source, "gpumon.stages") and (
                    upward or inside(target, "gpumon.collectors", "gpumon.simulate")):
                breach("stages import no collector, simulate, loop or face module", source, target)
            if inside(target, "gpumon.stages") and not inside(source, "gpumon.stages", "gpumon.daemon"):
                breach("stages are imported only by the loop (daemon/) and each other", source, target)
            if inside(source, "gpumon.sources") and not (
                    inside(target, "gpumon.sources") or target in ("gpumon.model", "gpumon.config")):
                breach("sources import only model, config and sources", source, target)
            if inside(target, "gpumon.simulate") and not (
                    inside(source, "gpumon.simulate")
                    or source in ("gpumon.daemon.context", "gpumon.cli", "gpumon.cli_commands")):
                breach("simulate is imported only by simulate, daemon.context, cli and cli_commands", source, target)
            if inside(source, "gpumon.simulate") and not (
                    inside(target, "gpumon.simulate", "gpumon.sources") or target in (*SELF_CONTAINED, "gpumon")):
                breach("simulate imports only sources, the core types and itself", source, target)
            if source in SELF_CONTAINED and target != "gpumon" and not (
                    (source == "gpumon.model" and target in MODEL_MAY_IMPORT)
                    or (source == "gpumon.config" and target in CONFIG_MAY_IMPORT)):
                breach("model, config, table, backoff and the hint and unit types import nothing of gpumon "
                       "(the model only the hint types, the config only its values)", source, target)
            if inside(target, "gpumon.report") and not inside(source, *FACE):
                breach("the report (once's output, the terminal tables) is imported only by the face",
                       source, target)
            if target == IMDS_CLIENT and inside(source, *IMDS_FREE) and source not in IMDS_ONE_OFF:
                breach("only the identity provider refreshes the host identity: no sink, stage, health or loop "
                       "module imports the IMDS client (they read Snapshot.identity)", source, target)
            if inside(source, "gpumon.identity") and not (
                    inside(target, "gpumon.identity", "gpumon.sources")
                    or target in ("gpumon", IMDS_CLIENT, "gpumon.model", "gpumon.config")):
                breach("the identity provider imports only the IMDS client, sources, model and config "
                       "(every layer above reads its answer on the snapshot)", source, target)
            if inside(source, "gpumon.catalogue") and not (
                    inside(target, "gpumon.catalogue") or target in ("gpumon", "gpumon.model")):
                breach("the metric catalogue (pure data, the ground floor) imports only the model and itself",
                       source, target)
    return found


def test_the_rules_see_the_modules_they_are_about():
    """Guards the rules themselves: a renamed package would make every rule pass vacuously."""
    edges = graph()
    assert set(edges) >= COLLECTOR_MODULES, COLLECTOR_MODULES - set(edges)
    assert {"gpumon.collectors.base", "gpumon.collectors.gpu_directory"} <= set(edges) - COLLECTOR_MODULES
    assert "gpumon.collectors.gpu_directory" in edges["gpumon.collectors.attribution"]
    assert "gpumon.sources.ib_sysfs" in edges["gpumon.collectors.infiniband"]
    assert "gpumon.collectors.infiniband" in edges["gpumon.report.tables"]  # the report owns the tables
    assert "gpumon.report" in edges["gpumon.cli_commands"]
    assert "gpumon.backoff" in edges["gpumon.health.actions.worker"]  # the actions use the shared backoff
    assert "gpumon.backoff" in edges["gpumon.collectors.nvml_session"]  # and so does NVML's re-init
    assert "gpumon.stages" in edges["gpumon.daemon.plan"]  # the plan builds the stages
    assert "gpumon.health.stage" in edges["gpumon.stages.health"]  # which run the health rules
    for package in ("gpumon.sinks", "gpumon.health", "gpumon.sources", "gpumon.simulate", "gpumon.stages"):
        assert any(inside(m, package) for m in edges), package


def test_the_rules_catch_a_planted_breach(monkeypatch):
    me = sys.modules[__name__]  # breaches() looks graph up in this module

    real = graph()
    planted = {**real, "gpumon.sources.kvp": real["gpumon.sources.kvp"] | {"gpumon.collectors.nvml"},
               "gpumon.collectors.kmsg": real["gpumon.collectors.kmsg"] | {"gpumon.collectors.xid"},
               "gpumon.catalogue.gpu": real["gpumon.catalogue.gpu"] | {"gpumon.sources.ib_sysfs"},
               "gpumon.catalogue.hints": real["gpumon.catalogue.hints"] | {"gpumon.model"},
               "gpumon.sinks.otel.mapping": real["gpumon.sinks.otel.mapping"]
               | {"gpumon.collectors.nvml_readings"},
               "gpumon.collectors.nvml": real["gpumon.collectors.nvml"] | {"gpumon.report.tables"},
               "gpumon.daemon.once": real["gpumon.daemon.once"] | {"gpumon.report"},
               "gpumon.table": real["gpumon.table"] | {"gpumon.model"},
               "gpumon.backoff": real["gpumon.backoff"] | {"gpumon.sinks.common"},
               "gpumon.stages.relabel": real["gpumon.stages.relabel"] | {"gpumon.collectors.attribution"},
               "gpumon.sinks.prometheus": real["gpumon.sinks.prometheus"] | {"gpumon.stages.selfmetrics"},
               "gpumon.sinks.otel.resource": real["gpumon.sinks.otel.resource"] | {"gpumon.imds"},
               "gpumon.identity.provider": real["gpumon.identity.provider"] | {"gpumon.sinks.base"}}
    monkeypatch.setattr(me, "graph", lambda: planted)
    found = {edge for edges in breaches().values() for edge in edges}
    assert ("gpumon.sources.kvp", "gpumon.collectors.nvml") in found
    assert ("gpumon.collectors.kmsg", "gpumon.collectors.xid") in found
    assert ("gpumon.catalogue.gpu", "gpumon.sources.ib_sysfs") in found
    assert ("gpumon.catalogue.hints", "gpumon.model") in found
    assert ("gpumon.sinks.otel.mapping", "gpumon.collectors.nvml_readings") in found
    assert ("gpumon.collectors.nvml", "gpumon.report.tables") in found
    assert ("gpumon.daemon.once", "gpumon.report") in found
    assert ("gpumon.table", "gpumon.model") in found
    assert ("gpumon.backoff", "gpumon.sinks.common") in found
    assert ("gpumon.stages.relabel", "gpumon.collectors.attribution") in found
    assert ("gpumon.sinks.prometheus", "gpumon.stages.selfmetrics") in found
    assert ("gpumon.sinks.otel.resource", "gpumon.imds") in found
    assert ("gpumon.identity.provider", "gpumon.sinks.base") in found


def test_imports_point_down_the_layers():
    found = breaches()
    unexpected = {rule: sorted(edges - KNOWN_BREACHES) for rule, edges in found.items() if edges - KNOWN_BREACHES}
    assert not unexpected, f"imports against docs/architecture.md's layers: {unexpected}"
    stale = KNOWN_BREACHES - {edge for edges in found.values() for edge in edges}
    assert not stale, f"fixed breaches still listed in KNOWN_BREACHES: {sorted(stale)}"


# ------------------------------------------------------------------ one host identity, one IMDS thread
def imds_threads(edges: dict[str, set[str]]) -> set[str]:
    """Modules that import the IMDS client and start a thread: each one a refresh of its own."""
    found = set()
    for module, targets in edges.items():
        if IMDS_CLIENT not in targets or module == IMDS_CLIENT:
            continue
        path = Path(REPO, *module.split(".")).with_suffix(".py")
        if not path.exists():
            path = Path(REPO, *module.split("."), "__init__.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Thread"):
                found.add(module)
    return found


def test_one_thread_refreshes_the_host_identity():
    """The identity provider alone keeps the host identity fresh (IMDS and the KVP pool, on its own
    thread); the loop stamps it on each snapshot. A collector asks the shared client on its own run,
    never on a thread it starts."""
    edges = graph()
    assert IMDS_CLIENT in edges["gpumon.identity.provider"]  # guards the rule: the provider is found
    assert imds_threads(edges) == {"gpumon.identity.provider"}
    planted = {**edges, "gpumon.sinks.delivery": edges["gpumon.sinks.delivery"] | {IMDS_CLIENT}}
    assert "gpumon.sinks.delivery" in imds_threads(planted)


# ------------------------------------------------------------------ metric names live in the catalogue
CATALOGUE = Path(REPO) / "gpumon" / "catalogue"
KNOWN_NAME_STRINGS: set[str] = set()
"""Modules that still write a metric name as a string, each to move to the constant; a fixed one must leave."""


def metric_name_strings(root: Path, names: frozenset[str]) -> list[tuple[Path, int, str]]:
    """(path, line, name) for every string constant under ``root`` (gpumon/catalogue/ excepted) that is
    a catalogue metric's name: such a module must refer to the metric by its constant."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if CATALOGUE in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append((path, node.lineno, node.value))
    return found


def test_no_metric_name_is_written_as_a_string_outside_the_catalogue():
    """One new metric is one edit in the catalogue: collectors, health rules, sinks, the report and the
    docs generators name a metric by its constant (``gpu.LOST.name``), never as ``"gpumon_gpu_lost"``."""
    names = frozenset(spec.name for spec in every.ALL)
    assert {"gpumon_gpu_lost", "gpumon_ib_port_up", "gpumon_collector_up", "process_open_fds"} <= names
    found = [(str(path.relative_to(REPO)), line, name)
             for path, line, name in metric_name_strings(Path(REPO) / "gpumon", names)]
    unexpected = [f"{path}:{line}: {name}" for path, line, name in found if path not in KNOWN_NAME_STRINGS]
    assert not unexpected, "metric names written as strings outside gpumon/catalogue/:\n" + "\n".join(unexpected)
    stale = KNOWN_NAME_STRINGS - {path for path, _, _ in found}
    assert not stale, f"modules that no longer write metric names still listed in KNOWN_NAME_STRINGS: {stale}"


def test_the_metric_name_rule_finds_a_planted_string(tmp_path):
    """Guards the rule itself: a module that writes a catalogue name as a string is found; a longer
    string that merely starts with one is not."""
    (tmp_path / "planted.py").write_text('FAMILY = "gpumon_gpu_lost"\nOTHER = "gpumon_gpu_lost_not"\n')
    names = frozenset(spec.name for spec in every.ALL)
    assert [(p.name, line, name) for p, line, name in metric_name_strings(tmp_path, names)] == [
        ("planted.py", 1, "gpumon_gpu_lost")]


# ------------------------------------------------------------------ one delivery machine for the sinks
SINKS = Path(REPO) / "gpumon" / "sinks"
DELIVERY = SINKS / "delivery.py"
KNOWN_RETRY_LOOPS: set[str] = set()
"""Sink modules that still drive a backoff themselves (their own retry loop), each to move onto the
shared Uploader; a moved one must leave. None today: the OpenTelemetry sink's slot and event queue
are Uploader queues too (``sinks/queues.py``)."""


def retry_loops(root: Path, skip: Path | None = DELIVERY) -> list[tuple[Path, int]]:
    """(path, line) of every call of a backoff's ``failed`` or ``succeeded``, and every read of its
    ``not_before`` (a wait scheduled by hand, as the OpenTelemetry sink's export threads had), under
    ``root``, outside ``skip`` (``delivery.py``): the retry loop is the Uploader's, a sink only classifies."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == skip:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            called = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr in ("failed", "succeeded")
                      and "backoff" in ast.unparse(node.func.value).lower())
            scheduled = (isinstance(node, ast.Attribute) and node.attr == "not_before"
                         and "backoff" in ast.unparse(node.value).lower())
            if called or scheduled:
                found.append((path, node.lineno))
    return found


def test_no_sink_module_runs_its_own_retry_loop():
    """A new HTTP sink is an encoder and a classifier over ``sinks/delivery.py``'s Uploader, which
    alone waits out the backoff; a sink module that calls ``backoff.failed(...)`` has grown a loop."""
    found = {str(path.relative_to(REPO)) for path, _ in retry_loops(SINKS)}
    assert not found - KNOWN_RETRY_LOOPS, f"sink modules with their own retry loop: {sorted(found - KNOWN_RETRY_LOOPS)}"
    stale = KNOWN_RETRY_LOOPS - found
    assert not stale, f"modules on the Uploader now still listed in KNOWN_RETRY_LOOPS: {stale}"
    assert DELIVERY in {path for path, _ in retry_loops(SINKS, skip=None)}  # the rule sees the real loop


def test_the_retry_loop_rule_finds_a_planted_loop(tmp_path):
    (tmp_path / "planted.py").write_text(
        "def run(self):\n    while True:\n        delay = self._backoff.failed(now, retry_after)\n"
        "        self.backoff.succeeded()\n        counters.failed_attempt(1)\n"
        "        wake.wait(max(0.01, backoff.not_before - now))\n")
    assert [(p.name, line) for p, line in retry_loops(tmp_path)] == [
        ("planted.py", 3), ("planted.py", 4), ("planted.py", 6)]


# ------------------------------------------------------------------ small modules
MODULE_LINES = 600


def long_modules(root: Path) -> dict[str, int]:
    """Modules under ``root`` (gpumon/) longer than MODULE_LINES, but the simulated hosts' (simulate/:
    tables of profiles and the doubles of NVML, sysfs and IMDS, read as data)."""
    return {str(path.relative_to(root.parent)): n for path in sorted(root.rglob("*.py"))
            if "simulate" not in path.relative_to(root).parts[:1]
            and (n := len(path.read_text(encoding="utf-8").splitlines())) > MODULE_LINES}


def test_no_module_outside_simulate_passes_600_lines():
    """One job a module: the nvml collector is readers on one base (nvml_gpu, nvml_fields, nvml_mig),
    the face a parser and its commands (cli, cli_commands, cli_job), the endpoint's loop apart from its
    TLS steps. A module that outgrows MODULE_LINES is two modules."""
    long = long_modules(Path(REPO) / "gpumon")
    assert not long, f"modules over {MODULE_LINES} lines: {long}"


def test_the_module_length_rule_finds_a_planted_long_module(tmp_path):
    package = tmp_path / "gpumon"
    (package / "simulate").mkdir(parents=True)
    (package / "sinks").mkdir()
    (package / "sinks" / "long.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    (package / "sinks" / "short.py").write_text("x = 1\n" * MODULE_LINES)
    (package / "simulate" / "profiles.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    assert long_modules(package) == {"gpumon/sinks/long.py": MODULE_LINES + 1}


# ------------------------------------------------------------------ tests as a library
TESTS = Path(REPO) / "tests"


def imported_modules(source: str, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``source``, a module of ``package``: relative imports
    resolved, and each imported name too (``from tests import test_x`` gives ``tests.test_x``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def imports_of_test_modules(root: Path, paths: list[Path]) -> list[str]:
    """``path:line: module`` for every import of a ``test_*`` module in ``paths`` (under ``root``)."""
    found = []
    for path in paths:
        package = path.relative_to(root).parent.parts
        for line, module in imported_modules(path.read_text(encoding="utf-8"), package):
            if module.rpartition(".")[2].startswith("test_"):
                found.append(f"{path.relative_to(root)}:{line}: {module}")
    return found


def test_modules_import_no_test_module():
    """A helper two test files share lives in tests/support/ (a stand-in in tests/fakes/), so a test
    module is only ever collected, never imported: tests and benchmarks import no ``test_*`` module."""
    paths = [p for p in sorted(TESTS.rglob("*.py")) + sorted((Path(REPO) / "bench").rglob("*.py"))
             if "node_modules" not in p.parts]
    found = imports_of_test_modules(Path(REPO), paths)
    assert not found, "imports of test modules:\n" + "\n".join(found)


def test_the_test_import_rule_finds_planted_imports(tmp_path):
    """Guards the rule: absolute, ``from tests import``, relative and in-function imports are found."""
    planted = tmp_path / "tests" / "health" / "test_planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("import tests.test_a\nfrom tests import test_b\nfrom .test_c import x\n"
                       "from ..support import test_d\n\ndef f():\n    from tests.test_e import y\n"
                       "from tests.support.nvml import rig\n")
    assert [line.rpartition(" ")[2] for line in imports_of_test_modules(tmp_path, [planted])] == [
        "tests.test_a", "tests.test_b", "tests.health.test_c", "tests.support.test_d", "tests.test_e"]


HELPER_HOMES = ("support", "fakes")
NOT_TESTS = ("conftest.py", "__init__.py")


def helpers_outside_their_homes(root: Path) -> list[str]:
    """Every module under ``root`` (a ``tests/`` folder) that is neither a ``test_*`` module, a
    ``conftest.py`` nor an ``__init__.py``, outside tests/support/ and tests/fakes/: a helper there."""
    return [str(path.relative_to(root)) for path in sorted(root.rglob("*.py"))
            if path.relative_to(root).parts[0] not in HELPER_HOMES
            and not path.name.startswith("test_") and path.name not in NOT_TESTS]


def test_test_helpers_live_in_support_or_fakes():
    """A rig, reader or dump lives in tests/support/, a stand-in in tests/fakes/: a helper beside the
    test modules (tests/outputs_dump.py was one) is a second home for the same kind of thing."""
    found = helpers_outside_their_homes(TESTS)
    assert not found, "helper modules outside tests/support/ and tests/fakes/: " + ", ".join(found)


def test_the_test_layout_rule_finds_a_planted_helper(tmp_path):
    """Guards the rule: a helper at tests/ root or in a test folder is found; test modules,
    conftest.py, __init__.py and the two homes' modules are not."""
    for name in ("planted_helper.py", "conftest.py", "__init__.py", "test_a.py", "health/rig.py",
                 "health/test_b.py", "health/__init__.py", "support/rig.py", "fakes/imds.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert helpers_outside_their_homes(tmp_path) == ["health/rig.py", "planted_helper.py"]


def test_the_package_imports_nothing_of_the_checkout():
    """gpumon/ is what the wheel ships: it imports nothing from tests/ (the stand-ins) or tools/."""
    found = []
    for path in sorted((Path(REPO) / "gpumon").rglob("*.py")):
        package = path.relative_to(REPO).parent.parts
        found += [f"{path.relative_to(REPO)}:{line}: {module}"
                  for line, module in imported_modules(path.read_text(encoding="utf-8"), package)
                  if module.partition(".")[0] in ("tests", "tools")]
    assert not found, "gpumon/ imports from the checkout:\n" + "\n".join(found)


def test_the_simulation_rule_catches_a_planted_breach(monkeypatch):
    """simulate/ sits beside the collectors: it imports sources and itself, never a collector."""
    real = graph()
    planted = {**real, "gpumon.simulate.nvml": real["gpumon.simulate.nvml"] | {"gpumon.collectors.nvml_metrics"}}
    monkeypatch.setattr(sys.modules[__name__], "graph", lambda: planted)
    found = {edge for edges in breaches().values() for edge in edges}
    assert ("gpumon.simulate.nvml", "gpumon.collectors.nvml_metrics") in found
