"""The leaves of nests of tensors that gradients flow through: a pipeline's inputs, outputs and
boundaries are nests whose float tensors are differentiated and whose other leaves (integer ids,
masks, None) are carried along."""

from __future__ import annotations

import tensorflow as tf


def IsFloat(x) -> bool:
    return x is not None and x.dtype.is_floating


def Present(structure) -> list:
    """The leaves of a nest that are not None, in `tf.nest` order (IndexedSlices are leaves)."""
    return [x for x in tf.nest.flatten(structure) if x is not None]


def FloatLeaves(structure) -> list:
    """The floating-point tensors of a nest, in `tf.nest` order: what gradients flow through."""
    return [x for x in tf.nest.flatten(structure) if IsFloat(x)]


def WithNone(structure, positions):
    """`structure` with None for its flat leaves at `positions` (indices in `tf.nest` order)."""
    positions = set(positions)
    if not positions:
        return structure
    return tf.nest.pack_sequence_as(structure, [
        None if i in positions else x for i, x in enumerate(tf.nest.flatten(structure))])


def PassedOn(outputs, inputs, passed: dict):
    """`outputs` with, for each {input leaf: output leaf} of `passed` (a layer's
    `PassedLeaves`), the output leaf replaced by that leaf of `inputs` (flat `tf.nest`
    positions; `inputs` a nest or its flat list): what a cell gives on, its skips included."""
    if not passed:
        return outputs
    flat, given = tf.nest.flatten(outputs), tf.nest.flatten(inputs)
    for i, o in passed.items():
        flat[o] = given[i]
    return tf.nest.pack_sequence_as(outputs, flat)


def Identity(structure):
    """`tf.identity` of every tensor of a nest (None leaves stay None)."""
    return tf.nest.map_structure(lambda x: tf.identity(x) if x is not None else None, structure)


def WithFloatLeaves(structure, float_values) -> list:
    """The flat leaves of `structure` with its float leaves replaced by `float_values` and the
    others by None."""
    values = iter(float_values)
    return [next(values) if IsFloat(x) else None for x in tf.nest.flatten(structure)]


def Specs(structure):
    """The TensorSpec of every tensor of a nest (None leaves stay None)."""
    return tf.nest.map_structure(
        lambda x: None if x is None else tf.TensorSpec(x.shape, x.dtype), structure)
