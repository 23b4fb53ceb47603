r"""Partition quality: how evenly each partitioner spreads a model's FLOPs over K cells.

For the GPipe paper's two Table 2 models, AmoebaNet-D (18, 256) and Transformer-48 (the registered
`image.amoebanet.AmoebaNetD_18_256` and `lm.Transformer48`), each layer's forward FLOPs on one
mini-batch come from FPropMeta (Params and shapes only: no variable is built, no TF op runs). At
K = 2, 4, 8 the layers are split by

  * `optimal`: `partition.OptimalBoundaries`, the partitioner PipeliningLayer uses,
  * `histogram`: `partition.HistogramBoundaries`, Lingvo's cumulative-histogram heuristic,
  * `uniform`: `partition.UniformBoundaries`, equal layer counts, for reference,

and each split is scored by its balance, max cell cost / (total / K): 1.0 is perfect, and the
pipeline's step time grows with it (the slowest cell sets the pace of every tick).

    python benchmarks/partition_quality.py [--cells=2,4,8] [--out=...]

Prints a table as it goes and writes every row to JSON.
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import json
from typing import Sequence

import tensorflow as tf  # pylint: disable=g-import-not-at-top,g-bad-import-order

from gpipe_tf import hyperparams  # pylint: disable=g-import-not-at-top
from gpipe_tf import model_registry  # pylint: disable=g-import-not-at-top
from gpipe_tf.layers import sequential  # pylint: disable=g-import-not-at-top
from gpipe_tf.perf import plot  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import fields  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import partition  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top

# The paper's name of each model -> its registry key.
MODELS = {
    'AmoebaNet-D-18-256': 'image.amoebanet.AmoebaNetD_18_256',
    'Transformer-48': 'lm.Transformer48',
}

PARTITIONERS = {
    'optimal': partition.OptimalBoundaries,
    'histogram': partition.HistogramBoundaries,
    'uniform': lambda costs, num_cells: partition.UniformBoundaries(len(costs), num_cells),
}


def PipelineParams(model: str) -> hyperparams.Params:
    """The registered model's PipeliningLayer Params; `model` is a key of MODELS."""
    return model_registry.GetClass(MODELS[model])().Pipeline()


def LayerCosts(p: hyperparams.Params) -> list[int]:
    """Forward FLOPs on one mini-batch of each layer of `p.layer_tpl`, the layers PipeliningLayer
    partitions (before_tpl layers run ahead of the pipeline and are not counted).

    Raises:
      ValueError: if `p` has no layer_tpl or no input_shapes.
    """
    if p.layer_tpl is None or p.input_shapes is None:
        raise ValueError(f'{p.name}: needs layer_tpl and input_shapes to cost its layers, got '
                         f'layer_tpl={p.layer_tpl is not None}, input_shapes={p.input_shapes}.')
    before = list(p.before_tpl)
    _, metas = sequential.ChainMeta(before + list(p.layer_tpl),
                                    *fields.InputShapes(p))
    return [m.flops for m in metas[len(before):]]


def Balance(costs: Sequence[float], boundaries: Sequence[int]) -> float:
    """max cell cost / (total / K): 1.0 for a perfectly even split."""
    cell_costs = partition.CellCosts(costs, boundaries)
    return max(cell_costs) * len(cell_costs) / sum(costs)


def Compare(costs: Sequence[float], num_cells: int) -> dict[str, dict]:
    """Per partitioner: {'boundaries': [...], 'balance': float}."""
    result = {}
    for name, partitioner in PARTITIONERS.items():
        boundaries = partitioner(costs, num_cells)
        result[name] = {'boundaries': boundaries, 'balance': Balance(costs, boundaries)}
    return result


def FormatRow(row: dict) -> str:
    balances = '  '.join(f"{row[name]['balance']:9.4f}" for name in PARTITIONERS)
    return (f"{row['model']:20s} {row['num_layers']:3d}  K={row['k']}  {balances}   "
            f"{row['optimal']['boundaries']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--cells', default='2,4,8', help='Comma-separated K values.')
    parser.add_argument('--models', default=','.join(MODELS),
                        help=f'Comma-separated models, of {list(MODELS)}.')
    parser.add_argument('--out', default='benchmarks/results/partition_quality.json',
                        help='JSON path.')
    parser.add_argument('--plot_dir', default='benchmarks/results/partition',
                        help='Where the per-cell cost charts (ours vs the histogram) go.')
    args = parser.parse_args()
    rows = []

    def Emit(row):
        rows.append(row)
        print(FormatRow(row), flush=True)
        os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
        with open(args.out, 'w', encoding='utf-8') as f:  # After every row: a crash loses nothing.
            json.dump({'tensorflow': tf.__version__, 'cost': 'FPropMeta forward FLOPs',
                       'balance': 'max cell cost / (total / K)', 'rows': rows}, f, indent=1)

    header = '  '.join(f'{name:>9s}' for name in PARTITIONERS)
    print(f"{'model':20s} {'L':>3s}  K    {header}   optimal boundaries")
    for model in args.models.split(','):
        costs = LayerCosts(PipelineParams(model))
        for k in (int(k) for k in args.cells.split(',')):
            row = dict(model=model, registry_key=MODELS[model], num_layers=len(costs), k=k,
                       total_flops=sum(costs), **Compare(costs, k))
            Emit(row)
            for name in ('optimal', 'histogram'):
                plot.SavePng(plot.CellCostFigure(
                    partition.CellCosts(costs, row[name]['boundaries']), unit='FLOPs',
                    title=f'{model}, K={k}, {name} partition'),
                    os.path.join(args.plot_dir, f'{model}_k{k}_{name}.png'))
    print(f'wrote {args.out} and cost charts under {args.plot_dir}')


if __name__ == '__main__':
    main()
