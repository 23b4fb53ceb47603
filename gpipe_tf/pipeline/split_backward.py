"""A zero-bubble stage's split backward, differentiating the forward's own ops.

A split backward's input gradient I and weight gradient W share one forward: I computes each
layer's output gradient, last layer first, and passes the cell's input gradient on; W later
computes each layer's weight gradient from the layer's kept activations and the output
gradient I computed. A cell's forward as one call op gives tf.gradients nothing to stop at
between its layers, so a stage with a split backward runs its forward as one call per layer
(traced once per layer structure: `recompute.CellFunctions.Layers`):

* keeping its activations (recompute 'never', the last cell under 'except_last'): at F;
* re-materializing: F is the cell's one call (keeping its input), and the per-layer forward
  runs once, at I, after the incoming gradient exists.

W runs no forward: TensorFlow's gradient of each call reads the intermediates the call kept
(the forward's outputs and whatever its gradient needs). Each layer's own backward up to its
weights (a dense layer's activation gradient) is computed by I and again by W; the matrix
products of the two halves are apart. (The looped schedule, `looped.py`, whose I and W run in
other iterations than their forward, splits the cell's traced gradient instead and hands the
residuals on: `residuals.SplitCell`.)
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from gpipe_tf.pipeline import recompute


class Record(NamedTuple):
    """One micro-batch's per-layer forward on one stage: what its I and W differentiate."""
    theta: object  # The cell's theta as the sources of its weight gradients.
    inputs: list  # Per layer, its input (fresh identities: each layer differentiated alone).
    outputs: list  # Per layer, its outputs.


class LayeredCell:
    """A cell's forward as one call per layer, and the two halves of its backward.

    Args:
      functions: the cell's `recompute.CellFunctions` (its device, its layers' traces).
    """

    def __init__(self, functions: recompute.CellFunctions):
        self._functions = functions
        self._layers = functions.Layers()

    def Forward(self, theta, inputs, step, first_example, tape=None):
        """The cell's layers, one call each, on one micro-batch.

        Args:
          theta: the cell's theta, as the tensors its weight gradients are taken w.r.t.
          inputs: the cell's input, a tensor the input gradient is taken w.r.t.
          step, first_example: as `recompute.CellFunctions.Forward`.
          tape: eagerly, the persistent tape that records the calls (theta is watched).

        Returns:
          (the cell's outputs, its layers' statistics in the order they report them, the
          `Record` for `InputGradient` and `WeightGradient`).
        """
        if tape is not None:
            tape.watch(tf.nest.flatten(theta) + recompute.FloatLeaves(inputs))
        layer_inputs, layer_outputs, stats = [], [], []
        x = inputs
        for j, fn in enumerate(self._layers):
            if j:
                x = recompute.Identity(x)
                if tape is not None:
                    tape.watch(recompute.FloatLeaves(x))
            layer_inputs.append(x)
            x, layer_stats = fn.Forward(theta, x, step, first_example)
            layer_outputs.append(x)
            stats += layer_stats
        return x, stats, Record(theta, layer_inputs, layer_outputs)

    def InputGradient(self, record: Record, d_outputs: list, tape=None):
        """I: each layer's output gradient, from the cell's (`d_outputs`, per float leaf of its
        outputs), last layer first.

        Returns:
          (the cell's input gradient, flat over the leaves of its input, None where not
          floating point; per layer the gradients of its float outputs, for `WeightGradient`).
        """
        layer_d_outputs = [None] * len(self._layers)
        d_y = list(d_outputs)
        with tf.device(self._functions.device):
            for j in reversed(range(len(self._layers))):
                layer_d_outputs[j] = d_y
                d_y = recompute.Gradients(recompute.FloatLeaves(record.outputs[j]),
                                 recompute.FloatLeaves(record.inputs[j]), d_y, tape)
        return recompute.WithFloatLeaves(record.inputs[0], d_y), layer_d_outputs

    def WeightGradient(self, record: Record, layer_d_outputs: list, tape=None) -> list:
        """W: each layer's weight gradients from its output gradient (what I computed).

        Returns:
          The cell's theta gradients, flat over the leaves of its theta, None where a leaf is
          not trainable.
        """
        per_layer = []
        with tf.device(self._functions.device):
            for fn, outputs, d_y in zip(self._layers, record.outputs, layer_d_outputs):
                layer = fn.cell.sequence[0]
                theta = tf.nest.flatten(record.theta[layer.p.name])
                sources = [t for t, keep in zip(theta, fn.trainable) if keep]
                grads = iter(recompute.Gradients(recompute.FloatLeaves(outputs), sources, d_y,
                                                 tape))
                per_layer.append(tf.nest.pack_sequence_as(
                    record.theta[layer.p.name],
                    [next(grads) if keep else None for keep in fn.trainable]))
        return self._functions.Flat(per_layer)
