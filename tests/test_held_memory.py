"""What a compiled training step keeps alive between steps: nothing beyond the weights, for every
schedule and recompute mode, unrolled or looped, whatever the number of micro-batches.

TensorFlow folds every tensor computed from constants alone (up to 10 MiB each) into a constant
that lives as long as the graph: a step that computed zeros or ones of the activations' or
weights' sizes per micro-batch held them all (`gpipe_tf.pipeline.unfolded`).

Measured in a process of its own (the allocator's counters are process-wide), the batch fed to
every step as an input pipeline does (a batch built from constants in the graph would be folded
into it and held):
- tf.function: the bytes in use after two steps less those after the step's function is
  deleted (the layer and its variables kept): what the compiled step holds, to the byte
  (repeats agree within 10 KiB).
- tf.compat.v1 Session: a session holds the weights, its initial values and a copy-on-write
  copy of a weight or two, which varies from run to run by 0.5 MiB here; so its test is that
  the bytes held do not grow with M (a step that held something per micro-batch held a weight
  and an activation or more each).
"""

import json
import os
import sys

os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')  # Allocation statistics on the CPU.

from absl.testing import absltest  # pylint: disable=g-import-not-at-top
from absl.testing import parameterized  # pylint: disable=g-import-not-at-top

from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top

MIB = 2**20
BATCH, WIDTH, LAYERS, K = 512, 256, 4, 2  # Weights 1 MiB, the step's outputs 0.5 MiB.
# (schedule, recompute, M, unroll): the loss per micro-batch inside the pipeline (`FPropLoss`)
# for all but 'gpipe', whose loss follows the pipeline; unroll=False, the schedule as a loop.
CASES = [('gpipe', 'never', 1, True), ('gpipe', 'never', 8, True),
         ('gpipe_loss', 'never', 8, True), ('1f1b', 'never', 8, True),
         ('1f1b', 'except_last', 8, True), ('1f1b', 'always', 8, True),
         ('interleaved_1f1b', 'never', 8, True), ('zero_bubble', 'never', 8, True),
         ('zero_bubble', 'always', 8, True), ('zero_bubble_v', 'never', 8, True),
         ('zero_bubble_v', 'always', 8, True), ('gpipe', 'always', 8, False),
         ('1f1b', 'always', 8, False), ('zero_bubble', 'always', 8, False),
         ('gpipe', 'never', 8, False), ('1f1b', 'never', 8, False),
         ('1f1b', 'except_last', 8, False), ('zero_bubble', 'never', 8, False),
         ('zero_bubble_v', 'never', 8, False)]
# (schedule, recompute) measured in a Session at M=2 and M=16.
SESSION_CASES = [('gpipe', 'never'), ('gpipe_loss', 'never'), ('1f1b', 'never'),
                 ('zero_bubble', 'never')]


def _Params(kind: str, m: int, recompute: str, unroll: bool):
    from gpipe_tf.layers import basic  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
    devices = test_utils.ConfigureVirtualCpus(K)
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', num_cells=K, num_micro_batches=m, recompute=recompute, unroll=unroll,
        schedule='gpipe' if kind == 'gpipe_loss' else kind,
        virtual_stages=2 if kind in ('interleaved_1f1b', 'zero_bubble_v') else 1,
        input_shapes=[BATCH, WIDTH], devices=devices[:K],
        layer_tpl=[basic.DenseLayer.Params().Set(name=f'dense_{i}', input_dim=WIDTH,
                                                 output_dim=WIDTH, activation='tanh')
                   for i in range(LAYERS)])


def _Step(kind: str, layer, x):
    """One SGD step of a mean square loss; returns the loss."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    def MicroBatchLoss(outputs, _):
        return tf.reduce_mean(tf.square(outputs)), tf.constant(1.0)

    def WholeBatchLoss(outputs):
        # The same mean square as a product, whose gradient is data-dependent from its first
        # op: a reduction's would broadcast the backward's constant 1 to the outputs' shape,
        # which TensorFlow folds and holds. (The pipeline guards its own per micro-batch
        # losses against that; a loss after the pipeline is the user's.)
        flat = tf.reshape(outputs, [1, -1])
        return tf.matmul(flat, flat, transpose_b=True)[0, 0] / (BATCH * WIDTH)

    variables = layer.trainable_variables
    with tf.GradientTape() as tape:
        if kind == 'gpipe':
            loss = WholeBatchLoss(layer(x))
        else:
            _, loss, _ = layer.FPropLoss(layer.theta, x, MicroBatchLoss)
    updates = [v.assign_sub(1e-4 * g) for v, g in zip(variables, tape.gradient(loss, variables))]
    with tf.control_dependencies(updates):
        return tf.identity(loss)


def _InUse() -> int:
    import gc  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    gc.collect()
    return tf.config.experimental.get_memory_info('CPU:0')['current']


def _Batch():
    import numpy as np  # pylint: disable=g-import-not-at-top
    return np.random.RandomState(0).standard_normal([BATCH, WIDTH]).astype(np.float32)


def _HeldByFunction(kind: str, recompute: str, m: int, unroll: bool) -> int:
    """Bytes a tf.function step holds: in use with it, less in use once it is deleted."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    layer = _Params(kind, m, recompute, unroll).Instantiate()
    step = tf.function(lambda x: _Step(kind, layer, x),
                       input_signature=[tf.TensorSpec([BATCH, WIDTH], tf.float32)])
    x = tf.constant(_Batch())
    step(x)
    step(x)
    with_step = _InUse()
    del step
    return with_step - _InUse()


def _HeldBySession(kind: str, recompute: str, m: int) -> int:
    """Bytes a Session holds after two steps: in use with it, less in use once it is closed."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    graph = tf.Graph()
    with graph.as_default():
        layer = _Params(kind, m, recompute, True).Instantiate()
        batch = tf.compat.v1.placeholder(tf.float32, [BATCH, WIDTH])
        update = _Step(kind, layer, batch)
        init = tf.compat.v1.global_variables_initializer()
    config = tf.compat.v1.ConfigProto(device_count={'CPU': K})
    session = tf.compat.v1.Session(graph=graph, config=config)
    session.run(init)
    for _ in range(2):
        session.run(update, {batch: _Batch()})
    with_session = _InUse()
    session.close()
    del session
    return with_session - _InUse()


def _MeasureAll() -> dict:
    measured = {'weights': LAYERS * (WIDTH * WIDTH + WIDTH) * 4}
    for case in CASES:
        measured[_Key(case)] = _HeldByFunction(*case)
    for kind, recompute in SESSION_CASES:
        for m in (2, 16):
            # The least of two: the copy-on-write copies only add.
            measured[f'session {kind} {recompute} M={m}'] = min(
                _HeldBySession(kind, recompute, m) for _ in range(2))
    return measured


def _Key(case) -> str:
    kind, recompute, m, unroll = case
    return f'{kind} {recompute} M={m}' + ('' if unroll else ' looped')


def _Name(key: str) -> str:
    return '_' + key.replace(' ', '_').replace('=', '')


class HeldBetweenStepsTest(parameterized.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.measured = test_utils.MeasureInOwnProcess(__file__, '--measure')
        cls.weights = cls.measured['weights']

    @parameterized.named_parameters(*[(_Name(_Key(case)), _Key(case)) for case in CASES])
    def testAFunctionStepHoldsNothing(self, key):
        held = self.measured[key]
        print(f'{key}: the step holds {held / 1024:.1f} KiB (weights {self.weights / MIB:.2f} '
              'MiB)')
        # A folded copy of the outputs (0.5 MiB) or of a weight (0.25 MiB) is well over this.
        self.assertLessEqual(held, 0.05 * self.weights, f'{held / 1024:.1f} KiB held')

    @parameterized.named_parameters(*[(_Name(f'{k} {r}'), k, r) for k, r in SESSION_CASES])
    def testASessionHoldsNoMoreForMoreMicroBatches(self, kind, recompute):
        few = self.measured[f'session {kind} {recompute} M=2']
        many = self.measured[f'session {kind} {recompute} M=16']
        print(f'session {kind} {recompute}: {few / MIB:.2f} MiB held at M=2, '
              f'{many / MIB:.2f} at M=16')
        self.assertLessEqual(many - few, 0.5 * self.weights,
                             f'{few / MIB:.2f} MiB held at M=2, {many / MIB:.2f} at M=16')


if __name__ == '__main__':
    if sys.argv[1:] == ['--measure']:  # HeldBetweenStepsTest's process.
        print(json.dumps(_MeasureAll()))
    else:
        absltest.main()
