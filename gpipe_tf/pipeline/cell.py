"""A cell: consecutive layers of a pipeline, run as one unit on one device.

A cell is not a layer of its own. Its layers are the pipeline's children, named by their place in
the model (`model.layer_003`), so nothing a layer is known by depends on the partition: not its
path, its variables' names, its checkpoint keys or its random seeds. A checkpoint written at one K
restores at any other, and the same seed gives the same initial weights at every K. The cell only
groups the layers for the executor: their variables, their theta, and their forward in order.
"""

from __future__ import annotations

from gpipe_tf.layers import sequential
from gpipe_tf.nested_map import NestedMap


class Cell:
    """Layers applied one after another, grouped for one stage of the pipeline.

    Args:
      layers: the layers, in the order they are applied (children of the pipeline).
      path: a name for the cell's traced functions, e.g. `model.cell_1`; no variable or seed
        uses it.
    """

    def __init__(self, layers: list, path: str):
        self._layers = list(layers)
        self.path = path

    @property
    def sequence(self) -> list:
        """The layers in the order they are applied."""
        return list(self._layers)

    @property
    def names(self) -> list[str]:
        return [layer.p.name for layer in self._layers]

    @property
    def vars(self) -> NestedMap:
        """Each layer's variables, keyed by the layer's name."""
        return NestedMap({layer.p.name: layer.vars for layer in self._layers})

    @property
    def variables(self) -> list:
        return [v for layer in self._layers for v in layer.variables]

    @property
    def trainable_variables(self) -> list:
        return [v for layer in self._layers for v in layer.trainable_variables]

    @property
    def theta(self) -> NestedMap:
        """The current values of `vars`."""
        return NestedMap({layer.p.name: layer.theta for layer in self._layers})

    def Theta(self, theta: NestedMap) -> NestedMap:
        """The cell's part of a pipeline's theta (keyed by layer name)."""
        return NestedMap({name: theta[name] for name in self.names})

    def FProp(self, theta: NestedMap, *inputs):
        """The layers applied in order, each to the previous one's outputs; `theta` is the cell's
        (`Theta`)."""
        return sequential.Apply(self._layers, theta, *inputs)
