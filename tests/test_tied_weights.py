"""Tied weights (layers/tied_weights.py): the LM's softmax reading its embedding's token table
(`share_embedding_and_softmax`, as GPT-2) across the pipeline's cells.

The oracle shares no code with what it checks: the same LM built untied (no tie code runs),
its softmax's own weight set to the table's transpose, run without the pipeline
(`unpartitioned.Unpartitioned`). Its loss is the tied pipeline's, and the table's gradient is
the sum of the oracle's two, g_emb + g_w^T; every other gradient is the oracle's.
"""

import functools
import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import errors
from gpipe_tf import model_registry
from gpipe_tf import test_utils
from gpipe_tf.layers import embedding
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import sequential
from gpipe_tf.models.transformer import network
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.params import lm
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import unpartitioned

DEVICES = test_utils.ConfigureVirtualCpus()
TOLERANCE = 1e-5
TABLE, SOFTMAX_W = 'embedding.token_emb.emb', 'softmax.softmax.w'
# lm.TransformerLTiny smaller still (each pipeline traces its cells: seconds per case on two
# cores): embedding, 2 Transformer layers, softmax, so K x v = 4 cells hold a layer each.
SIZES = dict(VOCAB_SIZE=32, MODEL_DIM=16, HIDDEN_DIM=32, NUM_HEADS=2, DIM_PER_HEAD=8,
             NUM_LAYERS=2, MAX_LENGTH=8, BATCH_SIZE=4, NUM_CELLS=2, NUM_MICRO_BATCHES=2)


def Model(share: bool):
    """The registered tiny LM class, smaller, with share_embedding_and_softmax = `share`."""
    base = model_registry.GetClass('lm.TransformerLTiny')
    return type(base.__name__, (base,), dict(SIZES, SHARE_EMBEDDING_AND_SOFTMAX=share))


def PipelineParams(share: bool, **overrides):
    p = Model(share)().Pipeline().Set(**overrides)
    return p.Set(devices=DEVICES[:p.num_cells * p.num_replicas])


def Batch():
    return lm.SyntheticBatch(Model(True)().Train())


def LossFn(outputs, loss_inputs=None):
    """The LM's loss (network.ReduceLoss's): (weighted mean over tokens, weight)."""
    del loss_inputs
    weight = tf.reduce_sum(outputs.weight)
    total = tf.reduce_sum(outputs.per_example_loss * outputs.weight)
    return tf.math.divide_no_nan(total, weight), weight


def VarAt(layer, path: str) -> tf.Variable:
    return functools.reduce(lambda node, name: node[name], path.split('.'), layer.vars)


def NumParams(layer) -> int:
    return sum(int(np.prod(v.shape)) for v in layer.variables)


def Values(layer) -> dict:
    return {v.name: v.numpy() for v in layer.variables}


def Dense(x) -> tf.Tensor:
    return tf.convert_to_tensor(x)  # An IndexedSlices (a gather's gradient) as a tensor.


def NormwiseError(got: dict, want: dict) -> float:
    """||got - want|| / ||want|| over all tensors together (keyed alike). A tensor that is zero
    in exact arithmetic holds float noise, so none is compared on its own."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    diff = sum(float(tf.reduce_sum(tf.square(tf.cast(Dense(got[k]), tf.float64) -
                                             tf.cast(Dense(want[k]), tf.float64))))
               for k in want)
    norm = sum(float(tf.reduce_sum(tf.square(tf.cast(Dense(want[k]), tf.float64))))
               for k in want)
    return (diff / norm) ** 0.5


def Oracle(tied, inputs):
    """What the tied model `tied` must compute on `inputs` in its current state, from the
    untied model run without the pipeline.

    Returns:
      (loss, gradients by variable name (the tied model's variables; the table's g_emb +
      g_w^T), the table's two parts (g_emb, g_w^T)).
    """
    untied = PipelineParams(False, num_cells=1, num_micro_batches=1).Instantiate()
    assert not untied.p.tied_weights
    source = {v.name: v for v in tied.variables}
    table, softmax_w = VarAt(untied, TABLE), VarAt(untied, SOFTMAX_W)
    assert table.name in source and softmax_w.name not in source
    assert sorted(source) == sorted(v.name for v in untied.variables if v is not softmax_w)
    for var in untied.variables:
        var.assign(tf.transpose(source[table.name]) if var is softmax_w else source[var.name])
    variables = list(untied.trainable_variables)
    with tf.GradientTape() as tape:
        loss, _ = LossFn(unpartitioned.Unpartitioned(untied, inputs))
    grads = {v.name: Dense(g) for v, g in zip(variables, tape.gradient(loss, variables))}
    parts = grads[table.name], tf.transpose(grads.pop(softmax_w.name))
    grads[table.name] = parts[0] + parts[1]
    return loss, grads, parts


def Gradients(layer, grads) -> dict:
    return {v.name: g for v, g in zip(layer.trainable_variables, grads)}


def PipelineLossAndGrads(layer, inputs):
    variables = list(layer.trainable_variables)
    with tf.GradientTape() as tape, fprop_context.Scope(step=0):
        _, loss, _ = layer.FPropLoss(layer.theta, inputs, LossFn)
    return loss, Gradients(layer, tape.gradient(loss, variables))


# (name, schedule, v, recompute or None for the model's default ('always'), R).
SCHEDULES = [
    ('gpipe', 'gpipe', 1, None, 1),
    ('1f1b', '1f1b', 1, None, 1),
    ('interleaved_1f1b', 'interleaved_1f1b', 2, None, 1),
    ('zero_bubble_never', 'zero_bubble', 1, 'never', 1),
    ('zero_bubble_default_recompute', 'zero_bubble', 1, None, 1),
    ('zero_bubble_v_never', 'zero_bubble_v', 2, 'never', 1),  # Cells on devices 0, 1, 1, 0.
]
CASES = ([(f'{name}_unrolled', kind, v, recompute, r, True)
          for name, kind, v, recompute, r in SCHEDULES] +
         [(f'{name}_looped', kind, v, recompute, r, False)
          for name, kind, v, recompute, r in SCHEDULES] +
         [('1f1b_two_replicas_unrolled', '1f1b', 1, None, 2, True)])


class TiedGradientsTest(tf.test.TestCase, parameterized.TestCase):
    """Loss and gradients of the tied pipeline equal the untied oracle's, under every
    schedule, unrolled and looped."""

    def testTheOracleWeighsBothReadsOfTheTable(self):
        # Dropping either read's gradient must miss the tolerance by far.
        tied = PipelineParams(True).Instantiate()
        _, grads, parts = Oracle(tied, Batch())
        total = tf.sqrt(sum(tf.reduce_sum(tf.square(g)) for g in grads.values()))
        for name, part in zip(('g_emb', 'g_w^T'), parts):
            self.assertGreater(float(tf.norm(part) / total), 1000 * TOLERANCE, msg=name)

    @parameterized.named_parameters(*CASES)
    def testLossAndGradientsEqualTheUntiedOracle(self, kind, v, recompute, r, unroll):
        overrides = dict(schedule=kind, virtual_stages=v, num_replicas=r, unroll=unroll)
        if recompute is not None:
            overrides['recompute'] = recompute
        layer = PipelineParams(True, **overrides).Instantiate()
        cells = [[l.p.name for l in cell.sequence] for cell in layer.cells]
        self.assertLen(cells, 2 * v)
        # The tie crosses cells: the table is read by the first and the last.
        self.assertEqual((cells[0][0], cells[-1][-1]), ('embedding', 'softmax'))
        inputs = Batch()
        want_loss, want, _ = Oracle(layer, inputs)
        loss, got = PipelineLossAndGrads(layer, inputs)
        self.assertAllClose(loss, want_loss, rtol=TOLERANCE, atol=0)
        self.assertLess(NormwiseError(got, want), TOLERANCE)


class OneVariableTest(tf.test.TestCase):
    """The tie makes one variable, the embedding's, on the first cell's device."""

    def setUp(self):
        super().setUp()
        self.tied = PipelineParams(True).Instantiate()
        self.untied = PipelineParams(False).Instantiate()

    def testTheSoftmaxReadsTheTableAndOwnsOnlyItsBias(self):
        table = VarAt(self.tied, TABLE)
        self.assertIs(VarAt(self.tied, SOFTMAX_W), table)
        softmax = self.tied.Layers()[-1].softmax
        self.assertEqual([v.name for v in softmax.variables if v is not table],
                         ['lm/softmax/softmax/b:0'])
        self.assertNotIn('lm/softmax/softmax/w:0', [v.name for v in self.tied.variables])
        self.assertIn('lm/softmax/softmax/w:0', [v.name for v in self.untied.variables])

    def testTheTableLivesOnTheFirstCellsDevice(self):
        def Device(name):
            return tf.DeviceSpec.from_string(name).replace(job=None, replica=None, task=None)

        self.assertEqual(Device(VarAt(self.tied, TABLE).device), Device(self.tied.devices[0]))
        self.assertEqual(Device(VarAt(self.tied, 'softmax.softmax.b').device),
                         Device(self.tied.devices[-1]))
        self.assertNotEqual(self.tied.devices[0], self.tied.devices[-1])

    def testOneVariableFewerAndVocabTimesDFewerParameters(self):
        vocab, dim = SIZES['VOCAB_SIZE'], SIZES['MODEL_DIM']
        self.assertLen(self.tied.variables, len(self.untied.variables) - 1)
        self.assertLen(self.tied.trainable_variables,
                       len(self.untied.trainable_variables) - 1)
        self.assertEqual(NumParams(self.tied), NumParams(self.untied) - vocab * dim)

    def testFPropMetaCountsTheVariablesBuilt(self):
        for share, layer in ((True, self.tied), (False, self.untied)):
            with self.subTest(share=share):
                self.assertEqual(network.PipelineMeta(PipelineParams(share)).num_params,
                                 NumParams(layer))


@pytest.mark.unit
class ParamsOnlyTest(tf.test.TestCase):
    """What Params alone say (no variable, no op): the registered models keep their own softmax
    weights, a tied model counts one table, and its tie survives the Params' text."""

    def testRegisteredModelsDoNotTie(self):
        # The paper's counts (test_transformer_model) need two vocab x D matrices.
        for key in ('lm.TransformerL_3', 'lm.TransformerLTiny',
                    'mt.multilingual.TransformerTiny'):
            with self.subTest(key=key):
                params = model_registry.GetClass(key)().Pipeline()
                self.assertEqual(params.tied_weights, [])
                self.assertFalse(params.layer_tpl[-1].tied_embedding)
                self.assertFalse(params.layer_tpl[0].tied_softmax)

    def testPaperSizeTiedCountIsTheUntiedLessOneTable(self):
        base = model_registry.GetClass('lm.TransformerL_3')
        tied = type(base.__name__, (base,), dict(SHARE_EMBEDDING_AND_SOFTMAX=True))
        untied_count = network.PipelineMeta(base().Pipeline()).num_params
        self.assertEqual(untied_count, 282_176_768)
        self.assertEqual(network.PipelineMeta(tied().Pipeline()).num_params,
                         untied_count - 32000 * 2048)

    def testTiedParamsRoundTripThroughText(self):
        params = PipelineParams(True)
        self.assertEqual(params.tied_weights, [network.TIED_SOFTMAX])
        back = pipelining_layer.PipeliningLayer.Params().FromText(params.ToText())
        self.assertEqual(back, params)
        self.assertEqual(back.tied_weights, [network.TIED_SOFTMAX])


class CheckpointTest(tf.test.TestCase):
    """A tied checkpoint written at one K restores at another and into the un-pipelined stack,
    optimizer slots included, and the next step is the same."""

    def _Step(self, layer, optimizer, inputs):
        variables = layer.trainable_variables
        with tf.GradientTape() as tape, fprop_context.Scope(step=1):
            loss = network.ReduceLoss(layer(inputs)).loss
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return float(loss)

    def testRestoresAtAnotherKAndUnpipelinedAndContinuesTheSame(self):
        inputs = Batch()
        source = PipelineParams(True).Instantiate()
        optimizer = tf.compat.v1.train.AdamOptimizer(0.01)
        self._Step(source, optimizer, inputs)
        directory = tempfile.mkdtemp(prefix='tied_weights_')
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        path = tf.train.Checkpoint(model=source, optimizer=optimizer).save(
            os.path.join(directory, 'ckpt'))
        # Each variable once (the table under the embedding's key), no softmax weight.
        keys = [key for key, _ in tf.train.list_variables(path) if key.startswith('model/')]
        values = [key for key in keys if key.endswith('/.ATTRIBUTES/VARIABLE_VALUE') and
                  '.OPTIMIZER_SLOT' not in key]
        self.assertLen(values, len(source.variables))
        self.assertIn('model/_layer_children/embedding/_layer_children/token_emb/_layer_vars/'
                      'emb/.ATTRIBUTES/VARIABLE_VALUE', values)
        self.assertEmpty([key for key in keys if 'softmax/_layer_vars/w/' in key])
        expected_loss = self._Step(source, optimizer, inputs)
        expected = Values(source)
        targets = {'K=3': PipelineParams(True, num_cells=3),
                   'un-pipelined': pipelining_layer.PipeliningLayer.UnpipelinedParams(
                       PipelineParams(True))}
        for name, params in targets.items():
            with self.subTest(target=name):
                layer = params.Instantiate()
                self.assertIs(VarAt(layer, SOFTMAX_W), VarAt(layer, TABLE))
                restored = tf.compat.v1.train.AdamOptimizer(0.01)
                status = tf.train.Checkpoint(model=layer, optimizer=restored).restore(path)
                status.assert_existing_objects_matched()
                loss = self._Step(layer, restored, inputs)
                status.assert_consumed()  # Every slot found its variable.
                self.assertAllClose(loss, expected_loss, rtol=TOLERANCE, atol=0)
                values = Values(layer)
                self.assertCountEqual(values, expected)
                for key, value in expected.items():
                    self.assertAllClose(values[key], value, rtol=TOLERANCE, atol=1e-7, msg=key)


    def testAnUntiedCheckpointDoesNotRestoreSilentlyIntoATiedModel(self):
        directory = tempfile.mkdtemp(prefix='tied_weights_')
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        path = tf.train.Checkpoint(model=PipelineParams(False).Instantiate()).save(
            os.path.join(directory, 'ckpt'))
        status = tf.train.Checkpoint(model=PipelineParams(True).Instantiate()).restore(path)
        status.assert_existing_objects_matched()
        # The untied softmax weight has no variable to go to: reported, not dropped silently.
        with self.assertRaisesRegex(AssertionError, 'Unresolved object'):
            status.assert_consumed()


class GraphModesTest(tf.test.TestCase):
    """One SGD step in a tf.function and in a tf.compat.v1 graph updates the table by
    lr * (g_emb + g_w^T), every other variable by lr * its oracle gradient."""

    LEARNING_RATE = 10.0  # Updates as large as the values: float32 rounding stays small.

    def assertUpdates(self, before: dict, after: dict, want: dict, table_name: str):
        updates = {name: (before[name] - after[name]) / self.LEARNING_RATE for name in want}
        self.assertLess(NormwiseError({table_name: updates[table_name]},
                                      {table_name: want[table_name]}), TOLERANCE)
        self.assertLess(NormwiseError(updates, want), TOLERANCE)

    def testFunctionStep(self):
        layer = PipelineParams(True, schedule='1f1b').Instantiate()
        inputs = Batch()
        _, want, _ = Oracle(layer, inputs)
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(self.LEARNING_RATE)
        variables = list(layer.trainable_variables)

        @tf.function
        def Step(x):
            with tf.GradientTape() as tape, fprop_context.Scope(step=0):
                _, loss, _ = layer.FPropLoss(layer.theta, x, LossFn)
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

        before = Values(layer)
        Step(inputs)
        self.assertUpdates(before, Values(layer), want, VarAt(layer, TABLE).name)

    def testV1GraphStep(self):
        eager = PipelineParams(True).Instantiate()
        inputs = Batch()
        initial = Values(eager)
        _, want, _ = Oracle(eager, inputs)
        graph = tf.Graph()
        with graph.as_default():
            layer = PipelineParams(True).Instantiate()  # gpipe: FProp, the loss after it.
            x = tf.nest.map_structure(tf.constant, inputs.Transform(lambda t: t.numpy()))
            loss = network.ReduceLoss(layer(x)).loss
            train_op = tf.compat.v1.train.GradientDescentOptimizer(
                self.LEARNING_RATE).minimize(loss, var_list=list(layer.trainable_variables))
            variables = {v.name: v for v in layer.variables}
            table_name = VarAt(layer, TABLE).name
            config = tf.compat.v1.ConfigProto(
                device_count={'CPU': len(tf.config.list_logical_devices('CPU'))})
            with tf.compat.v1.Session(graph=graph, config=config) as session:
                session.run(tf.compat.v1.global_variables_initializer())
                before = session.run(variables)
                session.run(train_op)
                after = session.run(variables)
        # The graph's variables start where the eager model's did, so the oracle applies.
        self.assertCountEqual(before, initial)
        for name, value in initial.items():
            self.assertAllEqual(before[name], value, msg=name)
        self.assertUpdates(before, after, want, table_name)


class ErrorsTest(tf.test.TestCase, parameterized.TestCase):
    """A tie that cannot be made is a ConfigError, one line, naming the pipeline and the tie."""

    def assertConfigError(self, params, *fragments):
        with self.assertRaises(errors.ConfigError) as raised:
            params.Instantiate()
        message = str(raised.exception)
        self.assertNotIn('\n', message)
        self.assertTrue(message.startswith('lm: '), message)
        for fragment in fragments:
            self.assertIn(fragment, message)
        return message

    def testConsumerWithAVariableOfItsOwn(self):
        # tied_weights set, but the softmax built with its own weight (tied_embedding False).
        params = PipelineParams(False).Set(tied_weights=[list(network.TIED_SOFTMAX)])
        self.assertConfigError(params, "'softmax.softmax.w'", 'has a variable of its own',
                               'tied_weight=True')

    @parameterized.named_parameters(
        ('no_such_variable', 'embedding.token_emb.table', 'lm.embedding.token_emb has emb'),
        ('a_layer_not_a_variable', 'embedding.token_emb', 'lm.embedding has'),
    )
    def testProducerThatNamesNoVariable(self, producer, listing):
        params = PipelineParams(True).Set(tied_weights=[[SOFTMAX_W, producer]])
        self.assertConfigError(params, f'producer {producer!r} is no variable', listing)

    @parameterized.named_parameters(
        ('producer', [SOFTMAX_W, 'embeding.token_emb.emb'], "no layer 'embeding.token_emb'"),
        ('consumer', ['softmax.sofmax.w', TABLE], "no layer 'softmax.sofmax'"),
    )
    def testPathThatNamesNoLayer(self, tie, fragment):
        self.assertConfigError(PipelineParams(True).Set(tied_weights=[tie]), fragment,
                               'the layers are embedding, layer_0, layer_1, softmax')

    @parameterized.named_parameters(
        ('one_path', [SOFTMAX_W], repr([SOFTMAX_W])),
        ('three_paths', [SOFTMAX_W, TABLE, TABLE], repr([SOFTMAX_W, TABLE, TABLE])),
        ('undotted', ['softmax', TABLE], repr(['softmax', TABLE])),
        ('not_a_string', [SOFTMAX_W, 3], repr([SOFTMAX_W, 3])),
        ('pair_without_the_outer_list', None, repr(SOFTMAX_W)),
    )
    def testEntryThatIsNotAPairOfDottedPaths(self, tie, fragment):
        ties = [tie] if tie is not None else list(network.TIED_SOFTMAX)
        self.assertConfigError(PipelineParams(True).Set(tied_weights=ties),
                               'must be a pair [consumer path, producer path]', f'got {fragment}')

    def testTheUnpipelinedStackRefusesTheSameTie(self):
        params = pipelining_layer.PipeliningLayer.UnpipelinedParams(
            PipelineParams(False).Set(tied_weights=[list(network.TIED_SOFTMAX)]))
        with self.assertRaisesRegex(errors.ConfigError, r"^lm: tied_weights consumer "
                                    r"'softmax\.softmax\.w' has a variable of its own"):
            params.Instantiate()

    def testASoftmaxThatReadsATableNoTieGives(self):
        # The layers of a tied LM in a pipeline built without its tied_weights.
        layer = PipelineParams(True).Set(tied_weights=[]).Instantiate()
        with self.assertRaisesRegex(errors.ConfigError, r"lm\.softmax\.softmax: tied_weight=True "
                                    r"reads a \[num_classes, input_dim\] = \[32, 16\] table as "
                                    r"w, which the parent's tied_weights give .*; got none\.$"):
            layer(Batch())

    def testATableOfAnotherShape(self):
        layer = PipelineParams(True).Set(
            tied_weights=[[SOFTMAX_W, 'layer_0.ffn_in.w']]).Instantiate()
        with self.assertRaisesRegex(errors.ConfigError, r'\[32, 16\] table as w.*; got \[16, 32\]'):
            layer(Batch())


@pytest.mark.unit
class MemoryMetaTest(tf.test.TestCase):
    """With the tie the token table's gradient is dense (the softmax's is), so the embedding's
    LayerMeta no longer counts the table among its sparse parameters."""

    def _Meta(self, share: bool, position_embedding: str):
        p = PipelineParams(share).layer_tpl[0].Copy().Set(position_embedding=position_embedding)
        self.assertEqual(p.name, 'embedding')
        batch, length = SIZES['BATCH_SIZE'], SIZES['MAX_LENGTH']
        shapes = NestedMap({key: tf.TensorShape([batch, length])
                            for key in network.LM_INPUT_KEYS})
        return p.cls.FPropMeta(p, shapes)

    def testTiedTableIsNotSparse(self):
        vocab, dim = SIZES['VOCAB_SIZE'], SIZES['MODEL_DIM']
        batch, length = SIZES['BATCH_SIZE'], SIZES['MAX_LENGTH']
        for positions, position_params, position_rows in (('sinusoidal', 0, 0),
                                                          ('learned', length * dim, length)):
            with self.subTest(position_embedding=positions):
                tied, untied = self._Meta(True, positions), self._Meta(False, positions)
                self.assertEqual(tied.num_params, vocab * dim + position_params)
                self.assertEqual(tied.num_params, untied.num_params)
                self.assertEqual(tied.flops, untied.flops)
                # Untied (the default): the table's gradient is a gather's, rows of B x T ids.
                self.assertEqual(untied.sparse_params, vocab * dim + position_params)
                self.assertEqual(untied.sparse_gradient_bytes, embedding.SparseGradientBytes(
                    batch * length + position_rows, dim, tf.float32))
                # Tied: only the learned positions stay sparse.
                self.assertEqual(tied.sparse_params, position_params)
                self.assertEqual(tied.sparse_gradient_bytes, embedding.SparseGradientBytes(
                    position_rows, dim, tf.float32))

    def testPipelineMetaSumsTheSameSparseParameters(self):
        vocab, dim = SIZES['VOCAB_SIZE'], SIZES['MODEL_DIM']
        self.assertEqual(network.PipelineMeta(PipelineParams(False)).sparse_params, vocab * dim)
        self.assertEqual(network.PipelineMeta(PipelineParams(True)).sparse_params, 0)


@pytest.mark.unit
class MemoryPlanTest(tf.test.TestCase):
    """The last cell holds the table it reads (a copy) and its dense gradient, as the untied
    softmax's own weight, but no optimizer slots for it: those are the first cell's."""

    def testTheReadingCellHoldsTheTableButNoSlots(self):
        from gpipe_tf.perf import memory  # pylint: disable=import-outside-toplevel
        vocab, dim = SIZES['VOCAB_SIZE'], SIZES['MODEL_DIM']
        table = vocab * dim * 4
        plans = {share: memory.PlanMemory(PipelineParams(share), slots_per_param=2).cells
                 for share in (True, False)}
        tied, untied = plans[True][-1], plans[False][-1]
        self.assertEqual(tied.params, untied.params)
        self.assertEqual(tied.gradients, untied.gradients)
        self.assertEqual(untied.slots - tied.slots, 2 * table)
        # The first cell: the same weights and slots.
        first = {share: plans[share][0] for share in (True, False)}
        self.assertEqual(first[True].params, first[False].params)
        self.assertEqual(first[True].slots, first[False].slots)
        # Its table's gradient is dense (every row), where untied it was a gather's rows.
        self.assertGreater(first[True].gradients, first[False].gradients)


class TableGradientTest(tf.test.TestCase):
    """The table's gradient, the sum of a gather's and a matrix product's, is a dense tensor
    with the tie (as the meta counts it), a gather's IndexedSlices without."""

    def testTheTiedTablesGradientIsDenseAsTheMetaSays(self):
        inputs = Batch()
        for share, gradient_type in ((True, tf.Tensor), (False, tf.IndexedSlices)):
            with self.subTest(share=share):
                stack = pipelining_layer.PipeliningLayer.UnpipelinedParams(
                    PipelineParams(share)).Instantiate()
                self.assertIsInstance(stack, sequential.SequentialLayer)
                table = VarAt(stack, TABLE)
                with tf.GradientTape() as tape:
                    loss, _ = LossFn(stack(inputs))
                self.assertIsInstance(tape.gradient(loss, table), gradient_type)


if __name__ == '__main__':
    tf.test.main()
