"""gpipe_tf.keras.Functional's contract: a functional Keras model pipelined as it is (its graph
cut into stages, skips carried across cuts, tied weights read by two stages) predicts, trains
and saves as the same model under Keras alone.

The oracle is the model itself run by Keras: a second model built alike from the same seed (the
pipelined one's weights move to the stages' devices), compared normwise over all its weights,
predictions and losses. Batch norm normalises per micro-batch in a pipeline, so models with it
are compared in inference, and in training at M = 1.
"""

import os
import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import test_utils
from gpipe_tf.keras import Functional

DEVICES = test_utils.ConfigureVirtualCpus()
M = 4
TOLERANCE = 1e-5
SCHEDULES = [('gpipe', {}), ('1f1b', {}), ('interleaved_1f1b', {'virtual_stages': 2}),
             ('zero_bubble', {'recompute': 'never'}), ('zero_bubble', {}),
             ('zero_bubble_v', {'virtual_stages': 2, 'recompute': 'never'})]


# ---- models: each a function of no argument, the same weights at every call ------------------
def SkipsAndTies():
    """Two inputs (a dict), two outputs: a layer called at the start and near the end (tied
    weights, in the first and the last stage), a residual add whose skip crosses a cut, an
    input only the last stage reads, an output the first stage makes."""
    keras.utils.set_random_seed(0)
    x = keras.Input((8,), name='x')
    aux = keras.Input((8,), name='aux')
    shared = keras.layers.Dense(8, activation='tanh', name='shared')
    h = shared(x)
    s = keras.layers.Dense(8, activation='tanh', name='d2')(h)
    h2 = keras.layers.Add(name='add')([s, h])
    h3 = keras.layers.Dense(8, activation='tanh', name='d3')(h2)
    h4 = shared(h3)
    out = keras.layers.Multiply(name='mul')([h4, aux])
    y = keras.layers.Dense(2, name='head')(out)
    return keras.Model({'x': x, 'aux': aux}, {'y': y, 'h': h}, name='skips_and_ties')


def ResidualNet(batch_norm=False):
    """A small functional ResNet: a stem and three residual blocks of two convolutions, whose
    adds read the block's input; the cuts fall inside blocks."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding='same', activation='relu', name='stem')(inputs)
    for i in range(3):
        r = keras.layers.Conv2D(8, 3, padding='same', activation='relu', name=f'conv_{i}a')(h)
        if batch_norm:
            r = keras.layers.BatchNormalization(name=f'bn_{i}')(r)
        r = keras.layers.Conv2D(8, 3, padding='same', name=f'conv_{i}b')(r)
        h = keras.layers.ReLU(name=f'relu_{i}')(keras.layers.Add(name=f'add_{i}')([h, r]))
    h = keras.layers.GlobalAveragePooling2D(name='pool')(h)
    return keras.Model(inputs, keras.layers.Dense(3, name='head')(h), name='resnet')


def UNet():
    """A U-Net of two levels: each encoder output is concatenated into the decoder stages
    later, the first one three stages later."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((8, 8, 2))
    e1 = keras.layers.Conv2D(4, 3, padding='same', activation='relu', name='enc_1')(inputs)
    e2 = keras.layers.Conv2D(8, 3, padding='same', activation='relu', name='enc_2')(
        keras.layers.MaxPooling2D(name='down_1')(e1))
    b = keras.layers.Conv2D(8, 3, padding='same', activation='relu', name='bottom')(
        keras.layers.MaxPooling2D(name='down_2')(e2))
    d2 = keras.layers.Conv2D(8, 3, padding='same', activation='relu', name='dec_2')(
        keras.layers.Concatenate(name='cat_2')([keras.layers.UpSampling2D(name='up_2')(b), e2]))
    d1 = keras.layers.Conv2D(4, 3, padding='same', activation='relu', name='dec_1')(
        keras.layers.Concatenate(name='cat_1')([keras.layers.UpSampling2D(name='up_1')(d2), e1]))
    return keras.Model(inputs, keras.layers.Conv2D(1, 1, name='out')(d1), name='unet')


def TiedLanguageModel():
    """GPT-2's shape in small: a reversible token embedding (keras_hub's, tie_weights=True),
    decoder blocks that read a padding mask input, the embedding called again for the logits."""
    import keras_hub  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(3)
    ids = keras.Input((6,), dtype='int32', name='ids')
    mask = keras.Input((6,), dtype='bool', name='mask')
    embedding = keras_hub.layers.ReversibleEmbedding(20, 8, tie_weights=True, name='embedding')
    h = embedding(ids)
    for i in range(3):
        h = keras_hub.layers.TransformerDecoder(16, 2, name=f'block_{i}')(
            h, decoder_padding_mask=mask)
    return keras.Model({'ids': ids, 'mask': mask}, embedding(h, reverse=True), name='tied_lm')


# ---- data ---------------------------------------------------------------------------------
def SkipsAndTiesData(n=11):
    rng = np.random.RandomState(4)
    x = {'x': rng.randn(n, 8).astype(np.float32), 'aux': rng.randn(n, 8).astype(np.float32)}
    y = {'y': rng.randn(n, 2).astype(np.float32), 'h': rng.randn(n, 8).astype(np.float32)}
    return x, y


def Images(shape, outputs, n=11):
    rng = np.random.RandomState(5)
    return (rng.randn(n, *shape).astype(np.float32),
            rng.randn(n, *outputs).astype(np.float32))


def Tokens(n=10):
    rng = np.random.RandomState(6)
    return ({'ids': rng.randint(0, 20, (n, 6)).astype(np.int32), 'mask': rng.rand(n, 6) > 0.2},
            rng.randint(0, 20, (n, 6)).astype(np.int32))


def Weights(model) -> np.ndarray:
    return np.concatenate([np.ravel(w) for w in model.get_weights()])


class FunctionalTestCase(tf.test.TestCase):

    def assertNormClose(self, expected, actual, msg=None):
        want = np.concatenate([np.ravel(np.asarray(v, np.float64))
                               for v in tf.nest.flatten(expected)])
        got = np.concatenate([np.ravel(np.asarray(v, np.float64))
                              for v in tf.nest.flatten(actual)])
        self.assertEqual(want.shape, got.shape, msg)
        error, scale = np.linalg.norm(got - want), np.linalg.norm(want)
        self.assertLessEqual(error, TOLERANCE * max(scale, 1e-2),
                             f'{msg or ""}: |a - b| = {error:.3g}, |b| = {scale:.3g}')

    def assertFitsAsTheModel(self, make, x, y, loss, optimizer=None, batch_size=4,
                             epochs=2, **params):
        """`fit` of the pipelined model gives the model's own losses, weights and then
        predictions under Keras."""
        model, reference = make(), make()
        pipelined = Functional(model, num_micro_batches=params.pop('num_micro_batches', M),
                               devices=DEVICES, **params)
        for m in (pipelined, reference):
            m.compile(optimizer() if optimizer else keras.optimizers.SGD(0.1), loss)
        histories = [m.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0,
                           shuffle=False).history['loss'] for m in (pipelined, reference)]
        self.assertNormClose(histories[1], histories[0], 'losses')
        self.assertNormClose(Weights(reference), Weights(model), 'weights')
        self.assertNormClose(reference.predict(x, verbose=0),
                             pipelined.predict(x, verbose=0), 'predictions')
        return pipelined


class ContractTest(FunctionalTestCase):

    def testSkipsAndTiedWeightsEverySchedule(self):
        x, y = SkipsAndTiesData()
        for schedule, params in SCHEDULES:
            for unroll in (True, False):
                with self.subTest(schedule=schedule, unroll=unroll, **params):
                    cells = 2 if params.get('virtual_stages') else 4
                    self.assertFitsAsTheModel(SkipsAndTies, x, y, {'y': 'mse', 'h': 'mse'},
                                              epochs=1, num_cells=cells, schedule=schedule,
                                              unroll=unroll, **params)

    def testAResNetWhoseResidualsCrossTheCuts(self):
        x, y = Images((8, 8, 3), (3,))
        pipelined = self.assertFitsAsTheModel(
            ResidualNet, x, y, 'mse', schedule='1f1b', recompute='except_last',
            split_points=['conv_0b', 'conv_1b', 'conv_2b'])
        # Every stage but the first receives the block input its add reads.
        for stage in pipelined.stages[1:]:
            self.assertLen(stage.inputs, 2)

    def testAUNetWhoseSkipsCrossSeveralStages(self):
        x, y = Images((8, 8, 2), (8, 8, 1))
        pipelined = self.assertFitsAsTheModel(
            UNet, x, y, 'mse', schedule='zero_bubble',
            split_points=['down_1', 'bottom', 'dec_2', 'up_1'], num_cells=5)
        # enc_1's output, made in stage 0, reaches stage 4 through stages 1 to 3.
        enc_1 = pipelined.model.get_layer('enc_1').output
        enc_1 = next(k for k, t in pipelined.graph.tensors.items() if t is enc_1)
        self.assertEqual([enc_1 in stage.inputs for stage in pipelined.stages],
                         [False, True, True, True, True])

    def testATiedEmbeddingIsOneWeightOnTheFirstStageItsGradientSummed(self):
        x, y = Tokens()
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        pipelined = self.assertFitsAsTheModel(
            TiedLanguageModel, x, y, loss, optimizer=lambda: keras.optimizers.Adam(0.01),
            epochs=1, schedule="1f1b", split_points=["block_0", "block_1", "block_2"])
        layers = [[layer.name for layer in pipelined.StageLayers(s)] for s in range(4)]
        self.assertEqual(layers, [['embedding'], ['block_0'], ['block_1'],
                                  ['block_2', 'embedding']])
        table = pipelined.model.get_layer('embedding').embeddings
        self.assertEqual(tf.DeviceSpec.from_string(table.value.device).device_index, 0)
        self.assertEqual(pipelined.count_params(), TiedLanguageModel().count_params())

    def testUnevenAndSmallBatchesPredictAndTrain(self):
        x, y = SkipsAndTiesData(7)
        model, reference = SkipsAndTies(), SkipsAndTies()
        pipelined = Functional(model, num_cells=4, num_micro_batches=M, devices=DEVICES[:4],
                               schedule='1f1b')
        for n in (1, 3, 7):
            part = {k: v[:n] for k, v in x.items()}
            self.assertNormClose(reference.predict(part, verbose=0),
                                 pipelined.predict(part, verbose=0), f'{n} examples')
        for m in (pipelined, reference):
            m.compile(keras.optimizers.SGD(0.1), {'y': 'mse', 'h': 'mse'})
        for n in (1, 3):
            part_x = {k: v[:n] for k, v in x.items()}
            part_y = {k: v[:n] for k, v in y.items()}
            losses = [m.train_on_batch(part_x, part_y) for m in (pipelined, reference)]
            self.assertNormClose(losses[1], losses[0], f'train_on_batch on {n}')
        self.assertNormClose(Weights(reference), Weights(model), 'weights')

    def testBatchNormTrainsAsTheModelAtOneMicroBatchAndInfersAtAny(self):
        x, y = Images((8, 8, 3), (3,))
        self.assertFitsAsTheModel(lambda: ResidualNet(batch_norm=True), x, y, 'mse',
                                  num_micro_batches=1, num_cells=3, schedule='1f1b',
                                  batch_size=11, epochs=1)
        model, reference = ResidualNet(batch_norm=True), ResidualNet(batch_norm=True)
        pipelined = Functional(model, num_cells=3, num_micro_batches=M, devices=DEVICES[:3])
        self.assertNormClose(reference.predict(x, verbose=0), pipelined.predict(x, verbose=0))


class StructureTest(FunctionalTestCase):

    def testWeightsAreTheModelsOwnOnTheirStagesDevices(self):
        model = SkipsAndTies()
        pipelined = Functional(model, num_micro_batches=M, devices=DEVICES[:4],
                               split_points=['d2', 'd3', 'mul'])
        self.assertEqual(len(pipelined.weights), len(model.weights))
        self.assertEqual(pipelined.count_params(), SkipsAndTies().count_params())
        stage_of = {'shared': 0, 'd2': 1, 'd3': 2, 'head': 3}
        for variable in model.weights:
            layer = variable.path.split('/')[0]
            self.assertEqual(tf.DeviceSpec.from_string(variable.value.device).device_index,
                             tf.DeviceSpec.from_string(DEVICES[stage_of[layer]]).device_index,
                             variable.path)

    def testAutomaticCutsBalanceParameters(self):
        model = ResidualNet()
        pipelined = Functional(model, num_cells=2, num_micro_batches=M, devices=DEVICES[:2])
        counts = [sum(layer.count_params() for layer in pipelined.StageLayers(s))
                  for s in range(2)]
        self.assertEqual(sum(counts), model.count_params())
        self.assertLess(abs(counts[0] - counts[1]), max(counts) / 2)

    def testTheMemoryPlanCountsOnlyGatheredTablesAsSparse(self):
        # A table only gathered gets IndexedSlices (a row per id: 16 ids of 4 float32 values
        # and an 8-byte index); a tied one, also multiplied by in its reverse call, a dense
        # gradient.
        import keras_hub  # pylint: disable=import-outside-toplevel
        ids = keras.Input((8,), dtype='int32')
        tied = keras_hub.layers.ReversibleEmbedding(20, 4, tie_weights=True, name='tied')
        plain = keras.layers.Embedding(30, 4, name='plain')
        h = keras.layers.Dense(4, name='d')(keras.layers.Add()([tied(ids), plain(ids)]))
        pipelined = Functional(keras.Model(ids, tied(h, reverse=True)), num_micro_batches=2,
                               split_points=['d'], devices=DEVICES[:2])
        first, last = pipelined.pipeline.params.layer_tpl
        meta = first.cls.FPropMeta(first, tf.TensorShape([2, 8]))
        self.assertEqual((meta.sparse_params, meta.sparse_gradient_bytes),
                         (30 * 4, 16 * (4 * 4 + 8)))
        meta = last.cls.FPropMeta(last, tf.TensorShape([2, 8]))
        self.assertEqual((meta.sparse_params, meta.sparse_gradient_bytes), (0, 0))

    def testSummaryListsEachStagesLayers(self):
        pipelined = Functional(SkipsAndTies(), num_micro_batches=M, devices=DEVICES[:4],
                               split_points=['d2', 'd3', 'mul'])
        lines = []
        pipelined.summary(expand_nested=True, print_fn=lambda line, **_: lines.append(line))
        text = '\n'.join(lines)
        for name in ('cell_0', 'cell_3', 'shared', 'd2', 'd3', 'mul', 'head'):
            self.assertIn(name, text)

    def testSavedAndLoadedAsAKerasFile(self):
        x, y = SkipsAndTiesData()
        pipelined = Functional(SkipsAndTies(), num_micro_batches=M, devices=DEVICES[:4],
                               split_points=['d2', 'd3', 'mul'], schedule='1f1b')
        pipelined.compile(keras.optimizers.SGD(0.1), {'y': 'mse', 'h': 'mse'})
        pipelined.fit(x, y, batch_size=4, verbose=0)
        directory = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, directory)
        path = os.path.join(directory, 'model.keras')
        pipelined.save(path)
        loaded = keras.models.load_model(path)
        self.assertIsInstance(loaded, Functional)
        self.assertEqual([s.calls for s in loaded.stages], [s.calls for s in pipelined.stages])
        self.assertNormClose(pipelined.predict(x, verbose=0), loaded.predict(x, verbose=0))
        self.assertNormClose(Weights(pipelined.model), Weights(loaded.model))


class ErrorsTest(tf.test.TestCase):

    def testNotAFunctionalModel(self):
        with self.assertRaisesRegex(errors.ConfigError, 'takes a functional keras.Model'):
            Functional(keras.Sequential([keras.layers.Dense(2)]), num_cells=2,
                       num_micro_batches=M)

    def testASplitPointThatIsNoLayer(self):
        with self.assertRaisesRegex(errors.ConfigError, r"split point 'nosuch' is no layer of "
                                    r'skips_and_ties; its layers are add, d2, d3, head, mul, '
                                    r'shared\.$'):
            Functional(SkipsAndTies(), num_micro_batches=M, split_points=['nosuch'])

    def testSplitPointsOutOfOrder(self):
        with self.assertRaisesRegex(errors.ConfigError, "split point 'd2' does not come after"):
            Functional(SkipsAndTies(), num_micro_batches=M, split_points=['d3', 'd2'])

    def testSplitPointsThatDisagreeWithNumCells(self):
        with self.assertRaisesRegex(errors.ConfigError, r'2 split points make 3 stages, which '
                                    r'is not num_cells \(4\)'):
            Functional(SkipsAndTies(), num_cells=4, num_micro_batches=M,
                       split_points=['d2', 'd3'])

    def testMoreStagesThanCalls(self):
        with self.assertRaisesRegex(errors.ConfigError, 'calls 7 layers, fewer than the 9'):
            Functional(SkipsAndTies(), num_cells=9, num_micro_batches=M)

    def testNeitherNumCellsNorSplitPoints(self):
        with self.assertRaisesRegex(errors.ConfigError, 'give num_cells=K or split_points'):
            Functional(SkipsAndTies(), num_micro_batches=M)


if __name__ == '__main__':
    tf.test.main()
