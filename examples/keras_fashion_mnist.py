r"""Fashion-MNIST with plain Keras layers pipelined by GPipe (`gpipe_tf.keras.Sequential`).

Keras's own layers only: flatten, a dense layer of 256, 4 blocks of (dense 256, batch norm,
relu), a dense head of 10 logits. `gpipe_tf.keras.Sequential` partitions them into K=2 cells
on 2 virtual CPU devices, by parameter count, and splits each batch of 100 into M=4
micro-batches run with the 1F1B schedule. Trained with Keras's `fit` and Adam, then evaluated
on the 10,000 test images:

    python examples/keras_fashion_mnist.py [--epochs=2] [--data_dir=<IDX files' directory>]

The data come from Debian's `dataset-fashion-mnist` (`apt-get install dataset-fashion-mnist`),
read by gpipe_tf's own input generator (`gpipe_tf.input.image.FashionMnistInput`).
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order

from gpipe_tf.pipeline import devices  # pylint: disable=g-import-not-at-top

# The virtual devices must exist before TensorFlow starts; Keras starts it on import.
DEVICES = devices.VirtualCpus(2)

import keras  # pylint: disable=g-import-not-at-top,g-bad-import-order

from gpipe_tf import keras as gpipe_keras  # pylint: disable=g-import-not-at-top
from gpipe_tf.input import image  # pylint: disable=g-import-not-at-top

BATCH, WIDTH, NUM_BLOCKS = 100, 256, 4
NUM_CELLS, NUM_MICRO_BATCHES = 2, 4
TRAIN_EXAMPLES = 60000


def Input(split: str, data_dir: str):
    """gpipe_tf's Fashion-MNIST input generator for `split` ('train' or 'test')."""
    return image.FashionMnistInput.Params().Set(
        split=split, data_dir=data_dir, batch_size=BATCH).Instantiate()


def Model() -> gpipe_keras.Sequential:
    """The Keras layers, pipelined."""
    layers = [keras.layers.Flatten(), keras.layers.Dense(WIDTH, activation='relu')]
    for _ in range(NUM_BLOCKS):
        layers += [keras.layers.Dense(WIDTH, use_bias=False),
                   keras.layers.BatchNormalization(momentum=0.99), keras.layers.ReLU()]
    layers.append(keras.layers.Dense(10))
    return gpipe_keras.Sequential(layers, NUM_CELLS, NUM_MICRO_BATCHES, input_shape=(28, 28, 1),
                                  devices=DEVICES[:NUM_CELLS], schedule='1f1b',
                                  name='fashion_mnist')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--epochs', type=int, default=2, help='passes over the 60,000 images')
    parser.add_argument('--data_dir', default='/usr/share/datasets/fashion-mnist',
                        help='directory of the Fashion-MNIST IDX files')
    args = parser.parse_args()
    keras.utils.set_random_seed(0)

    model = Model()
    print(model.pipeline.pipeline.PartitionReport())
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=['accuracy'])
    train = Input('train', args.data_dir).TrainDataset().map(
        lambda batch: (batch.images, batch.labels))
    # Evaluation batches carry weights (0 for the padding of a last, partial batch).
    test = Input('test', args.data_dir).EvalDataset().map(
        lambda batch: (batch.images, batch.labels, batch.weights))
    # The input generator shuffles every epoch itself (seeded), so Keras need not.
    model.fit(train, epochs=args.epochs, steps_per_epoch=TRAIN_EXAMPLES // BATCH, shuffle=False,
              verbose=2)
    _, accuracy = model.evaluate(test, verbose=0)
    print(f'final test accuracy {accuracy:.4f}')


if __name__ == '__main__':
    main()
