r"""Measured peak memory of a train step against the memory planner, per K, M and recompute mode.

    python benchmarks/memory_vs_planner.py [--models=dense16,transformer8] [--quick]

The models are `pipeline_overhead.py`'s (16 dense layers of 512 on a batch of 1024; 8 Transformer
blocks of dim 256 on 32 x 64 tokens), on virtual CPU devices. Every virtual device allocates from
the one CPU allocator, so what a step allocates at its peak (BFC allocator statistics: the peak
during the step less what was allocated before it, i.e. the variables and the input batch) is
compared with the planner's `step_bytes`: its `shared_peak_bytes` (everything persistent of every
cell plus the largest one-micro-batch working set) less the variables and the input. The step
computes the loss and the gradients (no optimizer: 0 slots). The ratio planned / measured is
printed per row; the planner's target is within 20%.

Prints a table as it goes and writes benchmarks/results/memory_vs_planner.json.
"""

from __future__ import annotations

import argparse
import json
import os

import pipeline_overhead as bench  # Same directory: the models, devices and memory setup.


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', default=','.join(bench.MODELS), help='Comma-separated.')
    parser.add_argument('--quick', action='store_true', help='Fewer configurations.')
    parser.add_argument('--out', default='benchmarks/results/memory_vs_planner.json')
    parser.add_argument('--plot_dir', default='benchmarks/results/memory',
                        help='Where the planned memory per device at the largest K and M goes.')
    args = parser.parse_args()
    bench.Setup('shared')
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top
    from gpipe_tf.perf import memory  # pylint: disable=g-import-not-at-top
    from gpipe_tf.perf import plot  # pylint: disable=g-import-not-at-top
    cells = (1, 4) if args.quick else (1, 2, 4)
    micro_batches = (1, 8) if args.quick else (1, 4, 8)
    rows = []
    print(f"{'model':13s} {'K':>2} {'M':>2} {'recompute':9s} {'planned MiB':>12} "
          f"{'measured MiB':>13} {'planned/measured':>17}", flush=True)
    for model in args.models.split(','):
        layers, shapes, make_inputs = bench.MODELS[model]()
        inputs = make_inputs()
        for mode in ('always', 'never'):
            for k in cells:
                for m in micro_batches:
                    layer = bench.BuildPipeline(layers, shapes, k, m, mode, bench.DEVICES[:k])
                    plan = memory.PlanMemory(layer.p, slots_per_param=0)
                    if (k, m) == (cells[-1], micro_batches[-1]):
                        plot.SavePng(plot.MemoryFigure(plan, title=f'{model}, {mode}'),
                                     os.path.join(args.plot_dir, f'{model}_k{k}_m{m}_{mode}.png'))
                    measured = test_utils.StepBytes(layer, inputs, bench.Loss)
                    ratio = plan.step_bytes / measured
                    rows.append(dict(model=model, k=k, m=m, recompute=mode,
                                     planned_step_bytes=plan.step_bytes,
                                     planned_per_device_bytes=[c.total for c in plan.cells],
                                     measured_step_bytes=measured, planned_over_measured=ratio))
                    print(f'{model:13s} {k:2d} {m:2d} {mode:9s} '
                          f'{plan.step_bytes / 2**20:12.1f} {measured / 2**20:13.1f} '
                          f'{ratio:17.2f}', flush=True)
                    os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
                    with open(args.out, 'w', encoding='utf-8') as f:
                        json.dump({'tensorflow': tf.__version__, 'rows': rows}, f, indent=1)
    ratios = [r['planned_over_measured'] for r in rows]
    print(f'planned/measured: min {min(ratios):.2f}, max {max(ratios):.2f}; '
          f'{sum(abs(r - 1) <= 0.2 for r in ratios)}/{len(ratios)} within 20%')
    print(f'wrote {args.out}')


if __name__ == '__main__':
    main()
