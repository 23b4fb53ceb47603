r"""The looped step of every schedule as K grows, for the same work: is any slower than gpipe's?

A dense stack of 2K layers of 64 (tanh; --width), M = 4K micro-batches of 8 examples
(--micro_batch), K cells on K
virtual CPU devices (2K cells, two per device, for interleaved_1f1b and zero_bubble_v), run as
a loop (unroll=False). TensorFlow's default threads: the devices share this machine's cores, so
a step's time is its total work plus the loop's own cost, and the schedules, doing the same
arithmetic, should take the same time. gpipe runs as the reference at each K, and again with
two cells per device (v=2, the cells of interleaved_1f1b and zero_bubble_v): twice the actions
of half the work, which separates what a schedule costs from what its smaller cells cost. Per
(K, schedule):

  first_step_s   building the step and running it once
  step_ms        median of 5 train steps (loss per micro-batch via FPropLoss, SGD update)
  v              cells per device
  over_gpipe     step_ms over looped gpipe's at the same K (v=1)
  over_same_cells  step_ms over looped gpipe's at the same K and v
  ticks          the schedule's ticks (iterations of the loop)
  body_nodes     (--count_nodes) nodes of the loop body in the step's partition graphs, after
                 grappler: each runs once per tick, in the branches not taken too (a lowered
                 switch_case passes dead values through them)
  node_visits    body_nodes x ticks: the executor's work per step, independent of the load
  nodes_per_device  (--count_nodes) body_nodes / K by part: 'loop' (the while loop's own
                 nodes, the tables' reads, the cross-device fetches), 'switches' (each
                 switch_case's own: a _SwitchN per value it passes, a Merge per value it
                 returns), 'idle' (the branches that run no action) and, per kind of action
                 (F, B, I, W), the nodes of its branches

    python benchmarks/looped_scaling.py [--ks=8,16,32] [--recompute=always] [--schedules=...]
        [--width=64] [--micro_batch=8] [--count_nodes]
        [--out=benchmarks/results/looped_scaling.json]
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import json
import statistics
import time

import re  # pylint: disable=g-import-not-at-top,g-bad-import-order

import tensorflow as tf  # pylint: disable=g-import-not-at-top,g-bad-import-order
from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top



def Build(kind, k, devices, recompute, width, micro_batch, virtual):
    from gpipe_tf.layers import basic  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
    m = 4 * k
    layers = [basic.DenseLayer.Params().Set(name=f'dense_{i}', input_dim=width,
                                            output_dim=width, activation='tanh')
              for i in range(2 * k)]
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers, num_cells=k, virtual_stages=virtual,
        num_micro_batches=m, schedule=kind, recompute=recompute, unroll=False,
        input_shapes=[micro_batch * m, width], devices=devices[:k]).Instantiate()


def LossFn(outputs, _):
    return tf.reduce_mean(tf.square(outputs)), tf.constant(1.0)


def MakeStep(layer):
    variables = layer.trainable_variables

    @tf.function
    def Step(x):
        with tf.GradientTape() as tape:
            _, loss, _ = layer.FPropLoss(layer.theta, x, LossFn)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(1e-4 * g)
        return loss
    return Step


# A branch's ops are named in its action's scope (`looped._SCOPES`).
_KIND_SCOPES = {'fwd': 'F', 'bwd': 'B', 'bwd_input': 'I', 'bwd_weight': 'W'}


def BodyNodes(kind, k, devices, recompute, width, micro_batch, virtual) -> tuple[int, dict]:
    """Nodes of the while loops' bodies in the partition graphs of a step built afresh (a
    function's partition graphs are reported when it first runs), and per part of the body
    (see nodes_per_device above) their number per device."""
    step = MakeStep(Build(kind, k, devices, recompute, width, micro_batch, virtual))
    x = tf.random.stateless_normal([micro_batch * 4 * k, width], [1, 2])
    context.enable_run_metadata()
    try:
        context.export_run_metadata()  # Drops what earlier steps of this process left there.
        step(x).numpy()
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    graphs = list(metadata.partition_graphs) + [
        g for function in metadata.function_graphs for g in function.partition_graphs]
    in_loop = re.compile(r'(^|/)while(_\d+)?/')
    # A function's partition graphs are reported twice (as the step's and as the function's):
    # a node is counted once per device. Enter and Exit run once per loop, not per tick.
    nodes = {(node.name, node.device) for g in graphs for node in g.node
             if in_loop.search(node.name) and node.op not in ('Enter', 'Exit')}
    # A branch: its device's and switch's names and its index, as lowering names its nodes.
    branch_of = re.compile(r'(device_\d+/switch_case(?:_\d+)?)/indexed_case/branch(\d+)/')
    action_of = re.compile(r'/cell_\d+_(fwd|bwd|bwd_input|bwd_weight)/')
    branches, parts = {}, {}
    for name, device in nodes:
        found = branch_of.search(name)
        if found is None:
            part = 'switches' if 'switch_case' in name else 'loop'
            parts[part] = parts.get(part, 0) + 1
            continue
        branch = branches.setdefault((device, found.groups()), [0, None])
        branch[0] += 1
        action = action_of.search(name)
        if action is not None:
            branch[1] = _KIND_SCOPES[action.group(1)]
    for count, action in branches.values():
        parts[action or 'idle'] = parts.get(action or 'idle', 0) + count
    return len(nodes), {part: round(count / k, 1) for part, count in sorted(parts.items())}


def Measure(kind, k, devices, recompute, width, micro_batch, virtual,
            count_nodes=False) -> dict:
    from gpipe_tf.pipeline import executor  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import ticks as ticks_lib  # pylint: disable=g-import-not-at-top
    layer = Build(kind, k, devices, recompute, width, micro_batch, virtual)
    choice = executor.Choose(layer.plan, layer.plan.num_micro_batches)
    assert choice.loops, f'the benchmark measures the loop; this step runs {choice}'
    step = MakeStep(layer)
    x = tf.random.stateless_normal([micro_batch * 4 * k, width], [1, 2])
    start = time.perf_counter()
    step(x).numpy()
    first = time.perf_counter() - start
    ticks = len(ticks_lib.Ticks(layer.plan.schedule))
    step(x).numpy()
    times = []
    for _ in range(5):
        begin = time.perf_counter()
        step(x).numpy()
        times.append(time.perf_counter() - begin)
    counts = {}
    if count_nodes:
        nodes, parts = BodyNodes(kind, k, devices, recompute, width, micro_batch, virtual)
        counts = dict(body_nodes=nodes, node_visits=nodes * ticks, nodes_per_device=parts)
    return dict(schedule=kind, k=k, v=virtual, m=4 * k, layers=2 * k, width=width,
                micro_batch=micro_batch, recompute=recompute,
                first_step_s=first, step_ms=1e3 * statistics.median(times), ticks=ticks,
                **counts)


def Main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--ks', default='8,16,32', help='Comma-separated K values.')
    parser.add_argument('--recompute', default='always', choices=('always', 'except_last',
                                                                  'never'))
    parser.add_argument('--schedules', default=None,
                        help='Comma-separated kinds (default: every kind; gpipe always runs '
                             'first, as the reference).')
    parser.add_argument('--width', type=int, default=64, help="The dense layers' width.")
    parser.add_argument('--micro_batch', type=int, default=8, help='Examples per micro-batch.')
    parser.add_argument('--count_nodes', action='store_true',
                        help="Also count the loop body's nodes (one more step, traced).")
    parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                                      'looped_scaling.json'))
    args = parser.parse_args()
    ks = [int(v) for v in args.ks.split(',')]
    from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import schedule  # pylint: disable=g-import-not-at-top
    devices = test_utils.ConfigureVirtualCpus(max(ks))
    kinds = args.schedules.split(',') if args.schedules else list(schedule.KINDS)
    # gpipe first, at v=1 and at each v another kind runs with: the references.
    virtual = {kind: schedule.Kind(kind).searched_virtual_stages for kind in kinds}
    runs = [('gpipe', v) for v in sorted({1, *virtual.values()})] + [
        (kind, v) for kind, v in virtual.items() if kind != 'gpipe']
    print(f'TensorFlow {tf.__version__}, {os.cpu_count()} CPU cores; 2K dense layers of {args.width}, '
          f'M=4K micro-batches of {args.micro_batch}, looped, recompute {args.recompute}')
    print(f'{"schedule":17s} {"v":>2s} {"K":>3s} {"M":>4s} {"first step s":>12s} '
          f'{"step ms":>8s} {"/gpipe":>7s} {"/same cells":>11s} {"ticks":>6s} '
          f'{"node visits":>12s}', flush=True)
    rows = []
    for k in ks:
        references = {}  # v -> gpipe's step with v cells per device
        for kind, v in runs:
            row = Measure(kind, k, devices, args.recompute, args.width, args.micro_batch, v,
                          args.count_nodes)
            if kind == 'gpipe':
                references[v] = row['step_ms']
            row['over_gpipe'] = row['step_ms'] / references[1]
            row['over_same_cells'] = row['step_ms'] / references[v]
            rows.append(row)
            print(f'{kind:17s} {v:2d} {k:3d} {4 * k:4d} {row["first_step_s"]:12.1f} '
                  f'{row["step_ms"]:8.1f} {row["over_gpipe"]:7.2f} '
                  f'{row["over_same_cells"]:11.2f} {row["ticks"]:6d} '
                  f'{row.get("node_visits", ""):>12}', flush=True)
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, 'w', encoding='utf-8') as f:  # After every row: nothing lost.
                json.dump({'tensorflow': tf.__version__, 'cpu_cores': os.cpu_count(),
                           'rows': rows}, f, indent=1)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    Main()
