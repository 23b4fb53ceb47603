"""The fields of a pipeline's Params that list its layers and shape its inputs, read and
checked: `layer_tpl`, `before_tpl` and `cell_tpl`'s entries must be layer Params
(`LayerParamsList`), `input_shapes` one shape, a dict of shapes or a list of those
(`InputShapes`), `batch_dim` one of their dimensions (`BatchSize`). A mistake is an
`errors.ConfigError` naming the field and the entry, where it would otherwise fail deep in
partitioning or in TensorFlow. `plan` builds on these (and re-exports the public ones).
"""

from __future__ import annotations

import numbers

import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import hyperparams
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import sequential
from gpipe_tf.nested_map import NestedMap


def BatchSize(p) -> int | None:
    """N, from input_shapes along batch_dim (None without input_shapes).

    Raises:
      errors.ConfigError: for input_shapes that are not shapes (`InputShapes`), or a batch_dim
        that is not a dimension of each of them, or is of unknown size in the first.
    """
    shapes = InputShapes(p)
    if shapes is None:
        return None
    flat = base_layer.FlattenShapes(shapes)
    if not flat:
        raise errors.ConfigError(f'{p.name}: input_shapes {p.input_shapes!r} gives no shape.')
    batch_dim = p.batch_dim
    if not isinstance(batch_dim, int) or isinstance(batch_dim, bool):
        raise errors.ConfigError(f'{p.name}: batch_dim must be an int, got {batch_dim!r}.')
    for shape in flat:
        if not -shape.rank <= batch_dim < shape.rank:
            raise errors.ConfigError(
                f'{p.name}: batch_dim={batch_dim} is not a dimension of input_shapes '
                f'{shape.as_list()} (rank {shape.rank}): expected {-shape.rank} <= batch_dim '
                f'< {shape.rank}.')
    size = flat[0][batch_dim]
    if size is None:
        raise errors.ConfigError(
            f'{p.name}: input_shapes {flat[0].as_list()} leaves the batch (batch_dim='
            f'{batch_dim}) unknown; give the size of one mini-batch, or input_shapes=None.')
    return int(size)


def InputShapes(p) -> tuple | None:
    """`p.input_shapes` as a tuple of TensorShapes (NestedMaps of them), or None: one shape
    (a list of ints), a dict of them, or a list of those for several inputs.

    Raises:
      errors.ConfigError: for anything else (a string, a number, a list of strings).
    """
    shapes = p.input_shapes
    if shapes is None:
        return None
    try:
        if IsSeveralShapes(shapes):
            return tuple(_ToShapes(s) for s in shapes)
        return (_ToShapes(shapes),)
    except _NotAShape as error:
        raise errors.ConfigError(
            f'{p.name}: input_shapes must be the shape of one mini-batch as a list of ints '
            '(e.g. [128, 64]), a dict of such lists for a NestedMap input, or a list of those '
            f'for several inputs; got {shapes!r}' +
            ('' if error.args[0] is shapes else f', in which {error.args[0]!r} is not one') +
            '.') from None


def IsSeveralShapes(shapes) -> bool:
    """Whether input_shapes value `shapes` gives several inputs' shapes (a list whose first
    entry is itself a shape or a dict of them), not one input's (a list of ints, or a dict)."""
    return (isinstance(shapes, (list, tuple)) and bool(shapes) and
            isinstance(shapes[0], (list, tuple, dict, tf.TensorShape)))


def BodyInputShapes(p) -> tuple | None:
    """The shapes the first cell takes: the input's after the before_tpl layers."""
    shapes = InputShapes(p)
    before = BeforeTpl(p)
    if shapes is None or not before:
        return shapes
    meta, _ = sequential.ChainMeta(before, *shapes)
    return base_layer.AsArgs(meta.out_shapes)


def BodyLayers(p) -> list:
    """The layer_tpl layers' Params, named as the pipeline builds them (`LayerName`).

    Raises:
      errors.ConfigError: unless layer_tpl is a list of layer Params.
    """
    return [Named(p, lp, i)
            for i, lp in enumerate(LayerParamsList(p.name, 'layer_tpl', p.layer_tpl))]


def BeforeLayers(p) -> list:
    """The before_tpl layers' Params, named (their own name, else `layer_<index>`).

    Raises:
      errors.ConfigError: unless before_tpl is a list of layer Params (or None).
    """
    return [Named(p, lp, i) for i, lp in enumerate(BeforeTpl(p))]


def BeforeTpl(p) -> list:
    """`p.before_tpl`, checked (`LayerParamsList`); None is no layers."""
    return [] if p.before_tpl is None else LayerParamsList(p.name, 'before_tpl', p.before_tpl)


def LayerParamsList(where: str, field: str, value) -> list:
    """`value`, the `field` of `where` (a pipeline's name, or the function given it), checked to
    be a list of layer Params: a single Params or a layer's name there would fail deep in
    partitioning, naming neither the field nor the entry."""
    if not isinstance(value, (list, tuple)):
        one = (f'; for one layer, put its Params in a list: {field}=[params]'
               if IsLayerParams(value) else '')
        raise errors.ConfigError(f'{where}: {field} must be a list of layer Params, got '
                                 f'{Describe(value)}{one}.')
    for i, lp in enumerate(value):
        if not IsLayerParams(lp):
            raise errors.ConfigError(
                f'{where}: {field}[{i}] is {Describe(lp)}; expected a layer\'s Params, such '
                'as gpipe_tf.layers.basic.DenseLayer.Params().Set(...).')
    return list(value)


def IsLayerParams(value) -> bool:
    """Whether `value` is the Params of a gpipe_tf layer."""
    return (isinstance(value, hyperparams.InstantiableParams) and isinstance(value.cls, type)
            and issubclass(value.cls, base_layer.BaseLayer))


def Describe(value) -> str:
    """A value's type and (shortened) repr, for messages; Params by their class."""
    if isinstance(value, hyperparams.InstantiableParams):
        return f'Params of {getattr(value.cls, "__name__", value.cls)}'
    text = repr(value)
    return f'{type(value).__name__} {text[:60] + "..." if len(text) > 60 else text}'


def LayerName(p, index: int) -> str:
    """The name of the layer at `index`: its own, or `layer_<index>`."""
    return p.name or f'layer_{index:03d}'


def Named(p, lp, index: int):
    """A copy of layer Params `lp` at `index` of pipeline Params `p`, as the pipeline builds
    it: named (`LayerName`), and computing in the pipeline's fprop_dtype unless it sets its
    own (what CreateChild gives it), so its costs count its activations at that size."""
    lp = lp.Copy().Set(name=LayerName(lp, index))
    if lp.fprop_dtype is None:
        lp.fprop_dtype = p.fprop_dtype
    return lp


class _NotAShape(Exception):
    """A value in input_shapes that is neither a shape nor a dict of shapes (its one arg)."""


def _ToShapes(shapes):
    """Params-friendly shapes (lists of ints, dicts of them) as TensorShapes / NestedMaps.

    Raises:
      _NotAShape: for a value that is neither (`InputShapes` says what was expected).
    """
    if isinstance(shapes, dict):
        return NestedMap({k: _ToShapes(v) for k, v in shapes.items()})
    if isinstance(shapes, tf.TensorShape) and shapes.rank is not None:
        return shapes
    if isinstance(shapes, (list, tuple)) and all(
            d is None or (isinstance(d, numbers.Integral) and not isinstance(d, bool))
            for d in shapes):
        return tf.TensorShape(shapes)
    raise _NotAShape(shapes)
