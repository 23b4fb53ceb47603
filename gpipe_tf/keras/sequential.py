"""`Sequential`: a Keras model that is one pipeline of Keras layers, trained with every schedule.

    import keras
    from gpipe_tf import keras as gpipe_keras

    model = gpipe_keras.Sequential(
        [keras.layers.Dense(256, activation='relu') for _ in range(8)] + [keras.layers.Dense(10)],
        num_cells=4, num_micro_batches=8, input_shape=(64,), schedule='1f1b')
    model.compile('adam', keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=['accuracy'])
    model.fit(x, y, batch_size=64)

A `Pipeline` inside a larger Keras model trains with fill-drain (gpipe) only: Keras computes the
loss after the layer, once every micro-batch's forward is done. 1F1B, interleaved and
zero-bubble start a micro-batch's backward as soon as its own forward ends, so its loss must be
known there. `Sequential`'s train step therefore computes the compiled loss per micro-batch on
the last stage (`PipeliningLayer.FPropLoss`): micro-batch m's value is the compiled loss of its
examples (Keras's mean over them, sample weights and `class_weight` included), and the step's
loss is the mean of those values weighted by the micro-batches' examples, which equals the
compiled loss of the whole batch and so has its gradients. The metrics are then computed on the
whole batch's outputs, as `keras.Sequential` computes them, and so are the per-output loss
metrics of a model of several outputs (a last layer that returns a tuple; compile it with a loss
per output, as keras.Sequential).

Training runs only through the train step (`fit`, `train_on_batch`): with any schedule but gpipe,
`model(x, training=True)` in a custom training loop is a ConfigError, since the loss it would
compute afterwards comes too late for backwards that start before the last forward.

Weight regularizers (`kernel_regularizer=`) add their penalty to the loss once per step, as in
keras.Sequential. Not supported, and why: losses a layer adds in its call (`add_loss`,
`activity_regularizer=`), a ConfigError: they belong to a micro-batch on an earlier stage, and the
pipeline carries only the layers' outputs to the loss.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.keras import keras_layer
from gpipe_tf.keras import names
from gpipe_tf.keras import pipeline as pipeline_lib
from gpipe_tf.keras import pipeline_params


@names.Registered
class Sequential(keras.Model):
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
            raise errors.ConfigError(f'gpipe_tf.keras.Sequential takes layers or a pipeline; '
                                     f'got both.')
        self._pipeline_layer = pipeline
        built_for = _InputShape(pipeline)
        if built_for is not None:
            self.build(built_for)

    @property
    def pipeline(self) -> pipeline_lib.Pipeline:
        """The `Pipeline` layer (its `keras_layers`, its PipeliningLayer's report)."""
        return self._pipeline_layer

    def build(self, input_shape) -> None:
        self._pipeline_layer.build(input_shape)
        self.built = True

    def call(self, inputs, training=None):
        return self._pipeline_layer(inputs, training=training)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        # Split along the batch with the inputs: each micro-batch's labels and weights.
        loss_inputs = {'y': y}
        if sample_weight is not None:
            loss_inputs['sample_weight'] = sample_weight

        # Weight regularizers' penalties (compute_loss adds them) are read without a gradient
        # in each micro-batch's loss, whose weighted mean then holds them once; their gradient
        # is added outside the pipeline, below.
        regularized = [v for v in self.trainable_weights if v.regularizer is not None]
        # Read here: the pipeline's backward takes no variable read inside it.
        regularized_values = [(v, tf.stop_gradient(v.value)) for v in regularized]

        def MicroBatchLoss(outputs, part):
            # The stateless scope also drops the loss's metric updates (a model of several
            # outputs tracks each output's loss): they are made once, on the whole batch, below.
            with keras.StatelessScope(state_mapping=regularized_values):
                value = self.compute_loss(x=None, y=part['y'], y_pred=outputs,
                                          sample_weight=part.get('sample_weight'),
                                          training=True)
            examples = tf.shape(tf.nest.flatten(outputs)[0])[0]
            return tf.cast(value, tf.float32), tf.cast(examples, tf.float32)

        with tf.GradientTape() as tape:
            outputs, loss, _ = self._pipeline_layer.TrainWithLoss(x, MicroBatchLoss, loss_inputs)
            if regularized:
                penalty = tf.add_n([tf.cast(v.regularizer(v), loss.dtype) for v in regularized])
                loss += penalty - tf.stop_gradient(penalty)
            scaled = self.optimizer.scale_loss(loss) if self.optimizer is not None else loss
        if tf.nest.is_nested(outputs):
            # Each output's loss metric ('mse_loss'), from the whole batch as keras.Sequential
            # computes it (no gradient flows through the pipeline's outputs).
            self.compute_loss(x=None, y=y, y_pred=outputs, sample_weight=sample_weight,
                              training=True)
        # Keras's own train step updates its loss tracker (what `fit` reports as loss) so.
        tracker = getattr(self, '_loss_tracker', None)
        if tracker is not None:
            tracker.update_state(loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        weights = self.trainable_weights
        self.optimizer.apply_gradients(zip(tape.gradient(scaled, weights), weights))
        return self.compute_metrics(x, y, outputs, sample_weight=sample_weight)

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
