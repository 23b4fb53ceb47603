"""The PipeliningLayer Params a Keras `Pipeline` is built from: checked, made from a list of
layer Params, and written to and read from a Keras config as Params text.

Reading goes through `Params.FromText`, the parser the trainer reads `params.txt` and overrides
with: values are literals, and `type/`/`callable/` names resolve only to the gpipe_tf package's
own classes and functions, so loading a `.keras` file runs no code that its config names.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import hyperparams
from gpipe_tf.layers import base_layer
from gpipe_tf.pipeline import pipelining_layer

# What the messages call the layer.
LAYER = 'gpipe_tf.keras.Pipeline'


def _Describe(value) -> str:
    text = repr(value)
    return f'{type(value).__name__} {text[:60] + "..." if len(text) > 60 else text}'


def _IsLayerParams(value) -> bool:
    return (isinstance(value, hyperparams.InstantiableParams) and isinstance(value.cls, type)
            and issubclass(value.cls, base_layer.BaseLayer))


def Checked(params) -> hyperparams.Params:
    """A copy of PipeliningLayer Params `params`, checked to be usable in a Keras model.

    Raises:
      errors.ConfigError: for anything but PipeliningLayer Params, and for a schedule that needs
        the loss inside the pipeline (Keras computes it after the layer).
    """
    if isinstance(params, (list, tuple)):
        raise errors.ConfigError(
            f'{LAYER} takes PipeliningLayer Params; got a {type(params).__name__} of '
            f'{len(params)} items. For a list of layer Params use '
            f'{LAYER}.FromLayers(layers, num_cells, num_micro_batches).')
    if not _IsLayerParams(params) or not issubclass(params.cls,
                                                     pipelining_layer.PipeliningLayer):
        got = (f'Params of {params.cls.__name__}' if _IsLayerParams(params) else
               _Describe(params))
        raise errors.ConfigError(
            f'{LAYER} takes PipeliningLayer Params (gpipe_tf.PipeliningLayer.Params().Set('
            f'layer_tpl=[...], num_cells=K, num_micro_batches=M)); got {got}. For a list of '
            f'layer Params use {LAYER}.FromLayers(layers, num_cells, num_micro_batches).')
    if params.schedule != 'gpipe':
        raise errors.ConfigError(
            f'{LAYER}: schedule {params.schedule!r} computes the loss per micro-batch inside '
            'the pipeline, but a Keras model computes it after the layer: use '
            'schedule="gpipe" (the default).')
    return params.Copy()


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
                                 f'layer Params; got {_Describe(layers)}.')
    for i, lp in enumerate(layers):
        if not _IsLayerParams(lp):
            raise errors.ConfigError(
                f'{LAYER}.FromLayers: layers[{i}] is {_Describe(lp)}; expected a layer\'s '
                'Params, such as gpipe_tf.layers.basic.DenseLayer.Params().Set(...).')
    try:
        return pipelining_layer.PipeliningLayer.Params().Set(
            layer_tpl=list(layers), num_cells=num_cells, num_micro_batches=num_micro_batches,
            devices=devices, input_shapes=None if input_shape is None else list(input_shape),
            partition_method='uniform' if input_shape is None else 'flops')
    except ValueError as error:
        raise errors.ConfigError(f'{LAYER}.FromLayers: {error}') from None


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


def FromText(text) -> hyperparams.Params:
    """PipeliningLayer Params read from a Keras config's Params text, safely (see the module
    docstring).

    Raises:
      errors.ConfigError: naming the line, for text that does not parse, names something
        outside the gpipe_tf package, or is not a PipeliningLayer's.
    """
    if not isinstance(text, str):
        raise errors.ConfigError(f'{LAYER}: the config\'s "params" must be Params text (a '
                                 f'str); got {_Describe(text)}.')
    try:
        params = pipelining_layer.PipeliningLayer.Params().FromText(text)
    except ValueError as error:
        raise errors.ConfigError(f'{LAYER}: the config\'s Params text does not load: '
                                 f'{error}') from None
    return Checked(params)
