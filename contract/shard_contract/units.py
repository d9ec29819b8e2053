"""Byte quantities as people write them ("80GiB", "24G", "512Mi") and as tables show them; Kubernetes
resource quantities ("100m", "8Gi")."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

_UNITS = {
    "b": 1,
    "k": 10**3, "kb": 10**3, "ki": 2**10, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mi": 2**20, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gi": 2**30, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "ti": 2**40, "tib": 2**40,
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

GiB = 2**30
MiB = 2**20


def parse_bytes(text: str | int | float) -> int:
    """Parse "80GiB", "24G", "512Mi" or "4096B"; a number (not a string) is bytes.

    A string needs its unit: "80" is far more often 80 GiB forgotten than 80 bytes meant."""
    if isinstance(text, (int, float)):
        return int(text)
    match = _QUANTITY.match(text)
    if match and not match.group(2):
        raise ValueError(f"{text!r} has no unit; write it like {match.group(1)}GiB, {match.group(1)}GB "
                         f"or {match.group(1)}MiB")
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size; write it like 80GiB, 24GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def table_unit(largest: int | float) -> tuple[str, int]:
    """The one unit of a table whose largest figure is `largest`: GiB from 1 GiB up, else MiB
    (a plan and what its ranks measured are then told in the same unit)."""
    return ("GiB", GiB) if largest >= GiB else ("MiB", MiB)


def gib(n_bytes: int | float) -> str:
    """Format bytes as GiB with two decimals (the unit of every table)."""
    return f"{n_bytes / GiB:.2f}"


_STEPS = (("GiB", GiB, 2), ("MiB", MiB, 1), ("B", 1, 0))


def apart(a: int | float, b: int | float) -> tuple[str, str]:
    """`a` and `b` in the first unit that tells them apart: GiB with two decimals, else MiB with
    one, else bytes ("0.18 GiB" and "0.18 GiB" become "184.3 MiB" and "183.9 MiB")."""
    for unit, size, digits in _STEPS:
        x, y = f"{a / size:.{digits}f}", f"{b / size:.{digits}f}"
        if x != y or size == 1:
            return f"{x} {unit}", f"{y} {unit}"
    raise AssertionError("unreachable")


def exactly(n_bytes: int | float) -> str:
    """A gap as a number that does not round to 0: GiB with two decimals, else MiB with one, else bytes."""
    for unit, size, digits in _STEPS:
        text = f"{n_bytes / size:.{digits}f}"
        if float(text) != 0 or size == 1:
            return f"{text} {unit}"
    raise AssertionError("unreachable")


def human(n_bytes: int | float) -> str:
    """Format bytes with the largest binary unit that keeps the number readable."""
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if abs(n_bytes) >= size:
            return f"{n_bytes / size:.1f} {unit}"
    return f"{int(n_bytes)} B"


_KUBE_SUFFIXES: dict[str, Decimal | int] = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_KUBE_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
                            r"(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|)$")


def quantity(value: Any) -> Decimal:
    """A Kubernetes resource quantity ("100m", "8Gi", 2) as a number (case matters: "m" is milli)."""
    match = _KUBE_QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"{value!r} is not a Kubernetes quantity; write it like 16Gi, 500M or 250m")
    return Decimal(match.group(1)) * Decimal(_KUBE_SUFFIXES[match.group(2)])


def count(n: int, noun: str) -> str:
    """'1 device', '2 devices', '0 replicas': the number and the noun, plural unless one."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
