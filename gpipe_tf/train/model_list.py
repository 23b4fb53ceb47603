"""`--list_models`: every registered model with its parameters and cells, from Params alone (no
variable is built), and which ones train on a CPU in minutes.

A model-params class says so itself: `TRAINS_ON_A_CPU = True` marks the small models whose
documented runs take minutes on a 2-core CPU; the rest are the paper's sizes, for planning
(`--mode=inspect_model`, `--mode=tune`) and for accelerators.
"""

from __future__ import annotations

from gpipe_tf import model_registry
from gpipe_tf import units
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib

# The mark of `TRAINS_ON_A_CPU`, in the list.
CPU_MARK = 'trains on a CPU in minutes'


def Lines() -> list[str]:
    """One line per registered model, sorted by key: the key, its parameters and K (and M),
    and the CPU mark; a model whose parameters cannot be counted from Params says why."""
    rows = []
    for key in model_registry.ListModels():
        cls = model_registry.GetClass(key)
        try:
            p = model_registry.GetParams(key, model_registry.GetDatasets(key)[0])
            model = p.model if 'model' in p else p
            if not pipelining_layer.IsPipeline(model) or model.input_shapes is None:
                raise ValueError('not a PipeliningLayer with input_shapes')
            plan = plan_lib.MakePlan(model, place=False)
            size = (f'{units.Count(sum(m.num_params for m in plan.metas))} params, '
                    f'K={plan.num_cells} M={plan.num_micro_batches}')
        except (ValueError, LookupError) as error:
            size = f'(no size from Params: {error})'
        mark = CPU_MARK if getattr(cls, 'TRAINS_ON_A_CPU', False) else ''
        rows.append((key, size, mark))
    width = [max(len(row[i]) for row in rows) for i in range(2)]
    return [f'{key.ljust(width[0])}  {size.ljust(width[1])}  {mark}'.rstrip()
            for key, size, mark in rows]
