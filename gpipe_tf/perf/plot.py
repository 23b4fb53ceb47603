"""PNG pictures of a pipeline: a step's timeline, the cells' costs, and each device's memory.

Figures are built with matplotlib's object API (`Figure` on an Agg canvas), never pyplot: pyplot
keeps global figure state and may look for a display, and these are drawn from training jobs and
tests alike. Each figure has one Axes (`figure.axes[0]`) holding exactly one patch per box or bar
it draws, so callers (and tests) can read the picture back from its artists.
"""

from __future__ import annotations

import io
import math
import os
from typing import Sequence

import numpy as np
from matplotlib import patches as mpatches
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gpipe_tf.perf import memory
from gpipe_tf.perf import simulator

# One colour per kind of op, and per memory component; tests match boxes to kinds by these.
KIND_COLOURS = {'forward': '#4C72B0', 'recompute': '#DD8452', 'backward': '#55A868',
                'input_grad': '#8172B3', 'weight_grad': '#937860'}
COMPONENT_COLOURS = {
    'params': '#4C72B0',
    'gradients': '#8172B3',
    'slots': '#937860',
    'stored_activations': '#DD8452',
    'working_activations': '#C44E52',
}

_WIDTH_IN = 10.0
_DPI = 100
# Rotated tick labels that fit side by side under a figure's bars (at matplotlib's default
# font size, 10 inches wide).
_MAX_ROTATED_LABELS = 32
_ROW_IN = 0.5  # Height of one device's row in a timeline.
_MARGIN_IN = 1.5  # Title, x axis and its label.
# Measured timelines may overlap on one row (two threads of one device); see-through boxes keep
# both visible.
_BOX_ALPHA = 0.75
_BOX_HEIGHT = 0.8  # Of a row's height, leaving a gap between devices.
_LABEL_FONT_PT = 7
# The chart's share of the figure's width, the rest being tick labels and the legend; used to
# decide, before any layout is run, whether a box is wide enough for its label.
_AXES_WIDTH_FRACTION = 0.75


def _NewFigure(height_in: float) -> tuple[Figure, object]:
    figure = Figure(figsize=(_WIDTH_IN, height_in), dpi=_DPI, layout='constrained')
    FigureCanvasAgg(figure)  # Attaches itself as figure.canvas.
    return figure, figure.add_subplot()


def _Percent(fraction: float) -> str:
    return f'{100 * fraction:.1f}%'


def _CheckIntervals(intervals) -> None:
    if not intervals:
        raise ValueError('The timeline has no intervals to draw.')
    for i, interval in enumerate(intervals):
        if interval.kind not in simulator.KINDS + simulator.SPLIT_KINDS:
            raise ValueError(f'intervals[{i}] has kind {interval.kind!r}; expected one of '
                             f'{simulator.KINDS + simulator.SPLIT_KINDS}.')
        if interval.device < 0:
            raise ValueError(f'intervals[{i}] has device {interval.device} < 0.')
        if not (math.isfinite(interval.start) and math.isfinite(interval.end)
                and interval.start <= interval.end):
            raise ValueError(f'intervals[{i}] must have finite start <= end, got start '
                             f'{interval.start} and end {interval.end}.')


def _RowLabels(intervals, num_rows: int) -> list[str]:
    """'dev k · cell c' per row; a measured device may run several cells, or none."""
    cells = [set() for _ in range(num_rows)]
    for interval in intervals:
        cells[interval.device].add(interval.cell)
    labels = []
    for device, on_device in enumerate(cells):
        if not on_device:
            labels.append(f'dev {device}')
        elif len(on_device) == 1:
            labels.append(f'dev {device} · cell {next(iter(on_device))}')
        else:
            labels.append(f'dev {device} · cells {",".join(map(str, sorted(on_device)))}')
    return labels


def TimelineFigure(timeline: simulator.Timeline, title: str = '',
                   device_names: Sequence[str] | None = None,
                   ideal_utilisation: float | None = None) -> Figure:
    """A Gantt chart of a step: one row per device, one box per op, coloured by kind.

    Boxes read 'F3', 'R3' or 'B3' (forward, recompute or backward of micro-batch 3) when there
    is room for the text; device 0 is the top row.

    Args:
      timeline: a simulated or measured Timeline (times in seconds).
      title: shown before the utilisation in the figure's title.
      device_names: one tick label per row, replacing 'dev k · cell c'; their number sets the
        number of rows.
      ideal_utilisation: if given (e.g. `simulator.IdealUtilisation(M, K)`), shown beside the
        timeline's utilisation.

    Returns:
      The figure; its only Axes holds exactly one Rectangle per interval.

    Raises:
      ValueError: for an empty timeline, an interval with an unknown kind, a negative device or
        a start after its end, fewer device names than devices, or an ideal utilisation outside
        (0, 1].
    """
    intervals = list(timeline.intervals)
    _CheckIntervals(intervals)
    num_devices = max(interval.device for interval in intervals) + 1
    if device_names is not None:
        if len(device_names) < num_devices:
            raise ValueError(f'device_names needs a name per device, got {len(device_names)} '
                             f'names for {num_devices} devices.')
        num_rows, row_labels = len(device_names), list(device_names)
    else:
        num_rows, row_labels = num_devices, _RowLabels(intervals, num_devices)
    if ideal_utilisation is not None and not 0 < ideal_utilisation <= 1:
        raise ValueError(f'ideal_utilisation must be in (0, 1], got {ideal_utilisation}.')

    first = min(0.0, min(interval.start for interval in intervals))
    last = max(timeline.makespan, max(interval.end for interval in intervals))
    # Milliseconds read better than '0.004' for the short steps of small models.
    scale, unit = (1e3, 'ms') if last < 1 else (1.0, 's')
    span = (last - first) * scale or 1.0  # Zero-cost ops still get a visible axis.
    px_per_unit = _WIDTH_IN * _AXES_WIDTH_FRACTION * _DPI / span
    px_per_char = 0.6 * _LABEL_FONT_PT * _DPI / 72

    figure, ax = _NewFigure(_ROW_IN * num_rows + _MARGIN_IN)
    for interval in intervals:
        start, width = interval.start * scale, (interval.end - interval.start) * scale
        row = interval.device
        ax.add_patch(mpatches.Rectangle(
            (start, row - _BOX_HEIGHT / 2), width, _BOX_HEIGHT,
            facecolor=KIND_COLOURS[interval.kind], edgecolor='white', linewidth=0.5,
            alpha=_BOX_ALPHA))
        label = f'{interval.kind[0].upper()}{interval.micro_batch}'
        if width * px_per_unit >= len(label) * px_per_char + 4:
            ax.text(start + width / 2, row, label, ha='center', va='center',
                    fontsize=_LABEL_FONT_PT, color='white', clip_on=True)

    ax.set_xlim(first * scale, first * scale + span)
    ax.set_ylim(num_rows - 0.5, -0.5)  # Inverted: device 0 on top, as the pipeline flows down.
    ax.set_yticks(range(num_rows), row_labels)
    ax.set_xlabel(f'time ({unit})')
    ax.grid(axis='x', alpha=0.3)
    ax.set_axisbelow(True)
    # Legend handles are free-standing patches, so ax.patches keeps only the boxes.
    ax.legend(handles=[mpatches.Patch(color=KIND_COLOURS[kind], alpha=_BOX_ALPHA, label=kind)
                       for kind in simulator.KINDS + simulator.SPLIT_KINDS
                       if kind in simulator.KINDS or
                       any(i.kind == kind for i in timeline.intervals)],
              loc='upper left', bbox_to_anchor=(1.01, 1), frameon=False)
    summary = f'utilisation {_Percent(timeline.utilisation)}'
    if ideal_utilisation is not None:
        summary += f' (ideal {_Percent(ideal_utilisation)})'
    ax.set_title(f'{title}: {summary}' if title else summary)
    return figure


def CellCostFigure(costs: Sequence[float], unit: str = 'FLOPs', title: str = '',
                   labels: Sequence[str] | None = None) -> Figure:
    """A bar per cell and a dashed line at the mean, the cost a balanced partition gives each.

    The pipeline runs at the pace of its costliest cell, so the title reports max/mean: 1.0 is
    a perfect balance.

    Args:
      costs: per cell, its cost (FLOPs, seconds, parameters, ...), all >= 0.
      unit: the y axis label.
      title: shown before max/mean in the figure's title.
      labels: one x tick label per cell; default 'cell k'.

    Returns:
      The figure; its only Axes holds exactly one bar per cell.

    Raises:
      ValueError: for no costs, a negative or non-finite cost, or labels not one per cell.
    """
    costs = [float(c) for c in costs]
    if not costs:
        raise ValueError('CellCostFigure needs at least one cell cost, got none.')
    for k, cost in enumerate(costs):
        if not (math.isfinite(cost) and cost >= 0):
            raise ValueError(f'Costs must be finite and >= 0, got costs[{k}] = {cost}.')
    if labels is not None and len(labels) != len(costs):
        raise ValueError(f'labels needs one label per cell, got {len(labels)} labels for '
                         f'{len(costs)} cells.')
    labels = list(labels) if labels is not None else [f'cell {k}' for k in range(len(costs))]
    mean = sum(costs) / len(costs)
    ratio = max(costs) / mean if mean else 1.0  # All-zero cells are trivially balanced.

    figure, ax = _NewFigure(4.0)
    ax.bar(range(len(costs)), costs, width=0.6, color=KIND_COLOURS['forward'])
    ax.axhline(mean, color='black', linestyle='--', linewidth=1,
               label=f'mean (balance target) = {mean:.3g}')
    _LabelCells(ax, labels, rotate=len(costs) > 16)
    ax.set_ylabel(unit)
    ax.legend(loc='upper left', bbox_to_anchor=(1.01, 1), frameon=False)
    summary = f'max/mean = {ratio:.2f}'
    ax.set_title(f'{title}: {summary}' if title else summary)
    return figure


def MemoryFigure(plan: memory.MemoryPlan, device_bytes: float | None = None,
                 title: str = '') -> Figure:
    """Each device's peak memory as a bar stacked from `memory.COMPONENTS`.

    Args:
      plan: the MemoryPlan (device k runs cell k).
      device_bytes: an accelerator's memory, drawn as a horizontal line.
      title: shown before K, M and the batch size in the figure's title.

    Returns:
      The figure; its only Axes holds len(COMPONENTS) bar segments per cell and, with
      `device_bytes`, one line labelled 'device memory'.

    Raises:
      ValueError: for a plan with no cells, a negative byte count, or device_bytes <= 0.
    """
    cells = list(plan.cells)
    if not cells:
        raise ValueError('The memory plan has no cells to draw.')
    for cell in cells:
        for name in memory.COMPONENTS:
            if getattr(cell, name) < 0:
                raise ValueError(f'Byte counts must be >= 0, got cell {cell.cell} {name} = '
                                 f'{getattr(cell, name)}.')
    if device_bytes is not None and not device_bytes > 0:
        raise ValueError(f'device_bytes must be > 0, got {device_bytes}.')
    top = max([cell.total for cell in cells] + [device_bytes or 0])
    scale, unit = (2**30, 'GiB') if top >= 2**30 else (2**20, 'MiB')

    figure, ax = _NewFigure(4.0)
    x = range(len(cells))
    bottom = np.zeros(len(cells))
    handles = []
    for name in memory.COMPONENTS:
        heights = np.array([getattr(cell, name) for cell in cells], dtype=float) / scale
        handles.append(ax.bar(x, heights, width=0.6, bottom=bottom,
                              color=COMPONENT_COLOURS[name], label=name.replace('_', ' ')))
        bottom += heights
    # Reversed so the legend reads top-down in the order the segments stack.
    handles.reverse()
    if device_bytes is not None:
        handles.append(ax.axhline(device_bytes / scale, color='red', linestyle='--',
                                  linewidth=1, label='device memory'))
    # Side by side, these labels overlap from about 6 cells on (seen at 8).
    _LabelCells(ax, [f'dev {k} · cell {cell.cell}' + (' (remat)' if cell.recompute else '')
                     for k, cell in enumerate(cells)], rotate=len(cells) > 4)
    ax.set_ylabel(f'memory ({unit})')
    ax.legend(handles=handles, loc='upper left', bbox_to_anchor=(1.01, 1), frameon=False)
    summary = (f'K={plan.num_cells} M={plan.num_micro_batches} batch={plan.batch_size}: peak '
               f'{max(cell.total for cell in cells) / scale:.2f} {unit} per device')
    ax.set_title(f'{title}: {summary}' if title else summary)
    return figure


def _LabelCells(ax, labels: list, rotate: bool) -> None:
    """One x tick per bar, labelled with `labels`, rotated upright when `rotate`; where more
    bars than rotated labels fit side by side (the paper's K=128), every n-th bar's."""
    stride = max(1, math.ceil(len(labels) / _MAX_ROTATED_LABELS)) if rotate else 1
    ticks = list(range(0, len(labels), stride))
    ax.set_xticks(ticks, [labels[k] for k in ticks], rotation=90 if rotate else 0)


def _Canvas(figure: Figure) -> FigureCanvasAgg:
    # A figure made elsewhere may carry another canvas; Agg is what renders PNG pixels.
    if not isinstance(figure.canvas, FigureCanvasAgg):
        FigureCanvasAgg(figure)
    return figure.canvas


def PngBytes(figure: Figure) -> bytes:
    """The figure as PNG file contents, at the figure's own size and dpi."""
    buffer = io.BytesIO()
    _Canvas(figure).print_png(buffer)
    return buffer.getvalue()


def SavePng(figure: Figure, path: str | os.PathLike) -> str:
    """Writes the figure as a PNG at `path`, creating its parent directories.

    Returns:
      The path written, as a string.
    """
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, 'wb') as f:
        f.write(PngBytes(figure))
    return path


def ImageArray(figure: Figure) -> np.ndarray:
    """The figure's RGBA pixels as a uint8 array [1, height, width, 4], for tf.summary.image."""
    canvas = _Canvas(figure)
    canvas.draw()
    # Copied: the canvas reuses its buffer on the next draw.
    return np.array(canvas.buffer_rgba(), dtype=np.uint8)[np.newaxis]
