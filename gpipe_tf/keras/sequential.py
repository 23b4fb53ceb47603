"""`Sequential`: a Keras model that is one pipeline of Keras layers, trained with every schedule.

    import keras
    from gpipe_tf import keras as gpipe_keras

    model = gpipe_keras.Sequential(
        [keras.layers.Dense(256, activation='relu') for _ in range(8)] + [keras.layers.Dense(10)],
        num_cells=4, num_micro_batches=8, input_shape=(64,), schedule='1f1b')
    model.compile('adam', keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=['accuracy'])
    model.fit(x, y, batch_size=64)

Its train step computes the compiled loss per micro-batch on the last stage, so it trains with
every schedule (`pipeline_model`): the loss, the metrics, sample weights, `class_weight` and one
optimizer step equal keras.Sequential's on the same layers. A last layer that returns a tuple
gives a model of several outputs (compile it with a loss per output, as keras.Sequential).
"""

from __future__ import annotations

import keras

from gpipe_tf import errors
from gpipe_tf.keras import keras_layer
from gpipe_tf.keras import names
from gpipe_tf.keras import pipeline as pipeline_lib
from gpipe_tf.keras import pipeline_model
from gpipe_tf.keras import pipeline_params


@names.Registered
class Sequential(pipeline_model.PipelineModel):
    """A Keras model whose layers run as one GPipe pipeline, with any schedule.

    Args:
      layers: Keras layers, applied in order (see `Pipeline.FromKeras`).
      num_cells: K.
      num_micro_batches: M (or give micro_batch_size=).
      input_shape: one example's input shape (batch excluded), or a list of them. The model
        is then built, as a keras.Sequential that starts with a keras.Input: `summary`,
        `count_params` and BackupAndRestore work before the first call.
      pipeline: instead of the layers, a `Pipeline` (what loading a saved model passes).
      name: the model's name.
      **params: `Pipeline.FromKeras`'s keywords: balance and any PipeliningLayer Param
        (schedule, recompute, devices, virtual_stages, unroll, ...).

    Raises:
      errors.ConfigError: see `Pipeline.FromKeras`.
    """

    def __init__(self, layers=None, num_cells: int = 1, num_micro_batches: int | None = None,
                 input_shape=None, pipeline=None, name: str | None = None, **params):
        super().__init__(name=name)
        if pipeline is None:
            pipeline = pipeline_lib.Pipeline.FromKeras(
                layers, num_cells, num_micro_batches, input_shape, loss_inside=True,
                name='pipeline', **params)
        elif layers is not None:
            raise errors.ConfigError('gpipe_tf.keras.Sequential takes layers or a pipeline; '
                                     'got both.')
        self._pipeline_layer = pipeline
        built_for = _InputShape(pipeline)
        if built_for is not None:
            self.build(built_for)

    def get_config(self) -> dict:
        return {'name': self.name,
                'pipeline': keras.saving.serialize_keras_object(self._pipeline_layer)}

    @classmethod
    def from_config(cls, config: dict) -> 'Sequential':
        config = dict(config)
        pipeline = keras.saving.deserialize_keras_object(config.pop('pipeline'))
        if not isinstance(pipeline, pipeline_lib.Pipeline):
            raise errors.ConfigError(f'{pipeline_params.LAYER}: a Sequential\'s config holds '
                                     f'a {type(pipeline).__name__}, not a Pipeline.')
        return cls(pipeline=pipeline, **config)


def _InputShape(pipeline: pipeline_lib.Pipeline):
    """The Keras input shape (batch None) of a pipeline whose first layer is a Keras layer, which
    knows what it was built for (given as input_shape, or a keras.Sequential's, or read from a
    saved config); None for gpipe_tf layers."""
    first = pipeline.pipeline.Layers()[0]
    if not isinstance(first, keras_layer.KerasLayer) or first.p.input_shapes is None:
        return None
    shapes = [tuple(shape) for shape in first.p.input_shapes]
    return shapes[0] if len(shapes) == 1 else tuple(shapes)
