"""`FunctionalStage`: one stage of a Keras functional model (`graph.Stage`) as a gpipe_tf layer,
a cell of `gpipe_tf.keras.Functional`.

It runs its calls of the model's graph as the model runs them (`graph.Graph.Run`: each node's
layer on the tensors its node names, with Keras's `training` flag), on the tensors
it receives, and gives on the tensors later stages read. It is a `keras_layer.KerasLayer`
whose Keras layer is the whole model but whose variables are those of the layers it calls,
mapped in one stateless scope, so re-materialization, dropout seeds and batch norm's moving
statistics work as for any Keras layer in a pipeline. A layer that an earlier stage calls too
(a tied embedding) keeps its weights on that stage's device; this stage reads them there.
"""

from __future__ import annotations

import math
import weakref

import tensorflow as tf

from gpipe_tf.keras import graph as graph_lib
from gpipe_tf.keras import keras_layer
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import embedding

_GRAPHS = weakref.WeakKeyDictionary()  # model -> its Graph, read once.


def GraphOf(model) -> graph_lib.Graph:
    """The model's `graph.Graph`, made once per model."""
    if model not in _GRAPHS:
        _GRAPHS[model] = graph_lib.Graph(model)
    return _GRAPHS[model]


class FunctionalStage(keras_layer.KerasLayer):
    """A stage of a functional Keras model (see the module docstring)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('calls', [], 'The positions of the nodes the stage calls (`graph.Stage`).')
        p.Define('stage_inputs', [], 'The keys of the tensors the stage receives, in order.')
        p.Define('stage_outputs', [], 'The keys of the tensors the stage gives on, in order.')
        p.Define('earlier_layers', [],
                 'Names of the layers it calls whose weights live on an earlier stage.')
        return p

    def _Stage(self) -> graph_lib.Stage:
        return graph_lib.Stage(tuple(self.p.calls), tuple(self.p.stage_inputs),
                               tuple(self.p.stage_outputs))

    def _KerasVariables(self) -> tuple[list, list]:
        layers = GraphOf(self.keras_layer).StageLayers(self._Stage())
        trainable, state = {}, {}
        for layer in layers:
            if layer.name not in self.p.earlier_layers:
                _MoveHere(layer)
            trainable.update((id(v), v) for v in layer.trainable_variables)
            state.update((id(v), v) for v in layer.non_trainable_variables)
        return list(trainable.values()), list(state.values())

    @property
    def stage_layers(self) -> list:
        """The layers this stage calls, each once, in order."""
        return GraphOf(self.keras_layer).StageLayers(self._Stage())

    @property
    def placed_variables(self) -> list:
        """The tf.Variables that live on the cell's device: those of the layers this stage
        calls first (seed states apart, as `KerasLayer.placed_variables`)."""
        earlier = {id(w.value) for layer in GraphOf(self.keras_layer).StageLayers(self._Stage())
                   if layer.name in self.p.earlier_layers for w in layer.weights}
        return [v for v in super().placed_variables if id(v) not in earlier]

    def _Call(self, inputs: tuple, keywords, training: bool):
        del keywords  # A stage receives every tensor it reads positionally.
        graph = GraphOf(self.keras_layer)
        values = graph.Run(self.p.calls, dict(zip(self.p.stage_inputs, inputs)), training)
        given = tuple(values[key] for key in self.p.stage_outputs)
        return given[0] if len(given) == 1 else given

    @classmethod
    def PassedLeaves(cls, p) -> dict[int, int]:
        """The tensors the stage receives and gives on without any of its calls reading them
        (a skip connection to a later stage): {input position: output position}. Given None
        for one, `_Call` gives None (`graph.Graph.Run` looks it up), so the executor sends the
        tensor straight from the stage that made it to the one that reads it."""
        graph = GraphOf(keras_layer.Resolve(p.layer))
        read = {key for position in p.calls for key in graph.Reads(position)}
        outputs = list(p.stage_outputs)
        return {i: outputs.index(key) for i, key in enumerate(p.stage_inputs)
                if key in outputs and key not in read}

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        model = keras_layer.Resolve(p.layer)
        graph = GraphOf(model)
        stage = graph_lib.Stage(tuple(p.calls), tuple(p.stage_inputs), tuple(p.stage_outputs))
        batch = input_shapes[0][0] if input_shapes and input_shapes[0].rank else None

        def Shape(key):
            return tf.TensorShape([batch] + list(graph.tensors[key].shape[1:]))

        out = tuple(Shape(key) for key in stage.outputs)
        out_shapes = out[0] if len(out) == 1 else out
        layers = [l for l in graph.StageLayers(stage) if l.name not in p.earlier_layers]
        num_params = sum(l.count_params() for l in layers)
        # Keras reports no FLOPs: 2 per trainable parameter and position of each call's first
        # input (exact for Dense), as `KerasLayer.FPropMeta` estimates them.
        flops, sparse_bytes = 0, 0
        sparse = graph.SparseTables()
        for position in stage.calls:
            layer = graph.LayerOf(position)
            tensors = graph.nodes[position].arguments.keras_tensors
            if layer is None or not tensors:
                continue
            shape = [batch] + list(tensors[0].shape[1:])
            elements = math.prod(d or 1 for d in shape)
            positions = elements // max(shape[-1] or 1, 1) if len(shape) > 1 else elements
            flops += 2 * positions * sum(math.prod(v.shape) for v in layer.trainable_variables)
            if id(layer) in sparse:  # A gather: a row per id.
                sparse_bytes += embedding.SparseGradientBytes(elements, layer.output_dim,
                                                              layer.embeddings.dtype)
        # A dimension unknown until the step runs (a sequence's length) counts as 1.
        known = tuple(tf.TensorShape([d or 1 for d in shape.as_list()]) for shape in out)
        return base_layer.LayerMeta(
            out_shapes=out_shapes, flops=flops, num_params=num_params,
            activation_bytes=base_layer.ActivationBytes(known, p),
            sparse_params=sum(l.input_dim * l.output_dim for l in layers if id(l) in sparse),
            sparse_gradient_bytes=sparse_bytes)

def _MoveHere(layer) -> None:
    """Gives each Keras variable of the built `layer` a new tf.Variable of its value, made on
    the current device (the cell's: the pipeline builds its cells under their `tf.device`), as
    the variable's storage: Keras's TensorFlow backend takes a tf.Variable given to a variable's
    `_initialize` as its storage (`weights.Wrap` relies on the same). The Keras variable stays
    the one object the layer, the model and an optimizer know; a tf.Variable cannot move, so a
    layer built before the pipeline (a functional model's are) would otherwise keep its weights
    where it was built. Seed states stay: a call only reads them."""
    for variable in layer.weights:
        if variable.path.endswith(keras_layer.SEED_STATE):
            continue
        old = variable.value
        variable._initialize(tf.Variable(  # pylint: disable=protected-access
            old.read_value(), trainable=old.trainable, name=old.name.split(':')[0],
            dtype=old.dtype, aggregation=old.aggregation, synchronization=old.synchronization))
