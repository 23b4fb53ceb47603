"""Image classification: batches NestedMap(images, labels, weights) through a model whose
output is the AmoebaNet head's NestedMap(logits, per_example_loss, weight, correct), or plain
logits [B, classes] (then the cross-entropy is computed here)."""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.layers import precision
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.tasks import base_task


class ClassifierTask(base_task.BaseTask):
    """Metrics: `loss` (the model's per-example loss: label smoothing and the aux head included),
    `accuracy` (top-1) and `log_loss` (the plain cross-entropy of the logits), per example."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('flatten_images', False, 'Feed images as [B, H*W*C] vectors (for MLPs).')
        return p

    def ModelInputs(self, batch):
        images = batch.images
        if self.p.flatten_images:
            images = tf.reshape(images, [tf.shape(images)[0], -1])
            return images
        return NestedMap(images=images, labels=batch.labels)

    def _Outputs(self, batch, outputs) -> NestedMap:
        # A model computing in bfloat16 or float16 (fprop_dtype): the loss in float32.
        outputs = precision.AtLeastFloat32(outputs)
        if isinstance(outputs, NestedMap):
            return outputs
        labels = tf.cast(batch.labels, tf.int32)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=outputs)
        correct = tf.cast(tf.equal(tf.argmax(outputs, -1, output_type=tf.int32), labels),
                          outputs.dtype)
        return NestedMap(logits=outputs, per_example_loss=xent, correct=correct)

    def ComputeMetrics(self, batch, outputs):
        out = self._Outputs(batch, outputs)
        weights = tf.cast(batch.weights, out.per_example_loss.dtype)
        log_loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.cast(batch.labels, tf.int32), logits=out.logits)
        return NestedMap(loss=base_task.WeightedMean(out.per_example_loss, weights),
                         accuracy=base_task.WeightedMean(out.correct, weights),
                         log_loss=base_task.WeightedMean(log_loss, weights))

    @base_task.Inference
    def Predict(self, images: tf.Tensor) -> tf.Tensor:
        """Class probabilities [B, classes] of `images` in inference mode (batch norm with its
        moving statistics, no dropout or drop-path, no variable changed): each image's answer is
        the same whatever other images come with it. Labels are not needed."""
        labels = tf.zeros([tf.shape(images)[0]], tf.int32)
        batch = NestedMap(images=images, labels=labels, weights=tf.ones([tf.shape(images)[0]]))
        out = self._Outputs(batch, self.model(self.ModelInputs(batch)))
        return tf.nn.softmax(out.logits)
