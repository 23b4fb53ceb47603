"""A functional model's calls run on an example micro-batch: each tensor's value (what a cut
carries, in bytes) and each call's measured training time (`partition_method='time'`).

torch's `pipeline(module, mb_args)` traces a model on an example micro-batch; `Functional`
takes one the same way (`example_inputs`), or synthesizes one where every input's shape is
known but the batch. A call is timed as the pipeline runs it: one `FunctionalStage` of that call
alone, measured by `perf.measured_costs` (its training forward, its backward, on the first
cell's device) on the values the calls before it computed from the example, so a cut balances
measured time as `Pipeline.FromKeras(partition_method='time')` does for a list of layers.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.keras import functional_stage
from gpipe_tf.keras import graph as graph_lib
from gpipe_tf.keras import keras_layer
from gpipe_tf.perf import measured_costs
from gpipe_tf.pipeline import plan as plan_lib

# The micro-batch synthesized without example inputs and without micro_batch_size.
SYNTHESIZED_MICRO_BATCH = 16


def ExampleInputs(graph: graph_lib.Graph, example_inputs, micro_batch_size: int | None,
                  what: str) -> list:
    """The model's flat inputs for one micro-batch: `example_inputs` (as the model takes its
    inputs), or synthesized (uniform floats, zero integers: valid ids and masks) where every
    input's shape is known but the batch.

    Raises:
      errors.ConfigError: without example inputs, for an input with a dimension known only
        when the model runs (a sequence's length); for example inputs of another structure.
    """
    keys = graph.inputs
    if example_inputs is not None:
        flat = keras.tree.flatten(example_inputs)
        if len(flat) != len(keys):
            raise errors.ConfigError(
                f'{graph_lib.MODEL}: example_inputs has {len(flat)} input(s); '
                f'{graph.model.name} takes {len(keys)}.')
        return [tf.convert_to_tensor(x, dtype=graph.tensors[key].dtype)
                for x, key in zip(flat, keys)]
    size = micro_batch_size or SYNTHESIZED_MICRO_BATCH
    tensors = [graph.tensors[key] for key in keys]
    for tensor in tensors:
        if any(d is None for d in tensor.shape[1:]):
            raise errors.ConfigError(
                f'{graph_lib.MODEL}: {what} needs example_inputs= (a micro-batch of the '
                f'model\'s inputs, as torch\'s mb_args): input {tensor.name!r} has shape '
                f'{tuple(tensor.shape)}, known only when the model runs.')
    return measured_costs.SynthesizedInputs([[size] + list(t.shape[1:]) for t in tensors],
                                            [t.dtype for t in tensors])


def Values(graph: graph_lib.Graph, inputs: list) -> dict:
    """Every tensor of the graph (by key) computed from the flat `inputs`, in inference."""
    return graph.Run(graph.calls, dict(zip(graph.inputs, inputs)), training=False)


def Bytes(values: dict, keys) -> int:
    """The bytes of the tensors `keys` of `values`."""
    return sum(int(np.prod(values[key].shape, dtype=np.int64)) *
               tf.as_dtype(values[key].dtype).size for key in keys)


def MeasuredSeconds(graph: graph_lib.Graph, p, values: dict, device: str) -> list[float]:
    """Per call, in order, its measured share of a training step (forward, backward, and the
    forward again where a cell re-materializes: `LayerCost.StepSeconds`) on the tensors of
    one micro-batch, on `device`.

    Args:
      graph: the model's graph.
      p: the PipeliningLayer Params (recompute, num_cells, virtual_stages).
      values: every tensor of the graph on one micro-batch (`Values` of `ExampleInputs`).
      device: the device to time on (the first cell's).
    """
    handle = keras_layer.Handle(graph.model)
    recompute = plan_lib.AnyRematerialized(p)
    seconds = []
    for position in graph.calls:
        reads = tuple(dict.fromkeys(graph.Reads(position)))
        outputs = [f'{position}:{j}' for j in range(len(graph.nodes[position].outputs))]
        layer = graph.LayerOf(position)
        # The layer's weights stay where they are: measured, not moved (`earlier_layers`).
        call = functional_stage.FunctionalStage.Params().Set(
            name=f'call_{position}', layer=handle, calls=[position], stage_inputs=list(reads),
            stage_outputs=outputs, earlier_layers=[layer.name] if layer is not None else [])
        operation = graph.nodes[position].operation
        config = operation.get_config() if hasattr(operation, 'get_config') else {}

        def KeyOf(_, operation=operation, config=config):
            return json.dumps([type(operation).__module__, type(operation).__name__,
                               {k: v for k, v in config.items() if k != 'name'}],
                              sort_keys=True, default=str)

        cost, = measured_costs.MeasureLayers([call], tuple(values[key] for key in reads),
                                             device, key_of=KeyOf)
        seconds.append(cost.StepSeconds(recompute))
    return seconds
