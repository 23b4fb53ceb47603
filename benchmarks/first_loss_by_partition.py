r"""The first training loss at a fixed seed, at several partitions: it must not change.

The Transformer LM of the comparison with Lingvo's own GPipe (8 layers, model dim 256, 4 heads of
64, feed-forward 1024, vocabulary 32000, batch 32 x 64 tokens, dropout 0.1 on residuals and
attention) is built at each (K, M) with the same seed, and one training forward (dropout on,
step 0) of the same synthetic batch gives its loss. Initial weights and dropout masks come from
each layer's name and each example's index, never from the cell or micro-batch, so every row
should give the same loss up to float32 summation order. (Before layers were keyed by name, the
same configuration gave 7.0905 at K=2, 7.0994 at K=4 and 7.1273 at K=8; Lingvo's GPipe gives
7.757243 at every K on its own initialisation.)

    python benchmarks/first_loss_by_partition.py [--partitions=1x1,2x4,4x8,8x32] [--out=...]

Prints a row per partition and writes them to JSON.
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import json
import time

import tensorflow as tf  # pylint: disable=g-import-not-at-top,g-bad-import-order

from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top
from gpipe_tf.layers import fprop_context  # pylint: disable=g-import-not-at-top
from gpipe_tf.params import lm  # pylint: disable=g-import-not-at-top

SEED = 1234


class LingvoPeerLm(lm.TransformerLm):
    """The comparison's configuration (see the module docstring)."""
    MODEL_DIM = 256
    HIDDEN_DIM = 1024
    NUM_HEADS = 4
    NUM_LAYERS = 8
    MAX_LENGTH = 64
    BATCH_SIZE = 32


def FirstLoss(devices: list[str], num_cells: int, num_micro_batches: int) -> float:
    config = LingvoPeerLm()
    p = config.Task()
    p.model.Set(num_cells=num_cells, num_micro_batches=num_micro_batches,
                devices=devices[:num_cells], random_seed=SEED)
    task = p.Instantiate()
    batch = next(iter(config.Train().Instantiate().TrainDataset(start_step=0)))
    with fprop_context.Scope(training=True, step=0):
        return float(task.FPropTower(batch).loss[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--partitions', default='1x1,2x4,4x8,8x32',
                        help='KxM pairs, comma-separated')
    parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                                      'first_loss_by_partition.json'))
    args = parser.parse_args()
    # Each partition builds its own cell functions: TensorFlow's retracing warning counts them.
    tf.get_logger().setLevel('ERROR')
    partitions = [tuple(int(v) for v in pair.split('x')) for pair in args.partitions.split(',')]
    devices = test_utils.ConfigureVirtualCpus(max(k for k, _ in partitions))
    rows = []
    print(f'{"K":>3} {"M":>3}  {"first loss":>12}  {"seconds":>7}', flush=True)
    for k, m in partitions:
        start = time.time()
        loss = FirstLoss(devices, k, m)
        rows.append({'num_cells': k, 'num_micro_batches': m, 'first_loss': loss,
                     'seconds': round(time.time() - start, 1)})
        print(f'{k:>3} {m:>3}  {loss:>12.6f}  {rows[-1]["seconds"]:>7}', flush=True)
    losses = [row['first_loss'] for row in rows]
    spread = (max(losses) - min(losses)) / abs(losses[0])
    print(f'largest relative difference from each other: {spread:.2e}')
    with open(args.out, 'w', encoding='utf-8') as f:
        json.dump({'config': 'Transformer LM, 8 layers, d=256, 4 heads, ff 1024, vocab 32000, '
                             'batch 32 x 64, dropout 0.1, seed 1234',
                   'rows': rows, 'relative_spread': spread}, f, indent=1)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    main()
