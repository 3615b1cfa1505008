"""Configuration: a schema of sections and options, loaded from TOML, the environment and flags.

Each collector and sink declares its own options (as Telegraf plugins do); the core declares the
``[daemon]`` section. Layers, later wins: defaults, the TOML file, ``GPUMON_<SECTION>_<KEY>``
variables, command-line flags. Every error names the key and where the bad value came from.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Generic, TypeVar, cast, overload

from gpumon.config_values import (
    KINDS,
    IntList,
    TableList,
    coerce,
    file_kind,
    format_listen,
    from_text,
    listen_check,
    parse_listen,
    readable_file_check,
    regex_check,
    shown,
)

__all__ = [  # the public names: plugins, sinks and sources import them from here (config_values' too)
    "DAEMON", "DEFAULT_CONFIG_PATH", "FLAG_KEYS", "MAX_CONFIG_BYTES", "Config", "ConfigError", "IntList", "Option",
    "Section", "SectionSchema", "TableList", "deprecated_key", "env_name", "format_listen", "listen_check", "load",
    "parse_listen", "parsed_section", "readable_file_check", "regex_check", "shown"]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

DEFAULT_CONFIG_PATH = "/etc/gpumon/gpumon.toml"
MAX_CONFIG_BYTES = 1 << 20
"""A config file is a few kilobytes; anything this large is a mistake (or /dev/zero)."""

S = TypeVar("S", covariant=True)
"""The settings type of a :class:`SectionSchema`: a frozen dataclass, or :class:`Section` without one."""



class ConfigError(Exception):
    """A config value is wrong. ``str()`` is the one line the CLI prints before exiting 2."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source, self.key, self.message = source, key, message
        super().__init__(f"{source}: {key}: {message}")


@dataclass(frozen=True)
class Option:
    """One config key: its type, default, bounds and the sentence the docs print for it."""

    key: str
    type: type
    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], str | None] | None = None
    secret: bool = False
    aliases: tuple[str, ...] = ()
    """Deprecated names of this key, still read (in a file, the environment or a section given to a
    plugin) with a warning, logged once per section and name: see :func:`deprecated_key`."""

    def validate(self, value: Any) -> Any:
        """Return the value coerced to the option's type, or raise ValueError with a reason (which,
        for a secret option, never shows the value)."""
        try:
            value = coerce(self.type, value)
        except ValueError as exc:
            if not self.secret or "(got" not in str(exc):
                raise
            raise ValueError(f"must be {KINDS.get(self.type, self.type.__name__)} (got a value of type "
                             f"{type(value).__name__}, not shown: it is a secret)") from None
        if self.choices is not None:
            items = value if isinstance(value, list) else [value]
            for item in items:
                if item not in self.choices:
                    raise ValueError(f"{shown(item)} is not one of {', '.join(self.choices)}")
        if self.min is not None and value < self.min:
            raise ValueError(f"must be >= {self.min} (got {value})")
        if self.max is not None and value > self.max:
            raise ValueError(f"must be <= {self.max} (got {value})")
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise ValueError(problem)
        return value




@dataclass(frozen=True, init=False)
class SectionSchema(Generic[S]):
    """One config section: its options and, for typed access, the frozen dataclass they are parsed
    into (``settings``), whose fields are exactly the option keys (checked here, at construction).

    ``settings_of(section)`` is the one way to read a section: ``XSettings`` with every option as a
    typed attribute (lists as tuples), or, for a schema declared without one, a :class:`Section`."""

    name: str
    help: str
    options: tuple[Option, ...]
    settings: type[S] | None = None

    @overload
    def __init__(self: SectionSchema[Section], name: str, help: str, options: tuple[Option, ...]) -> None: ...

    @overload
    def __init__(self, name: str, help: str, options: tuple[Option, ...], settings: type[S]) -> None: ...

    def __init__(self, name: str, help: str, options: tuple[Option, ...], settings: type[S] | None = None) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "help", help)
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "settings", settings)
        if settings is not None:
            _check_settings(name, options, settings)

    def option(self, key: str) -> Option | None:
        """The option named ``key``, or by one of its deprecated aliases."""
        for opt in self.options:
            if opt.key == key or key in opt.aliases:
                return opt
        return None

    def aliases(self) -> dict[str, str]:
        """Every deprecated key of this section -> the key it stands for."""
        return {alias: opt.key for opt in self.options for alias in opt.aliases}

    def values(self, cfg: Mapping[str, Any] | None) -> dict[str, Any]:
        """Every option: the section's values over this schema's defaults (a value given under a
        deprecated alias counts under its key, with the warning)."""
        given = dict(cfg) if cfg is not None else {}
        aliases = self.aliases()
        for alias in [k for k in given if k in aliases]:
            deprecated_key(self.name, alias, aliases[alias])
            value = given.pop(alias)
            given.setdefault(aliases[alias], value)
        return {**{opt.key: opt.default for opt in self.options}, **given}

    def value(self, cfg: Mapping[str, Any] | None, key: str) -> Any:
        """``key`` from a validated section, or this schema's default where the section (or the key)
        is absent: a plugin built without config (tests, ``gpumon once``) reads the same defaults."""
        if cfg is not None and key in cfg:
            return cfg[key]
        opt = self.option(key)
        assert opt is not None, f"[{self.name}] has no option {key!r}"
        return opt.default

    def settings_of(self, cfg: Mapping[str, Any] | None) -> S:
        """The section parsed once: the validated values over this schema's defaults, as the
        ``settings`` dataclass (a list option becomes a tuple, a float option's integer a float), or
        as a :class:`Section` where the schema declares no settings type. A key this schema does not
        know is a programming error (a validated section never has one): TypeError."""
        values = self.values(cfg)
        if self.settings is None:
            return cast(S, Section(self.name, values, self.aliases()))
        types = {opt.key: opt.type for opt in self.options}
        unknown = sorted(set(values) - set(types))
        if unknown:
            raise TypeError(f"[{self.name}] has no option {', '.join(map(repr, unknown))} "
                            f"({self.settings.__name__} has no such field)")
        return self.settings(**{key: _settled(types[key], value) for key, value in values.items()})


def parsed_section(name: str, schema: SectionSchema[Any] | None, cfg: Mapping[str, Any] | None) -> Any:
    """A plugin's section parsed once, as collectors and sinks hold it (``self.settings``):
    ``schema.settings_of(cfg)``; for a plugin that declares no schema, the section as a
    :class:`Section` (None when it has none)."""
    if schema is not None:
        return schema.settings_of(cfg)
    return Section(name, cfg) if cfg is not None else None


def _check_settings(name: str, options: tuple[Option, ...], settings: type) -> None:
    """A settings type must be a frozen dataclass with a field for every option and no other."""
    params = getattr(settings, "__dataclass_params__", None)  # set by @dataclass
    if not is_dataclass(settings) or params is None or not params.frozen:
        raise TypeError(f"[{name}] settings {settings.__name__} must be a frozen dataclass")
    declared = {f.name for f in fields(settings)}
    keys = {opt.key for opt in options}
    if declared != keys:
        raise TypeError(f"[{name}] settings {settings.__name__} must have a field for each option and "
                        f"no other: missing {sorted(keys - declared)}, extra {sorted(declared - keys)}")


def _settled(kind: type, value: Any) -> Any:
    """An option's value as its settings field holds it: immutable (a tuple for a list), a float
    option's integer as a float (a validated section already holds it so)."""
    if isinstance(value, list):
        return tuple(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


_warned: set[tuple[str, str]] = set()
_log = logging.getLogger("gpumon.config")


def deprecated_key(section: str, old: str, new: str) -> None:
    """Say once per process that ``[section] old`` is a deprecated name of ``new`` (still honoured)."""
    if (section, old) in _warned:
        return
    _warned.add((section, old))
    _log.warning("[%s] %s is deprecated (honoured for now): use [%s] %s", section, old, section, new)


class Section(Mapping[str, Any]):
    """The validated values of one section; read them as attributes (``cfg.interval``). A key's
    deprecated alias (``aliases``: old -> new) reads the same value."""

    def __init__(self, name: str, values: Mapping[str, Any], aliases: Mapping[str, str] | None = None) -> None:
        self._name = name
        self._values = dict(values)
        self._aliases = dict(aliases or {})

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):  # copy and pickle look for dunders before __init__ ran
            raise AttributeError(key)
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"[{self._name}] has no option {key!r}") from None

    def __getitem__(self, key: str) -> Any:
        if key not in self._values and key in self._aliases:
            return self._values[self._aliases[key]]
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Section({self._name!r}, {self._values!r})"


@dataclass
class Config:
    sections: dict[str, Section]
    source: str = "(defaults)"
    origins: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Section:
        return self.sections[name]

    @property
    def daemon(self) -> Section:
        return self.sections["daemon"]

    def origin(self, section: str, key: str) -> str:
        """Where ``[section] key`` came from (a file, a variable, a flag), for error messages."""
        return self.origins.get(f"{section}.{key}", self.source)

    def replace(self, section: str, **values: Any) -> Config:
        """A copy with some values of one section replaced (already-validated values only)."""
        sections = dict(self.sections)
        old = self.sections[section]
        sections[section] = Section(section, {**old, **values}, getattr(old, "_aliases", None))
        return Config(sections, self.source, self.origins)


def _not_empty(value: str) -> str | None:
    return "must not be empty" if not value.strip() else None


DAEMON = SectionSchema(
    "daemon",
    "The loop: which collectors and sinks run, how often, and where state is kept.",
    (
        Option("collectors", list, ["auto"],
               "Collectors to run. `auto` runs every collector whose source this host has and reports "
               "the others as unavailable; a source that is there but not ready (libnvidia-ml present, "
               "driver not loaded yet) runs reported down until it is. A collector named explicitly "
               "that is unavailable is an error."),
        Option("sinks", list, ["prometheus"], "Sinks that publish each snapshot."),
        Option("interval", float, 10.0,
               "Default collection interval in seconds for collectors that do not set their own.",
               min=0.05, max=3600.0),
        Option("deadline", float, 0.0,
               "Seconds a collector run may take before the collector is reported down; 0 means the "
               "collector's interval (at least 1 s).", min=0.0, max=3600.0),
        Option("sysfs_root", str, "/sys",
               "Directory holding `class/infiniband` and `class/net` (/host/sys in a container). One "
               "given explicitly (file, environment or flag) must exist: a missing one (an unmounted "
               "/host/sys) stops gpumon with exit 2 rather than looking like a host without InfiniBand."),
        Option("state_dir", str, "/var/lib/gpumon",
               "Where state that must survive a restart is kept (flap window, spools, health verdicts; a "
               "simulated host in simulate/<profile>/). One `gpumon run` per directory: it holds "
               "`gpumon.lock` there while it runs, and writes the address it serves on to `listen`.",
               check=_not_empty),
        Option("hostname", str, "", "Host name reported to sinks; empty means the system's host name."),
        Option("simulate", str, "",
               "Serve a simulated host instead of the real one (for demos, dashboards and tests): "
               "a profile such as `nd-h100-v5`; empty for the real host."),
        Option("log_level", str, "info", "Log level.",
               choices=("debug", "info", "warning", "error")),
        Option("log_format", str, "text", "Log line format.", choices=("text", "json")),
    ),
)

# Command-line flags and the (section, key) each one sets.
FLAG_KEYS: dict[str, tuple[str, str]] = {
    "collectors": ("daemon", "collectors"),
    "sinks": ("daemon", "sinks"),
    "interval": ("daemon", "interval"),
    "sysfs_root": ("daemon", "sysfs_root"),
    "simulate": ("daemon", "simulate"),
    "log_level": ("daemon", "log_level"),
    "log_format": ("daemon", "log_format"),
    "listen": ("prometheus", "listen"),
    "state_dir": ("daemon", "state_dir"),
}


def load(
    schemas: Iterable[SectionSchema],
    path: str | None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Config:
    """Build a validated Config. ``path=None`` uses the default file when it exists."""
    by_name = {s.name: s for s in schemas}
    environ = os.environ if environ is None else environ
    values: dict[str, dict[str, Any]] = {
        name: {opt.key: _copy(opt.default) for opt in schema.options} for name, schema in by_name.items()
    }
    origins: dict[str, str] = {}

    source = "(defaults)"
    if path is None and os.path.exists(DEFAULT_CONFIG_PATH):
        path = DEFAULT_CONFIG_PATH
    if path is not None:
        source = path
        document = _read_toml(path)
        for section_name, table in document.items():
            schema = by_name.get(section_name)
            if schema is None:
                known = ", ".join(sorted(by_name))
                raise ConfigError(path, f"[{section_name}]", f"unknown section (known: {known})")
            if not isinstance(table, dict):
                raise ConfigError(path, f"[{section_name}]", "must be a table")
            for key, raw in table.items():
                opt = _option(schema, key, path)
                if key != opt.key and opt.key in table:
                    raise ConfigError(path, f"[{section_name}] {key}",
                                      f"is a deprecated name of {opt.key}, which is set too: keep {opt.key}")
                values[section_name][opt.key] = _validated(opt, raw, path, section_name, key)
                origins[f"{section_name}.{opt.key}"] = path

    for var, text in environ.items():
        if not var.startswith("GPUMON_"):
            continue
        env_section, key = _split_env(var, by_name)
        where = f"environment variable {var}"
        if env_section is None:
            # Not ours: Kubernetes service links for a Service named gpumon (GPUMON_SERVICE_HOST,
            # GPUMON_PORT_9470_TCP) and other tools share the prefix. A typo in a key of a known
            # section is still an error below.
            continue
        section_name = env_section
        opt = _option(by_name[section_name], key, where)
        try:
            raw = from_text(opt.type, text)
        except ValueError as exc:
            raise ConfigError(where, f"[{section_name}] {key}", str(exc)) from None
        values[section_name][opt.key] = _validated(opt, raw, where, section_name, key)
        origins[f"{section_name}.{opt.key}"] = where

    for flag, raw in (flags or {}).items():
        if raw is None:
            continue
        section_name, key = FLAG_KEYS[flag]
        if section_name not in by_name:
            continue
        where = f"flag --{flag.replace('_', '-')}"
        opt = _option(by_name[section_name], key, where)
        if isinstance(raw, str) and opt.type is not str:
            try:
                raw = from_text(opt.type, raw)
            except ValueError as exc:
                raise ConfigError(where, f"[{section_name}] {key}", str(exc)) from None
        values[section_name][key] = _validated(opt, raw, where, section_name)
        origins[f"{section_name}.{key}"] = where

    return Config({n: Section(n, v, by_name[n].aliases()) for n, v in values.items()}, source, origins)


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def _read_toml(path: str) -> dict[str, Any]:
    data = _read_regular(path)
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(path, "(file)", "not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "(syntax)", f"not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(path, "(syntax)", "not valid TOML: nested too deeply") from None
    except ValueError as exc:  # tomllib lets int() errors through: more than 4300 digits
        raise ConfigError(path, "(syntax)", f"not valid TOML: {exc}") from None


def _read_regular(path: str) -> bytes:
    """The file's bytes, refusing anything but a regular file before reading: opening with
    O_NONBLOCK does not wait for a FIFO's writer, and fstat of the open descriptor leaves no window
    for the path to be swapped between the check and the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(path, "(file)", "no such file") from None
    except PermissionError:
        raise ConfigError(path, "(file)", "permission denied") from None
    except OSError as exc:  # ENOTDIR, ELOOP, ENAMETOOLONG, ENXIO (a FIFO-less socket), EIO...
        raise ConfigError(path, "(file)", exc.strerror or str(exc)) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(path, "(file)", f"is {file_kind(mode)}, not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(path, "(file)", exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(path, "(file)", f"larger than {MAX_CONFIG_BYTES} bytes")
    return data


def _option(schema: SectionSchema, key: str, where: str) -> Option:
    opt = schema.option(key)
    if opt is None:
        known = ", ".join(o.key for o in schema.options)
        raise ConfigError(where, f"[{schema.name}] {key}", f"unknown key (known: {known})")
    if key != opt.key:
        deprecated_key(schema.name, key, opt.key)
    return opt


def _validated(opt: Option, raw: Any, where: str, section: str, written: str | None = None) -> Any:
    """The value checked; an error names the key as it was ``written`` (a deprecated alias too)."""
    try:
        return opt.validate(raw)
    except (ValueError, OverflowError, RecursionError) as exc:  # a plugin's check may raise those too
        raise ConfigError(where, f"[{section}] {written or opt.key}", str(exc) or type(exc).__name__) from None


def _split_env(var: str, schemas: Mapping[str, SectionSchema]) -> tuple[str | None, str]:
    """``GPUMON_AZURE_MONITOR_ENDPOINT`` -> ("azure_monitor", "endpoint"): longest section wins."""
    rest = var[len("GPUMON_"):].lower()
    for name in sorted(schemas, key=len, reverse=True):
        if rest.startswith(name + "_"):
            return name, rest[len(name) + 1:]
    return None, rest


def env_name(section: str, key: str) -> str:
    return f"GPUMON_{section.upper()}_{key.upper()}"
