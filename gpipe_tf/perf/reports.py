"""What `--mode=inspect_model` prints, from Params alone: the partition table (per cell its
layers, device, FLOPs, parameters, activation bytes) and the memory plan per device, with the
plan pictures."""

from __future__ import annotations

import os

from gpipe_tf import errors
from gpipe_tf.perf import pictures
from gpipe_tf.perf import plot
from gpipe_tf.pipeline import executor
from gpipe_tf.pipeline import partition
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib


def PartitionTable(p, name: str, plan=None) -> str:
    """The partition table of task Params `p`'s pipeline from Params alone (no variables, no
    TF ops), from `plan` (placed) or one made here."""
    if plan is None and pipelining_layer.IsPipeline(p.model):
        plan = plan_lib.MakePlan(p.model)
    if plan is None:
        raise errors.ConfigError(f'{name}: inspect_model needs a PipeliningLayer model; got '
                                 f'{p.model.cls.__name__}.')
    metas = plan.metas
    rows = [partition.ReportRow(cell=k, device=plan.devices[k], layers=[l.name for l in cell],
                                flops=metas[k].flops if metas else None,
                                num_params=metas[k].num_params if metas else None,
                                activation_bytes=metas[k].activation_bytes if metas else None)
            for k, cell in enumerate(plan.cells)]
    cells = (f'K={plan.num_cells} cells' if plan.virtual_stages == 1 else
             f'K={plan.num_devices} devices x v={plan.virtual_stages} = {plan.num_cells} cells')
    m = plan_lib.NumMicroBatches(plan.params, p.input.batch_size, equal=False)
    head = (f'{name}: {cells}, M={m} micro-batches, schedule {p.model.schedule} '
            f'({executor.Choose(plan, m)}), recompute={p.model.recompute}, '
            f'batch {p.input.batch_size}. '
            'FLOPs and activation bytes are per mini-batch; with re-materialization a cell '
            'keeps about 1/M of its activations at a time.')
    return head + '\n' + partition.FormatReport(rows)


def MemoryTable(p, name: str, device_bytes: float | None = None, plot_dir: str | None = None,
                plan=None) -> str:
    """The memory plan table of task Params `p`'s pipeline from Params alone (from its `plan`
    when given); with `plot_dir`, also writes the plan pictures there as PNGs and lists their
    paths.

    Raises:
      ValueError: for a model that is not a PipeliningLayer or has no input_shapes.
    """
    plan = pictures.Plan(p, pipeline_plan=plan)
    lines = [f'{name}: planned memory per device, in MiB (slots per parameter: '
             f'{plan.memory.slots_per_param}).', plan.memory.Format(device_bytes)]
    if plot_dir:
        for key, figure in pictures.Figures(plan, name, device_bytes).items():
            lines.append(f'wrote {plot.SavePng(figure, os.path.join(plot_dir, key + ".png"))}')
    return '\n'.join(lines)



