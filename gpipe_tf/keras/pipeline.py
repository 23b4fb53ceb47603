"""`Pipeline`: a gpipe_tf PipeliningLayer as a Keras 3 layer (TensorFlow backend).

    import keras
    from gpipe_tf import keras as gpipe_keras
    from gpipe_tf.layers import basic

    layers = [basic.DenseLayer.Params().Set(input_dim=64, output_dim=64, activation='relu')
              for _ in range(8)]
    model = keras.Sequential([
        keras.Input((64,)),
        gpipe_keras.Pipeline.FromLayers(layers, num_cells=2, num_micro_batches=4),
        keras.layers.Dense(10)])
    model.compile('adam', keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=32)     # any batch size

**Variables.** The PipeliningLayer builds its tf.Variables as everywhere else (cell k's on
device k, initial values seeded by the layer's path), and the Keras layer tracks each through a
Keras variable whose storage is that tf.Variable (`weights.Wrap`): trainable ones in
`trainable_weights`, batch norm's moving statistics in `non_trainable_weights`. There is one copy
of every weight, so nothing can go out of sync: the Keras optimizer assigns the tf.Variable,
`FProp` reads it (as theta), batch norm's update assigns it. The other way round, Keras-made
variables passed to `FProp` as theta, would leave the pipeline's own variables (which
`Instantiate` builds anyway) as a second copy, and batch norm's `ApplyUpdate`, which assigns the
layer's own variables, would update the copy Keras does not see.

**Training mode and batch norm.** Keras's `training` becomes `fprop_context`'s, as the trainer
sets it: `fit` calls the layer with training=True, `evaluate` and `predict` with False. The step
of the context (which seeds dropout masks, as the trainer's global step does) is the layer's
`step`, the number of training calls so far: a tf.Variable saved and restored with the weights
(`save_own_variables`) but not one of them, so it counts as no parameter. In training
the pipeline sums each batch norm layer's statistics over the M micro-batches and assigns the
moving statistics once per call, an op of the traced step that `tf.function` runs (its automatic
control dependencies keep stateful ops); in inference it normalises with them and changes no
weight.

**Mixed precision.** Under Keras's `mixed_bfloat16` policy (`keras.mixed_precision.
set_global_policy('mixed_bfloat16')`, or `dtype='mixed_bfloat16'` on the layer) the pipeline's
Params get `fprop_dtype=tf.bfloat16`: its variables stay float32, every cell computes in
bfloat16 (weights cast as they are read, activations crossing cells in bfloat16), and the
weight gradients are summed over micro-batches in float32. The output is bfloat16, as Keras's
own layers' under that policy; Keras's losses compute in float32. `mixed_float16` gives
float16, and `model.compile` then wraps the optimizer in Keras's LossScaleOptimizer. Params
that set fprop_dtype themselves keep it under the global policy.

**Saving.** `get_config` carries the Params as Params text, read back by the same safe parser as
the trainer's `params.txt` (`pipeline_params.FromText`); weights are ordered by layer name, so
`save_weights` of one partition loads into another. Import `gpipe_tf.keras` before
`keras.models.load_model`, which finds the class by its registered name
`gpipe_tf.keras>Pipeline` (`names`; files saved as `gpipe_tf>Pipeline` load too).

**Summary.** `model.summary(expand_nested=True)` lists one row per cell, its layers nested under
it (`summary`); the parameter counts are the layers' own, as in keras.Sequential.

**Any batch size.** A batch of N examples splits into M micro-batches as equal as they can be
(the first N mod M one example larger), also when N is known only when the step runs (Keras
traces a second batch size with an unknown batch): so `predict` on one example, `evaluate` on
a number M does not divide, and `fit` whose last batch is partial all run, for every layer. No
layer runs on zero examples: with N < M a static batch runs N micro-batches of one example, and
one known only when the step runs skips the empty ones' work. A training step's gradient is
the un-pipelined model's whatever the sizes (Keras's loss comes after the pipeline, over the
whole batch), an Embedding's as the IndexedSlices Keras's own model gives its optimizer.
The looped schedule (`unroll=False`, or 'auto' from 64 cell calls) pads an inference batch
with copies of its last example and drops their outputs; it trains on the uneven micro-batches
of a batch known only when the step runs, and a training step whose static batch M does not
divide is unrolled instead.

**Limits.** XLA (`jit_compile`) compiles a step for one device, and cannot read
variables that live on others: a pipeline on several devices says `supports_jit = False`, so
Keras's default `jit_compile='auto'` leaves XLA off and an explicit `jit_compile=True` falls back
with Keras's warning; a pipeline on one device compiles. Keras's `tf.distribute` strategies are
not supported: the pipeline places its cells itself (`num_replicas` gives data parallelism).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
# The XLA context a jit_compile tf.function traces in is not public API; tf.function's own
# OptionalXlaContext reads it this way.
from tensorflow.python.ops import control_flow_util  # pylint: disable=g-direct-tensorflow-import

from gpipe_tf import errors
from gpipe_tf import hyperparams
from gpipe_tf.keras import keras_layer
from gpipe_tf.keras import names
from gpipe_tf.keras import pipeline_params
from gpipe_tf.keras import summary
from gpipe_tf.keras import weights
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import sequential
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import schedule as schedule_lib


@names.Registered
class Pipeline(keras.layers.Layer):
    """A GPipe pipeline (`gpipe_tf.PipeliningLayer`) inside a Keras model.

    Args:
      params: PipeliningLayer Params; their `name` (default: the Keras layer's) names and
        seeds the variables. See `FromLayers` for a list of layer Params.
      **kwargs: Keras layer arguments (`name`, `trainable`, `dtype`). A dtype policy (or, by
        default, Keras's global one) that is mixed, 'mixed_bfloat16' or 'mixed_float16',
        sets the Params' fprop_dtype; its variable dtype must be the Params' dtype.

    Raises:
      errors.ConfigError: for Params that are not a PipeliningLayer's, a dtype policy whose
        variable dtype is not the Params' dtype or whose compute dtype contradicts their
        fprop_dtype, or construction under a tf.distribute strategy; the pipeline's own errors
        (devices, K, M) are ConfigErrors too.
    """

    def __init__(self, params, loss_inside: bool = False, **kwargs):
        params = pipeline_params.Checked(params, loss_inside)
        self._loss_inside = loss_inside
        policy = pipeline_params.ApplyDtypePolicy(params, kwargs.pop('dtype', None))
        if tf.distribute.has_strategy():
            raise errors.ConfigError(
                f'{pipeline_params.LAYER} does not run under a tf.distribute strategy (got '
                f'{type(tf.distribute.get_strategy()).__name__}): the pipeline places its '
                'cells on its own devices. Build it outside strategy.scope(); for data '
                'parallelism set the Params\' num_replicas.')
        super().__init__(dtype=policy, **kwargs)
        if not params.name:
            params.name = self.name
        self._pipeline = params.Instantiate()
        cells = [layer for layer in self._pipeline.Layers()
                 if isinstance(layer, keras_layer.KerasLayer)]
        # Keras layers in the cells are this layer's sublayers: Keras tracks their own weights
        # (training, saving) as it tracks any sublayer's.
        # Each once: the stages of a `Functional` all run the one model's layers.
        self._keras_layers = list({id(layer.keras_layer): layer.keras_layer
                                   for layer in cells}.values())
        _CheckKerasPlacement(self._pipeline)
        # An attribute holding Keras variables is how a Keras layer tracks them (weights,
        # saving, the optimizer); the name scope gives their paths (`pipeline/layer_003.w`).
        gpipe_vars = type(self._pipeline.vars)(
            {name: v for name, v in self._pipeline.vars.items()
             if name not in {layer.p.name for layer in cells}})
        with keras.name_scope(self.name, caller=self):
            self._pipeline_weights = weights.Wrap(gpipe_vars)
        # The count of training calls is state, not a parameter: a tf.Variable, which Keras
        # does not track as a weight, so count_params, summary and get_weights leave it out
        # (as keras.Sequential's of the same layers) and no optimizer sees it. Keras saves it
        # through save_own_variables, where the weight was before.
        self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name='step')
        self._devices = _DistinctDevices(self._pipeline.mesh)
        self.supports_jit = len(self._devices) <= 1

    @classmethod
    def FromLayers(cls, layers, num_cells: int, num_micro_batches: int,
                   devices: list[str] | None = None, input_shape: list[int] | None = None,
                   **kwargs) -> 'Pipeline':
        """The pipeline of `layers` (a list of layer Params) in K = `num_cells` cells over M =
        `num_micro_batches` micro-batches, on `devices` (None: the logical devices present);
        with `input_shape` (one mini-batch's, batch included) the cells are balanced by FLOPs,
        without it by number of layers. `kwargs` are Keras layer arguments.

        Raises:
          errors.ConfigError: see `pipeline_params.FromLayers` and `Pipeline`.
        """
        return cls(pipeline_params.FromLayers(layers, num_cells, num_micro_batches, devices,
                                              input_shape), **kwargs)

    @classmethod
    def FromKeras(cls, layers, num_cells: int, num_micro_batches: int | None = None,
                  input_shape=None, balance=None, name: str | None = None,
                  dtype=None, loss_inside: bool = False, **params) -> 'Pipeline':
        """The pipeline of Keras `layers` (a list, or a `keras.Sequential`'s layers) in K =
        `num_cells` cells over M = `num_micro_batches` micro-batches: the very layer objects,
        each built and its weights created on its cell's device.

        Args:
          layers: Keras layers (keras.layers, keras_hub blocks), applied in order.
          num_cells: K.
          num_micro_batches: M (or give micro_batch_size=).
          input_shape: one example's input shape (batch excluded), or a list of them; None
            takes a `keras.Sequential`'s input.
          balance: layers per cell (torchgpipe's balance); None balances parameter counts
            (or partition_method="uniform", or boundaries [0, b_1, ..., L]).
          name: the Keras layer's name.
          dtype: the Keras layer's dtype policy (see `Pipeline`).
          **params: any PipeliningLayer Param: devices, recompute, schedule,
            micro_batch_size, virtual_stages, num_replicas, unroll, partition_method...

        Raises:
          errors.ConfigError: see `pipeline_params.FromKeras` and `Pipeline`.
        """
        p = pipeline_params.FromKeras(layers, num_cells, num_micro_batches, input_shape,
                                      balance, **params)
        return cls(p, loss_inside=loss_inside, name=name, dtype=dtype)

    @property
    def metrics(self) -> list:
        """The layers' metrics, but a compiled model's among them (a keras_hub task given to
        `Functional` comes compiled): the model that trains is the pipelined one, and Keras
        skips a nested model's own compile metrics so too."""
        return list(self._metrics) + [metric for layer in self._layers
                                      if not isinstance(layer, keras.Model)
                                      for metric in layer.metrics]

    @property
    def keras_layers(self) -> list:
        """The Keras layers in the cells, in order (empty for a pipeline of gpipe_tf
        layers)."""
        return list(self._keras_layers)

    @property
    def pipeline(self) -> pipelining_layer.PipeliningLayer:
        """The PipeliningLayer (its `PartitionReport()`, `devices`, `Layers()`)."""
        return self._pipeline

    @property
    def params(self) -> hyperparams.Params:
        """The pipeline's (frozen) Params."""
        return self._pipeline.p

    @property
    def step(self) -> tf.Variable:
        """The number of training calls so far: the step that seeds the layers' randomness.
        Saved and restored with the weights (`save_own_variables`), but not one of them."""
        return self._step

    @property
    def layers(self) -> list:
        """What `model.summary(expand_nested=True)` lists inside the pipeline: one row per
        cell (`cell_0`, ...), its layers nested under it (`summary.Rows`)."""
        return summary.Rows(self._pipeline, self._LayerOutputShapes)

    # ---- Keras's layer interface ----------------------------------------------------------------
    def build(self, input_shape) -> None:
        # The variables exist since __init__; building checks that the input fits the layers.
        self.compute_output_shape(input_shape)
        self._input_shape = input_shape  # For the summary's shapes (`_LayerOutputShapes`).

    def compute_output_shape(self, input_shape) -> tuple:
        """The output shape for `input_shape`, from the layers' FPropMeta (no TF op runs): a
        shape, or a tuple of them for layers whose last gives several outputs. Several inputs
        (a tuple of shapes) are the first layer's; keyword inputs (a dict last) do not change
        the output.

        Raises:
          errors.ConfigError: if the input does not fit the first layer, or the output is not
            a tensor or a tuple of them.
        """
        shapes, batch = self._WholeShapes(input_shape)
        try:
            meta = pipelining_layer.PipeliningLayer.FPropMeta(self._pipeline.p, *shapes)
        except (ValueError, TypeError) as error:
            raise errors.ConfigError(f'{self.name}: an input of shape {input_shape} does not '
                                     f'fit the pipeline: {error}') from None
        out = self._WithBatch(meta.out_shapes, batch)
        if out is None:
            raise errors.ConfigError(f'{self.name}: the pipeline\'s output in a Keras model '
                                     f'must be a tensor or a tuple of tensors; its layers give '
                                     f'{meta.out_shapes}.')
        return out

    def _WholeShapes(self, input_shape) -> tuple[list, int | None]:
        """(the positional inputs' TensorShapes for FPropMeta, the batch size) of Keras's
        `input_shape`: FPropMeta needs whole shapes, and the batch size (1 where unknown) does
        not change the others."""
        batch_dim = self._pipeline.p.batch_dim
        shapes = _InputShapes(input_shape)
        batch = None
        for i, shape in enumerate(shapes):
            if not -len(shape) <= batch_dim < len(shape):
                raise errors.ConfigError(
                    f'{self.name}: the input of shape {tuple(shape)} has no batch dimension '
                    f'{batch_dim} (Params batch_dim).')
            batch = batch or shape[batch_dim]
            shape[batch_dim] = shape[batch_dim] or 1
            shapes[i] = tf.TensorShape(shape)
        return shapes, batch

    def _WithBatch(self, out_shapes, batch):
        """FPropMeta's `out_shapes` as Keras shapes with the batch size `batch`: a tuple, or a
        tuple of them; None for anything else (a NestedMap, keyword inputs passed on)."""
        def WithBatch(shape):
            out = shape.as_list()
            out[self._pipeline.p.batch_dim] = batch
            return tuple(out)

        if isinstance(out_shapes, tf.TensorShape):
            return WithBatch(out_shapes)
        if isinstance(out_shapes, tuple) and all(
                isinstance(shape, tf.TensorShape) for shape in out_shapes):
            return tuple(WithBatch(shape) for shape in out_shapes)
        return None

    def _LayerOutputShapes(self) -> dict | None:
        """Each layer's output shape (as `_WithBatch` gives it) by its name, for the input the
        layer was built for; None before it is built."""
        input_shape = getattr(self, '_input_shape', None)
        if input_shape is None:
            return None
        shapes, batch = self._WholeShapes(input_shape)
        layers = self._pipeline.Layers()
        _, metas = sequential.ChainMeta([layer.p for layer in layers], *shapes)
        return {layer.p.name: self._WithBatch(meta.out_shapes, batch)
                for layer, meta in zip(layers, metas)}

    @tf.autograph.experimental.do_not_convert
    def call(self, inputs, training=None):
        training = _TrainingFlag(training, self.name)
        self._CheckTraceable(inputs)
        schedule = self._pipeline.p.schedule
        if training and schedule_lib.SCHEDULE_KINDS[schedule].loss_inside_pipeline:
            raise errors.ConfigError(
                f'{self.name}: schedule {schedule!r} trains only through the model\'s train '
                'step (model.fit, train_on_batch), which computes the loss per micro-batch '
                'inside the pipeline: it runs backwards before the last forward, so a loss '
                'computed after model(x, training=True) (a custom training loop) comes too '
                'late. Use schedule="gpipe" for such a loop; call the model with '
                'training=False for inference.')
        return _WithoutKeywords(inputs, self._InContext(
            training, lambda: self._pipeline.FProp(self._pipeline.theta, inputs)))

    @tf.autograph.experimental.do_not_convert
    def TrainWithLoss(self, inputs, loss_fn, loss_inputs=None):
        """A training call with the loss computed per micro-batch on the last stage
        (`PipeliningLayer.FPropLoss`), which every schedule runs: what
        `gpipe_tf.keras.Sequential`'s train step calls.

        Args:
          inputs: the pipeline's input.
          loss_fn: (a micro-batch's outputs, its part of loss_inputs) -> (value, weight).
          loss_inputs: a nest split along the batch with the inputs (labels, sample weights).

        Returns:
          (outputs, loss, weight): the outputs (no gradient flows back through them), the
          loss (the mean of the values weighted by their weights), the summed weight.
        """
        if not self.built:
            self.build(tf.nest.map_structure(lambda x: x.shape, inputs))
        self._CheckTraceable(inputs)
        outputs, loss, weight = self._InContext(True, lambda: self._pipeline.FPropLoss(
            self._pipeline.theta, inputs,
            lambda outputs, part: loss_fn(_WithoutKeywords(inputs, outputs), part),
            loss_inputs))
        return _WithoutKeywords(inputs, outputs), loss, weight

    def _InContext(self, training: bool, compute):
        """`compute()` in the pipeline's forward context (Keras's training flag, `step` as the
        step that seeds randomness); a training call then counts one step."""
        step = tf.convert_to_tensor(self._step)
        with fprop_context.Scope(training=training, step=step, first_example=0,
                                 update_collector=None):
            result = compute()
        if training:
            self._step.assign_add(1)
        return result

    def get_config(self) -> dict:
        config = {**super().get_config(),
                  'params': pipeline_params.ToText(_WithoutKerasLayers(self._pipeline.p)),
                  'loss_inside': self._loss_inside}
        if self._keras_layers:
            # Without their build configs: Keras would build them on loading, on its default
            # device; the pipeline builds each on its cell's.
            config['keras_layers'] = [
                {k: v for k, v in keras.saving.serialize_keras_object(layer).items()
                 if k != 'build_config'} for layer in self._keras_layers]
        return config

    @classmethod
    def from_config(cls, config: dict) -> 'Pipeline':
        config = dict(config)
        params = pipeline_params.FromText(config.pop('params', None),
                                          config.get('loss_inside', False))
        # Keras's own deserialization (safe mode: registered classes only) makes the layers.
        layers = [keras.saving.deserialize_keras_object(c)
                  for c in config.pop('keras_layers', [])]
        _WithKerasLayers(params, layers)
        return cls(params, **config)  # The dtype policy saved agrees with the Params'.

    # `step` is saved after the layer's own weights, under the key add_weight gave it when it
    # was a weight: weight files (`.keras`, `.weights.h5`, BackupAndRestore's) keep their layout,
    # so those saved before load here, and a resumed fit seeds dropout as an uninterrupted one.
    def save_own_variables(self, store) -> None:
        super().save_own_variables(store)
        store[str(self._OwnWeightCount())] = self._step.numpy()

    def load_own_variables(self, store) -> None:
        count = self._OwnWeightCount()
        if len(store.keys()) != count + 1:
            raise ValueError(
                f"Layer '{self.name}' expected {count + 1} variables (its {count} weights, "
                f'then step), but received {len(store.keys())} variables during loading.')
        self._step.assign(np.asarray(store[str(count)]))
        super().load_own_variables({str(i): store[str(i)] for i in range(count)})

    def _OwnWeightCount(self) -> int:
        """The number of weights Keras's save_own_variables stores for this layer (its
        sublayers' are stored with them)."""
        return len(self._trainable_variables) + len(self._non_trainable_variables)

    # ---- checks -------------------------------------------------------------------------------
    def _CheckTraceable(self, inputs) -> None:
        """Raises errors.ConfigError for an input or a compilation the pipeline cannot run."""
        keywords = None
        if _HasKeywords(inputs):
            inputs, keywords = inputs[:-1], inputs[-1]
        elif isinstance(inputs, (tuple, list)):
            inputs = tuple(inputs)
        else:
            inputs = (inputs,)
        several = len(inputs) > 1 or keywords is not None
        if not inputs or not all(tf.is_tensor(x) for x in inputs) or not all(
                tf.is_tensor(x) for x in (keywords or {}).values()) or (
                    several and not self._keras_layers):
            raise errors.ConfigError(
                f'{self.name}: a Keras Pipeline takes a tensor, or (of Keras layers) a tuple of '
                'tensors whose last item may be a dict of keyword inputs (masks: (x, '
                '{"padding_mask": m})); got '
                f'{keras_layer.Structure(inputs if keywords is None else (*inputs, keywords))}.')
        if keywords is not None:
            taken = set().union(*(layer_keywords for layer_keywords in (
                keras_layer.Keywords(layer) for layer in self._keras_layers)))
            unknown = sorted(set(keywords) - taken)
            if unknown:
                raise errors.ConfigError(
                    f'{self.name}: no layer of the pipeline takes the keyword input(s) '
                    f'{", ".join(map(repr, unknown))}; its Keras layers take '
                    f'{", ".join(map(repr, sorted(taken))) or "none"}.')
        if len(self._devices) > 1 and control_flow_util.GraphOrParentsInXlaContext(
                tf.compat.v1.get_default_graph()):
            raise errors.ConfigError(
                f'{self.name}: XLA (jit_compile) compiles a step for one device, but this '
                f'pipeline\'s cells are on {len(self._devices)} devices '
                f'({", ".join(sorted(self._devices))}), whose variables XLA cannot read there. '
                'Compile with jit_compile=False (model.compile\'s default, "auto", does), or '
                'put every cell on one device (Params devices).')


def _InputShapes(input_shape) -> list[list]:
    """The shapes (lists) of the positional inputs in Keras's `input_shape`: one shape, or a
    tuple of them, then maybe the keyword inputs' dict of shapes."""
    if _HasKeywords(input_shape):
        input_shape = input_shape[:-1]
        if len(input_shape) == 1:
            input_shape = input_shape[0]

    def IsShape(value):
        return isinstance(value, tf.TensorShape) or (
            isinstance(value, (list, tuple)) and
            all(d is None or isinstance(d, int) for d in value))

    if IsShape(input_shape):
        return [tf.TensorShape(input_shape).as_list()]
    return [tf.TensorShape(shape).as_list() for shape in input_shape]


def _HasKeywords(inputs) -> bool:
    """Whether `inputs` (or their shapes) end in a dict of keyword inputs."""
    return isinstance(inputs, (tuple, list)) and bool(inputs) and isinstance(inputs[-1], dict)


def _WithoutKeywords(inputs, outputs):
    """The pipeline's outputs without the keyword inputs its Keras layers passed along (one
    output as a tensor)."""
    if not _HasKeywords(inputs) or not isinstance(outputs, tuple) or not outputs or (
            not isinstance(outputs[-1], dict)):
        return outputs
    return outputs[0] if len(outputs) == 2 else outputs[:-1]


def _TrainingFlag(training, name: str) -> bool:
    """Keras's `training` argument as a Python bool (None: inference)."""
    if training is None:
        return False
    if tf.is_tensor(training):
        value = tf.get_static_value(training)
        if value is None:
            raise errors.ConfigError(
                f'{name}: training must be known when the step is traced (a Python bool); '
                f'got the tensor {training!r}. The pipeline builds its backward only in '
                'training.')
        return bool(value)
    return bool(training)


def _KerasLayerParams(params) -> list:
    """The KerasLayer Params among a pipeline's layer Params, in order."""
    layers = list(params.layer_tpl or [])
    for cell in params.cell_tpl or []:
        layers += list(cell) if isinstance(cell, (list, tuple)) else [cell]
    return [lp for lp in layers if lp.cls is keras_layer.KerasLayer]


def _WithoutKerasLayers(params):
    """A copy of `params` whose Keras layers' handles are None: what a config can hold (the
    layers go into it through Keras's own serialization)."""
    params = params.Copy()
    for lp in _KerasLayerParams(params):
        lp.layer = None
    return params


def _WithKerasLayers(params, layers: list) -> None:
    """Sets the handles of `params`' Keras layers (in place) to `layers`, in order."""
    keras_params = _KerasLayerParams(params)
    if len(keras_params) != len(layers):
        raise errors.ConfigError(
            f'{pipeline_params.LAYER}: the config names {len(layers)} Keras layers but its '
            f'Params hold {len(keras_params)}.')
    for lp, layer in zip(keras_params, layers):
        lp.layer = keras_layer.Handle(layer)


def _CheckKerasPlacement(pipeline) -> None:
    """Raises errors.ConfigError for a Keras layer built before the pipeline whose weights are
    not on its cell's device (a built layer's variables cannot move)."""
    for k, cell in enumerate(pipeline.cells):
        want = _DistinctDevices([[pipeline.devices[k]]])
        for layer in cell.sequence:
            if not isinstance(layer, keras_layer.KerasLayer) or want == {''}:
                continue
            on = _DistinctDevices([[v.device for v in layer.placed_variables]])
            if on - want:
                raise errors.ConfigError(
                    f'{pipeline_params.LAYER}: the Keras layer {layer.keras_layer.name} of cell '
                    f'{k} was built before the pipeline, with its weights on '
                    f'{", ".join(sorted(on))}, not on its cell\'s device {pipeline.devices[k]}. '
                    'Pass layers that are not built yet (a keras.Sequential without a '
                    'keras.Input, and input_shape=...): the pipeline builds each on its '
                    'device.')


def _DistinctDevices(mesh: list[list[str]]) -> set[str]:
    """The devices of `mesh`, each spelled one way ('/device:CPU:1' is the local
    '/job:localhost/replica:0/task:0/device:CPU:1'); '' (no device scope) stays ''."""
    distinct = set()
    for device in (d for row in mesh for d in row):
        spec = tf.DeviceSpec.from_string(device)
        if spec.device_type is None:
            distinct.add(device)
            continue
        if spec.job is None:
            spec = spec.replace(job='localhost', replica=0, task=0)
        distinct.add(spec.to_string())
    return distinct
