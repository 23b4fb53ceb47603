r"""Peak memory of the dense16 pipeline against K at M=1 (forward alone, and forward + backward).

    python benchmarks/memory_vs_cells.py [--out=benchmarks/results/memory_vs_cells.json]

Prints a row per (K, recompute mode) and writes them to JSON. Written to chase an observation:
peak memory grows with K even for the forward pass.
"""

from __future__ import annotations

import argparse
import json
import os

import pipeline_overhead as bench  # Same directory: the models, devices and memory setup.


def Peak(fn, inputs) -> int:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    fn(inputs)
    tf.config.experimental.reset_memory_stats('CPU:0')
    fn(inputs)
    return tf.config.experimental.get_memory_info('CPU:0')['peak']


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', default='benchmarks/results/memory_vs_cells.json')
    args = parser.parse_args()
    bench.Setup('shared')
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    layers, shapes, make_inputs = bench.DenseModel()
    inputs = make_inputs()
    rows = []
    for mode in ('always', 'never'):
        for k in (1, 2, 4, 8):
            layer = bench.BuildPipeline(layers, shapes, k, 1, mode, bench.DEVICES[:k])
            forward = Peak(tf.function(lambda x: tf.reduce_sum(layer(x))), inputs)
            both = Peak(tf.function(lambda x: tf.gradients(tf.reduce_sum(layer(x)),
                                                           layer.trainable_variables)), inputs)
            rows.append(dict(k=k, m=1, recompute=mode, forward_peak_bytes=forward,
                             train_peak_bytes=both))
            print(f'K={k} M=1 {mode:7s} forward {forward / 2**20:7.1f} MiB   forward+backward '
                  f'{both / 2**20:7.1f} MiB', flush=True)
    os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
    with open(args.out, 'w', encoding='utf-8') as f:
        json.dump(rows, f, indent=1)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    main()
