"""The GPipe clock: which cell works on which micro-batch at each tick.

A schedule is plain data, a list of ticks, each a list of (cell, micro_batch) pairs. The graph
builder walks it, and the timeline plot and simulator read the same list, so what is drawn is
what is built.
"""

from __future__ import annotations


def _Check(num_micro_batches: int, num_cells: int) -> None:
    if num_micro_batches < 1 or num_cells < 1:
        raise ValueError(f'num_micro_batches and num_cells must be >= 1, got '
                         f'{num_micro_batches} and {num_cells}.')


def ForwardTicks(num_micro_batches: int, num_cells: int) -> list[list[tuple[int, int]]]:
    """At tick t, cell k computes the forward pass of micro-batch t - k.

    Returns:
      M + K - 1 ticks; tick t lists the (cell, micro_batch) pairs active at t, by cell.
    """
    _Check(num_micro_batches, num_cells)
    return [[(k, t - k) for k in range(num_cells) if 0 <= t - k < num_micro_batches]
            for t in range(num_micro_batches + num_cells - 1)]


def BackwardTicks(num_micro_batches: int, num_cells: int) -> list[list[tuple[int, int]]]:
    """The backward pass: at tick t, cell K-1-k handles micro-batch t - k, last cell first.

    Returns:
      M + K - 1 ticks; tick t lists the (cell, micro_batch) pairs active at t, last cell first.
    """
    _Check(num_micro_batches, num_cells)
    last = num_cells - 1
    return [[(last - k, t - k) for k in range(num_cells) if 0 <= t - k < num_micro_batches]
            for t in range(num_micro_batches + num_cells - 1)]


def BubbleFraction(num_micro_batches: int, num_cells: int) -> float:
    """Idle fraction of the ideal schedule: (K - 1) / (M + K - 1)."""
    _Check(num_micro_batches, num_cells)
    return (num_cells - 1) / (num_micro_batches + num_cells - 1)
