"""PipeliningLayer: GPipe's partitioned, micro-batched, re-materialized layer stack.

The layers are partitioned into K cells, each built and run under a device of its own. A mini-batch
is split into M micro-batches; the forward schedule (`schedule.ForwardTicks`) is unrolled into the
graph, so cell k works on micro-batch t - k at tick t and K devices work at once. The backward is
built explicitly by walking `schedule.BackwardTicks`: every cell's backward (and its recompute) runs
under that cell's device, and each cell's weight gradients are summed over the M micro-batches on
that device. The result, outputs and gradients, equals the same layers run un-partitioned.
"""

from __future__ import annotations

import contextlib
import inspect

import tensorflow as tf
from absl import logging

from gpipe_tf import errors
from gpipe_tf import hyperparams
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import sequential
from gpipe_tf.layers.base_layer import BaseLayer, LayerMeta
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline import executor
from gpipe_tf.pipeline import microbatch
from gpipe_tf.pipeline import partition
from gpipe_tf.pipeline import recompute

RECOMPUTE_MODES = ('always', 'except_last', 'never')
PARTITION_METHODS = ('flops', 'params', 'uniform')


def DefaultDevices() -> list[str]:
    """The logical accelerators present (GPUs, else TPUs, else CPUs)."""
    for kind in ('GPU', 'TPU', 'CPU'):
        devices = tf.config.list_logical_devices(kind)
        if devices:
            return [d.name for d in devices]
    return ['/device:CPU:0']


def MeshDevices(devices, num_replicas: int, num_cells: int,
                round_robin: bool = True) -> list[list[str]]:
    """Device string of each (replica, stage): R lists of K.

    Args:
      devices: None (the logical devices present), a flat list of device strings (replica r's
        stage k takes entry r * K + k), a list of R lists of K, or a function of
        (replica, stage) returning a device string (of the stage alone when R is 1).
      num_replicas: R, the pipelines run side by side for data parallelism.
      num_cells: K.
      round_robin: whether stages may share devices when a flat list has fewer than R * K.

    Raises:
      ValueError: for too few devices without round_robin, or a nested list that is not R x K.
    """
    if num_replicas < 1:
        raise errors.ConfigError(f'num_replicas must be >= 1, got {num_replicas}.')
    if callable(devices):
        if len(inspect.signature(devices).parameters) >= 2:
            return [[devices(r, k) for k in range(num_cells)] for r in range(num_replicas)]
        if num_replicas > 1:
            raise errors.ConfigError(f'With {num_replicas} replicas, devices must be a function of '
                             '(replica, stage); this one takes the stage only.')
        return [[devices(k) for k in range(num_cells)]]
    if devices and isinstance(devices[0], (list, tuple)):
        if len(devices) != num_replicas or any(len(row) != num_cells for row in devices):
            raise errors.ConfigError(f'A nested devices list must be {num_replicas} replicas x '
                             f'{num_cells} stages, got {[len(row) for row in devices]}.')
        return [list(row) for row in devices]
    available = list(devices) if devices else DefaultDevices()
    needed = num_replicas * num_cells
    if len(available) < needed and not round_robin:
        raise errors.ConfigError(f'{num_replicas} replicas of {num_cells} cells need {needed} devices, '
                         f'but only {len(available)} were given ({available}) and round_robin '
                         'is off.')
    return [[available[(r * num_cells + k) % len(available)] for k in range(num_cells)]
            for r in range(num_replicas)]


# Device types a string is checked for even when none is present (a GPU asked for on a machine
# without one); other types (TPU_REPLICATED_CORE, which tpu.rewrite maps to cores) only when
# TensorFlow lists devices of the type.
_CHECKED_DEVICE_TYPES = ('CPU', 'GPU', 'TPU')


def CheckDevices(mesh: list[list[str]], available: list[str] | None = None) -> None:
    """Raises unless every device of `mesh` that names one device is present.

    TensorFlow's soft placement would silently run a missing device's ops elsewhere (on CPU:0):
    the numbers would be right, the placement not the one asked for.

    A device string is checked when it names a device type (CPU, GPU, TPU, or a type among the
    available devices) and an index. Empty strings, wildcards and unparsable strings are left to
    TensorFlow.

    Args:
      mesh: the device of each (replica, stage), R lists of K (`MeshDevices`).
      available: names of the devices present; default: this process's logical devices
        (`tf.config.list_logical_devices()`), against which only local strings (no job, or job
        `localhost`) are checked: another job's devices belong to a cluster. Given (a cluster's
        devices, say), every string is checked, and a job, replica or task it names must match.

    Raises:
      errors.ConfigError (a ValueError): naming the first missing device, its stage and
        replica, and the devices present.
    """
    local = available is None
    present, kinds = None, set()
    for r, row in enumerate(mesh):
        for k, device in enumerate(row):
            try:
                spec = tf.DeviceSpec.from_string(device or '')
            except ValueError:
                continue
            if spec.device_type is None or spec.device_index is None:
                continue
            if local and spec.job not in (None, 'localhost'):
                continue
            if present is None:  # Listing initialises TF's devices: only when there is a need.
                names = ([d.name for d in tf.config.list_logical_devices()] if local
                         else list(available))
                present = [(name, tf.DeviceSpec.from_string(name)) for name in names]
                kinds = set(_CHECKED_DEVICE_TYPES) | {
                    p.device_type.upper() for _, p in present if p.device_type}
            if spec.device_type.upper() not in kinds:
                continue
            if not any(_SameDevice(spec, p) for _, p in present):
                where = ('is not a device of this process; devices present' if local else
                         'is not among the devices available')
                raise errors.ConfigError(
                    f'PipeliningLayer devices: {device} (stage {k} of replica {r}) {where}: '
                    f'{", ".join(name for name, _ in present) or "none"}.')


def _SameDevice(wanted: tf.DeviceSpec, present: tf.DeviceSpec) -> bool:
    """Whether `present` is the device `wanted` names; a field either leaves unset matches."""
    if (wanted.device_type.upper() != (present.device_type or '').upper() or
            wanted.device_index != present.device_index):
        return False
    return all(a is None or b is None or a == b for a, b in (
        (wanted.job, present.job), (wanted.replica, present.replica),
        (wanted.task, present.task)))


def StageDevices(devices, num_cells: int, round_robin: bool = True) -> list[str]:
    """Device string of each of the K stages of the first replica (see `MeshDevices`)."""
    return MeshDevices(devices, 1, num_cells, round_robin)[0]


def _ToShapes(shapes):
    """Params-friendly shapes (lists of ints, dicts of them) as TensorShapes / NestedMaps."""
    if isinstance(shapes, dict):
        return NestedMap({k: _ToShapes(v) for k, v in shapes.items()})
    return tf.TensorShape(shapes)


def _LayerName(p, index: int) -> str:
    return p.name or f'layer_{index:03d}'


class PipeliningLayer(BaseLayer):
    """Runs a sequence of layers as a GPipe pipeline of K cells over M micro-batches."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('cell_tpl', None,
                 'Explicit cells: a list of K entries, each a layer Params or a list of them.')
        p.Define('layer_tpl', None,
                 'A flat list of layer Params, partitioned into num_cells cells automatically.')
        p.Define('num_cells', 1, 'K, the number of cells when partitioning layer_tpl.',
                 check=hyperparams.Integer(at_least=1))
        p.Define('before_tpl', [], 'Layer Params run ahead of the pipeline on the first device.')
        p.Define('num_micro_batches', None,
                 'M, the number of micro-batches per mini-batch; None: 1, unless '
                 'micro_batch_size is set.',
                 check=hyperparams.OrNone(hyperparams.Integer(at_least=1)))
        p.Define('micro_batch_size', None,
                 'Size of a micro-batch, instead of num_micro_batches: M = batch size / '
                 'micro_batch_size.', check=hyperparams.OrNone(hyperparams.Integer(at_least=1)))
        p.Define('batch_dim', 0, 'The batch dimension of every input and output.')
        p.Define('num_replicas', 1,
                 'R, pipelines run side by side on shards of the mini-batch (data parallelism); '
                 'their gradients are summed on the variables\' devices before the update.',
                 check=hyperparams.Integer(at_least=1))
        p.Define('devices', None,
                 'Device of each (replica, stage): None (logical devices present), a flat list '
                 '(replica r, stage k: entry r * K + k), R lists of K, or a function of '
                 '(replica, stage) (of the stage alone when num_replicas is 1).')
        p.Define('logical_device_fn', None,
                 'None, or a function (tensor, k) -> tensor assigning a tensor to logical device '
                 'k of the replica, for XLA model parallelism (TF2 TPU: '
                 'gpipe_tf.train.tpu.AssignToLogicalDevice). Cell k\'s parameters, inputs, '
                 'outputs and gradients are assigned to logical device k, and under a '
                 'TPUStrategy its variables are created there. Give devices too '
                 '(tpu.CoreDevices(K) on a TPU) to place every op of the cell; they default to '
                 '"" (no device scope). Graph mode only (a tf.function or strategy.run); the '
                 'replicas are the strategy\'s, so num_replicas stays 1.')
        p.Define('round_robin', True,
                 'Whether stages share devices round-robin when there are fewer devices than K.')
        p.Define('recompute', 'always',
                 f'Re-materialization: {RECOMPUTE_MODES} ("except_last" keeps the last cell\'s '
                 'activations, which backprop needs first).')
        p.Define('partition_method', 'flops',
                 f'How layer_tpl is split: one of {PARTITION_METHODS}, or explicit boundaries '
                 '[0, b_1, ..., L] (cell k holds layers b_k .. b_{k+1} - 1).')
        p.Define('input_shapes', None,
                 'Shapes of the inputs for one mini-batch (list of ints per input, or a dict of '
                 'them for a NestedMap input); needed by the flops/params partitioners and to '
                 'check that adjacent cells fit together.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.p
        if p.recompute not in RECOMPUTE_MODES:
            raise errors.ConfigError(f'recompute must be one of {RECOMPUTE_MODES}, got {p.recompute!r}.')
        if p.logical_device_fn is not None and p.num_replicas != 1:
            raise errors.ConfigError(f'With logical_device_fn the replicas are the strategy\'s: '
                             f'num_replicas must be 1, got {p.num_replicas}.')
        cell_layers, self._cell_metas = self.PlanCells(p)
        self._num_cells = len(cell_layers)
        devices = p.devices
        if devices is None and p.logical_device_fn is not None:
            devices = [''] * self._num_cells  # The strategy's replica device; XLA places cells.
        self._mesh = MeshDevices(devices, p.num_replicas, self._num_cells, p.round_robin)
        if p.logical_device_fn is None:  # With it, a strategy places the cells.
            CheckDevices(self._mesh)
        self._devices = self._mesh[0]  # The variables live on the first replica's devices.
        with tf.device(self._devices[0]):
            self._before = [self.CreateChild(_LayerName(lp, i), lp)
                            for i, lp in enumerate(p.before_tpl)]
        self._cells = []
        for k, layers in enumerate(cell_layers):
            with tf.device(self._devices[k]), self._LogicalDeviceScope(k):
                self._cells.append(self.CreateChild(
                    f'cell_{k}', sequential.SequentialLayer.Params().Set(sub=layers)))
        self._replica_functions = [
            [recompute.CellFunctions(cell, device) for cell, device in zip(self._cells, row)]
            for row in self._mesh]
        self._functions = self._replica_functions[0]
        logging.info('%s partition:\n%s', self.path, self.PartitionReport())

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def PlanCells(cls, p) -> tuple[list[list], list[LayerMeta] | None]:
        """From Params alone: each cell's layer Params, and each cell's FPropMeta (None without
        input_shapes). No variable is built, no TF op created.

        Raises:
          ValueError: for inconsistent cells, partitions or shapes (see Params).
        """
        cells = cls._CellLayerParams(p)
        return cells, cls._CheckCellsFit(p, cells)

    @staticmethod
    def InputShapes(p) -> tuple | None:
        """`p.input_shapes` as a tuple of TensorShapes (NestedMaps of them), or None."""
        shapes = p.input_shapes
        if shapes is None:
            return None
        if isinstance(shapes, dict) or (shapes and isinstance(shapes[0], int)):
            return (_ToShapes(shapes),)
        return tuple(_ToShapes(s) for s in shapes)

    @classmethod
    def _BodyInputShapes(cls, p) -> tuple | None:
        shapes = cls.InputShapes(p)
        if shapes is None or not p.before_tpl:
            return shapes
        meta, _ = sequential.ChainMeta(p.before_tpl, *shapes)
        return base_layer.AsArgs(meta.out_shapes)

    @classmethod
    def _CellLayerParams(cls, p) -> list[list]:
        """Names the layers and splits them into cells."""
        if (p.cell_tpl is None) == (p.layer_tpl is None):
            raise errors.ConfigError('Set exactly one of cell_tpl (explicit cells) and layer_tpl (layers '
                             'to partition into num_cells).')
        if p.cell_tpl is not None:
            if not p.cell_tpl:
                raise errors.ConfigError('cell_tpl is empty: expected at least one cell.')
            cells = [list(c) if isinstance(c, (list, tuple)) else [c] for c in p.cell_tpl]
            index, named = 0, []
            for cell in cells:
                named.append([lp.Copy().Set(name=_LayerName(lp, index + i))
                              for i, lp in enumerate(cell)])
                index += len(cell)
            return named
        layers = [lp.Copy().Set(name=_LayerName(lp, i)) for i, lp in enumerate(p.layer_tpl)]
        boundaries = cls._Boundaries(p, layers)
        return [layers[boundaries[k]:boundaries[k + 1]] for k in range(len(boundaries) - 1)]

    @classmethod
    def _Boundaries(cls, p, layers: list) -> list[int]:
        num_layers, num_cells = len(layers), p.num_cells
        if num_cells > num_layers:
            raise errors.ConfigError(f'num_cells ({num_cells}) is larger than the number of layers '
                             f'({num_layers}).')
        method = p.partition_method
        if isinstance(method, (list, tuple)):
            return partition.CheckBoundaries(method, num_layers, num_cells)
        if method == 'uniform':
            return partition.UniformBoundaries(num_layers, num_cells)
        if method not in PARTITION_METHODS:
            raise errors.ConfigError(f'partition_method must be one of {PARTITION_METHODS} or a list of '
                             f'boundaries, got {method!r}.')
        shapes = cls._BodyInputShapes(p)
        if shapes is None:
            raise errors.ConfigError(f'partition_method={method!r} needs input_shapes (the shapes of '
                             'one mini-batch of inputs) to estimate layer costs.')
        _, metas = sequential.ChainMeta(layers, *shapes)
        costs = [m.flops if method == 'flops' else m.num_params for m in metas]
        return partition.OptimalBoundaries(costs, num_cells)

    @classmethod
    def _CheckCellsFit(cls, p, cell_layers: list) -> list[LayerMeta] | None:
        """FPropMeta of every cell, checking each cell's output fits the next cell's input."""
        shapes = cls._BodyInputShapes(p)
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

    # ---- introspection ----------------------------------------------------------------------
    @property
    def num_cells(self) -> int:
        return self._num_cells

    @property
    def devices(self) -> list[str]:
        """The device of each cell."""
        return list(self._devices)

    @property
    def cells(self) -> list:
        return list(self._cells)

    @property
    def mesh(self) -> list[list[str]]:
        """The device of each (replica, stage)."""
        return [list(row) for row in self._mesh]

    @property
    def cell_functions(self) -> list:
        """Each cell's traced forward/backward functions."""
        return list(self._functions)

    @property
    def theta(self) -> NestedMap:
        """Variable values, each cell's read on the cell's device."""
        theta = NestedMap()
        with tf.device(self._devices[0]):
            for layer in self._before:
                theta[layer.p.name] = layer.theta
        for k, cell in enumerate(self._cells):
            with tf.device(self._devices[k]), tf.name_scope(f'cell_{k}_theta'):
                theta[f'cell_{k}'] = cell.theta
        return theta

    def Layers(self) -> list:
        """Every layer, in the order the pipeline applies them (before_tpl layers first)."""
        return self._before + [layer for cell in self._cells for layer in cell.sequence]

    def PartitionReport(self) -> str:
        """A table: per cell its device, layers, FLOPs, parameters and activation bytes."""
        rows = []
        for k, cell in enumerate(self._cells):
            meta = self._cell_metas[k] if self._cell_metas else None
            rows.append(partition.ReportRow(
                cell=k, device=self._devices[k], layers=[l.p.name for l in cell.sequence],
                flops=meta.flops if meta else None,
                num_params=meta.num_params if meta else sum(
                    int(v.shape.num_elements()) for v in cell.variables),
                activation_bytes=meta.activation_bytes if meta else None))
        return partition.FormatReport(rows)

    # ---- computation ----------------------------------------------------------------------
    def FProp(self, theta, *inputs):
        p = self.p
        with tf.device(self._devices[0]):
            args = inputs
            for layer in self._before:
                args = base_layer.AsArgs(layer.FProp(theta[layer.p.name], *args))
        inputs = args[0] if len(args) == 1 else args
        batch_size = microbatch.BatchSize(inputs, p.batch_dim)
        if batch_size is None:
            raise errors.ConfigError(f'{self.path}: the batch dimension {p.batch_dim} of the inputs must '
                             'be statically known to split micro-batches.')
        num_replicas = p.num_replicas
        if batch_size % num_replicas:
            raise errors.ConfigError(f'{self.path}: batch size {batch_size} is not divisible by '
                             f'num_replicas ({num_replicas}).')
        num_micro_batches = microbatch.NumMicroBatches(
            batch_size // num_replicas, p.num_micro_batches, p.micro_batch_size)
        ctx = fprop_context.Current()
        recomputes = [self._Recomputes(k) for k in range(self._num_cells)]
        assign = self._LogicalDeviceFn()
        runs = [executor.UnrolledSchedule(functions, recomputes, num_micro_batches, p.batch_dim,
                                          tf.cast(ctx.step, tf.int64), assign)
                for functions in self._replica_functions]
        thetas = []
        for k in range(self._num_cells):
            with tf.name_scope(f'cell_{k}_theta'):
                thetas.append(executor.AssignNest(assign, k, theta[f'cell_{k}']))
        if not ctx.training:  # Forward only, micro-batched, no re-materialization.
            return self._Replicated(
                lambda r, shard: runs[r].Forward(thetas, shard, training=False)[0], inputs)
        outputs, updates = self._Train(runs, thetas, inputs)
        replica_context = tf.distribute.get_replica_context()
        if (replica_context is not None and replica_context.num_replicas_in_sync > 1 and
                tf.nest.flatten(updates)):
            # Under a tf.distribute strategy (the TPU path), each replica has summed its
            # shard's statistics; their sum is the global batch's, as with in-graph replicas.
            updates = replica_context.all_reduce(tf.distribute.ReduceOp.SUM, updates)
        for k, cell_updates in enumerate(updates):
            with tf.device(self._devices[k]), tf.name_scope(f'cell_{k}_update'):
                for layer, stats in zip(self._functions[k].update_layers or [], cell_updates):
                    layer.AddUpdate(stats)
        return outputs

    def _LogicalDeviceScope(self, k: int):
        """Where cell k's variables are created: with logical_device_fn, under a strategy that
        places variables by logical device (a TPUStrategy's
        `extended.experimental_logical_device`), on logical device k; else no extra scope."""
        if self.p.logical_device_fn is None:
            return contextlib.nullcontext()
        scope = getattr(tf.distribute.get_strategy().extended, 'experimental_logical_device',
                        None)
        return scope(k) if scope is not None else contextlib.nullcontext()

    def _LogicalDeviceFn(self):
        """`p.logical_device_fn`, checked to be usable here (it annotates graph tensors)."""
        fn = self.p.logical_device_fn
        if fn is not None and tf.executing_eagerly():
            raise errors.ConfigError(f'{self.path}: logical_device_fn annotates graph tensors; call the '
                             'layer inside a tf.function (or strategy.run), not eagerly.')
        return fn

    def _ReplicaScope(self, r: int):
        """Replica r's name scope; none with one replica, so op names stay `cell_<k>_mb_<m>_*`."""
        return tf.name_scope(f'replica_{r}') if self.p.num_replicas > 1 else contextlib.nullcontext()

    def _Replicated(self, fn, inputs):
        """Concatenation over replicas of `fn(r, replica r's shard of inputs)`; with one
        replica, `fn(0, inputs)`."""
        num_replicas, batch_dim = self.p.num_replicas, self.p.batch_dim
        if num_replicas == 1:
            return fn(0, inputs)
        with tf.device(self._devices[0]):
            shards = microbatch.Split(inputs, num_replicas, batch_dim)
        outputs = []
        for r, shard in enumerate(shards):
            with self._ReplicaScope(r):
                outputs.append(fn(r, shard))
        with tf.device(self._devices[-1]):
            return microbatch.Concat(outputs, batch_dim)

    def _Recomputes(self, k: int) -> bool:
        mode = self.p.recompute
        return mode == 'always' or (mode == 'except_last' and k < self._num_cells - 1)

    def _Train(self, runs: list, thetas: list, inputs):
        """The unrolled step of every replica as one custom-gradient op, so that its backward is
        ours: built per cell under the cell's device, in the schedule's order. With R replicas,
        each cell's weight gradient is the sum of the replicas', taken on the device of the
        variables (replica 0's): an in-graph all-reduce whose broadcast is the next step's read.

        Returns:
          (outputs, per cell its layers' training statistics summed over micro-batches and
          replicas).
        """
        theta_sizes = [len(tf.nest.flatten(t)) for t in thetas]
        num_replicas, batch_dim = self.p.num_replicas, self.p.batch_dim
        results = []

        @tf.custom_gradient
        def Pipeline(*flat):
            thetas_in, offset = [], 0
            for theta, size in zip(thetas, theta_sizes):
                thetas_in.append(tf.nest.pack_sequence_as(theta, flat[offset:offset + size]))
                offset += size
            replica_updates = []

            def Forward(r, shard):
                outputs, updates = runs[r].Forward(thetas_in, shard)
                replica_updates.append(updates)
                return outputs

            outputs = self._Replicated(Forward, tf.nest.pack_sequence_as(inputs, flat[offset:]))
            results.append((outputs, self._SumOverReplicas(replica_updates)))

            def Grad(*d_flat):
                d_outputs = tf.nest.pack_sequence_as(outputs, _FloatGrads(outputs, d_flat))
                replica_d_thetas = []

                def Backward(r, d_shard):
                    d_thetas, d_inputs = runs[r].Backward(d_shard)
                    replica_d_thetas.append(d_thetas)
                    return d_inputs

                if num_replicas == 1:
                    d_inputs = Backward(0, d_outputs)
                else:
                    with tf.device(self._devices[-1]):
                        d_shards = microbatch.Split(d_outputs, num_replicas, batch_dim)
                    d_inputs = []
                    for r, d_shard in enumerate(d_shards):
                        with self._ReplicaScope(r):
                            d_inputs.append(Backward(r, d_shard))
                    with tf.device(self._devices[0]):
                        d_inputs = microbatch.Concat(d_inputs, batch_dim)
                d_thetas = self._SumOverReplicas(replica_d_thetas)
                return [g for cell in d_thetas for g in cell] + tf.nest.flatten(d_inputs)

            return tf.nest.flatten(outputs), Grad

        flat_outputs = Pipeline(*[t for theta in thetas for t in tf.nest.flatten(theta)],
                                *tf.nest.flatten(inputs))
        outputs, updates = results[0]
        return tf.nest.pack_sequence_as(outputs, list(flat_outputs)), updates

    def _SumOverReplicas(self, per_replica: list) -> list:
        """Per cell, the sum over replicas (on the cell's variables' device) of a per-replica
        list of per-cell nests; None leaves stay None."""
        if len(per_replica) == 1:
            return per_replica[0]
        summed = []
        for k, cells in enumerate(zip(*per_replica)):
            with tf.device(self._devices[k]), tf.name_scope(f'cell_{k}_replica_sum'):
                summed.append(tf.nest.map_structure(
                    lambda *xs: None if xs[0] is None else tf.add_n(list(xs)), *cells))
        return summed

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        layers = list(p.before_tpl)
        if p.cell_tpl is not None:
            for c in p.cell_tpl:
                layers += list(c) if isinstance(c, (list, tuple)) else [c]
        else:
            layers += list(p.layer_tpl or [])
        layers = [lp.Copy().Set(name=_LayerName(lp, i)) for i, lp in enumerate(layers)]
        return sequential.ChainMeta(layers, *input_shapes)[0]


def _Names(layers: list) -> str:
    return ', '.join(lp.name for lp in layers)


def _FloatGrads(outputs, d_flat) -> list:
    """Incoming gradients with zeros where none arrived (unused outputs)."""
    return [d if d is not None or not recompute.IsFloat(y) else tf.zeros_like(y)
            for y, d in zip(tf.nest.flatten(outputs), d_flat)]

