"""Typed settings: every built-in section is parsed once into a frozen dataclass whose fields are its
option keys, and gpumon's own code reads options only through it (``self.settings.<key>``)."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from gpumon import imds, registry
from gpumon.collectors.aer import AerCollector
from gpumon.collectors.base import Collector, Context
from gpumon.config import IntList, Option, Section, SectionSchema, TableList, load
from gpumon.health.settings import HEALTH
from gpumon.sinks.base import SinkContext
from gpumon.sinks.prometheus import PrometheusSink

FIELD_TYPE = {float: "float", int: "int", str: "str", bool: "bool", list: "tuple[str, ...]",
              IntList: "tuple[int, ...]", TableList: "tuple[dict[str, Any], ...]"}
"""The annotation a settings field has for each option type (lists are held as tuples)."""


def builtin_classes() -> list[type]:
    return ([registry.collector_class(n) for n in registry.BUILTIN_COLLECTORS]
            + [registry.sink_class(n) for n in registry.BUILTIN_SINKS])


def builtin_schemas() -> list[SectionSchema]:
    """Every built-in section read through a schema; [daemon] is read as ``config.daemon.<key>``."""
    return [cls.options for cls in builtin_classes()] + [imds.OPTIONS, HEALTH]


SCHEMAS = builtin_schemas()


def typed(opt: Option, value):
    return tuple(value) if isinstance(value, list) else value


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.name)
def test_the_settings_type_is_a_frozen_dataclass_with_a_typed_field_per_option(schema):
    assert schema.settings is not None, f"[{schema.name}] declares no settings dataclass"
    fields = dataclasses.fields(schema.settings)
    assert sorted(f.name for f in fields) == sorted(opt.key for opt in schema.options)
    assert len(fields) == len(schema.options)
    annotations = {f.name: f.type for f in fields}
    assert {opt.key: annotations[opt.key] for opt in schema.options} == \
        {opt.key: FIELD_TYPE[opt.type] for opt in schema.options}
    settings = schema.settings_of(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(settings, schema.options[0].key, schema.options[0].default)


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.name)
def test_defaults_give_the_typed_defaults(schema):
    settings = schema.settings_of(None)
    for opt in schema.options:
        value = getattr(settings, opt.key)
        assert value == typed(opt, opt.default), opt.key
        assert type(value) is {list: tuple, IntList: tuple, TableList: tuple}.get(opt.type, opt.type), opt.key


def test_every_collector_and_sink_narrows_self_settings_to_its_schemas_type():
    for cls in builtin_classes():
        assert cls.__dict__.get("__annotations__", {}).get("settings") == cls.options.settings.__name__, cls


def _other_value(opt: Option, readable: str):
    """A value other than the default that the option accepts (its checks run on it)."""
    if opt.type is bool:
        candidates: list = [not opt.default]
    elif opt.type in (int, float):
        candidates = [opt.default + 1, opt.min, opt.max]
    elif opt.type is str:
        candidates = [*(opt.choices or ()), "127.0.0.1:9999", "http://127.0.0.1:1", "https://127.0.0.1:1", readable,
                      "6f1c43b5-6a1b-4c53-9d0e-2f8b7c1e9a40", "x"]
    elif opt.type is IntList:
        candidates = [[7]]
    elif opt.type is TableList:
        candidates = [[{"xid": 999, "level": "unhealthy"}]]
    else:
        candidates = [[c] for c in opt.choices or ()] + [["k=v"], ["gpu.thermal_slowdown"]]
    for raw in candidates:
        if raw is None or raw == opt.default:
            continue
        try:
            return opt.validate(raw)
        except ValueError:
            continue
    raise AssertionError(f"no other value for {opt.key}")


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def test_a_config_file_section_gives_the_typed_values(tmp_path):
    readable = tmp_path / "readable.pem"
    readable.write_text("not really a certificate\n")
    expected: dict[str, dict] = {}
    lines = []
    for schema in SCHEMAS:
        expected[schema.name] = {opt.key: _other_value(opt, str(readable)) for opt in schema.options}
        lines.append(f"[{schema.name}]")
        lines += [f"{key} = {_toml(value)}" for key, value in expected[schema.name].items()]
    path = tmp_path / "gpumon.toml"
    path.write_text("\n".join(lines) + "\n")

    config = load(SCHEMAS, str(path), {}, {})
    for schema in SCHEMAS:
        settings = schema.settings_of(config.sections[schema.name])
        for opt in schema.options:
            value = getattr(settings, opt.key)
            assert value == typed(opt, expected[schema.name][opt.key]), (schema.name, opt.key)
            assert value != typed(opt, opt.default), (schema.name, opt.key)
            assert type(value) is {list: tuple, IntList: tuple, TableList: tuple}.get(opt.type, opt.type), \
                (schema.name, opt.key)


def test_a_collector_and_a_sink_hold_the_section_parsed_once(tmp_path):
    path = tmp_path / "gpumon.toml"
    path.write_text('[aer]\nper_type = "all"\ninterval = 3\n[prometheus]\nlisten = "127.0.0.1:0"\n'
                    "backlog = 64\n")
    config = load([AerCollector.options, PrometheusSink.options], str(path), {}, {})
    aer = AerCollector(Context("h", sysfs_root=str(tmp_path)), config.sections["aer"])
    assert (aer.settings.per_type, aer.settings.interval, aer.interval(10.0)) == ("all", 3.0, 3.0)
    sink = PrometheusSink(SinkContext("h", str(tmp_path), "0"), config.sections["prometheus"])
    assert (sink.settings.listen, sink.settings.backlog, sink.port) == ("127.0.0.1:0", 64, 0)
    assert AerCollector(Context("h", sysfs_root=str(tmp_path))).settings == AerCollector.options.settings_of(None)


# ------------------------------------------------------------------------------------ the contract


@dataclasses.dataclass(frozen=True)
class _Good:
    rate: float
    names: tuple[str, ...]


OPTS = (Option("rate", float, 1.0, "Rate."), Option("names", list, ["a"], "Names."))


def test_a_settings_type_that_does_not_match_its_options_is_refused_at_construction():
    @dataclasses.dataclass
    class Mutable:
        rate: float
        names: tuple[str, ...]

    @dataclasses.dataclass(frozen=True)
    class Missing:
        rate: float

    @dataclasses.dataclass(frozen=True)
    class Extra:
        rate: float
        names: tuple[str, ...]
        other: str

    for bad in (Mutable, Missing, Extra, dict):
        with pytest.raises(TypeError, match=r"\[x\] settings"):
            SectionSchema("x", "X.", OPTS, bad)


def test_settings_of_parses_over_the_defaults_and_refuses_an_unknown_key():
    schema = SectionSchema("x", "X.", OPTS, _Good)
    assert schema.settings_of(None) == _Good(1.0, ("a",))
    assert schema.settings_of({"rate": 2, "names": ["b", "c"]}) == _Good(2.0, ("b", "c"))
    assert type(schema.settings_of({"rate": 2}).rate) is float
    with pytest.raises(TypeError, match="has no option 'typo'"):
        schema.settings_of({"typo": 1})


def test_a_plugin_without_a_settings_type_still_gets_a_section():
    class Plugin(Collector):
        name = "acme"
        options = SectionSchema("acme", "Acme.", (Option("interval", float, 0.0, "Seconds."),
                                                  Option("offset", float, 0.5, "Offset.")))

    plain = Plugin(Context("h"), Section("acme", {"interval": 2.0, "offset": 1.0}))
    assert isinstance(plain.settings, Section) and plain.settings.offset == 1.0 and plain.cfg.offset == 1.0
    assert plain.interval(10.0) == 2.0
    assert Plugin(Context("h")).settings.offset == 0.5  # defaults filled in
    assert Plugin(Context("h")).interval(10.0) == 10.0
    assert SectionSchema("acme", "Acme.", OPTS).value(None, "rate") == 1.0  # the old reader still works


# --------------------------------------------------------------------------------- one way to read

OLD_READERS = re.compile(r"\bOPTIONS\.values?\(|\bself\._opts?\b|\bcfg\.get\(")
"""``OPTIONS.value(cfg, key)``/``OPTIONS.values(cfg)[key]``, the ``self._opt``/``self._opts`` helpers
and ``cfg.get(key)``: the readers the settings dataclasses replaced."""


def test_no_gpumon_module_reads_an_option_the_old_ways():
    root = pathlib.Path(__file__).resolve().parent.parent / "gpumon"
    sources = sorted(root.rglob("*.py"))
    assert len(sources) > 50
    found = [f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
             for path in sources
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if OLD_READERS.search(line)]
    assert not found, "read options as self.settings.<key>:\n" + "\n".join(found)
    assert OLD_READERS.search('        return float(OPTIONS.value(self.cfg, "interval"))')
    assert OLD_READERS.search("        self._opts: dict[str, Any] = OPTIONS.values(cfg)")
