"""`Functional`: a Keras functional model run as a pipeline as it is, its graph cut into stages.

    import keras
    from gpipe_tf import keras as gpipe_keras

    inputs = keras.Input((32, 32, 3))
    ...                                   # any functional model: skips, several inputs, ...
    model = keras.Model(inputs, outputs)
    pipelined = gpipe_keras.Functional(model, num_micro_batches=8,
                                       split_points=['block_2', 'block_4', 'block_6'],
                                       schedule='1f1b')
    pipelined.compile('adam', 'mse')
    pipelined.fit(x, y, batch_size=64)

The model's layer calls, in one topological order (`graph.Graph`), are cut into K stages: at the
layers named in `split_points` (a new stage begins at each, K = len + 1; torch's
`SplitPoint.BEGINNING`), or, given `num_cells=K`, where the stages' parameter counts are most
even (or their measured training time, `partition_method='time'`, on `example_inputs`: one
micro-batch, as torch's `mb_args`; or `balance=`, calls per stage). Each stage is a cell
(`functional_stage.FunctionalStage`) on a device of its own: it receives every tensor an
earlier stage made that it or a later one reads, and the model's inputs (a padding mask reaches
every stage that reads it). A skip connection from stage 0 to stage 3, which stages 1 and 2
only carry, goes straight from stage 0's device to stage 3's, unrolled or looped
(`FunctionalStage.PassedLeaves`): stages 1 and 2 are not given it.

The layers are the model's own objects. Their weights are moved, when the pipeline is made, to
the device of the first stage that calls them (a layer's Keras variables keep their identity;
their storage is made anew there): the given model then computes with them where they are, and
its `get_weights()`, `save_weights` and `summary()` are the pipelined model's. A layer called by
two stages (a tied embedding, a shared layer) is one set of weights on the first stage's device,
read by the later one; its gradient is the sum over its calls and micro-batches, and it counts
once in `count_params()`.

The model's inputs and outputs are the given model's (several, in dicts or lists); its train
step is `pipeline_model.PipelineModel`'s (the compiled loss per micro-batch on the last stage),
so it trains with every schedule and recompute mode.

A nested functional model called on its inputs (keras_hub's `GPT2CausalLM` calls its
`GPT2Backbone`) is looked into: a split point may name a layer inside it (`transformer_layer_2`),
and automatic cuts see its layers. A keras_hub task given here comes compiled by keras_hub; the
pipelined model is compiled anew, and the task's own compile is not used.

A keras_hub causal LM's `predict`, `evaluate` and `score` run pipelined; `generate` is a
ConfigError that names the given model, whose `generate` runs the same layers and weights.

Not supported, and why: Keras's implicit masks (`_keras_mask`) do not cross a cut (pass masks as
inputs, as keras_hub's padding masks are); a nested model called with other arguments than its
inputs is one layer, in one stage.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.keras import call_costs
from gpipe_tf.keras import functional_stage
from gpipe_tf.keras import graph as graph_lib
from gpipe_tf.keras import keras_layer
from gpipe_tf.keras import names
from gpipe_tf.keras import pipeline as pipeline_lib
from gpipe_tf.keras import pipeline_model
from gpipe_tf.pipeline import devices as devices_lib
from gpipe_tf.pipeline import pipelining_layer

_MODEL = graph_lib.MODEL
PARTITION_METHODS = ('params', 'time')


@names.Registered
class Functional(pipeline_model.PipelineModel):
    """A functional Keras model run as a GPipe pipeline (see the module docstring).

    Args:
      model: the functional `keras.Model`.
      num_cells: K; None takes it from `split_points` (K = len + 1, over v with
        virtual_stages).
      num_micro_batches: M (or give micro_batch_size=).
      split_points: the names of the layers at which a new stage begins, in the order the
        model calls them; None cuts automatically (`balance`, or parameters balanced).
      balance: the number of calls per stage, instead of split points.
      partition_method: how automatic cuts balance the stages: "params" (parameters) or
        "time" (each call's training forward and backward measured on one micro-batch on the
        first cell's device, `call_costs`).
      example_inputs: one micro-batch of the model's inputs (as the model takes them; torch's
        `mb_args`): what "time" measures on, and what `StageReport` counts bytes of. None
        synthesizes one of `micro_batch_size` (or 16) examples where every input's shape is
        known but the batch.
      name: the Keras model's name (default: the given model's with `_pipelined`).
      **params: any PipeliningLayer Param: devices, recompute, schedule, virtual_stages,
        num_replicas, unroll, ...

    Raises:
      errors.ConfigError: for a model that is not functional, split points that are no layers
        or out of order, a K that does not agree with them, and the pipeline's own errors.
    """

    def __init__(self, model=None, num_cells: int | None = None,
                 num_micro_batches: int | None = None, split_points=None, balance=None,
                 partition_method: str = 'params', example_inputs=None,
                 name: str | None = None, **params):
        graph = functional_stage.GraphOf(model)
        super().__init__(name=name or f'{model.name}_pipelined')
        self._arguments = dict(num_cells=num_cells, num_micro_batches=num_micro_batches,
                               split_points=split_points, balance=balance, **params)
        if partition_method not in PARTITION_METHODS:
            raise errors.ConfigError(f'{_MODEL}: partition_method must be one of '
                                     f'{PARTITION_METHODS}; got {partition_method!r}.')
        virtual = params.get('virtual_stages', 1)
        if split_points is not None:
            stages = len(split_points) + 1
            if stages % virtual or (num_cells is not None and num_cells * virtual != stages):
                raise errors.ConfigError(
                    f'{_MODEL}: {len(split_points)} split points make {stages} stages, which '
                    f'is not num_cells ({num_cells}) x virtual_stages ({virtual}).')
            num_cells = stages // virtual
        if num_cells is None:
            raise errors.ConfigError(f'{_MODEL}: give num_cells=K or split_points=[...] (the '
                                     'layers at which stages begin).')
        num_stages = num_cells * virtual
        if len(graph.calls) < num_stages:
            raise errors.ConfigError(
                f'{_MODEL}: {model.name} calls {len(graph.calls)} layers, fewer than the '
                f'{num_stages} stages asked for.{graph.NestedNote()}')
        p = pipelining_layer.PipeliningLayer.Params()
        try:
            p.Set(num_cells=num_cells, num_micro_batches=num_micro_batches)
            p.Set(**params)
        except (AttributeError, ValueError, TypeError) as error:
            raise errors.ConfigError(f'{_MODEL}: {error}') from None
        timed = partition_method == 'time' and split_points is None and balance is None
        # Every tensor of the graph on one micro-batch: what the time cut measures on, and,
        # of the example inputs given, what `StageReport` counts.
        values = (call_costs.Values(graph, call_costs.ExampleInputs(
            graph, example_inputs, p.micro_batch_size, 'partition_method="time"'))
                  if example_inputs is not None or timed else None)
        self._example = values if example_inputs is not None else None
        costs = None
        if timed:
            device = devices_lib.MeshDevices(p.devices, p.num_replicas, p.num_cells)[0][0]
            costs = call_costs.MeasuredSeconds(graph, p, values, device)
        bounds = graph.Bounds(num_stages, split_points, balance, costs)
        if costs is not None:  # A model loaded from its config is cut where this one is.
            self._arguments['balance'] = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        stages = graph.Stages(bounds)
        owners = graph.Owners(stages)
        layer_params = []
        for s, stage in enumerate(stages):
            earlier = [l.name for l in graph.StageLayers(stage) if owners[id(l)] < s]
            layer_params.append(functional_stage.FunctionalStage.Params().Set(
                name=f'stage_{s}', layer=keras_layer.Handle(model), calls=list(stage.calls),
                stage_inputs=list(stage.inputs), stage_outputs=list(stage.outputs),
                earlier_layers=earlier))
        p.Set(layer_tpl=layer_params, partition_method=list(range(num_stages + 1)))
        self._graph = graph
        self._stages = stages
        self._pipeline_layer = pipeline_lib.Pipeline(p, loss_inside=True, name='pipeline')
        self.build(self._InputShapes())

    @property
    def model(self) -> keras.Model:
        """The given functional model, whose layers (and weights) the pipeline runs (tracked
        by the pipeline layer, not here: Keras would list it twice)."""
        return self._graph.model

    @property
    def graph(self) -> graph_lib.Graph:
        """The model's graph as the cut reads it (its calls in order, its tensors' keys)."""
        return self._graph

    @property
    def stages(self) -> list[graph_lib.Stage]:
        """The stages of the cut, in order."""
        return list(self._stages)

    def StageLayers(self, s: int) -> list:
        """The layers stage `s` calls, in order."""
        return self._graph.StageLayers(self._stages[s])

    def StageReport(self, examples: int = 1) -> str:
        """A table: per stage its device, the layers it calls (a layer an earlier stage
        calls too marked `*`: its weights live there), its parameters, the tensors it
        receives and sends, and those it only carries (given on unread: a skip to a later
        stage, which the executors send past it: it is not given them), with their
        bytes: per micro-batch of the `example_inputs` given, else for `examples` examples
        ('?' where a dimension is known only when the model runs)."""
        devices = self._pipeline_layer.pipeline.devices
        rows = [('stage', 'device', 'params', 'receives', 'sends', 'carries', 'layers')]
        for s, stage in enumerate(self._stages):
            stage_params = self._pipeline_layer.params.layer_tpl[s]
            earlier = set(stage_params.earlier_layers)
            carried = {stage.inputs[i] for i in stage_params.cls.PassedLeaves(stage_params)}
            layers = self.StageLayers(s)
            owned = sum(l.count_params() for l in layers if l.name not in earlier)
            rows.append((
                str(s), devices[s], f'{owned:,}',
                self._Bytes([k for k in stage.inputs if k not in carried], examples),
                self._Bytes([k for k in stage.outputs if k not in carried], examples),
                self._Bytes(sorted(carried), examples),
                ', '.join(l.name + ('*' if l.name in earlier else '') for l in layers)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        return '\n'.join('  '.join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) +
                         '  ' + row[-1] for row in rows)

    def _Bytes(self, keys, examples: int) -> str:
        """'<n> tensors, <bytes>' of the tensors `keys`: of the example micro-batch, else for
        `examples` examples."""
        if self._example is not None:
            return f'{len(keys)}, {call_costs.Bytes(self._example, keys):,} B'
        total = 0
        for key in keys:
            tensor = self._graph.tensors[key]
            dims = list(tensor.shape[1:])
            if any(d is None for d in dims):
                return f'{len(keys)}, ?'
            total += examples * int(np.prod(dims, dtype=np.int64)) * tf.as_dtype(
                tensor.dtype).size
        return f'{len(keys)}, {total:,} B'

    def generate(self, *args, **kwargs):
        """Not pipelined: a ConfigError naming the un-pipelined model, whose layers (and so
        weights) are this one's."""
        del args, kwargs
        where = (f'call {self.model.name}.generate(...) instead (pipelined.model): it runs the '
                 'same layers, and so the weights this model trains'
                 if hasattr(self.model, 'generate') else
                 f'{self.model.name} has no generate either')
        raise errors.ConfigError(
            f'{self.name}: generate is not pipelined (incremental decoding runs one token at '
            f'a time, through every stage in turn, with a cache per layer); {where}.')

    def score(self, token_ids, padding_mask=None, scoring_mode: str = 'logits',
              target_ids=None, batch_size: int | None = None):
        """keras_hub's `CausalLM.score`, pipelined: the logits of `token_ids` (batch, length)
        from `predict`, or with scoring_mode="loss" each token's cross-entropy against
        `target_ids` (keras_hub's layer_intercept_fn is not supported: the layers run inside
        the stages)."""
        if scoring_mode not in ('logits', 'loss'):
            raise errors.ConfigError(f'{self.name}: scoring_mode must be "logits" or "loss"; '
                                     f'got {scoring_mode!r}.')
        if scoring_mode == 'loss' and target_ids is None:
            raise errors.ConfigError(f'{self.name}: scoring_mode="loss" needs target_ids.')
        if padding_mask is None:
            padding_mask = np.ones(np.shape(token_ids), bool)
        logits = self.predict({'token_ids': token_ids, 'padding_mask': padding_mask},
                              batch_size=batch_size, verbose=0)
        if scoring_mode == 'logits':
            return logits
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)(
            target_ids, logits)

    def _InputShapes(self):
        shapes = [tuple(self._graph.tensors[key].shape) for key in self._graph.inputs]
        return shapes[0] if len(shapes) == 1 else tuple(shapes)

    def _PipelineInputs(self, inputs):
        flat = keras.tree.flatten(inputs)
        if len(flat) != len(self._graph.inputs):
            expected = keras.tree.map_structure(lambda t: t.name, self._graph.input_structure)
            raise errors.ConfigError(
                f'{self.name}: {self.model.name} takes {len(self._graph.inputs)} input(s) '
                f'({expected}); got {len(flat)}.')
        return flat[0] if len(flat) == 1 else tuple(flat)

    def _ModelOutputs(self, outputs):
        flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        return keras.tree.pack_sequence_as(self._graph.output_structure, flat)

    def get_config(self) -> dict:
        return {'name': self.name, 'model': keras.saving.serialize_keras_object(self.model),
                **self._arguments}

    @classmethod
    def from_config(cls, config: dict) -> 'Functional':
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop('model'))
        return cls(model=model, **config)
