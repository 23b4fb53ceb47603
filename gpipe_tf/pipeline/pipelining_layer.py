"""PipeliningLayer: GPipe's partitioned, micro-batched, re-materialized layer stack.

The layers are partitioned into K cells (v K with v virtual stages per device), each built and run
under a device of its own. A mini-batch is split into M micro-batches, and the schedule
(`schedule.Make(p.schedule, K, M, v)`: per device, its ordered forwards and backwards) is compiled
into the graph by an `executor.Executor` (`unrolled.UnrolledSchedule`, or
`looped.LoopedSchedule` from many cell calls): every cell's forward and backward (and its
recompute) runs under that cell's device, and each cell's weight gradients are summed over the M
micro-batches on that device. With R replicas each runs its own executor on its shard of the
batch, and the training step is one custom-gradient op over all of them (`replicas`). The
result, outputs and gradients, equals the same layers run un-partitioned, whatever the schedule.

With gpipe (fill-drain) the loss may be computed after the pipeline (`FProp`); the other schedules
start backwards before the last forward, so the loss is computed per micro-batch on the last stage
(`FPropLoss`).
"""

from __future__ import annotations

import contextlib
import numbers

import tensorflow as tf
from absl import logging

from gpipe_tf import errors
from gpipe_tf import hyperparams
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import precision
from gpipe_tf.layers import sequential
from gpipe_tf.layers import tied_weights
from gpipe_tf.layers.base_layer import BaseLayer
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline import cell as cell_lib
from gpipe_tf.pipeline import devices as devices_lib
from gpipe_tf.pipeline import executor
from gpipe_tf.pipeline import fields
from gpipe_tf.pipeline import looped
from gpipe_tf.pipeline import microbatch
from gpipe_tf.pipeline import partition
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.pipeline import replicas
from gpipe_tf.pipeline import schedule as schedule_lib
from gpipe_tf.pipeline import unrolled

# A method's name, or boundaries (which the plan checks against the layers and cells).
_PARTITION_METHOD = hyperparams.Check(
    lambda v: v in plan_lib.PARTITION_METHODS if isinstance(v, str) else (
        isinstance(v, (list, tuple)) and
        all(isinstance(b, int) and not isinstance(b, bool) for b in v)),
    f'one of {plan_lib.PARTITION_METHODS} or a list of layer indices [0, b_1, ..., L]')


def _LossAfterKinds() -> str:
    """The kinds whose loss may follow the pipeline, for help texts."""
    return ' and '.join(kind.name for kind in schedule_lib.SCHEDULE_KINDS.values()
                        if not kind.loss_inside_pipeline)


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
                 '(replica, stage) (of the stage alone when num_replicas is 1). Each device is '
                 'a string, a tf.config.LogicalDevice or a tf.DeviceSpec.')
        p.Define('logical_device_fn', None,
                 'None, or a function (tensor, k) -> tensor assigning a tensor to logical device '
                 'k of the replica, for XLA model parallelism (TF2 TPU: '
                 'gpipe_tf.train.tpu.AssignToLogicalDevice). Cell k\'s parameters, inputs, '
                 'outputs and gradients are assigned to its device in the schedule (k, or k '
                 'mod K with virtual_stages), and under a TPUStrategy its variables are created '
                 'there. Give devices too '
                 '(tpu.CoreDevices(K) on a TPU) to place every op of the cell; they default to '
                 '"" (no device scope). Graph mode only (a tf.function or strategy.run); the '
                 'replicas are the strategy\'s, so num_replicas stays 1.')
        p.Define('round_robin', None,
                 'Whether stages share devices round-robin when there are fewer devices than R '
                 'x K: None (the default) shares the devices present (with a warning) and a '
                 'devices list of one, and refuses a longer list shorter than R x K; True '
                 'shares any; False none.',
                 check=hyperparams.OneOf(None, True, False))
        p.Define('recompute', 'always',
                 'Re-materialization: "always" (every cell re-runs its forward in its '
                 'backward), "never" (every cell keeps its activations), "except_last" (the '
                 'last cell keeps them: backprop needs them first) or "except_last_<j>" (the '
                 'last j cells keep them, the others re-materialize; 0 <= j <= num_cells x '
                 'virtual_stages).')
        p.Define('schedule', schedule_lib.DEFAULT_KIND,
                 f'The pipeline schedule, one of {schedule_lib.KINDS}: '
                 f'{schedule_lib.KindsHelp()}. All but {_LossAfterKinds()} need the loss per '
                 'micro-batch inside the pipeline (FPropLoss; tasks do this).')
        p.Define('virtual_stages', 1,
                 'v, cells per device for interleaved_1f1b: the layers are partitioned into '
                 'v x num_cells cells, cell s on device s % num_cells (zero_bubble_v: 2, in a '
                 'V).',
                 check=hyperparams.Integer(at_least=1))
        p.Define('unroll', 'auto',
                 'True: the schedule is unrolled into the graph (v K M calls of the cells); '
                 'False: it runs as a loop over its clock, whose graph does not grow with M '
                 '(any recompute mode; a logical_device_fn is a ConfigError); '
                 f'"auto": a loop from {executor.LOOP_FROM_CELL_CALLS} cell calls (v K M), '
                 'where the unrolled graph takes long to optimize, else unrolled (its steps '
                 'are as fast or faster).', check=hyperparams.OneOf(*plan_lib.UNROLL_MODES))
        p.Define('partition_method', 'flops',
                 f'How layer_tpl is split: one of {plan_lib.PARTITION_METHODS}, or explicit '
                 'boundaries [0, b_1, ..., L] (cell k holds layers b_k .. b_{k+1} - 1). "time" '
                 'measures each layer\'s training forward and backward on one micro-batch on the '
                 'first cell\'s device and balances their sum; its caller measures (the trainer, '
                 'or perf.measured_costs.TimedBoundaries(p), whose boundaries the layer takes).',
                 check=_PARTITION_METHOD)
        p.Define('input_shapes', None,
                 'Shapes of the inputs for one mini-batch (list of ints per input, or a dict of '
                 'them for a NestedMap input); needed by the flops/params/time partitioners and '
                 'to check that adjacent cells fit together.')
        p.Define('input_dtypes', None,
                 'Dtypes of the inputs (partition_method="time" synthesizes a micro-batch of '
                 'them): None (float32), one dtype name for every input, or a dict of names '
                 'by key for a NestedMap input (missing keys: float32).')
        p.Define('tied_weights', [], tied_weights.PARAM_HELP + ' Across cells the consumer '
                 'reads the variable on the producer\'s cell\'s device.')
        p.Define('costs_file', None,
                 'partition_method="time": a JSON file that keeps measured layer costs, so a '
                 'second run does not measure again (the trainer uses <logdir>/layer_costs.json);'
                 ' None keeps them for the process only.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.p
        self.plan = plan_lib.MakePlan(p, check_devices=True)
        # The variables live on the first replica's devices.
        self._devices = self.plan.mesh[0]
        shared = (devices_lib.SharedDevices([row[:self.plan.num_devices]
                                             for row in self.plan.mesh])
                  if p.devices is None and p.logical_device_fn is None else None)
        if shared:
            logging.warning('%s: %s', self.path, shared)
        with tf.device(self._devices[0]):
            self._before = [self.CreateChild(lp.name, lp) for lp in self.plan.before]
        # The layers are this layer's children, named by their place in the model; a cell only
        # groups them (`cell.Cell`), so names, checkpoint keys and seeds do not depend on K.
        cells = []
        for k, layers in enumerate(self.plan.cells):
            with tf.device(self._devices[k]), self._LogicalDeviceScope(k):
                cells.append(cell_lib.Cell([self.CreateChild(lp.name, lp) for lp in layers],
                                           f'{self.path}.cell_{k}'))
        self._cells = tuple(cells)
        tied_weights.Apply(self.Layers(), p.tied_weights, self.path)
        traced = {}  # Cells of one structure, and the replicas, share traced functions.
        self._replica_functions = [
            [cell_lib.CellFunctions(cell, device, p.batch_dim, traced)
             for cell, device in zip(self._cells, row)]
            for row in self.plan.mesh]
        self._functions = self._replica_functions[0]
        logging.info('%s partition:\n%s', self.path, self.PartitionReport())

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def UnpipelinedParams(cls, p):
        """The same model without the pipeline: a SequentialLayer of the same name over the same
        (named) layers, before_tpl first. Its variables have the pipeline's names, checkpoint keys
        and initial values, so a pipeline's checkpoint restores into it and back (to evaluate or
        export on one device, say)."""
        plan = plan_lib.MakePlan(p, place=False)
        return sequential.SequentialLayer.Params().Set(
            name=p.name, dtype=p.dtype, fprop_dtype=p.fprop_dtype,
            params_init=p.params_init.Copy(),
            random_seed=p.random_seed,
            sub=plan.before + [lp for layers in plan.cells for lp in layers],
            tied_weights=[list(tie) for tie in p.tied_weights])

    # ---- introspection ----------------------------------------------------------------------
    @property
    def num_cells(self) -> int:
        return self.plan.num_cells

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
        return [list(row) for row in self.plan.mesh]

    @property
    def cell_functions(self) -> list:
        """Each cell's traced forward/backward functions."""
        return list(self._functions)

    @property
    def theta(self) -> NestedMap:
        """Variable values keyed by layer name, like `vars`; each cell's read on the cell's
        device."""
        theta = NestedMap()
        with tf.device(self._devices[0]):
            for layer in self._before:
                theta[layer.p.name] = layer.theta
        for k, cell in enumerate(self._cells):
            with tf.device(self._devices[k]), tf.name_scope(f'cell_{k}_theta'):
                for layer in cell.sequence:
                    theta[layer.p.name] = layer.theta
        return theta

    def CellTheta(self, k: int) -> NestedMap:
        """Cell k's theta, as its `cell_functions[k]` take it (its layers' variable values,
        read on its device)."""
        with tf.device(self._devices[k]), tf.name_scope(f'cell_{k}_theta'):
            return self._cells[k].Theta(self.theta)

    def Layers(self) -> list:
        """Every layer, in the order the pipeline applies them (before_tpl layers first)."""
        return self._before + [layer for cell in self._cells for layer in cell.sequence]

    def PartitionReport(self) -> str:
        """A table: per cell its device, layers, FLOPs, parameters and activation bytes."""
        rows = []
        for k, cell in enumerate(self._cells):
            meta = self.plan.metas[k] if self.plan.metas else None
            rows.append(partition.ReportRow(
                cell=k, device=self._devices[k], layers=[l.p.name for l in cell.sequence],
                flops=meta.flops if meta else None,
                num_params=meta.num_params if meta else sum(
                    int(v.shape.num_elements()) for v in cell.variables),
                activation_bytes=meta.activation_bytes if meta else None))
        return partition.FormatReport(rows)

    # ---- computation ----------------------------------------------------------------------
    def FProp(self, theta, *inputs):
        """The pipeline's outputs; in training, its backward is built by the schedule. A
        schedule that starts backwards before the last forward (all but gpipe) needs the loss
        inside the pipeline: train it with `FPropLoss`."""
        ctx = fprop_context.Current()
        inputs, runs, thetas = self._Prepare(theta, inputs, ctx.training)
        if not ctx.training:
            return self._Infer(runs, thetas, inputs)
        if not runs[0].schedule.forward_first:
            raise errors.ConfigError(
                f'{self.path}: schedule {self.p.schedule!r} runs backwards before the last '
                'forward, so the loss must be computed per micro-batch inside the pipeline: '
                'train with FPropLoss(theta, inputs, loss_fn) (tasks do), or use '
                'schedule="gpipe".')
        outputs, updates = replicas.Train(runs, thetas, inputs, self._devices,
                                          self.p.batch_dim)
        self._ApplyUpdates(updates)
        return outputs

    def FPropLoss(self, theta, inputs, loss_fn, loss_inputs=None):
        """The pipeline with its loss computed per micro-batch on the last stage, as soon as
        each micro-batch's forward is done: what every schedule can run (1f1b, interleaved and
        zero-bubble need it). With a `fprop_context` loss_scale (float16), the backward runs on
        the gradients of the loss times it; the loss's gradients come out as usual.

        Args:
          theta: the layer's theta.
          inputs: the pipeline's input (one tensor or nest).
          loss_fn: (outputs, loss_inputs) of a micro-batch (or, in inference, of the whole
            batch) -> (value, weight), a mean over `weight` items: a task's `loss` metric.
          loss_inputs: a nest split along batch_dim with the inputs, for loss_fn (labels,
            example weights); or None.

        Returns:
          (outputs, loss, weight): the outputs, through which no gradient flows back (use the
          loss); loss = sum over micro-batches of value * weight / sum of weight, whose
          gradients equal those of loss_fn applied to the whole batch's outputs; the weight.
        """
        ctx = fprop_context.Current()
        inputs, runs, thetas = self._Prepare(theta, (inputs,), ctx.training)
        if not ctx.training:
            outputs = self._Infer(runs, thetas, inputs)
            value, weight = loss_fn(outputs, loss_inputs)
            return outputs, value, tf.cast(weight, value.dtype)
        outputs, updates, loss, weight = replicas.TrainWithLoss(
            runs, thetas, inputs, loss_fn, loss_inputs, self._devices, self.p.batch_dim)
        self._ApplyUpdates(updates)
        return tf.nest.map_structure(tf.stop_gradient, outputs), loss, weight

    def ToFPropDtype(self, theta, inputs):
        """The pipeline's inputs are cast to fprop_dtype on the first device (`_Prepare`, for
        FProp and FPropLoss alike); its layers cast their weights themselves."""
        return theta, inputs

    def _Prepare(self, theta, inputs, training: bool):
        """Runs the before_tpl layers; returns (the pipeline's input, per replica its
        `executor.Executor` for this batch, per cell its theta)."""
        p = self.p
        with tf.device(self._devices[0]), fprop_context.Scope(batch_dim=p.batch_dim):
            inputs = _ArrayLikesAsTensors(inputs)
            if p.fprop_dtype is not None:
                # Before the split: cell 0 keeps its micro-batches in fprop_dtype too.
                inputs = precision.CastFloats(inputs, tf.as_dtype(p.fprop_dtype))
            inputs = sequential.Apply(self._before, theta, *inputs)
        batch_size = microbatch.StaticBatchSize(inputs, p.batch_dim)  # None: known when it runs.
        try:
            num_micro_batches = plan_lib.NumMicroBatches(p, batch_size, equal=False)
        except errors.ConfigError as error:
            raise errors.ConfigError(f'{self.path}: {error}') from None
        sched = self.plan.Schedule(num_micro_batches, training=training)  # Names the layer.
        ctx = fprop_context.Current()
        assign = self._LogicalDeviceFn()
        # Replica r's shard starts after the shards before it (and after the examples that come
        # before this whole batch, under a strategy's replicas).
        shard_starts = microbatch.Starts(microbatch.RunBatchSize(inputs, p.batch_dim),
                                         p.num_replicas)
        runs: list[executor.Executor] = []
        for r, size in enumerate(replicas.ShardSizes(batch_size, p.num_replicas)):
            # No layer runs on zero examples: a static shard of fewer examples than M runs the
            # schedule of its first micro-batches only (one example each), a batch of fewer
            # examples than R on fewer replicas. A batch known only when the step runs skips
            # its empty micro-batches when it runs (`executor`, `looped`).
            shard_sched = (sched if size is None else
                           schedule_lib.FirstMicroBatches(sched, max(1, size)))
            m_count = shard_sched.num_micro_batches
            choice = executor.Choose(self.plan, m_count, training,
                                     even=size is None or size % m_count == 0)
            run: type[executor.Executor] = (looped.LoopedSchedule if choice.loops
                                            else unrolled.UnrolledSchedule)
            runs.append(run(self._replica_functions[r], self.plan.recompute, shard_sched,
                            p.batch_dim, tf.cast(ctx.step, tf.int64), assign,
                            first_example=tf.cast(ctx.first_example, tf.int64) +
                            shard_starts[r]))
        thetas = []
        for k in range(self.plan.num_cells):
            with tf.name_scope(f'cell_{k}_theta'):
                thetas.append(executor.AssignWeights(assign, k, self._cells[k].Theta(theta)))
        return inputs, runs, thetas

    def _Infer(self, runs: list[executor.Executor], thetas: list, inputs):
        """The outputs of every replica's forward-only schedule: micro-batched, no
        re-materialization, nothing recorded for a backward."""
        return replicas.Replicated(
            lambda r, shard: runs[r].Forward(thetas, shard, training=False)[0], inputs,
            len(runs), self._devices, self.p.batch_dim)

    def _ApplyUpdates(self, updates: list) -> None:
        """Hands each cell's layers their training statistics, summed over micro-batches (and
        over a strategy's replicas)."""
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

    def _LogicalDeviceScope(self, k: int):
        """Where cell k's variables are created: with logical_device_fn, under a strategy that
        places variables by logical device (a TPUStrategy's
        `extended.experimental_logical_device`), on cell k's logical device (`Plan.DeviceOf`:
        k % K with v virtual stages); else no extra scope."""
        if self.p.logical_device_fn is None:
            return contextlib.nullcontext()
        scope = getattr(tf.distribute.get_strategy().extended, 'experimental_logical_device',
                        None)
        return scope(self.plan.DeviceOf(k)) if scope is not None else contextlib.nullcontext()

    def _LogicalDeviceFn(self):
        """`p.logical_device_fn`, checked to be usable here (it annotates graph tensors)."""
        fn = self.p.logical_device_fn
        if fn is not None and tf.executing_eagerly():
            raise errors.ConfigError(
                f'{self.path}: logical_device_fn annotates graph tensors; call the '
                'layer inside a tf.function (or strategy.run), not eagerly.')
        return fn

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        layers = list(p.before_tpl)
        if p.cell_tpl is not None:
            for c in p.cell_tpl:
                layers += list(c) if isinstance(c, (list, tuple)) else [c]
        else:
            layers += list(p.layer_tpl or [])
        layers = [lp.Copy().Set(name=fields.LayerName(lp, i)) for i, lp in enumerate(layers)]
        return sequential.ChainMeta(layers, *input_shapes)[0]


def IsPipeline(p) -> bool:
    """Whether layer Params `p` are a PipeliningLayer's (a model a plan applies to)."""
    return p is not None and issubclass(p.cls, PipeliningLayer)


def _ArrayLikesAsTensors(inputs: tuple) -> tuple:
    """The layer's inputs, each that is a (nested) list of Python numbers converted to a tensor,
    as Keras layers take array-likes (ints become int32, as token ids should; floats float32);
    tensors, arrays, tuples (a structure of inputs) and nests of them are left as they are, as
    is a list that is no array (ragged), which `microbatch.StaticBatchSize` then refuses."""
    def AsTensor(x):
        if not isinstance(x, list):
            return x
        leaves = tf.nest.flatten(x)
        if not leaves or not all(isinstance(leaf, numbers.Number) for leaf in leaves):
            return x
        try:
            return tf.convert_to_tensor(x)
        except (ValueError, TypeError):
            return x
    return tuple(AsTensor(x) for x in inputs)
