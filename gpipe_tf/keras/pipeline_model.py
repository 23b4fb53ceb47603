"""`PipelineModel`: a Keras model that is one pipeline, whose train step computes the loss per
micro-batch on the last stage, so that it trains with every schedule.

A `Pipeline` inside a larger Keras model trains with fill-drain (gpipe) only: Keras computes the
loss after the layer, once every micro-batch's forward is done. 1F1B, interleaved and
zero-bubble start a micro-batch's backward as soon as its own forward ends, so its loss must be
known there. The train step here computes the compiled loss per micro-batch on the last stage
(`PipeliningLayer.FPropLoss`): micro-batch m's value is the compiled loss of its examples
(Keras's mean over them, sample weights and `class_weight` included), and the step's loss is the
mean of those values weighted by the micro-batches' examples, which equals the compiled loss of
the whole batch and so has its gradients. The metrics are then computed on the whole batch's
outputs, as a Keras model computes them, and so are the per-output loss metrics of a model of
several outputs.

Training runs only through the train step (`fit`, `train_on_batch`): with any schedule but gpipe,
`model(x, training=True)` in a custom training loop is a ConfigError, since the loss it would
compute afterwards comes too late for backwards that start before the last forward.

Weight regularizers (`kernel_regularizer=`) add their penalty to the loss once per step, as in
keras.Sequential. Not supported, and why: losses a layer adds in its call (`add_loss`,
`activity_regularizer=`), a ConfigError: they belong to a micro-batch on an earlier stage, and the
pipeline carries only the layers' outputs to the loss.

`gpipe_tf.keras.Sequential` (a list of layers) and `gpipe_tf.keras.Functional` (a functional
model's graph) are such models; they differ in how the model's inputs and outputs map to the
pipeline's (`_PipelineInputs`, `_ModelOutputs`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from gpipe_tf.keras import pipeline as pipeline_lib


class PipelineModel(keras.Model):
    """A Keras model that runs one `Pipeline` (set as `_pipeline_layer` by the subclass), with
    the train step of the module docstring."""

    @property
    def pipeline(self) -> pipeline_lib.Pipeline:
        """The `Pipeline` layer (its `keras_layers`, its PipeliningLayer's report)."""
        return self._pipeline_layer

    def build(self, input_shape) -> None:
        self._pipeline_layer.build(input_shape)
        self.built = True

    def call(self, inputs, training=None):
        return self._ModelOutputs(self._pipeline_layer(self._PipelineInputs(inputs),
                                                       training=training))

    def _PipelineInputs(self, inputs):
        """The model's inputs as the pipeline takes them (here, as they are)."""
        return inputs

    def _ModelOutputs(self, outputs):
        """The pipeline's outputs as the model gives them (here, as they are)."""
        return outputs

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
                value = self.compute_loss(x=None, y=part['y'], y_pred=self._ModelOutputs(outputs),
                                          sample_weight=part.get('sample_weight'),
                                          training=True)
            examples = tf.shape(tf.nest.flatten(outputs)[0])[0]
            return tf.cast(value, tf.float32), tf.cast(examples, tf.float32)

        with tf.GradientTape() as tape:
            outputs, loss, _ = self._pipeline_layer.TrainWithLoss(self._PipelineInputs(x),
                                                                  MicroBatchLoss, loss_inputs)
            outputs = self._ModelOutputs(outputs)
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
