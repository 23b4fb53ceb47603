"""Partitioning a sequence of layer costs into K contiguous cells.

Boundaries are K + 1 indices `[0, b_1, ..., L]`; cell k holds layers `b_k .. b_{k+1} - 1`.
Everything here is pure Python on lists of numbers.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Sequence

from gpipe_tf import errors
from gpipe_tf import units


def _Prefix(costs: Sequence[float]) -> list[float]:
    prefix = [0.0]
    for c in costs:
        if c < 0 or math.isnan(c):
            raise ValueError(f'Layer costs must be non-negative numbers, got {c}.')
        prefix.append(prefix[-1] + c)
    return prefix


def _CheckCounts(num_layers: int, num_cells: int) -> None:
    if num_cells < 1:
        raise ValueError(f'num_cells must be >= 1, got {num_cells}.')
    if num_cells > num_layers:
        raise ValueError(f'Cannot partition {num_layers} layers into {num_cells} non-empty cells '
                         f'({num_layers} < {num_cells}).')


def CellCosts(costs: Sequence[float], boundaries: Sequence[int]) -> list[float]:
    """The summed cost of each cell."""
    return [sum(costs[boundaries[k]:boundaries[k + 1]]) for k in range(len(boundaries) - 1)]


def CheckBoundaries(boundaries: Sequence[int], num_layers: int, num_cells: int) -> list[int]:
    """Validates explicit boundaries; returns them as a list.

    Raises:
      errors.ConfigError (a ValueError): unless they are K + 1 strictly increasing ints from 0
        to L (a user's partition_method; the trainer reports it in one line).
    """
    b = list(boundaries)
    if (len(b) != num_cells + 1 or b[0] != 0 or b[-1] != num_layers or
            any(not isinstance(x, int) for x in b) or any(x >= y for x, y in zip(b, b[1:]))):
        raise errors.ConfigError(
            f'Partition boundaries {b} do not cover the {num_layers} layers in {num_cells} '
            f'non-empty cells: expected {num_cells + 1} strictly increasing ints from 0 to '
            f'{num_layers}.')
    return b


def UniformBoundaries(num_layers: int, num_cells: int) -> list[int]:
    """Cells of (nearly) equal layer counts; earlier cells take the remainder."""
    _CheckCounts(num_layers, num_cells)
    base, extra = divmod(num_layers, num_cells)
    b = [0]
    for k in range(num_cells):
        b.append(b[-1] + base + (1 if k < extra else 0))
    return b


def _GreedyMax(prefix: list[float], num_cells: int, limit: float) -> float | None:
    """Packs layers greedily into parts costing <= limit.

    Returns:
      The largest part cost if at most `num_cells` parts suffice, else None.
    """
    start, parts, largest = 0, 0, 0.0
    n = len(prefix) - 1
    while start < n:
        end = bisect.bisect_right(prefix, prefix[start] + limit, lo=start) - 1
        # The sum above may round up; the part's cost is judged as a difference, as elsewhere.
        while end > start and prefix[end] - prefix[start] > limit:
            end -= 1
        if end <= start or parts == num_cells:
            return None
        largest = max(largest, prefix[end] - prefix[start])
        start, parts = end, parts + 1
    return largest


def _MinMaxCost(prefix: list[float], num_cells: int) -> float:
    """The smallest achievable maximum cell cost.

    Bisection on the limit; `hi` is always a cost some partition actually reaches, so when the
    interval closes `hi` is exactly the optimum.
    """
    lo, hi = 0.0, prefix[-1]
    if _GreedyMax(prefix, num_cells, lo) is not None:
        return lo
    while True:
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            return hi
        reached = _GreedyMax(prefix, num_cells, mid)
        if reached is None:
            lo = mid
        else:
            hi = reached


def OptimalBoundaries(costs: Sequence[float], num_cells: int) -> list[int]:
    """The contiguous partition with the smallest maximum cell cost.

    Among partitions reaching that optimum, the one with the lowest variance of cell costs
    (equivalently, the lowest sum of squared cell costs) is returned.
    """
    _CheckCounts(len(costs), num_cells)
    prefix = _Prefix(costs)
    n = len(costs)
    limit = _MinMaxCost(prefix, num_cells)
    # best[k][i]: least sum of squares splitting layers [0, i) into k cells each <= limit.
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_cells + 1)]
    back = [[-1] * (n + 1) for _ in range(num_cells + 1)]
    best[0][0] = 0.0
    for k in range(1, num_cells + 1):
        prev, cur, arg = best[k - 1], best[k], back[k]
        for i in range(k, n - (num_cells - k) + 1):
            # One step of slack: the subtraction may round; the explicit check below decides.
            lo = bisect.bisect_left(prefix, prefix[i] - limit) - 1
            for j in range(max(lo, k - 1), i):
                if prev[j] == inf or prefix[i] - prefix[j] > limit:
                    continue
                value = prev[j] + (prefix[i] - prefix[j]) ** 2
                if value < cur[i]:
                    cur[i], arg[i] = value, j
    boundaries = [n]
    for k in range(num_cells, 0, -1):
        boundaries.append(back[k][boundaries[-1]])
    return boundaries[::-1]


def HistogramBoundaries(costs: Sequence[float], num_cells: int) -> list[int]:
    """Lingvo's cumulative-histogram heuristic, kept for comparison.

    Cell k ends at the first layer whose cumulative cost reaches k/K of the total, nudged so that
    every cell keeps at least one layer.
    """
    _CheckCounts(len(costs), num_cells)
    prefix = _Prefix(costs)
    n, total = len(costs), prefix[-1]
    b = [0]
    for k in range(1, num_cells):
        target = total * k / num_cells
        end = bisect.bisect_left(prefix, target)
        end = min(max(end, b[-1] + 1), n - (num_cells - k))
        b.append(end)
    b.append(n)
    return b


@dataclasses.dataclass
class ReportRow:
    """One cell of a partition report; unknown costs are None."""
    cell: int
    device: str
    layers: list
    flops: int | None
    num_params: int | None
    activation_bytes: int | None


def _LayerRange(names: list) -> str:
    if len(names) <= 3:
        return ', '.join(names)
    return f'{names[0]} .. {names[-1]} ({len(names)} layers)'


def FormatReport(rows: list[ReportRow]) -> str:
    """A fixed-width table of cells: device, layers, FLOPs (and share), params, activations."""
    total_flops = sum(r.flops for r in rows if r.flops) or None
    header = ('cell', 'device', 'flops', 'share', 'params', 'act bytes', 'layers')
    table = [header]
    for r in rows:
        share = f'{100 * r.flops / total_flops:.1f}%' if r.flops is not None and total_flops \
            else '?'
        table.append((str(r.cell), r.device, units.Count(r.flops), share,
                      units.Count(r.num_params), units.Bytes(r.activation_bytes),
                      _LayerRange(r.layers)))
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    lines = ['  '.join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + '  ' + row[-1]
             for row in table]
    return '\n'.join(lines)
