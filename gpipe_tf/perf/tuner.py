"""Chooses a pipeline's configuration: M, the schedule, virtual stages, re-materialization and the
cell boundaries that minimise the simulated step while every device's planned peak fits.

Re-materialization is searched per cell where it pays: besides every recompute mode of the
search, for each schedule, M and v the tuner finds by bisection the most last cells that can
keep their activations while every device still fits (`recompute='except_last_<j>'`, the last j
cells keeping theirs): a device's peak grows with j, and keeping a cell's activations spares its
backward the forward's re-run.

For each configuration of the search (`Space`), the boundaries are first the time-optimal
partition of the layers' step costs (the min-max partition `partition_method='time'` makes);
where a device's planned peak exceeds its memory, boundaries next to the fullest device move
one layer at a time to its neighbours while the peak falls (so a 1F1B stage 0, which holds K
micro-batches, is given fewer layers than the last stage, which holds one). Each configuration is
then scored by the simulated step (`cost_model.Simulated`: `simulator.Simulate` on the per-cell
sums of the layers' costs) and by the memory planner (`memory.FromPlan`) on the same plan the
pipeline would make, so the prediction and the run share one partition.

Layer costs are the cost model's (`cost_model`: measured, or estimated from FLOPs); with
measured ones, `Calibrate` scales them to measured gpipe steps at the M of the search, and
`MeasureBest` runs the best-ranked configurations and puts the fastest measured first.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from gpipe_tf import errors
from gpipe_tf import units
from gpipe_tf.perf import cost_model
from gpipe_tf.perf import memory as memory_lib
from gpipe_tf.pipeline import fields
from gpipe_tf.pipeline import partition
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.pipeline import schedule as schedule_lib

# Per configuration, at most this many one-layer boundary moves towards fitting.
_MAX_MOVES = 64


@dataclasses.dataclass(frozen=True)
class Config:
    """One point of the search."""
    schedule: str
    num_micro_batches: int
    virtual_stages: int
    recompute: str

    def __str__(self) -> str:
        v = f' v={self.virtual_stages}' if self.virtual_stages > 1 else ''
        return f'{self.schedule}{v} M={self.num_micro_batches} recompute={self.recompute}'

    def Group(self) -> tuple[str, int, int]:
        """Schedule, M and v: what configurations that differ only in recompute share."""
        return self.schedule, self.num_micro_batches, self.virtual_stages

    def KeepingLast(self, kept_cells: int, num_cells: int) -> Config:
        """This configuration with the last `kept_cells` of `num_cells` cells keeping their
        activations ('always' for none, 'never' for all)."""
        mode = ('always' if kept_cells == 0 else 'never' if kept_cells == num_cells else
                plan_lib.KeepLast(kept_cells))
        return dataclasses.replace(self, recompute=mode)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A configuration with its boundaries, scored.

    Attributes:
      config: schedule, M, v and recompute mode.
      boundaries: the cell boundaries (v K + 1 layer indices).
      step_s: the simulated step (seconds with measured costs; nominal with FLOPs).
      bubble: the simulated step's idle fraction of device time.
      device_bytes: per device, the planned peak.
      fits: whether every device's peak fits the memory given.
      moved: whether the boundaries were moved from the time-optimal ones to fit.
      params: the PipeliningLayer Params of this configuration.
      memory: its memory plan.
    """
    config: Config
    boundaries: tuple[int, ...]
    step_s: float
    bubble: float
    device_bytes: tuple[int, ...]
    fits: bool
    moved: bool
    params: object = dataclasses.field(repr=False, compare=False, default=None)
    memory: memory_lib.MemoryPlan | None = dataclasses.field(repr=False, compare=False,
                                                             default=None)

    @property
    def peak_bytes(self) -> int:
        return max(self.device_bytes)

    @property
    def num_cells(self) -> int:
        """S = v K, the cells."""
        return len(self.boundaries) - 1

    @property
    def kept_cells(self) -> int:
        """How many of the last cells keep their activations."""
        return plan_lib.KeptCells(self.config.recompute, self.num_cells)

    def RecomputeText(self) -> str:
        """The recompute mode, with how many of the cells keep their activations where some
        but not all do: 'except_last_3 (3/8 kept)'."""
        kept = self.kept_cells
        if 0 < kept < self.num_cells:
            return f'{self.config.recompute} ({kept}/{self.num_cells} kept)'
        return self.config.recompute


@dataclasses.dataclass(frozen=True)
class Result:
    """Every configuration scored, ranked: those that fit by predicted step, then the others
    by peak memory."""
    candidates: list[Candidate]
    device_memory_bytes: float
    costs: str
    measured: bool
    skipped: dict[str, str]  # Configuration -> why the pipeline refuses it.

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates and self.candidates[0].fits else None

    def Format(self, limit: int | None = 20, verbose: bool = False) -> str:
        """The ranked table (the first `limit` rows; None: all), step times in ms: one line
        per configuration, its largest planned peak and the spread of the peaks across
        devices (the largest less the smallest), so the line's width does not grow with K;
        `verbose` adds the boundaries and every device's peak."""
        unit = 'ms' if self.measured else 'nominal ms'
        header = ('rank', 'schedule', 'v', 'M', 'recompute', f'step ({unit})', 'bubble',
                  'peak (MiB)', 'spread (MiB)', 'fits')
        if verbose:
            header += ('boundaries', 'peak per device (MiB)')
        rows = [header]
        for rank, c in enumerate(self.candidates[:limit], 1):
            row = (str(rank), c.config.schedule, str(c.config.virtual_stages),
                   str(c.config.num_micro_batches), c.RecomputeText(),
                   f'{c.step_s * 1e3:.2f}', f'{c.bubble:.0%}', units.MiB(c.peak_bytes),
                   units.MiB(c.peak_bytes - min(c.device_bytes)),
                   ('yes' if c.fits else 'no') + (' (moved)' if c.moved else ''))
            if verbose:
                row += (','.join(map(str, c.boundaries)),
                        ' '.join(units.MiB(b) for b in c.device_bytes))
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ['  '.join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        shown = min(len(self.candidates), limit or len(self.candidates))
        lines.append(f'{shown} of {len(self.candidates)} configurations; layer costs '
                     f'{self.costs}; devices of {units.MiB(self.device_memory_bytes)} MiB'
                     f'{"" if verbose else "; boundaries and per-device peaks: --verbose"}')
        return '\n'.join(lines)


def MicroBatchCounts(batch_per_replica: int, num_devices: int) -> list[int]:
    """The M searched: for i = 0..3, the smallest divisor of the replica's batch at least
    2^i K (M below K leaves devices idle); the largest divisor when none is that large."""
    divisors = [d for d in range(1, batch_per_replica + 1) if batch_per_replica % d == 0]
    counts = {next((d for d in divisors if d >= num_devices << i), divisors[-1])
              for i in range(4)}
    return sorted(counts)


def Space(num_layers: int, num_devices: int, batch_per_replica: int,
          schedules: Sequence[str] = schedule_lib.KINDS,
          recompute_modes: Sequence[str] = plan_lib.RECOMPUTE_MODES,
          micro_batches: Sequence[int] | None = None) -> list[Config]:
    """The configurations searched: every schedule (at its `searched_virtual_stages` per
    device, two for interleaved_1f1b and zero_bubble_v, where the layers allow), M
    (`MicroBatchCounts` unless given) and recompute mode. (`Tune` adds, per schedule, M and
    v, the most last cells kept that fit.)"""
    counts = micro_batches or MicroBatchCounts(batch_per_replica, num_devices)
    space = []
    for kind in schedules:
        v = schedule_lib.Kind(kind).searched_virtual_stages
        if v * num_devices > num_layers:
            continue
        space += [Config(kind, m, v, mode) for m in counts for mode in recompute_modes]
    return space


def Tune(p, num_devices: int, device_memory_bytes: float, costs: cost_model.Costs | None = None,
         slots_per_param: int = 1, space: Sequence[Config] | None = None,
         progress: Callable | None = None, search_kept_cells: bool = True) -> Result:
    """Scores every configuration of `space` for PipeliningLayer Params `p` (with layer_tpl
    and input_shapes) on `num_devices` devices of `device_memory_bytes` each; with
    `search_kept_cells`, for each schedule, M and v of the space, also the configuration that
    keeps the activations of the most last cells while it fits (`MostKept`), where the space
    does not hold it already.

    Args:
      p: the pipeline's Params; its other settings (devices, replicas, dtypes) are kept.
      num_devices: K.
      device_memory_bytes: each device's memory.
      costs: the layers' costs (None: `FlopsCosts(p)`).
      slots_per_param: the optimizer's slots per parameter (`memory.SlotsPerParam`).
      space: the configurations (None: `Space(...)` for the layers, K and the batch).
      progress: None, or called with a line per configuration scored.
      search_kept_cells: whether to search, per schedule, M and v, the most last cells kept.

    Raises:
      errors.ConfigError: for Params without layer_tpl or input_shapes.
    """
    if p.layer_tpl is None or p.input_shapes is None:
        raise errors.ConfigError(f'{p.name}: tuning needs layer_tpl (layers to partition) and '
                                 'input_shapes (the shapes of one mini-batch).')
    costs = costs or cost_model.FlopsCosts(p)
    batch = fields.BatchSize(p) // p.num_replicas
    if space is None:
        space = Space(len(p.layer_tpl), num_devices, batch)
    scored, skipped = [], {}

    def Report(candidate):
        if progress:
            progress(f'{candidate.config}: {candidate.step_s * 1e3:.2f} ms, peak '
                     f'{units.MiB(candidate.peak_bytes)} MiB')

    for config in space:
        micro_batch = batch // config.num_micro_batches
        before, layers = costs.Of(micro_batch)
        try:
            candidate = _Fitted(p, num_devices, config, before, layers, device_memory_bytes,
                                slots_per_param, costs.Overheads(micro_batch))
        except (errors.ConfigError, ValueError) as error:
            skipped[str(config)] = str(error)
            continue
        scored.append(candidate)
        Report(candidate)
    if search_kept_cells:
        groups = {}  # Schedule, M and v -> their candidates scored.
        for candidate in scored:
            groups.setdefault(candidate.config.Group(), []).append(candidate)
        for candidates in groups.values():
            micro_batch = batch // candidates[0].config.num_micro_batches
            before, layers = costs.Of(micro_batch)
            kept = MostKept(p, num_devices, candidates, before, layers, device_memory_bytes,
                            slots_per_param, costs.Overheads(micro_batch))
            if kept is not None and all(kept.config != c.config for c in candidates):
                scored.append(kept)
                Report(kept)
    scored.sort(key=lambda c: (not c.fits, c.step_s if c.fits else c.peak_bytes, c.peak_bytes))
    return Result(scored, device_memory_bytes, costs.description, costs.measured, skipped)


def Calibrate(p, num_devices: int, costs: cost_model.Costs,
              measure: Callable[[Candidate], float | None],
              device_memory_bytes: float, slots_per_param: int = 1,
              space: Sequence[Config] | None = None) -> cost_model.Costs:
    """`costs` scaled to measured steps of the pipeline itself (`cost_model.Calibrated`): gpipe
    at each M of `space` (the first recompute mode of each that fits, at its time-optimal
    boundaries) is run by `measure` (a Candidate -> its step in seconds, or None where it was
    not run), and the scale is the least squares fit of their predicted steps to the measured in
    relative error (each M weighs the same, however long its step).

    One number. Two were tried, the layers' work scaled and an action's cost fitted apart: a
    small model's steps are mostly a fixed cost per step (the update, the function's call),
    which neither term holds (examples.PipelinedMLP was then predicted at a third of its
    measured step), and a third term for it is nearly collinear with the work (both change
    little with M): with steps varying 5-15% between runs, the fit put everything into it.
    Where no gpipe configuration fits or none was run, `costs` are returned as they are.
    """
    batch = fields.BatchSize(p) // p.num_replicas
    space = space if space is not None else Space(len(p.layer_tpl), num_devices, batch)
    references = []  # (M, predicted seconds, measured seconds)
    for m in sorted({c.num_micro_batches for c in space}):
        before, layers = costs.Of(batch // m)
        candidate = next((c for c in (
            _FittedOrNone(p, num_devices, Config('gpipe', m, 1, mode), before, layers,
                          device_memory_bytes, slots_per_param, costs.Overheads(batch // m))
            for mode in ('never', 'always')) if c is not None and c.fits), None)
        seconds = None if candidate is None else measure(candidate)
        if seconds is not None:
            references.append((m, candidate.step_s, seconds))
    if not references:
        return costs
    # Minimises the sum over M of (scale x predicted / measured - 1) squared.
    ratios = [predicted / seconds for _, predicted, seconds in references]
    scale = sum(ratios) / sum(r * r for r in ratios)
    shown = ', '.join(f'{m}: {t * 1e3:.1f} ms' for m, _, t in references)
    return cost_model.Calibrated(costs, scale,
                                 f'x{scale:.2f} calibrated on measured gpipe steps (M={shown})')


def _FittedOrNone(*args) -> Candidate | None:
    try:
        return _Fitted(*args)
    except (errors.ConfigError, ValueError):
        return None


def MeasureBest(result: Result, measure: Callable[[Candidate], float | None], count: int,
                progress: Callable | None = None) -> list[tuple[Candidate, float]]:
    """The `count` best-ranked candidates that fit, each run by `measure` (a Candidate -> its
    step in seconds, or None where it was not run: then it is left out), fastest first. What a
    simulation cannot see (how two schedules share a device's cores, what splitting a backward
    costs in the graph) decides between configurations it ranks close."""
    measured = []
    for rank, candidate in enumerate([c for c in result.candidates if c.fits][:count], 1):
        seconds = measure(candidate)
        if seconds is None:
            continue
        measured.append((candidate, seconds))
        if progress:
            progress(f'rank {rank}: {candidate.config} {list(candidate.boundaries)}: predicted '
                     f'{candidate.step_s * 1e3:.2f} ms, measured {seconds * 1e3:.2f} ms')
    return sorted(measured, key=lambda pair: pair[1])


def NoFitError(p, result: Result) -> errors.ConfigError:
    """The one line for a search where nothing fits: the smallest peak and its configuration."""
    if not result.candidates:
        reasons = '; '.join(f'{k}: {v}' for k, v in list(result.skipped.items())[:2])
        return errors.ConfigError(f'{p.name}: the pipeline refuses every configuration tried '
                                  f'({reasons}).')
    least = min(result.candidates, key=lambda c: c.peak_bytes)
    return errors.ConfigError(
        f'{p.name}: no configuration fits devices of '
        f'{_GiB(result.device_memory_bytes)} GiB; the smallest peak, '
        f'{_GiB(least.peak_bytes)} GiB per device, is {least.config} with boundaries '
        f'{list(least.boundaries)}: give devices of at least that much memory, or more of them.')


def _GiB(value: float) -> str:
    return f'{value / 2**30:.3g}'


def Score(p, num_devices: int, config: Config, boundaries: Sequence[int],
          before: Sequence[cost_model.LayerSeconds], layers: Sequence[cost_model.LayerSeconds],
          device_memory_bytes: float, slots_per_param: int = 1, moved: bool = False,
          overheads: cost_model.Overheads = cost_model.Overheads()) -> Candidate:
    """One configuration with `boundaries`, simulated (`cost_model.Simulated`) and planned on the
    plan the pipeline makes of it.

    Raises:
      errors.ConfigError: if the pipeline refuses the configuration.
    """
    q = p.Copy().Set(num_cells=num_devices, virtual_stages=config.virtual_stages,
                     schedule=config.schedule, recompute=config.recompute,
                     num_micro_batches=config.num_micro_batches, micro_batch_size=None,
                     partition_method=list(boundaries))
    pipeline_plan = plan_lib.MakePlan(q, place=False)
    memory = memory_lib.FromPlan(pipeline_plan, slots_per_param)
    timeline = cost_model.Simulated(pipeline_plan, boundaries, before, layers, overheads)
    totals = tuple(memory.device_totals)
    return Candidate(config, tuple(boundaries), timeline.makespan, timeline.bubble, totals,
                     memory.Fits(device_memory_bytes), moved, q, memory)


def MostKept(p, num_devices: int, scored: Sequence[Candidate],
             before: Sequence[cost_model.LayerSeconds], layers: Sequence[cost_model.LayerSeconds],
             device_memory_bytes: float, slots_per_param: int = 1,
             overheads: cost_model.Overheads = cost_model.Overheads()) -> Candidate | None:
    """Of one schedule, M and v (those of `scored`, candidates that differ only in recompute),
    the configuration that keeps the activations of the most last cells (j of the S cells,
    recompute 'except_last_<j>'; 'always' for j = 0) and still fits, its boundaries fitted as
    every configuration's (`_Fitted`); None where every cell can keep them ('never' fits) or
    the configuration cannot fit ('always' does not).

    A bisection on j, over the candidates `scored` already and those it scores: a device's peak
    grows with j (a cell that keeps its activations holds them per micro-batch in flight),
    so about log2(S) configurations are scored, not S.
    """
    base = scored[0].config
    num_cells = num_devices * base.virtual_stages
    known = {c.kept_cells: c for c in scored}

    def Fits(kept):
        if kept not in known:
            known[kept] = _Fitted(p, num_devices, base.KeepingLast(kept, num_cells), before,
                                  layers, device_memory_bytes, slots_per_param, overheads)
        return known[kept].fits

    try:
        if Fits(num_cells) or not Fits(0):
            return None
        fits, fails = 0, num_cells
        while fails - fits > 1:
            middle = (fits + fails) // 2
            if Fits(middle):
                fits = middle
            else:
                fails = middle
    except (errors.ConfigError, ValueError):  # The pipeline refuses it (as in `Tune`).
        return None
    return known[fits]


def _Fitted(p, num_devices, config, before, layers, device_memory_bytes, slots_per_param,
            overheads=cost_model.Overheads()):
    """The configuration at its time-optimal boundaries, or, if a device does not fit, at the
    boundaries one-layer moves away from the fullest device reach while its peak falls."""
    # Boundaries come before the cells: with any cell re-materializing, every layer's
    # forward counts twice (as `partition_method='time'` counts them).
    remat = any(plan_lib.RecomputeFlags(config.recompute,
                                        num_devices * config.virtual_stages))
    step = [c.Step(remat) for c in layers]
    step[0] += sum(c.Step(remat) for c in before)  # Before layers run on cell 0's device.
    boundaries = partition.OptimalBoundaries(step, num_devices * config.virtual_stages)
    args = (before, layers, device_memory_bytes, slots_per_param)
    best = Score(p, num_devices, config, boundaries, *args, overheads=overheads)
    for _ in range(_MAX_MOVES):
        if best.fits:
            break
        moves = []
        fullest = best.device_bytes.index(best.peak_bytes)
        for b in _MovesFrom(list(best.boundaries), fullest, num_devices, config):
            try:
                moves.append(Score(p, num_devices, config, b, *args, moved=True,
                                   overheads=overheads))
            except errors.ConfigError:
                continue
        if not moves:
            break
        move = min(moves, key=lambda c: (c.peak_bytes, c.step_s))
        if move.peak_bytes >= best.peak_bytes:
            break
        best = move
    return best


def _MovesFrom(boundaries: list[int], device: int, num_devices: int, config: Config):
    """Boundaries with one layer moved off each cell of `device` to a neighbouring cell."""
    num_cells = len(boundaries) - 1
    for cell in range(num_cells):
        if schedule_lib.StageDevice(cell, num_devices,
                                    schedule_lib.Placement(config.schedule)) != device:
            continue
        if boundaries[cell + 1] - boundaries[cell] < 2:
            continue  # A cell keeps at least one layer.
        if cell > 0:  # Its first layer to the cell before.
            yield boundaries[:cell] + [boundaries[cell] + 1] + boundaries[cell + 1:]
        if cell < num_cells - 1:  # Its last layer to the cell after.
            yield boundaries[:cell + 1] + [boundaries[cell + 1] - 1] + boundaries[cell + 2:]
