"""How the package prints sizes, in one unit system: counts (FLOPs, parameters) with decimal
prefixes (K = 10^3), bytes with binary ones (KiB = 2^10, MiB, GiB, TiB), as nvidia-smi and
TensorFlow's memory statistics count them. Tables of memory use MiB throughout (`MiB`)."""

from __future__ import annotations

_DECIMAL = ((1e12, 'T'), (1e9, 'G'), (1e6, 'M'), (1e3, 'K'))
_BINARY = ((2**40, 'Ti'), (2**30, 'Gi'), (2**20, 'Mi'), (2**10, 'Ki'))


def _Prefixed(value: float | None, prefixes, unit: str) -> str:
    """`value` scaled by the largest of `prefixes` ((scale, prefix), largest first) it reaches,
    with two decimals, then `unit`; below the smallest, as it is; None -> '?'."""
    if value is None:
        return '?'
    for scale, prefix in prefixes:
        if abs(value) >= scale:
            return f'{value / scale:.2f}{prefix}{unit}'
    return f'{value:g}{unit}'


def Count(value: float | None) -> str:
    """A count with a decimal prefix: 139260 -> '139.26K'; None -> '?'."""
    return _Prefixed(value, _DECIMAL, '')


def Bytes(value: float | None) -> str:
    """A byte size with a binary prefix: 16384 -> '16.00KiB', 1000 -> '1000B'; None -> '?'."""
    return _Prefixed(value, _BINARY, 'B')


def MiB(value: float) -> str:
    """Bytes as MiB with one decimal, without the unit (the table's header says it):
    2**20 -> '1.0'."""
    return f'{value / 2**20:.1f}'
