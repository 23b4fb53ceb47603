"""What `model.summary(expand_nested=True)` lists inside a `Pipeline`: one row per cell
(`cell_0`, ...), with the cell's layers nested under it, and their parameter counts.

Keras's summary (`keras/src/utils/summary_utils.py`) expands a layer whose `layers` attribute
lists others, and reads of each row its `name`, class name, `count_params()` and output shape.
A pipeline's cells are no Keras layers: they group the pipeline's layers, which are Keras layers
(`Pipeline.FromKeras`, rows of their own) or gpipe_tf layers (tf.Modules, shown by `LayerRow`).
So the rows here are read-only views, made when the summary asks and held by nothing: Keras's
saving walks a layer's attributes, and views that were Keras layers would be saved as layers of
their own, which would move their layers' weights in the weight files.
"""

from __future__ import annotations

import functools
from typing import Callable

from gpipe_tf.keras import functional_stage
from gpipe_tf.keras import keras_layer


class Row:
    """A row of Keras's summary that is not a Keras layer.

    Args:
      name: the row's name.
      layers: the rows nested under it (Keras layers or `Row`s).
      output_shape: a function giving the row's output shape (a tuple, or a tuple of them), or
        None where it is not known; called only when the summary prints it.
    """

    built = True
    # What summary_utils.format_layer_shape reads before `output_shape`: a view takes part in
    # no Keras call (no nodes); a non-empty build dict says that `output_shape` is known.
    _inbound_nodes = ()

    def __init__(self, name: str, layers: list, output_shape: Callable[[], tuple | None]):
        self.name = name
        self.layers = list(layers)
        self._output_shape = output_shape

    @property
    def _build_shapes_dict(self) -> dict:
        return {'input_shape': None} if self.output_shape is not None else {}

    @property
    def output_shape(self) -> tuple | None:
        return self._output_shape()

    @property
    def weights(self) -> list:
        return [w for layer in self.layers for w in layer.weights]

    @property
    def trainable(self) -> bool:
        return any(layer.trainable for layer in self.layers)

    def count_params(self) -> int:
        return sum(layer.count_params() for layer in self.layers)


class Cell(Row):
    """A cell of the pipeline: its layers, in order."""


class LayerRow(Row):
    """A gpipe_tf layer (a tf.Module) of the pipeline: its variables, under its own name."""

    def __init__(self, layer, output_shape: Callable[[], tuple | None]):
        super().__init__(layer.p.name, [], output_shape)
        self._variables = layer.vars.Flatten()

    @property
    def weights(self) -> list:
        return list(self._variables)

    @property
    def trainable(self) -> bool:
        return any(v.trainable for v in self._variables)

    def count_params(self) -> int:
        return sum(int(v.shape.num_elements()) for v in self._variables)


@functools.cache
def _RowClass(layer_class: type) -> type:
    """A `LayerRow` class named as `layer_class`: the summary prints a row's class name, and a
    row of a DenseLayer should say DenseLayer."""
    return type(layer_class.__name__, (LayerRow,), {'__module__': __name__,
                                                   '__doc__': LayerRow.__doc__})


def Rows(pipeline, output_shapes: Callable[[], dict | None]) -> list:
    """The summary's rows inside a PipeliningLayer `pipeline`: its before_tpl layers, then one
    `Cell` per cell, its layers nested (Keras layers as themselves).

    Args:
      pipeline: the PipeliningLayer.
      output_shapes: a function giving each layer's output shape by its name (None before the
        pipeline is built), called only when the summary prints the shapes.
    """
    output_shapes = functools.cache(output_shapes)  # One chain of FPropMeta per summary.

    def ShapeOf(name):
        def Shape():
            shapes = output_shapes()
            return None if shapes is None else shapes[name]
        return Shape

    def LayerRowsOf(layer):
        if isinstance(layer, functional_stage.FunctionalStage):
            return layer.stage_layers  # A functional model's stage: the layers it calls.
        if isinstance(layer, keras_layer.KerasLayer):
            return [layer.keras_layer]
        return [_RowClass(type(layer))(layer, ShapeOf(layer.p.name))]

    in_cells = {id(layer) for cell in pipeline.cells for layer in cell.sequence}
    rows = [row for layer in pipeline.Layers() if id(layer) not in in_cells
            for row in LayerRowsOf(layer)]
    for k, cell in enumerate(pipeline.cells):
        # A cell's output is its last layer's.
        rows.append(Cell(f'cell_{k}', [row for layer in cell.sequence
                                       for row in LayerRowsOf(layer)],
                         ShapeOf(cell.sequence[-1].p.name)))
    return rows
