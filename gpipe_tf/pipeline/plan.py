"""The plan of a pipeline: everything its Params determine, made once, before any variable or
TF op exists.

`MakePlan(p)` partitions the layers into K cells (by cost, `partition`), computes each cell's
`FPropMeta`, M from the one rule (`NumMicroBatches`), each cell's re-materialization, and the
R x K device mesh (`devices`). Everything Params allow to be checked is checked here: K against
the layers, the shapes between cells, the batch against R and M, and (optionally) that the
devices exist. `PipeliningLayer` (which makes its own from its Params), the trainer,
`tools/model_table.py` and `perf/` read the plan instead of re-deriving any of it; its memory
plan is `perf.memory.FromPlan(plan)`. A plan is a value made from data: this module imports no
executor and nothing of `perf/`; partition_method='time' takes the costs its caller measured
(`MakePlan(layer_costs=...)`, `perf.measured_costs.TimedBoundaries`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

from gpipe_tf import errors
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import sequential
from gpipe_tf.layers.base_layer import LayerMeta
from gpipe_tf.pipeline import devices as devices_lib
from gpipe_tf.pipeline import fields
from gpipe_tf.pipeline import partition
from gpipe_tf.pipeline import schedule as schedule_lib

RECOMPUTE_MODES = ('always', 'except_last', 'never')
# recompute='except_last_<j>': the last j cells keep their activations and the others
# re-materialize, for any 0 <= j <= S ('except_last' is j = 1, 'always' j = 0, 'never' j = S).
KEEP_LAST_PREFIX = 'except_last_'
_KEEP_LAST = re.compile(r'except_last_(0|[1-9][0-9]*)')
RECOMPUTE_HELP = (f"one of {RECOMPUTE_MODES} or 'except_last_<j>' (the last j cells keep their "
                  "activations, the others re-materialize; 0 <= j <= the number of cells)")
PARTITION_METHODS = ('flops', 'params', 'time', 'uniform')
UNROLL_MODES = (True, False, 'auto')


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a PipeliningLayer's Params determine.

    Attributes:
      params: the PipeliningLayer Params the plan is of.
      cells: per cell (stage), its layers' Params (named: by their own name, else
        `layer_<index>`; with the pipeline's fprop_dtype unless they set one); v K of them
        with v virtual stages per device.
      metas: per cell, its FPropMeta on one mini-batch; None without input_shapes.
      recompute: per cell, whether its forward is re-materialized in the backward.
      batch_size: N, the examples of one mini-batch (from input_shapes; None without them).
      num_micro_batches: M for that mini-batch (None without input_shapes).
      mesh: the device of each (replica, cell), R lists of v K (cell s on the replica's
        device s % K); None until placed (a trainer needs K to know how many devices to set
        up, before the devices exist).
      before: the before_tpl layers' Params (named), run ahead of cell 0 on its device.
      schedule: the training schedule (`schedule.Schedule`) for num_micro_batches; None
        without input_shapes (`Schedule(m)` makes one for any M).
    """
    params: Any
    cells: list[list]
    metas: list[LayerMeta] | None
    recompute: list[bool]
    batch_size: int | None
    num_micro_batches: int | None
    mesh: list[list[str]] | None = None
    before: list = dataclasses.field(default_factory=list)
    schedule: schedule_lib.Schedule | None = None

    @property
    def num_cells(self) -> int:
        """The cells (stages) of a replica: K, or v K with v virtual stages per device."""
        return len(self.cells)

    @property
    def boundaries(self) -> list[int]:
        """[0, b_1, ..., L]: cell k holds the layers b_k .. b_{k+1} - 1 (before_tpl apart), as
        partition_method takes them."""
        bounds = [0]
        for layers in self.cells:
            bounds.append(bounds[-1] + len(layers))
        return bounds

    @property
    def virtual_stages(self) -> int:
        """v, cells per device."""
        return self.params.virtual_stages

    @property
    def num_devices(self) -> int:
        """K, the devices of one replica."""
        return self.num_cells // self.virtual_stages

    def DeviceOf(self, cell: int) -> int:
        """The index among a replica's K devices of `cell`'s device: cell % K, or in a V
        under zero_bubble_v (`schedule.StageDevice`). With logical_device_fn, its logical
        device."""
        return schedule_lib.StageDevice(cell, self.num_devices,
                                        schedule_lib.Placement(self.params.schedule))

    def Schedule(self, num_micro_batches: int, training: bool = True) -> schedule_lib.Schedule:
        """The Params' schedule kind for M = `num_micro_batches` (forward-only unless
        `training`).

        Raises:
          errors.ConfigError: if the kind cannot schedule these counts.
        """
        return MakeSchedule(self.params, self.num_devices, num_micro_batches, training)

    @property
    def num_replicas(self) -> int:
        """R."""
        return self.params.num_replicas

    @property
    def devices(self) -> list[str]:
        """The device of each cell of the first replica, where the variables live."""
        return list(self.mesh[0])

    def Placed(self, check_devices: bool = False, available: list[str] | None = None) -> Plan:
        """This plan with its mesh, from the Params' devices (`devices.MeshDevices`).

        Args:
          check_devices: also check that every device of the mesh exists
            (`devices.CheckDevices`); off for a plan of a machine other than this one.
          available: with check_devices, the devices to check against (default: this
            process's).

        Raises:
          errors.ConfigError: for devices that do not form R x K, or (check_devices) a device
            that does not exist.
        """
        p = self.params
        devices = p.devices
        if devices is None and p.logical_device_fn is not None:
            devices = [''] * self.num_devices  # The strategy's replica device; XLA places cells.
        mesh = devices_lib.MeshDevices(devices, p.num_replicas, self.num_devices, p.round_robin)
        if check_devices and p.logical_device_fn is None:  # With it, a strategy places cells.
            devices_lib.CheckDevices(mesh, available)
        # With v virtual stages, cell s runs on the replica's device s % K (in a V under
        # zero_bubble_v).
        mesh = [[row[self.DeviceOf(s)] for s in range(self.num_cells)] for row in mesh]
        return dataclasses.replace(self, mesh=mesh)


def MakePlan(p, place: bool = True, check_devices: bool = False,
             available: list[str] | None = None,
             layer_costs: Sequence[float] | None = None) -> Plan:
    """The plan of PipeliningLayer Params `p`; no variable is built, no TF op created.

    Args:
      p: PipeliningLayer Params.
      place: also make the device mesh (`Plan.Placed`); without, naming no device, the plan
        touches no TensorFlow device (it can be made before the devices are set up).
      check_devices, available: see `Plan.Placed`.
      layer_costs: for partition_method='time', each body layer's measured cost (seconds of a
        training step, `perf.measured_costs.StepSeconds`): the plan partitions on them and
        measures nothing itself.

    Raises:
      errors.ConfigError: for layers that are not a list of layer Params, inconsistent cells,
        partitions or shapes, a schedule or recompute mode that is not one (`KeptCells`), a
        batch that R or M do not divide, unroll=False where the loop cannot run the pipeline,
        or (check_devices) a device that does not exist; partition_method='time' without
        `layer_costs`.
    """
    if p.logical_device_fn is not None and p.num_replicas != 1:
        raise errors.ConfigError(f'With logical_device_fn the replicas are the strategy\'s: '
                                 f'num_replicas must be 1, got {p.num_replicas}.')
    try:  # Params alone name it; M, known here only with input_shapes, is checked below.
        schedule_lib.Kind(p.schedule).CheckVirtualStages(p.virtual_stages)
    except schedule_lib.ScheduleError as error:
        raise errors.ConfigError(f'{p.name}: {error}') from None
    cells, metas = Cells(p, layer_costs)
    try:
        recompute = RecomputeFlags(p.recompute, len(cells))
    except errors.ConfigError as error:
        raise errors.ConfigError(f'{p.name}: {error}') from None
    if p.unroll is False and p.logical_device_fn is not None:
        raise errors.ConfigError(f'{p.name}: unroll=False runs the schedule as a loop, which '
                                 'cannot run a logical_device_fn (its XLA sharding annotations '
                                 'are not tried inside a loop). Set unroll=True or "auto", '
                                 'which unrolls it.')
    before = fields.BeforeLayers(p)
    _CheckUniqueNames(p, before + [lp for layers in cells for lp in layers])
    batch_size = fields.BatchSize(p)
    num_micro_batches = None if batch_size is None else NumMicroBatches(p, batch_size)
    plan = Plan(params=p, cells=cells, metas=metas, before=before,
                recompute=recompute, batch_size=batch_size,
                num_micro_batches=num_micro_batches,
                schedule=(None if num_micro_batches is None else MakeSchedule(
                    p, len(cells) // p.virtual_stages, num_micro_batches)))
    return plan.Placed(check_devices, available) if place else plan


def MakeSchedule(p, num_devices: int, num_micro_batches: int,
                 training: bool = True) -> schedule_lib.Schedule:
    """`p.schedule` for K = `num_devices` and M = `num_micro_batches`, v = p.virtual_stages,
    its actions ordered for `p.recompute`'s costs.

    Raises:
      errors.ConfigError: if the kind cannot schedule these counts.
    """
    recomputes = RecomputeFlags(p.recompute, num_devices * p.virtual_stages)
    try:
        return schedule_lib.Make(p.schedule, num_devices, num_micro_batches, p.virtual_stages,
                                 training=training, recomputes=recomputes)
    except schedule_lib.ScheduleError as error:
        raise errors.ConfigError(f'{p.name}: {error}') from None


def NumMicroBatches(p, batch_size: int | None, equal: bool = True) -> int:
    """M of PipeliningLayer Params `p` for a mini-batch of `batch_size` examples (None: known
    only when the step runs), per replica: the one rule, `num_micro_batches`, or a replica's
    batch over `micro_batch_size`, else 1.

    Args:
      p: the PipeliningLayer Params.
      batch_size: the mini-batch's examples, over all R replicas.
      equal: whether each replica's batch must split into M equal micro-batches: a plan's
        (`MakePlan` sizes memory for the batch its input_shapes declare) and the trainer's.
        A step's (`equal=False`) splits any batch with num_micro_batches, into micro-batches
        as equal as they can be (`microbatch.Sizes`); micro_batch_size must still divide a
        batch known when the step is traced.

    Raises:
      errors.ConfigError: for Params that set both (the Params' checks refuse values below
        1), and, where the rule needs it, a batch R does not divide, M does not divide (or
        exceed) a replica's, or that is unknown.
    """
    m, size = p.num_micro_batches, p.micro_batch_size
    if m is not None and size is not None:
        raise errors.ConfigError('Set exactly one of num_micro_batches and micro_batch_size, '
                                 f'got {m} and {size}.')
    if not equal and size is None:
        return m or 1
    if batch_size is None:
        raise errors.ConfigError(
            f'micro_batch_size ({size}) gives M from the batch size, which must then be known '
            'when the step is traced; set num_micro_batches instead for batches known only '
            'when the step runs.')
    if batch_size % p.num_replicas:
        raise errors.ConfigError(f'batch size {batch_size} is not divisible by num_replicas '
                                 f'({p.num_replicas}).')
    batch_size //= p.num_replicas
    if size is not None:
        if batch_size % size:
            raise errors.ConfigError(f'Batch size {batch_size} is not divisible by '
                                     f'micro_batch_size {size}.')
        return batch_size // size
    m = m or 1
    if m > batch_size:
        raise errors.ConfigError(f'num_micro_batches ({m}) is larger than the batch size '
                                 f'({batch_size}).')
    if batch_size % m:
        raise errors.ConfigError(f'Batch size {batch_size} is not divisible by '
                                 f'num_micro_batches ({m}).')
    return m


def KeptCells(mode, num_cells: int) -> int:
    """How many of the last of `num_cells` cells keep their activations under recompute
    `mode`: 'always' 0, 'except_last' 1, 'except_last_<j>' j, 'never' all of them.

    Raises:
      errors.ConfigError: for another mode, or j > num_cells.
    """
    if mode in RECOMPUTE_MODES:
        return {'always': 0, 'except_last': min(1, num_cells), 'never': num_cells}[mode]
    match = _KEEP_LAST.fullmatch(mode) if isinstance(mode, str) else None
    if match is None:
        raise errors.ConfigError(f'recompute must be {RECOMPUTE_HELP}, got {mode!r}.')
    kept = int(match.group(1))
    if kept > num_cells:
        raise errors.ConfigError(
            f"recompute={mode!r} keeps the activations of the last {kept} cells, but the "
            f"pipeline has {num_cells} (num_cells x virtual_stages); expected 'except_last_<j>' "
            f'with 0 <= j <= {num_cells}.')
    return kept


def KeepLast(kept_cells: int) -> str:
    """The recompute mode in which the last `kept_cells` cells keep their activations and the
    others re-materialize ('except_last' for one)."""
    return 'except_last' if kept_cells == 1 else f'{KEEP_LAST_PREFIX}{kept_cells}'


def RecomputeFlags(mode, num_cells: int) -> list[bool]:
    """Per cell, whether it re-materializes under recompute `mode`: all but the last
    `KeptCells(mode, num_cells)` ('always' all, 'never' none, 'except_last' all but the last,
    whose activations backprop needs first; 'except_last_<j>' all but the last j).

    Raises:
      errors.ConfigError: as `KeptCells`.
    """
    kept = KeptCells(mode, num_cells)
    return [k < num_cells - kept for k in range(num_cells)]


def AnyRematerialized(p) -> bool:
    """Whether any of layer_tpl pipeline Params `p`'s num_cells x virtual_stages cells
    re-materializes. A partition on measured time, made before the cells exist, then counts
    every layer's forward twice (a layer in a cell that keeps its activations runs it once).

    Raises:
      errors.ConfigError: as `KeptCells`.
    """
    return any(RecomputeFlags(p.recompute, p.num_cells * p.virtual_stages))


def Cells(p, layer_costs: Sequence[float] | None = None
          ) -> tuple[list[list], list[LayerMeta] | None]:
    """Each cell's layer Params, and each cell's FPropMeta (None without input_shapes).
    `layer_costs`: as `MakePlan`'s.

    Raises:
      errors.ConfigError: for inconsistent cells, partitions or shapes.
    """
    cells = _CellLayerParams(p, layer_costs)
    return cells, _CheckCellsFit(p, cells)


def _CheckUniqueNames(p, layers: list) -> None:
    """Every layer is a child of the pipeline, known by its name wherever it is placed."""
    names = [lp.name for lp in layers]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise errors.ConfigError(
            f'{p.name}: layer names must be unique across before_tpl and the cells (a layer\'s '
            f'name is its identity in checkpoints, whatever cell it lands in); '
            f'{", ".join(duplicates)} appear more than once.')


def _CellLayerParams(p, layer_costs: Sequence[float] | None) -> list[list]:
    """Names the layers and splits them into cells."""
    if (p.cell_tpl is None) == (p.layer_tpl is None):
        raise errors.ConfigError('Set exactly one of cell_tpl (explicit cells) and layer_tpl '
                                 '(layers to partition into num_cells).')
    if p.cell_tpl is not None:
        if not isinstance(p.cell_tpl, (list, tuple)):
            raise errors.ConfigError(f'{p.name}: cell_tpl must be a list of cells, each a layer '
                                     'Params or a list of them; got '
                                     f'{fields.Describe(p.cell_tpl)}.')
        if not p.cell_tpl:
            raise errors.ConfigError('cell_tpl is empty: expected at least one cell.')
        if len(p.cell_tpl) % p.virtual_stages:
            raise errors.ConfigError(f'cell_tpl has {len(p.cell_tpl)} cells, which '
                                     f'virtual_stages={p.virtual_stages} devices cannot share '
                                     'evenly: expected a multiple of it.')
        cells = []
        for k, cell in enumerate(p.cell_tpl):
            if isinstance(cell, (list, tuple)):
                cells.append(fields.LayerParamsList(p.name, f'cell_tpl[{k}]', cell))
            elif fields.IsLayerParams(cell):
                cells.append([cell])
            else:
                raise errors.ConfigError(f"{p.name}: cell_tpl[{k}] is {fields.Describe(cell)}; "
                                         "expected a layer's Params or a list of them.")
        index, named = 0, []
        for cell in cells:
            named.append([fields.Named(p, lp, index + i) for i, lp in enumerate(cell)])
            index += len(cell)
        return named
    layers = fields.BodyLayers(p)
    boundaries = _Boundaries(p, layers, layer_costs)
    return [layers[boundaries[k]:boundaries[k + 1]] for k in range(len(boundaries) - 1)]


def _Boundaries(p, layers: list, layer_costs: Sequence[float] | None) -> list[int]:
    num_layers, num_cells = len(layers), p.num_cells * p.virtual_stages
    if num_cells > num_layers:
        cells = (f'num_cells ({num_cells})' if p.virtual_stages == 1 else
                 f'num_cells x virtual_stages ({p.num_cells} x {p.virtual_stages})')
        raise errors.ConfigError(f'{cells} is larger than the number of layers ({num_layers}).')
    method = p.partition_method
    if isinstance(method, (list, tuple)):
        return partition.CheckBoundaries(method, num_layers, num_cells)
    if method == 'uniform':
        return partition.UniformBoundaries(num_layers, num_cells)
    if method not in PARTITION_METHODS:
        raise errors.ConfigError(f'partition_method must be one of {PARTITION_METHODS} or a '
                                 f'list of boundaries, got {method!r}.')
    shapes = fields.BodyInputShapes(p)
    if shapes is None:
        raise errors.ConfigError(f'partition_method={method!r} needs input_shapes (the shapes '
                                 'of one mini-batch of inputs) to estimate layer costs.')
    try:
        _, metas = sequential.ChainMeta(layers, *shapes)
    except ValueError as e:  # A layer that cannot take its predecessor's output.
        raise errors.ConfigError(f'{p.name}: the layers do not chain: {e}') from None
    if method == 'time':
        if layer_costs is None:
            raise errors.ConfigError(
                f"{p.name}: partition_method='time' partitions on the layers' measured costs, "
                'which a plan does not measure: set partition_method to the boundaries '
                '`perf.measured_costs.TimedBoundaries(p)` measures (the trainer does so before '
                'it builds the model), or pass the costs to `plan.MakePlan(layer_costs=...)`.')
        if len(layer_costs) != num_layers:
            raise errors.ConfigError(f'{p.name}: layer_costs has {len(layer_costs)} costs for '
                                     f'{num_layers} layers: expected one per layer.')
        costs = list(layer_costs)
    else:
        costs = [m.flops if method == 'flops' else m.num_params for m in metas]
    return partition.OptimalBoundaries(costs, num_cells)


def _CheckCellsFit(p, cell_layers: list) -> list[LayerMeta] | None:
    """FPropMeta of every cell, checking each cell's output fits the next cell's input."""
    shapes = fields.BodyInputShapes(p)
    if shapes is None:
        return None
    metas = []
    for k, layers in enumerate(cell_layers):
        try:
            meta, _ = sequential.ChainMeta(layers, *shapes)
        except ValueError as e:
            if k == 0:
                raise errors.ConfigError(f'{p.name}: cell 0 ({_Names(layers)}) does not accept '
                                         f'the pipeline input {shapes}: {e}') from None
            raise errors.ConfigError(
                f'{p.name}: cell {k - 1} ({_Names(cell_layers[k - 1])}) outputs '
                f'{shapes}, which cell {k} ({_Names(layers)}) cannot take: {e}') from None
        metas.append(meta)
        shapes = base_layer.AsArgs(meta.out_shapes)
    return metas


def _Names(layers: list) -> str:
    return ', '.join(lp.name for lp in layers)
