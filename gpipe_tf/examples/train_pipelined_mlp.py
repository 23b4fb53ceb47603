r"""Trains the registered `examples.PipelinedMLP` pipelined over 4 virtual CPU devices.

A small, self-contained main job until the trainer binary exists: synthetic data labelled by a
fixed random teacher network, a PipeliningLayer of K=4 cells and M=8 micro-batches inside a
`tf.function` train step, and one synchronous Adam update per mini-batch.

    python -m gpipe_tf.examples.train_pipelined_mlp --steps=600
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
from absl import logging

from gpipe_tf import test_utils

flags.DEFINE_integer('steps', 600, 'Training steps.')
flags.DEFINE_integer('num_devices', 4, 'Virtual CPU devices the pipeline runs on.')
flags.DEFINE_float('learning_rate', 1e-2, 'Adam learning rate.')
FLAGS = flags.FLAGS


def TeacherData(p, tf):
    """(features, labels): Gaussian features, labels from a fixed random 2-layer teacher."""
    features = tf.random.stateless_normal([p.num_examples, p.input_dim], [p.seed, 1])
    w1 = tf.random.stateless_normal([p.input_dim, 32], [0, 2])
    w2 = tf.random.stateless_normal([32, p.num_classes], [0, 3])
    labels = tf.argmax(tf.tanh(features @ w1) @ w2, axis=-1, output_type=tf.int32)
    return features, labels


def main(argv):
    del argv
    # Virtual devices must be set before TensorFlow creates any tensor.
    devices = test_utils.ConfigureVirtualCpus(FLAGS.num_devices)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from gpipe_tf import model_registry  # pylint: disable=g-import-not-at-top

    p = model_registry.GetParams('examples.PipelinedMLP', 'Train')
    test_p = model_registry.GetParams('examples.PipelinedMLP', 'Test').input
    p.devices = devices
    model = p.Instantiate()
    optimizer = tf.keras.optimizers.Adam(FLAGS.learning_rate)
    features, labels = TeacherData(p.input, tf)
    data = (tf.data.Dataset.from_tensor_slices((features, labels))
            .shuffle(p.input.num_examples, seed=p.input.seed).repeat()
            .batch(p.input.batch_size, drop_remainder=True))

    @tf.function
    def TrainStep(x, y):
        with tf.GradientTape() as tape:
            logits = model(x)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    start = time.time()
    for step, (x, y) in enumerate(data.take(FLAGS.steps), start=1):
        loss = TrainStep(x, y)
        if step == 1 or step % 50 == 0 or step == FLAGS.steps:
            rate = step * p.input.batch_size / (time.time() - start)
            print(f'step {step:5d}/{FLAGS.steps}  loss {float(loss):.4f}  '
                  f'{rate:,.0f} examples/sec', flush=True)

    test_x, test_y = TeacherData(test_p, tf)
    predictions = tf.concat([tf.argmax(model(test_x[i:i + test_p.batch_size]), -1,
                                       output_type=tf.int32)
                             for i in range(0, test_p.num_examples, test_p.batch_size)], 0)
    accuracy = float(tf.reduce_mean(tf.cast(predictions == test_y, tf.float32)))
    print(f'test accuracy {accuracy:.3f} on {test_p.num_examples} held-out examples')
    logging.info('done')


if __name__ == '__main__':
    app.run(main)
