r"""A table of every registered model, from Params alone (no variables are built).

    python -m gpipe_tf.tools.model_table [--models=SUBSTRING] [--json=PATH]

Per model: K cells, M micro-batches and the batch it is configured for; parameters; parameter
memory at 12 bytes per parameter (weights, gradient and RMSProp slot, as the GPipe paper counts);
activation memory kept for backprop without re-materialization (every layer's output for the whole
batch) and with it (each cell's input for the whole batch, plus one cell's activations for one
micro-batch while it is recomputed: O(N + (L/K)(N/M))); and the FLOPs balance of the cells (the
largest cell over the mean: 1.00 is perfect).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from absl import app
from absl import flags

from gpipe_tf import model_registry
from gpipe_tf import units
from gpipe_tf.layers import base_layer
from gpipe_tf.pipeline import fields
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib

flags.DEFINE_string('models', '', 'Only models whose key contains this string.')
flags.DEFINE_string('json', None, 'Also write the rows to this JSON file.')
FLAGS = flags.FLAGS

BYTES_PER_PARAM = 12


@dataclasses.dataclass
class ModelRow:
    model: str
    num_cells: int
    num_micro_batches: int
    batch_size: int | None
    num_params: int
    param_bytes: int
    activation_bytes: int
    remat_activation_bytes: int
    flops_balance: float


def Row(key: str) -> ModelRow:
    """The table row of registered model `key`.

    Raises:
      ValueError: if the model's task (or its `model`) is not a PipeliningLayer with
        input_shapes.
    """
    p = model_registry.GetParams(key, model_registry.GetDatasets(key)[0])
    if 'model' in p:  # Task Params: the pipeline is their model.
        p = p.model
    if not pipelining_layer.IsPipeline(p) or p.input_shapes is None:
        raise ValueError(f'{key}: expected PipeliningLayer Params with input_shapes, got '
                         f'{p.cls.__name__}.')
    plan = plan_lib.MakePlan(p, place=False)
    metas, m = plan.metas, plan.num_micro_batches
    cell_inputs = [base_layer.ActivationBytes(fields.InputShapes(p), p)]
    cell_inputs += [base_layer.ActivationBytes(meta.out_shapes, p) for meta in metas[:-1]]
    flops = [meta.flops for meta in metas]
    num_params = sum(meta.num_params for meta in metas)
    return ModelRow(
        model=key, num_cells=plan.num_cells, num_micro_batches=m, batch_size=plan.batch_size,
        num_params=num_params, param_bytes=BYTES_PER_PARAM * num_params,
        activation_bytes=sum(meta.activation_bytes for meta in metas),
        remat_activation_bytes=sum(cell_inputs) + max(
            meta.activation_bytes // m for meta in metas),
        flops_balance=max(flops) / (sum(flops) / len(flops)) if sum(flops) else 1.0)


def FormatTable(rows: list[ModelRow]) -> str:
    header = ('model', 'K', 'M', 'batch', 'params', 'param mem', 'act mem', 'act mem remat',
              'flops max/mean')
    table = [header] + [
        (r.model, str(r.num_cells), str(r.num_micro_batches), str(r.batch_size),
         units.Count(r.num_params), units.Bytes(r.param_bytes), units.Bytes(r.activation_bytes),
         units.Bytes(r.remat_activation_bytes), f'{r.flops_balance:.2f}') for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return '\n'.join('  '.join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))) for row in table)


def main(argv):
    del argv
    keys = [k for k in model_registry.ListModels() if FLAGS.models in k]
    rows = []
    for i, key in enumerate(keys, start=1):
        start = time.perf_counter()
        rows.append(Row(key))
        print(f'[{i}/{len(keys)}] {key} ({time.perf_counter() - start:.1f}s)', file=sys.stderr,
              flush=True)
    print(FormatTable(rows))
    if FLAGS.json:
        with open(FLAGS.json, 'w', encoding='utf-8') as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)


if __name__ == '__main__':
    app.run(main)
