"""A Keras functional model's graph as a pipeline cuts it: its layer calls in one topological
order, cut into stages, and the tensors each cut carries.

A functional model (`keras.Model(inputs, outputs)`) is a graph of nodes, one per call of a layer
(or of a `keras.ops` operation) on the tensors of earlier calls. Ordered by depth (a node's
inputs come from deeper nodes), its calls form a sequence any contiguous cut of which is a
valid pipeline stage: everything a call reads is computed in its stage or an earlier one. A
stage receives, from the stage before it, every tensor computed earlier that it or a later stage
reads (a skip connection is listed by the stages between, which only carry it: the executors
send it past them, `functional_stage.FunctionalStage.PassedLeaves`), and the model's
inputs; the last stage gives the model's outputs.

A nested functional model called on its inputs (a keras_hub backbone inside its task) is looked
into: its calls take the place of its own, so a cut may fall between its layers and automatic
cuts see them. A layer that is not a functional model (a `TransformerDecoder` block) is one
call, never split.

A layer called twice (a shared layer, a tied embedding) may be called in two stages: it is one
layer with one set of weights, placed on the device of the first stage that calls it
(`Owners`), and read by the later one. The gradient of a weight read by two stages is the sum of
the two stages' gradients (each stage's theta reads it; the tape adds them).

Tensors are named by text, `'<node>:<output>'` (the node's position in the order, the
output's index), so that a stage's Params can hold them.
"""

from __future__ import annotations

import dataclasses

import keras

from gpipe_tf import errors
from gpipe_tf.pipeline import partition

# What the messages call the model class.
MODEL = 'gpipe_tf.keras.Functional'


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a cut graph.

    Attributes:
      calls: the positions (in `Graph.nodes`) of the nodes it calls, in order.
      inputs: the keys of the tensors it receives, in order.
      outputs: the keys of the tensors it gives on, in order (the last stage: the model's
        flat outputs).
    """
    calls: tuple
    inputs: tuple
    outputs: tuple


class Graph:
    """The calls of a functional model, in one topological order.

    Args:
      model: a `keras.Model` built from `keras.Input`s (a Functional).

    Raises:
      errors.ConfigError: for a model that is not a functional one (a subclassed model or a
        `keras.Sequential` without an input).
    """

    def __init__(self, model):
        if not _IsFunctional(model):
            raise errors.ConfigError(
                f'{MODEL} takes a functional keras.Model (built from keras.Input); got '
                f'{type(model).__name__}. For a list of layers use gpipe_tf.keras.Sequential.')
        self.model = model
        # Keras's Functional keeps its graph in these (as keras.src.ops.function.Function
        # runs it); no public API gives the nodes.
        self.input_structure = model._inputs_struct  # pylint: disable=protected-access
        self.output_structure = model._outputs_struct  # pylint: disable=protected-access
        self.nodes = []  # Input nodes and calls, nested models' calls in place of theirs.
        self._keys = {}  # id(KerasTensor) -> key (a nested model's tensors too).
        self.tensors = {}  # key -> KerasTensor.
        self._opaque = []  # The nested functional models called as one layer.
        self._Add(model, top=True)
        self.inputs = tuple(self.KeyOf(t) for t in keras.tree.flatten(self.input_structure))
        self.outputs = tuple(self.KeyOf(t) for t in keras.tree.flatten(self.output_structure))
        # The nodes that call something (not the inputs), in order.
        self.calls = tuple(i for i, node in enumerate(self.nodes) if not node.is_input)

    def _Add(self, model, top: bool) -> None:
        """Appends the nodes of `model`, deepest first (a node's inputs are made by deeper
        nodes), a call of a nested functional model replaced by its own nodes: its inputs
        are the call's arguments, the call's outputs its outputs. A nested model's input
        nodes are not nodes of the graph (`top` False)."""
        by_depth = model._nodes_by_depth  # pylint: disable=protected-access
        for node in (n for depth in sorted(by_depth, reverse=True) for n in by_depth[depth]):
            if node.is_input:
                if top:
                    self._Append(node)
                continue
            inner = _Inlined(node)
            if inner is None:
                if _IsFunctional(node.operation):
                    self._opaque.append(node.operation)
                self._Append(node)
                continue
            # pylint: disable=protected-access
            for outer, own in zip(keras.tree.flatten(node.arguments.args[0]),
                                  keras.tree.flatten(inner._inputs_struct)):
                self._keys[id(own)] = self.KeyOf(outer)
            self._Add(inner, top=False)
            for outer, own in zip(node.outputs, keras.tree.flatten(inner._outputs_struct)):
                self._keys[id(outer)] = self.KeyOf(own)
            # pylint: enable=protected-access

    def _Append(self, node) -> None:
        position = len(self.nodes)
        self.nodes.append(node)
        for j, tensor in enumerate(node.outputs):
            key = f'{position}:{j}'
            self._keys[id(tensor)] = key
            self.tensors[key] = tensor

    def KeyOf(self, tensor) -> str:
        """The key of a tensor of the model (or of a nested model's, looked into)."""
        return self._keys[id(tensor)]

    def Fill(self, position: int, values: dict) -> tuple[tuple, dict]:
        """The arguments of node `position`, its tensors taken from `values` (by key)."""
        node = self.nodes[position]
        return node.arguments.fill_in(
            {id(t): values[self.KeyOf(t)] for t in node.arguments.keras_tensors})

    def Run(self, positions, values: dict, training) -> dict:
        """Runs the calls `positions` in order as the model runs them (Keras's functional call:
        each node's operation on the values its node names, the model's training flag to every
        layer that takes one), adding their outputs to `values` (by key), which it returns."""
        for position in positions:
            node = self.nodes[position]
            args, kwargs = self.Fill(position, values)
            operation = node.operation
            if getattr(operation, '_call_has_training_arg', False):
                kwargs['training'] = training
            for j, value in enumerate(keras.tree.flatten(operation(*args, **kwargs))):
                values[f'{position}:{j}'] = value
        return values

    def Reads(self, position: int) -> list[str]:
        """The keys of the tensors node `position` reads."""
        return [self.KeyOf(t) for t in self.nodes[position].arguments.keras_tensors]

    def LayerOf(self, position: int):
        """The Keras layer node `position` calls, or None (a keras.ops operation)."""
        operation = self.nodes[position].operation
        return operation if isinstance(operation, keras.layers.Layer) else None

    def NestedNote(self) -> str:
        """'' or a sentence naming the nested functional models called as one layer each (a
        call the cut cannot follow into: not on one structure of its inputs), whose own layers
        a cut does not reach."""
        if not self._opaque:
            return ''
        what = 'is a functional model' if len(self._opaque) == 1 else 'are functional models'
        return (f' {", ".join(m.name for m in self._opaque)} {what} called as one layer '
                '(with arguments other than one structure of its inputs), whose own layers '
                'a cut does not reach: call it on its inputs alone to have it looked into.')

    def SparseTables(self) -> set:
        """The ids of the Embedding layers whose gradient is a gather's (IndexedSlices): every
        call of theirs reads integer ids. A table also called on vectors (a tied embedding's
        reverse call, a matrix product) gets a dense gradient, summed over its calls."""
        tables, dense = set(), set()
        for position in self.calls:
            layer = self.LayerOf(position)
            if not isinstance(layer, keras.layers.Embedding):
                continue
            tensors = self.nodes[position].arguments.keras_tensors
            gathers = bool(tensors) and 'int' in str(tensors[0].dtype)
            (tables if gathers else dense).add(id(layer))
        return tables - dense

    def Costs(self) -> list[int]:
        """Per call, in order, the parameters it brings: its layer's, at the layer's first
        call (a shared layer's weights count once)."""
        seen, costs = set(), []
        for position in self.calls:
            layer = self.LayerOf(position)
            if layer is None or id(layer) in seen:
                costs.append(0)
                continue
            seen.add(id(layer))
            costs.append(layer.count_params())
        return costs

    def Bounds(self, num_stages: int, split_points=None, balance=None,
               costs=None) -> list[int]:
        """Stage boundaries over `calls` ([0, b_1, ..., len(calls)]): at the first call of each
        layer named in `split_points` (a new stage begins there, as torch's
        SplitPoint.BEGINNING), else by `balance` (calls per stage), else balancing `costs`
        (one per call; default: parameters, `Costs`).

        Raises:
          errors.ConfigError: for a name that is no layer of the model, split points out of
            topological order or repeated, a balance that does not add up.
        """
        count = len(self.calls)
        if split_points is not None:
            if isinstance(split_points, str) or not isinstance(split_points, (list, tuple)):
                raise errors.ConfigError(
                    f'{MODEL}: split_points must be a list of layer names; got '
                    f'{type(split_points).__name__} {split_points!r}.')
            first = {}
            for index, position in enumerate(self.calls):
                layer = self.LayerOf(position)
                if layer is not None:
                    first.setdefault(layer.name, index)
            bounds = [0]
            for name in split_points:
                if name not in first:
                    raise errors.ConfigError(
                        f'{MODEL}: split point {name!r} is no layer of {self.model.name}; its '
                        f'layers are {", ".join(sorted(first)) or "none"}.{self.NestedNote()}')
                if first[name] <= bounds[-1]:
                    raise errors.ConfigError(
                        f'{MODEL}: split point {name!r} does not come after the one before it '
                        f'in the model\'s order of calls ({", ".join(split_points)}); give them '
                        'in the order the model calls them, each once, none at its first call.')
                bounds.append(first[name])
            return bounds + [count]
        try:
            if balance is not None:
                if (not isinstance(balance, (list, tuple)) or len(balance) != num_stages or
                        sum(balance) != count or
                        not all(isinstance(n, int) and n > 0 for n in balance)):
                    raise ValueError(f'balance must give {num_stages} positive numbers of calls '
                                     f'that add up to the model\'s {count}; got {balance!r}')
                bounds = [0]
                for n in balance:
                    bounds.append(bounds[-1] + n)
                return bounds
            return partition.OptimalBoundaries(self.Costs() if costs is None else costs,
                                               num_stages)
        except ValueError as error:
            raise errors.ConfigError(f'{MODEL}: {str(error).rstrip(".")}.') from None

    def Stages(self, bounds: list[int]) -> list[Stage]:
        """The stages of `bounds` (`Bounds`), with what each receives and gives on."""
        stage_calls = [self.calls[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        # Per tensor, the last stage that reads it (a model output: past the last stage).
        last_read = {}
        for s, calls in enumerate(stage_calls):
            for position in calls:
                for key in self.Reads(position):
                    last_read[key] = max(last_read.get(key, -1), s)
        for key in self.outputs:
            last_read[key] = len(stage_calls)
        stages, received = [], self.inputs
        for s, calls in enumerate(stage_calls):
            made = [f'{p}:{j}' for p in calls for j in range(len(self.nodes[p].outputs))]
            if s == len(stage_calls) - 1:
                given = self.outputs
            else:
                alive = dict.fromkeys(k for k in list(received) + made
                                      if last_read.get(k, -1) > s)
                given = tuple(alive)
            stages.append(Stage(tuple(calls), tuple(received), tuple(given)))
            received = given
        return stages

    def Owners(self, stages: list[Stage]) -> dict:
        """Per layer (by id), the first stage that calls it: where its weights live."""
        owners = {}
        for s, stage in enumerate(stages):
            for position in stage.calls:
                layer = self.LayerOf(position)
                if layer is not None:
                    owners.setdefault(id(layer), s)
        return owners

    def StageLayers(self, stage: Stage) -> list:
        """The layers a stage calls, each once, in order."""
        layers = {}
        for position in stage.calls:
            layer = self.LayerOf(position)
            if layer is not None:
                layers.setdefault(id(layer), layer)
        return list(layers.values())


def _IsFunctional(model) -> bool:
    """Whether `model` is a functional keras.Model (a graph of nodes from keras.Input)."""
    return isinstance(model, keras.Model) and hasattr(model, '_nodes_by_depth')


def _Inlined(node):
    """The functional model `node` calls, if the cut can look into the call: the model is
    called on one structure of its inputs (keras_hub's backbone in a task), with no argument
    but Keras's own `mask` (None) and `training`; else None (called as one layer)."""
    model = node.operation
    if not _IsFunctional(model):
        return None
    arguments = node.arguments
    if len(arguments.args) != 1 or any(
            value is not None for key, value in arguments.kwargs.items()
            if key not in ('mask', 'training')):
        return None
    try:
        keras.tree.assert_same_structure(
            arguments.args[0], model._inputs_struct)  # pylint: disable=protected-access
    except (ValueError, TypeError):
        return None
    return model
