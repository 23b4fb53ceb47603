"""A pipeline cell's traced forward and re-materializing backward.

Each cell is traced once into a forward function and once into a backward function, and both are
called once per micro-batch, so the graph grows with M by one call op, not by the cell's layers.

The backward function recomputes the cell's forward from the cell's input and then differentiates
it. Its recompute waits on the incoming gradient (a control dependency on `dy`), so it runs during
backprop in every mode; `tf.recompute_grad` was measured to recompute during the forward pass in a
tf.compat.v1 graph, saving nothing there, which is why this module exists.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.layers import base_layer
from gpipe_tf.layers import fprop_context
from gpipe_tf.nested_map import NestedMap

# The name scope of a backward's re-materialized forward, so a trace tells it from the gradients.
RECOMPUTE_SCOPE = 'recompute'


def IsFloat(x) -> bool:
    return x is not None and x.dtype.is_floating


def FloatLeaves(structure) -> list:
    """The floating-point tensors of a nest, in `tf.nest` order: what gradients flow through."""
    return [x for x in tf.nest.flatten(structure) if IsFloat(x)]


def Identity(structure):
    """`tf.identity` of every tensor of a nest (None leaves stay None)."""
    return tf.nest.map_structure(lambda x: tf.identity(x) if x is not None else None, structure)


def WithFloatLeaves(structure, float_values) -> list:
    """The flat leaves of `structure` with its float leaves replaced by `float_values` and the
    others by None."""
    values = iter(float_values)
    return [next(values) if IsFloat(x) else None for x in tf.nest.flatten(structure)]


class CellFunctions:
    """The traced forward and backward functions of one cell on one device.

    Args:
      cell: the cell (`cell.Cell`); `cell.FProp(theta, *args)`.
      device: the device string every op of the cell is placed on.
      batch_dim: the inputs' batch dimension (the layers' per-example randomness counts
        examples along it).
    """

    def __init__(self, cell, device: str, batch_dim: int = 0):
        self.cell = cell
        self.device = device
        self.batch_dim = batch_dim
        # Per leaf of the cell's theta, whether it is trainable (and so gets a gradient).
        self.trainable = [v.trainable for v in tf.nest.flatten(cell.vars)]
        # Layers that report training updates, in the order they report them; set when the
        # training forward is first traced.
        self.update_layers: list | None = None
        self._forward = {
            training: tf.function(self._MakeForward(training), autograph=False)
            for training in (True, False)}
        self._backward = tf.function(self._Backward, autograph=False)
        self._backward_input = tf.function(self._BackwardInput, autograph=False)
        self._backward_weight = tf.function(self._BackwardWeight, autograph=False)

    def _Scope(self, step, first_example, training, collector=None):
        """The layers' context for one micro-batch; updates go to `collector` (by default one
        that is dropped: a recompute's statistics were already reported by the forward)."""
        return fprop_context.Scope(
            training=training, step=step, first_example=first_example, batch_dim=self.batch_dim,
            update_collector=(fprop_context.UpdateCollector() if collector is None else collector))

    def _Run(self, theta, inputs, step, first_example, training):
        collector = fprop_context.UpdateCollector()
        with tf.device(self.device), self._Scope(step, first_example, training, collector):
            outputs = self.cell.FProp(theta, *base_layer.AsArgs(inputs))
        layers = [layer for layer, _ in collector.Items()]
        if training and self.update_layers is None:
            self.update_layers = layers
        stats = [tf.nest.map_structure(tf.stop_gradient, s) for _, s in collector.Items()]
        return outputs, stats

    def _MakeForward(self, training: bool):
        def Forward(theta, inputs, step, first_example):
            return self._Run(theta, inputs, step, first_example, training)
        Forward.__name__ = f'{self.cell.path.replace(".", "_")}_fwd'
        return Forward

    def _Backward(self, theta, inputs, step, first_example, d_outputs):
        """Recomputes the forward once `d_outputs` (gradients of the float outputs) exist, then
        differentiates it.

        Returns:
          (d_theta, d_inputs): flat lists over the leaves of theta and `inputs`, None where a
          theta leaf is not trainable or an input leaf is not floating point.
        """
        with tf.device(self.device):
            with tf.name_scope(RECOMPUTE_SCOPE):
                with tf.control_dependencies(d_outputs):
                    theta = Identity(theta)
                    inputs = Identity(inputs)
                outputs, _ = self._Run(theta, inputs, step, first_example, training=True)
            return Differentiate(outputs, theta, inputs, d_outputs, self.trainable)

    def _BackwardInput(self, theta, inputs, step, first_example, d_outputs):
        """The input gradient alone (a zero-bubble schedule's I): recomputes the forward layer
        by layer once `d_outputs` exist, then takes each layer's input gradient from its output
        gradient, last layer first.

        Returns:
          (d_inputs, flat over the leaves of `inputs` (None where not floating point);
          per layer its input arguments and the gradients of its float outputs, what
          `_BackwardWeight` needs).
        """
        layers = self.cell.sequence
        with tf.device(self.device):
            with tf.name_scope(RECOMPUTE_SCOPE):
                with tf.control_dependencies(d_outputs):
                    theta = Identity(theta)
                    args = Identity(base_layer.AsArgs(inputs))
                layer_inputs, layer_outputs = [], []
                with self._Scope(step, first_example, training=True):
                    for layer in layers:
                        # Fresh sources per layer, so each layer is differentiated alone.
                        args = Identity(args)
                        layer_inputs.append(args)
                        layer_outputs.append(layer.FProp(theta[layer.p.name], *args))
                        args = base_layer.AsArgs(layer_outputs[-1])
            d_y = list(d_outputs)
            layer_d_outputs = [None] * len(layers)
            for i in reversed(range(len(layers))):
                layer_d_outputs[i] = d_y
                d_y = tf.gradients(FloatLeaves(layer_outputs[i]), FloatLeaves(layer_inputs[i]),
                                   grad_ys=d_y,
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return WithFloatLeaves(inputs, d_y), (layer_inputs, layer_d_outputs)

    def _BackwardWeight(self, theta, saved, step, first_example):
        """The weight gradient (a zero-bubble schedule's W) from what `_BackwardInput` saved:
        each layer's forward re-run from its input, differentiated w.r.t. its weights alone.

        Returns:
          d_theta, flat over the leaves of theta (None where not trainable).
        """
        layer_inputs, layer_d_outputs = saved
        d_theta = {}
        with tf.device(self.device):
            for layer, args, d_y in zip(self.cell.sequence, layer_inputs, layer_d_outputs):
                name = layer.p.name
                layer_theta = Identity(theta[name])
                with tf.name_scope(RECOMPUTE_SCOPE), self._Scope(step, first_example, True):
                    outputs = layer.FProp(layer_theta, *args)
                leaves = tf.nest.flatten(layer_theta)
                trainable = [v.trainable for v in tf.nest.flatten(layer.vars)]
                sources = [t for t, keep in zip(leaves, trainable) if keep]
                grads = iter(tf.gradients(FloatLeaves(outputs), sources, grad_ys=d_y,
                                          unconnected_gradients=tf.UnconnectedGradients.ZERO))
                d_theta[name] = tf.nest.pack_sequence_as(
                    theta[name], [next(grads) if keep else None for keep in trainable])
        return tf.nest.flatten(NestedMap(d_theta))

    def ForwardSpecs(self, theta, input_spec, step_spec, training: bool = True):
        """TensorSpecs of the (outputs, statistics) of the cell's forward on inputs of
        `input_spec` (tracing it if it was not)."""
        concrete = self._forward[training].get_concrete_function(theta, input_spec, step_spec,
                                                                 step_spec)
        return tf.nest.map_structure(
            lambda t: None if t is None else tf.TensorSpec(t.shape, t.dtype),
            concrete.structured_outputs)

    def BackwardInput(self, theta, inputs, step, first_example, d_outputs):
        """(flat d_inputs, saved for `BackwardWeight`) for one micro-batch, recomputing its
        forward."""
        with tf.device(self.device):
            return self._backward_input(theta, inputs, step, first_example, d_outputs)

    def BackwardWeight(self, theta, saved, step, first_example):
        """Flat d_theta for one micro-batch from what `BackwardInput` saved."""
        with tf.device(self.device):
            return self._backward_weight(theta, saved, step, first_example)

    def Forward(self, theta, inputs, step, first_example, training: bool = True):
        """(outputs, update stats) of the cell on one micro-batch whose first example has index
        `first_example` (scalar int64 tensor) in the mini-batch; one call op on the device."""
        with tf.device(self.device):
            return self._forward[training](theta, inputs, step, first_example)

    def Backward(self, theta, inputs, step, first_example, d_outputs):
        """(flat d_theta, flat d_inputs) for one micro-batch, recomputing the forward."""
        with tf.device(self.device):
            return self._backward(theta, inputs, step, first_example, d_outputs)


def Differentiate(outputs, theta, inputs, d_outputs, trainable, tape=None):
    """Gradients of `outputs` w.r.t. the trainable leaves of theta and the float leaves of
    `inputs`.

    Args:
      outputs, theta, inputs: the forward computation's outputs, theta and inputs.
      d_outputs: the incoming gradients of the float leaves of `outputs`.
      trainable: per leaf of theta (flattened), whether it is a trainable variable's value;
        the others (batch norm's moving statistics) get no gradient.
      tape: a tape that recorded the forward (eager mode); else tf.gradients (graph mode).

    Returns:
      (flat d_theta with None for non-trainable leaves, flat d_inputs with None for non-float
      leaves).
    """
    ys = FloatLeaves(outputs)
    dys = list(d_outputs)
    sources = [t for t, keep in zip(tf.nest.flatten(theta), trainable) if keep]
    xs = FloatLeaves(inputs)
    if tape is not None:
        grads = tape.gradient(ys, sources + xs, output_gradients=dys,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
    else:
        grads = tf.gradients(ys, sources + xs, grad_ys=dys,
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)
    theta_grads = iter(grads[:len(sources)])
    d_theta = [next(theta_grads) if keep else None for keep in trainable]
    return d_theta, WithFloatLeaves(inputs, grads[len(sources):])

