"""The PipeliningLayer Params a Keras `Pipeline` is built from: checked, made from a list of
layer Params, and written to and read from a Keras config as Params text.

Reading goes through `Params.FromText`, the parser the trainer reads `params.txt` and overrides
with: values are literals, and `type/`/`callable/` names resolve only to the gpipe_tf package's
own classes and functions, so loading a `.keras` file runs no code that its config names.
"""

from __future__ import annotations

import json

from absl import logging
import keras
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import hyperparams
from gpipe_tf.keras import keras_layer
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import sequential
from gpipe_tf.perf import measured_costs
from gpipe_tf.pipeline import devices as devices_lib
from gpipe_tf.pipeline import fields
from gpipe_tf.pipeline import partition
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.pipeline import schedule as schedule_lib

# What the messages call the layer.
LAYER = 'gpipe_tf.keras.Pipeline'


def Checked(params, loss_inside: bool = False) -> hyperparams.Params:
    """A copy of PipeliningLayer Params `params`, checked to be usable in a Keras model.

    Args:
      params: the Params.
      loss_inside: whether the model computes the loss per micro-batch inside the pipeline
        (`gpipe_tf.keras.Sequential`), which every schedule can run; else only gpipe's.

    Raises:
      errors.ConfigError: for anything but PipeliningLayer Params, a schedule that is not one
        of `schedule.KINDS`, and without loss_inside for a schedule that needs the loss inside
        the pipeline (Keras computes it after the layer).
    """
    if isinstance(params, (list, tuple)):
        raise errors.ConfigError(
            f'{LAYER} takes PipeliningLayer Params; got a {type(params).__name__} of '
            f'{len(params)} items. For a list of layer Params use '
            f'{LAYER}.FromLayers(layers, num_cells, num_micro_batches).')
    if not fields.IsLayerParams(params) or not issubclass(params.cls,
                                                     pipelining_layer.PipeliningLayer):
        got = (f'Params of {params.cls.__name__}' if fields.IsLayerParams(params) else
               fields.Describe(params))
        raise errors.ConfigError(
            f'{LAYER} takes PipeliningLayer Params (gpipe_tf.PipeliningLayer.Params().Set('
            f'layer_tpl=[...], num_cells=K, num_micro_batches=M)); got {got}. For a list of '
            f'layer Params use {LAYER}.FromLayers(layers, num_cells, num_micro_batches).')
    # A name that is no schedule, before what a schedule of that name would need.
    kind = _ScheduleKind(params, LAYER)
    if kind.loss_inside_pipeline and not loss_inside:
        raise errors.ConfigError(
            f'{LAYER}: schedule {params.schedule!r} computes the loss per micro-batch inside '
            'the pipeline, but a Keras model computes it after the layer: use '
            'schedule="gpipe" (the default), or make the model a gpipe_tf.keras.Sequential, '
            'whose train step computes the loss inside.')
    return params.Copy()


def _ScheduleKind(params, where: str) -> schedule_lib.ScheduleKind:
    """The kind of `params.schedule`; a ConfigError naming `where` for a name that is none."""
    try:
        return schedule_lib.Kind(params.schedule)
    except schedule_lib.ScheduleError as error:
        raise errors.ConfigError(f'{where}: {error}') from None


def ApplyDtypePolicy(params: hyperparams.Params, dtype) -> keras.DTypePolicy:
    """Sets `params.fprop_dtype` from a Keras dtype policy; returns the Keras layer's policy.

    Args:
      params: PipeliningLayer Params (changed in place).
      dtype: the Keras layer's `dtype` argument (a policy, its name or its config), or None for
        Keras's global policy. A mixed policy ('mixed_bfloat16') sets fprop_dtype to its
        compute dtype; the global policy applies only when it is mixed with the Params' dtype
        for variables, and not over a fprop_dtype the Params set.

    Raises:
      errors.ConfigError: for a `dtype` whose variable dtype is not the Params' dtype, or whose
        compute dtype contradicts the Params' fprop_dtype.
    """
    variables = tf.as_dtype(params.dtype)
    given = dtype is not None
    try:
        policy = keras.dtype_policies.get(dtype) if given else keras.config.dtype_policy()
    except (ValueError, TypeError) as error:
        raise errors.ConfigError(f'{LAYER}: dtype={dtype!r} is not a Keras dtype policy '
                                 f'({error}).') from None
    if given and tf.as_dtype(policy.variable_dtype) != variables:
        raise errors.ConfigError(
            f'{LAYER}: the variables\' dtype is the Params\' ({variables.name}); set '
            f'params.dtype instead of dtype={dtype!r} (policy {policy.name}, variables in '
            f'{policy.variable_dtype}).')
    compute = tf.as_dtype(policy.compute_dtype)
    mixed = tf.as_dtype(policy.variable_dtype) == variables and compute != variables
    current = None if params.fprop_dtype is None else tf.as_dtype(params.fprop_dtype)
    if given and current is not None and current != compute:
        raise errors.ConfigError(
            f'{LAYER}: the Params compute in {current.name} (fprop_dtype) but dtype={dtype!r} '
            f'computes in {compute.name}; give one of them.')
    if mixed and current is None:
        params.fprop_dtype = current = compute
    # Keras names the policies of float32 variables computing in bfloat16 or float16.
    if variables == tf.float32 and current in (tf.bfloat16, tf.float16):
        return keras.DTypePolicy(f'mixed_{current.name}')
    return keras.DTypePolicy(variables.name)


def FromLayers(layers, num_cells: int, num_micro_batches: int,
               devices: list[str] | None = None,
               input_shape: list[int] | None = None) -> hyperparams.Params:
    """PipeliningLayer Params of `layers` (a list of layer Params) in K = `num_cells` cells
    over M = `num_micro_batches` micro-batches, on `devices` (None: the logical devices
    present). With `input_shape`, the shape of one mini-batch (batch included), the cells are
    balanced by FLOPs; without, each gets an equal share of the layers. The name is left
    empty: the Keras layer gives its own.

    Raises:
      errors.ConfigError: for a layer that is not a layer's Params, or a K or M that is not a
        positive integer.
    """
    if not isinstance(layers, (list, tuple)) or not layers:
        raise errors.ConfigError(f'{LAYER}.FromLayers: layers must be a non-empty list of '
                                 f'layer Params; got {fields.Describe(layers)}.')
    fields.LayerParamsList(f'{LAYER}.FromLayers', 'layers', layers)
    try:
        return pipelining_layer.PipeliningLayer.Params().Set(
            layer_tpl=list(layers), num_cells=num_cells, num_micro_batches=num_micro_batches,
            devices=devices, input_shapes=None if input_shape is None else list(input_shape),
            partition_method='uniform' if input_shape is None else 'flops')
    except ValueError as error:
        raise errors.ConfigError(f'{LAYER}.FromLayers: {error}') from None


def FromKeras(layers, num_cells: int, num_micro_batches: int, input_shape=None, balance=None,
              **params) -> hyperparams.Params:
    """PipeliningLayer Params whose layers are the given Keras layers, in order.

    Args:
      layers: a list of Keras layers, or a `keras.Sequential` (its layers). Layers not yet
        built are built by the pipeline under their cell's device; built ones keep their
        weights where they are (`Pipeline` checks they are on their cell's device).
      num_cells: K.
      num_micro_batches: M (None with micro_batch_size).
      input_shape: the shape of one example of the first layer's input (batch excluded), or a
        list of such shapes for a first layer of several inputs; None takes it from a
        `keras.Sequential` built with a `keras.Input`.
      balance: None, or the number of layers of each of the v K cells (torchgpipe's
        `balance=[...]`); without it `partition_method` decides: "params" (the default: equal
        parameter counts, optimal min-max), "time" (equal measured forward and backward time,
        on copies of the layers, on `micro_batch_size` or TIMED_MICRO_BATCH examples; cached
        in `costs_file` when given), "uniform", or boundaries [0, b_1, ..., L].
      **params: any other PipeliningLayer Param (`devices`, `recompute`, `schedule`,
        `micro_batch_size`, `virtual_stages`, `num_replicas`, `unroll`, ...).

    Raises:
      errors.ConfigError: for anything but Keras layers, a missing or wrong input shape, an
        unknown Param or a bad value, a balance that does not add up to the layers.
    """
    layers, input_shape = _KerasLayers(layers, input_shape)
    shapes = _InputShapes(input_shape)
    layer_params = [keras_layer.KerasLayer.Params().Set(layer=keras_layer.Handle(layer))
                    for layer in layers]
    p = pipelining_layer.PipeliningLayer.Params()
    try:
        p.Set(layer_tpl=layer_params, num_cells=num_cells,
              num_micro_batches=num_micro_batches, partition_method='params')
        p.Set(**params)
    except (AttributeError, ValueError, TypeError) as error:
        raise errors.ConfigError(f'{LAYER}.FromKeras: {error}') from None
    _ScheduleKind(p, f'{LAYER}.FromKeras')  # Before the layers are built or timed.
    # Each layer's input shape, chained through the layers on one example: what each is built
    # for (with an unknown batch) and what its parameters are counted on.
    metas, args = [], [tf.TensorShape([1] + s) for s in shapes]
    for i, lp in enumerate(layer_params):
        lp.input_shapes = [[None] + s.as_list()[1:] for s in args]
        try:
            meta = sequential.Meta(lp.Copy().Set(name=f'layer_{i:03d}'), *args)
        except errors.ConfigError as error:  # The layer cannot be copied, or its outputs.
            raise errors.ConfigError(
                f'{LAYER}.FromKeras: layers[{i}] ({layers[i].name}): {error}') from None
        except (ValueError, TypeError, NotImplementedError) as error:
            raise errors.ConfigError(
                f'{LAYER}.FromKeras: layers[{i}] ({layers[i].name}) does not take inputs of '
                f'shapes {[a.as_list()[1:] for a in args]} (per example): {error}') from None
        metas.append(meta)
        args = base_layer.AsArgs(meta.out_shapes)
    num_stages = p.num_cells * p.virtual_stages
    if balance is None and p.partition_method == 'time':
        costs = _MeasuredSeconds(p, layers, layer_params, shapes)
    else:
        costs = [m.num_params for m in metas]
    p.partition_method = _KerasBoundaries(p.partition_method, balance, costs, num_stages)
    return p


# The micro-batch the layers are timed on (partition_method="time") without micro_batch_size.
TIMED_MICRO_BATCH = 16


def _MeasuredSeconds(p, layers: list, layer_params: list, shapes: list) -> list[float]:
    """Each layer's measured share of a training step (`measured_costs`), timed on copies of
    the layers (`keras_layer.Clone`: the layers themselves stay unbuilt, for their cells'
    devices) on the first cell's device, on `p.micro_batch_size` examples or
    TIMED_MICRO_BATCH."""
    copies = [keras_layer.Clone(layer) for layer in layers]
    timed = [lp.Copy().Set(layer=keras_layer.Handle(copy))
             for lp, copy in zip(layer_params, copies)]
    size = p.micro_batch_size or TIMED_MICRO_BATCH
    inputs = [tf.random.stateless_uniform([size] + s, [i, 0]) for i, s in enumerate(shapes)]
    device = devices_lib.MeshDevices(p.devices, p.num_replicas, p.num_cells)[0][0]
    by_handle = dict(zip((lp.layer for lp in timed), copies))

    def KeyOf(lp):
        layer = by_handle[lp.layer]
        config = {k: v for k, v in layer.get_config().items() if k != 'name'}
        return json.dumps([type(layer).__module__, type(layer).__name__, config],
                          sort_keys=True, default=str)

    costs = measured_costs.MeasureLayers(timed, inputs, device, cache_file=p.costs_file,
                                         key_of=KeyOf, progress=logging.info)
    return [c.StepSeconds(plan_lib.AnyRematerialized(p)) for c in costs]


def _KerasLayers(layers, input_shape) -> tuple[list, object]:
    """(the Keras layers of a list or a Sequential, the input shape: given, or the
    Sequential's)."""
    if isinstance(layers, keras.Sequential):
        if input_shape is None and layers.inputs:
            input_shape = list(layers.inputs[0].shape[1:])
        layers = list(layers.layers)
    if not isinstance(layers, (list, tuple)) or not layers:
        raise errors.ConfigError(f'{LAYER}.FromKeras: layers must be a non-empty list of Keras '
                                 f'layers or a keras.Sequential; got {fields.Describe(layers)}.')
    for i, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer) or isinstance(layer, keras.Model):
            raise errors.ConfigError(
                f'{LAYER}.FromKeras: layers[{i}] is {fields.Describe(layer)}; expected a Keras '
                'layer (keras.layers.Dense(...), a keras_hub block). For gpipe_tf layer Params use '
                f'{LAYER}.FromLayers.')
    first = {}
    for i, layer in enumerate(layers):
        if id(layer) in first:  # One layer object has one set of weights, on one device.
            raise errors.ConfigError(
                f'{LAYER}.FromKeras: layers[{first[id(layer)]}] and layers[{i}] are the same '
                f'Keras layer object ({layer.name}); each layer must be a distinct object: '
                'for two layers alike, construct the layer twice (a layer object holds one set '
                'of weights, on one cell\'s device).')
        first[id(layer)] = i
    if input_shape is None:
        raise errors.ConfigError(
            f'{LAYER}.FromKeras: give input_shape, the shape of one example (batch '
            'excluded), such as input_shape=(16,); the cells are built for it on their devices.')
    return list(layers), input_shape


def _InputShapes(input_shape) -> list[list]:
    """`input_shape` as a list of per-example shapes (one per input of the first layer)."""
    def IsShape(value):
        return isinstance(value, (list, tuple)) and all(
            d is None or (isinstance(d, int) and not isinstance(d, bool) and d > 0)
            for d in value)

    if isinstance(input_shape, tf.TensorShape) and input_shape.rank is not None:
        input_shape = input_shape.as_list()
    if IsShape(input_shape):
        return [list(input_shape)]
    if (isinstance(input_shape, (list, tuple)) and input_shape and
            all(IsShape(s) for s in input_shape)):
        return [list(s) for s in input_shape]
    raise errors.ConfigError(
        f'{LAYER}.FromKeras: input_shape must be the shape of one example (a tuple of positive '
        f'ints, batch excluded), or a list of them; got {fields.Describe(input_shape)}.')


def _KerasBoundaries(method, balance, costs: list, num_stages: int) -> list[int]:
    """Cell boundaries [0, ..., L] from `balance` (layers per cell) or `method`; `costs` are
    the layers' parameter counts, or with method "time" their measured seconds."""
    num_layers = len(costs)
    try:
        if balance is not None:
            if (not isinstance(balance, (list, tuple)) or
                    not all(isinstance(n, int) and n > 0 for n in balance)):
                raise ValueError(f'balance must be a list of positive layer counts, one per '
                                 f'cell; got {balance!r}')
            if len(balance) != num_stages or sum(balance) != num_layers:
                raise ValueError(
                    f'balance {list(balance)} must give {num_stages} cells (sum of '
                    f'{len(balance)} entries) and {num_layers} layers (sum {sum(balance)})')
            bounds = [0]
            for n in balance:
                bounds.append(bounds[-1] + n)
            return bounds
        if isinstance(method, (list, tuple)):
            return partition.CheckBoundaries(list(method), num_layers, num_stages)
        if method in ('params', 'time'):
            return partition.OptimalBoundaries(costs, num_stages)
        if method == 'uniform':
            return partition.UniformBoundaries(num_layers, num_stages)
        raise ValueError(f'partition_method for Keras layers is "params", "time", "uniform" or '
                         f'boundaries; got {method!r}')
    except ValueError as error:
        raise errors.ConfigError(f'{LAYER}.FromKeras: {str(error).rstrip(".")}.') from None


def ToText(params: hyperparams.Params) -> str:
    """`params` as Params text, for a Keras config.

    Raises:
      errors.ConfigError: for a value Params text cannot write (a lambda as `devices`, say).
    """
    try:
        return params.ToText()
    except TypeError as error:
        raise errors.ConfigError(
            f'{LAYER} {params.name!r}: its Params cannot be written into the Keras config '
            f'({error}); give such fields values Params text can hold (devices as a list of '
            'strings) to save the model.') from None


def FromText(text, loss_inside: bool = False) -> hyperparams.Params:
    """PipeliningLayer Params read from a Keras config's Params text, safely (see the module
    docstring).

    Raises:
      errors.ConfigError: naming the line, for text that does not parse, names something
        outside the gpipe_tf package, or is not a PipeliningLayer's.
    """
    if not isinstance(text, str):
        raise errors.ConfigError(f'{LAYER}: the config\'s "params" must be Params text (a '
                                 f'str); got {fields.Describe(text)}.')
    try:
        params = pipelining_layer.PipeliningLayer.Params().FromText(text)
    except ValueError as error:
        raise errors.ConfigError(f'{LAYER}: the config\'s Params text does not load: '
                                 f'{error}') from None
    return Checked(params, loss_inside)
