r"""GPipe Table 2 by simulation: normalised training throughput against K and M.

For AmoebaNet-D (18, 256) and Transformer-48 (the registered `image.amoebanet.AmoebaNetD_18_256`
and `lm.Transformer48`), at K = 2, 4, 8 cells and M = 1, 4, 32 micro-batches:

  * the cells are PipeliningLayer's own (`plan.Cells` with num_cells = K, the
    registered input shapes, partition_method 'flops'), from Params alone;
  * a cell's forward on one micro-batch costs its FPropMeta FLOPs / M at a fixed device rate
    (`--device_tflops`), its backward `--backward_factor` times that, and its re-materialization
    (recompute=True, as GPipe runs) the forward again (`simulator.CostsFromFlops`);
  * a hop across a cell boundary costs the boundary's activation bytes / M over the link
    bandwidth (`--link_gbps`); the simulator takes one hop cost for every boundary, so this uses
    the largest boundary (AmoebaNet's vary by 4x; the Transformer's are all equal). Bytes are
    the elements of the boundary's tensors (labels and paddings included) at the Params' dtype;
  * `simulator.Simulate` walks the GPipe schedule and gives the step's makespan.

Throughput is the registered global batch (AmoebaNet 128 images, Transformer 32 sequences of 1024;
fixed, not scaled with K or M) per makespan, with K devices of the same rate, normalised to
K = 2, M = 1 as in the paper. Printed beside the paper's numbers, with whether throughput rises
with M for every K and with K for every M >= 4, the trend Table 2 shows.

Assumptions not in the paper: the default rate (50 TFLOP/s, of the order of one TPUv3 core) and
link bandwidth (50 GB/s, of the order of one accelerator-to-accelerator link) are ours; only
their ratio matters after normalisation, and only for the transfers. The simulator charges a
transfer as latency on the receiving cell and lets hops overlap, so a link slower than the
compute it feeds shows as added fill/drain time, not as a bottleneck.

    python benchmarks/simulated_throughput.py [--device_tflops=50] [--link_gbps=50] [--out=...]

Prints a table as it goes and writes every row to JSON.
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import json
from typing import Callable, Sequence

import tensorflow as tf  # pylint: disable=g-import-not-at-top,g-bad-import-order

from gpipe_tf import hyperparams  # pylint: disable=g-import-not-at-top
from gpipe_tf.layers import base_layer  # pylint: disable=g-import-not-at-top
from gpipe_tf.perf import simulator  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import fields  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import plan as plan_lib  # pylint: disable=g-import-not-at-top
# Same directory (a script's folder is on sys.path): the models and their Params.
from partition_quality import MODELS, PipelineParams  # pylint: disable=g-import-not-at-top

# GPipe Table 2, normalised throughput on TPUs: PAPER[model][K][M].
PAPER = {
    'AmoebaNet-D-18-256': {2: {1: 1.0, 4: 1.07, 32: 1.21}, 4: {1: 1.13, 4: 1.26, 32: 1.84},
                           8: {1: 1.38, 4: 1.72, 32: 3.48}},
    'Transformer-48': {2: {1: 1.0, 4: 1.7, 32: 1.8}, 4: {1: 1.07, 4: 3.2, 32: 3.4},
                       8: {1: 1.3, 4: 4.8, 32: 6.3}},
}
CELLS = (2, 4, 8)
MICRO_BATCHES = (1, 4, 32)
DEVICE_TFLOPS = 50.0  # Default device rate, TFLOP/s; see the module docstring.
LINK_GBPS = 50.0  # Default link bandwidth, GB/s; see the module docstring.


def BatchSize(p: hyperparams.Params) -> int:
    """The global batch of PipeliningLayer Params `p`: its first input's batch dimension."""
    return base_layer.FlattenShapes(fields.InputShapes(p))[0][p.batch_dim]


def CellPlan(p: hyperparams.Params, num_cells: int) -> tuple[list[int], list[int]]:
    """PipeliningLayer's partition of `p` into `num_cells` cells, from Params alone.

    Returns:
      (per cell its forward FLOPs on one mini-batch, per boundary (K - 1 of them) the bytes of
      the activations crossing it for one mini-batch).
    """
    _, metas = plan_lib.Cells(p.Copy().Set(num_cells=num_cells))
    element_bytes = tf.as_dtype(p.dtype).size
    boundary_bytes = [
        element_bytes * sum(s.num_elements() for s in base_layer.FlattenShapes(m.out_shapes))
        for m in metas[:-1]]
    return [m.flops for m in metas], boundary_bytes


def SimulateStep(flops_per_cell: Sequence[float], boundary_bytes: Sequence[float],
                 num_micro_batches: int, device_flops_per_sec: float,
                 link_bytes_per_sec: float, backward_factor: float) -> simulator.Timeline:
    """One re-materializing GPipe step of cells costing `flops_per_cell` per mini-batch."""
    m = num_micro_batches
    transfer = max(boundary_bytes, default=0) / m / link_bytes_per_sec
    costs = simulator.CostsFromFlops([f / m for f in flops_per_cell], device_flops_per_sec,
                                     backward_factor=backward_factor, transfer=transfer)
    return simulator.Simulate(costs, m, recompute=True)


def ThroughputTable(p: hyperparams.Params, device_flops_per_sec: float,
                    link_bytes_per_sec: float, backward_factor: float = 2.0,
                    cells: Sequence[int] = CELLS, micro_batches: Sequence[int] = MICRO_BATCHES,
                    emit: Callable[[dict], None] | None = None) -> list[dict]:
    """Simulated throughput of `p` for every (K, M), normalised to the first (K, M).

    Args:
      p: PipeliningLayer Params with layer_tpl and input_shapes.
      device_flops_per_sec: every device's FLOP rate.
      link_bytes_per_sec: the bandwidth of a hop between cells.
      backward_factor: a cell's backward cost as a multiple of its forward's.
      cells: the K values, smallest first.
      micro_batches: the M values, smallest first; each must divide the batch.
      emit: called with each row as it is computed.

    Returns:
      One row per (K, M), K-major: k, m, makespan_s, utilisation, transfer_s (per hop),
      examples_per_s, normalised.
    """
    batch = BatchSize(p)
    rows = []
    for k in cells:
        flops_per_cell, boundary_bytes = CellPlan(p, k)
        for m in micro_batches:
            if batch % m:
                raise ValueError(f'M={m} micro-batches do not divide the batch of {batch}.')
            timeline = SimulateStep(flops_per_cell, boundary_bytes, m, device_flops_per_sec,
                                    link_bytes_per_sec, backward_factor)
            throughput = batch / timeline.makespan
            rows.append(dict(
                k=k, m=m, batch=batch, makespan_s=timeline.makespan,
                utilisation=timeline.utilisation,
                transfer_s=max(boundary_bytes, default=0) / m / link_bytes_per_sec,
                max_cell_flops=max(flops_per_cell), examples_per_s=throughput,
                normalised=throughput / (rows[0]['examples_per_s'] if rows else throughput)))
            if emit:
                emit(rows[-1])
    return rows


def Trend(rows: Sequence[dict]) -> dict:
    """Whether normalised throughput strictly rises with M at every K, and with K at every
    M >= 4 (Table 2's trend; at M = 1 there is no pipelining to gain from).

    Returns:
      {'rises_with_m': {K: bool}, 'rises_with_k': {M: bool}}.
    """
    table = {(r['k'], r['m']): r['normalised'] for r in rows}
    cells = sorted({k for k, _ in table})
    micro_batches = sorted({m for _, m in table})

    def Rising(values):
        return all(a < b for a, b in zip(values, values[1:]))

    return {
        'rises_with_m': {k: Rising([table[k, m] for m in micro_batches]) for k in cells},
        'rises_with_k': {m: Rising([table[k, m] for k in cells]) for m in micro_batches if m >= 4},
    }


def FormatRow(model: str, row: dict) -> str:
    paper = PAPER.get(model, {}).get(row['k'], {}).get(row['m'])
    return (f"{model:20s} K={row['k']} M={row['m']:<3d} makespan {1e3 * row['makespan_s']:9.2f} "
            f"ms  util {row['utilisation']:5.3f}  hop {1e3 * row['transfer_s']:7.3f} ms  "
            f"{row['examples_per_s']:8.1f} ex/s  x{row['normalised']:5.2f}  "
            f"(paper {'-' if paper is None else f'x{paper:.2f}'})")


def FormatTable(model: str, rows: Sequence[dict]) -> str:
    """Rows M, columns K: ours / paper."""
    cells = sorted({r['k'] for r in rows})
    table = {(r['k'], r['m']): r['normalised'] for r in rows}
    lines = [f'{model}: normalised throughput, simulated / paper',
             '        ' + ''.join(f'{f"K={k}":>16s}' for k in cells)]
    for m in sorted({r['m'] for r in rows}):
        entries = []
        for k in cells:
            paper = PAPER.get(model, {}).get(k, {}).get(m)
            entries.append(f"{table[k, m]:7.2f} / {'-' if paper is None else f'{paper:<5.2f}'}")
        lines.append(f'M={m:<4d}  ' + ''.join(f'{e:>16s}' for e in entries))
    return '\n'.join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--device_tflops', type=float, default=DEVICE_TFLOPS,
                        help='Every device\'s sustained rate, TFLOP/s (a multiply-add is 2).')
    parser.add_argument('--link_gbps', type=float, default=LINK_GBPS,
                        help='Bandwidth of a hop between cells, GB/s (1e9 bytes); inf: free '
                             'transfers.')
    parser.add_argument('--backward_factor', type=float, default=2.0,
                        help='A cell\'s backward cost as a multiple of its forward\'s.')
    parser.add_argument('--models', default=','.join(MODELS),
                        help=f'Comma-separated models, of {list(MODELS)}.')
    parser.add_argument('--out', default='benchmarks/results/simulated_throughput.json',
                        help='JSON path.')
    args = parser.parse_args()
    device_flops, link_bytes = 1e12 * args.device_tflops, 1e9 * args.link_gbps
    results = {}

    def Write():
        os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
        with open(args.out, 'w', encoding='utf-8') as f:  # After every row: a crash loses nothing.
            json.dump({'tensorflow': tf.__version__, 'device_tflops': args.device_tflops,
                       'link_gbps': args.link_gbps, 'backward_factor': args.backward_factor,
                       'recompute': True, 'normalised_to': {'k': CELLS[0], 'm': MICRO_BATCHES[0]},
                       'paper': PAPER, 'models': results}, f, indent=1)

    print(f'device {args.device_tflops:g} TFLOP/s, link {args.link_gbps:g} GB/s, backward '
          f'{args.backward_factor:g} x forward, recompute on')
    for model in args.models.split(','):
        p = PipelineParams(model)
        results[model] = {'registry_key': MODELS[model], 'rows': []}

        def Emit(row, model=model):
            results[model]['rows'].append(row)
            print(FormatRow(model, row), flush=True)
            Write()

        rows = ThroughputTable(p, device_flops, link_bytes, args.backward_factor, emit=Emit)
        results[model]['trend'] = Trend(rows)
        Write()
    for model, result in results.items():
        print()
        print(FormatTable(model, result['rows']))
        trend = result['trend']
        print('rises with M, per K: ' + ', '.join(
            f'K={k}: {"yes" if up else "no"}' for k, up in trend['rises_with_m'].items()))
        print('rises with K, per M: ' + ', '.join(
            f'M={m}: {"yes" if up else "no"}' for m, up in trend['rises_with_k'].items()))
    print(f'wrote {args.out}')


if __name__ == '__main__':
    main()
