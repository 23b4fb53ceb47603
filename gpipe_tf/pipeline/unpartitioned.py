"""A pipeline's layers chained directly, without the pipeline: the reference that a pipeline's
outputs and gradients equal (docs/architecture.md's invariant 1), for the tests and `--mode=check`.

It reads nothing of the pipeline but its Params' batch_dim and its layers
(`PipeliningLayer.Layers()`, the same objects and so the same tf.Variables): no cell, schedule,
executor, micro-batch split or re-materialization code runs, so a bug there cannot agree with
itself.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.layers import base_layer
from gpipe_tf.layers import fprop_context


def Unpartitioned(pipeline_layer, inputs, num_micro_batches=1, step: int = 0):
    """A PipeliningLayer's layers applied one after another, without the pipeline.

    No devices, no recompute, no pipeline code: each micro-batch (M=1: the whole batch) runs
    through `pipeline_layer.Layers()` under `fprop_context.Scope(step, first_example=the
    examples before it)`. `num_micro_batches` is M equal parts, or a list of the parts' sizes
    (uneven micro-batches, written out by the caller). Training updates (batch norm's moving
    statistics) are collected and dropped, so this changes no state. Only batch norm's
    statistics depend on the micro-batches: the layers' randomness is drawn per example.

    Args:
      pipeline_layer: a built PipeliningLayer (or anything with `p.batch_dim` and `Layers()`).
      inputs: its input, one tensor or a nest, as its FProp takes it.
      num_micro_batches: M, or the sizes of the parts along batch_dim.
      step: the training step the layers draw their random masks for.

    Returns:
      The last layer's outputs, the micro-batches' concatenated along batch_dim.
    """
    batch_dim = pipeline_layer.p.batch_dim
    flat = [tf.split(x, num_micro_batches, batch_dim) for x in tf.nest.flatten(inputs)]
    outputs = []
    first_example = 0
    for m in range(len(flat[0])):
        args = (tf.nest.pack_sequence_as(inputs, [parts[m] for parts in flat]),)
        size = flat[0][m].shape[batch_dim]
        if size == 0:
            continue  # An empty part: the pipeline's empty micro-batch computes nothing.
        with fprop_context.Scope(step=step, first_example=first_example, batch_dim=batch_dim,
                                 update_collector=fprop_context.UpdateCollector()):
            for layer in pipeline_layer.Layers():
                args = base_layer.AsArgs(layer.FProp(layer.theta, *args))
        outputs.append(args[0] if len(args) == 1 else args)
        first_example += size
    return tf.nest.map_structure(lambda *xs: tf.concat(xs, batch_dim), *outputs)
