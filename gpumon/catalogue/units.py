"""A metric's unit, typed: the Prometheus word (in the name, in ``# UNIT`` and ``once --format json``)
and the UCUM code OpenTelemetry wants, declared together so no sink guesses one from the other."""

from __future__ import annotations


class Unit(str):
    """A unit as its Prometheus word (``bytes``; ``""`` for a count or a state), carrying its UCUM
    code (``By``; ``{error}``, ``{state}``). A ``str``, so a spec's ``unit`` reads as it always did;
    :attr:`ucum` is what the OpenTelemetry sink sends."""

    ucum: str

    def __new__(cls, prometheus: str, ucum: str) -> Unit:
        unit = super().__new__(cls, prometheus)
        unit.ucum = ucum
        return unit

    def __getnewargs__(self) -> tuple[str, str]:  # type: ignore[override]  # copy and pickle keep the code
        return (str(self), self.ucum)

    def __repr__(self) -> str:
        return f"Unit({str(self)!r}, {self.ucum!r})"


def count(thing: str) -> Unit:
    """A unit-less count or state, with its UCUM annotation: ``count("error")`` is ``{error}``."""
    return Unit("", "{" + thing + "}")


BYTES = Unit("bytes", "By")
BYTES_PER_SECOND = Unit("bytes_per_second", "By/s")
SECONDS = Unit("seconds", "s")
WATTS = Unit("watts", "W")
JOULES = Unit("joules", "J")
CELSIUS = Unit("celsius", "Cel")
HERTZ = Unit("hertz", "Hz")
RATIO = Unit("ratio", "1")
TICKS = Unit("ticks", "{tick}")

STATE = count("state")
"""A 0/1 flag or an enumeration's number (port state, health level, fabric state)."""
INFO = count("info")
"""An ``_info`` metric: value 1, identity in the labels."""
COUNT = count("count")
"""A gauge counting things the name does not say more precisely."""
EVENTS = count("event")
ERRORS = count("error")
PACKETS = count("packet")
