"""gpipe_tf.keras.Functional's contract: a functional Keras model pipelined as it is (its graph
cut into stages, skips carried across cuts, tied weights read by two stages) predicts, trains
and saves as the same model under Keras alone. So does a keras_hub causal LM given as it comes
(`GPT2CausalLM`, `LlamaCausalLM`, tiny and random from configs, nothing downloaded): its
backbone, a functional model nested in the task, is cut between its own layers, and the token
embedding the task calls again for the logits is one weight whose gradient sums both uses.

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


def GPT2CausalLM(num_layers=2):
    """keras_hub's GPT-2 task as it comes, tiny and random (built from a config, nothing
    downloaded; dropout 0, so that two runs agree): its GPT2Backbone a functional model nested
    in the task, the backbone's token embedding called again (reverse=True) for the logits."""
    import keras_hub  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(7)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=50, num_layers=num_layers, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=16, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def LlamaCausalLM():
    """keras_hub's Llama task, tiny and random: grouped-query attention (2 query heads, 1 key
    and value head), rotary positions, RMS norms, and (Llama's default) untied logits: the token
    embedding layer, called again for the logits, reads its own reverse_embeddings there."""
    import keras_hub  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(8)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=50, num_layers=3, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=8, intermediate_dim=16, dropout=0)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


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


def PaddedTokens(n=10, length=12, vocabulary=50):
    """A keras_hub causal LM's inputs: token ids and a padding mask, each sequence 4 to 12
    tokens long (7 to 12 here) and padded after (ids 0, mask 0); a label at every position."""
    rng = np.random.RandomState(7)
    mask = np.arange(length) < rng.randint(4, length + 1, (n, 1))
    ids = np.where(mask, rng.randint(1, vocabulary, (n, length)), 0)
    return ({'token_ids': ids.astype(np.int32), 'padding_mask': mask.astype(np.int32)},
            rng.randint(0, vocabulary, (n, length)).astype(np.int32))


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
        # A skip read from another micro-batch fails here: the images are distinct random
        # ones, a batch is M = 4 micro-batches (of one example in fit, of 2 or 3 in predict's
        # batch of 11) and the comparison is over all examples (a stage handed the skips of
        # the micro-batch before misses the losses by 300 times the tolerance).
        # testSkipsAndTiedWeightsEverySchedule compares the same way for every schedule,
        # looped and unrolled, with skips across cuts (h to add and out, input aux to mul).
        x, y = Images((8, 8, 2), (8, 8, 1))
        pipelined = self.assertFitsAsTheModel(
            UNet, x, y, 'mse', schedule='zero_bubble',
            split_points=['down_1', 'bottom', 'dec_2', 'up_1'], num_cells=5)
        # enc_1's output, made in stage 0, reaches stage 4 through stages 1 to 3.
        enc_1 = pipelined.model.get_layer('enc_1').output
        enc_1 = next(k for k, t in pipelined.graph.tensors.items() if t is enc_1)
        self.assertEqual([enc_1 in stage.inputs for stage in pipelined.stages],
                         [False, True, True, True, True])
        # Stage 1 reads it (down_1), stages 2 and 3 only carry it (unrolled, it goes from
        # stage 1's device to stage 4's: tests/test_skips.py reads such a placement back from
        # the graph), stage 4 reads it (cat_1).
        carried = [[stage.inputs[i] for i in p.cls.PassedLeaves(p)]
                   for stage, p in zip(pipelined.stages, pipelined.pipeline.params.layer_tpl)]
        self.assertEqual([enc_1 in keys for keys in carried], [False, False, True, True, False])
        self.assertEqual(pipelined.StageReport().splitlines()[0].split()[3:7],
                         ['receives', 'sends', 'carries', 'layers'])

    def testATiedEmbeddingIsOneWeightOnTheFirstStageItsGradientSummed(self):
        # That the comparison sees a use's gradient dropped (each use's is a large part of
        # the sum) is shown for GPT-2's table by
        # KerasHubTest.testATiedEmbeddingsStepSumsTheGradientsOfBothItsUses.
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


class KerasHubTest(FunctionalTestCase):
    """keras_hub's causal LMs given to Functional as they come (the task, preprocessor=None):
    its backbone, a functional model the task calls on its inputs, is cut between its own
    layers."""

    # Two-layer GPT-2's four stages: the embeddings; a transformer layer each; the final layer
    # norm and the logits (the token embedding again).
    SPLIT_POINTS = ['transformer_layer_0', 'transformer_layer_1', 'layer_norm']
    LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def assertTokenEmbeddingOnTheFirstStage(self, pipelined, task):
        """The token embedding layer is called by the first stage and again by the last (for
        the logits); its weights (GPT-2's tied table; Llama's table and reverse_embeddings)
        are the task's, each once, on the first stage's device, and the pipelined model
        counts the task's parameters and weights."""
        embedding = pipelined.model.backbone.token_embedding
        stages = [s for s in range(len(pipelined.stages))
                  if embedding in pipelined.StageLayers(s)]
        self.assertEqual(stages, [0, len(pipelined.stages) - 1])
        self.assertEqual(pipelined.count_params(), task.count_params())
        self.assertEqual(len(pipelined.weights), len(task.weights))
        first = tf.DeviceSpec.from_string(DEVICES[0]).device_index
        for weight in embedding.weights:
            self.assertEqual(sum(w is weight for w in pipelined.weights), 1, weight.path)
            self.assertEqual(tf.DeviceSpec.from_string(weight.value.device).device_index,
                             first, weight.path)

    def testGPT2CausalLMCutInsideItsBackboneTrainsAsTheTask(self):
        # Batches of 5 examples in M = 4 micro-batches, padded sequences. A schedule traces
        # for seconds here: three, with each recompute mode, virtual stages and a looped
        # (unroll=False) pipeline among them; with the Llama test's gpipe and 1f1b and the
        # tied embedding's step's zero_bubble, keras_hub's tasks run on every kind of
        # schedule. (SkipsAndTies runs on all of them, looped and unrolled.)
        x, y = PaddedTokens()
        for schedule, params in [
                ('gpipe', {'unroll': False}),
                ('interleaved_1f1b', {'virtual_stages': 2, 'recompute': 'except_last'}),
                ('zero_bubble_v', {'virtual_stages': 2, 'recompute': 'never'})]:
            with self.subTest(schedule=schedule, **params):
                cells = 2 if params.get('virtual_stages') else 4
                pipelined = self.assertFitsAsTheModel(
                    GPT2CausalLM, x, y, self.LOSS, batch_size=5, epochs=1, num_cells=cells,
                    schedule=schedule, split_points=self.SPLIT_POINTS, **params)
                self.assertTokenEmbeddingOnTheFirstStage(pipelined, GPT2CausalLM())
                # Tied: one table, read by the logits too.
                self.assertLen(pipelined.model.backbone.token_embedding.weights, 1)

    def testLlamaCausalLMCutAutomaticallyTrainsAsTheTask(self):
        x, y = PaddedTokens()
        task = LlamaCausalLM()
        self.assertFalse(task.backbone.tie_word_embeddings)
        for schedule in ('gpipe', '1f1b'):
            with self.subTest(schedule=schedule):
                pipelined = self.assertFitsAsTheModel(
                    LlamaCausalLM, x, y, self.LOSS, batch_size=5, epochs=1, num_cells=3,
                    schedule=schedule)
                layers = sum([[layer.name for layer in pipelined.StageLayers(s)]
                              for s in range(3)], [])
                self.assertNotIn('llama_backbone', layers)
                self.assertEqual([n for n in layers if n.startswith('transformer_layer_')],
                                 [f'transformer_layer_{i}' for i in range(3)])
                self.assertTokenEmbeddingOnTheFirstStage(pipelined, task)

    def testAutomaticCutsSeeTheBackbonesLayers(self):
        pipelined = Functional(GPT2CausalLM(num_layers=4), num_cells=4, num_micro_batches=M,
                               devices=DEVICES[:4])
        layers = [[layer.name for layer in pipelined.StageLayers(s)] for s in range(4)]
        self.assertNotIn('gpt2_backbone', sum(layers, []))
        # Parameters balanced: a transformer layer per stage.
        self.assertEqual([[n for n in names if n.startswith('transformer_layer_')]
                          for names in layers], [[f'transformer_layer_{s}'] for s in range(4)])
        self.assertEqual((layers[0][0], layers[-1][-2:]),
                         ('token_embedding', ['layer_norm', 'token_embedding']))

    def testScoreIsPipelinedAndGenerateNamesTheModelThatSharesTheWeights(self):
        x, _ = PaddedTokens(6)
        model, task = GPT2CausalLM(), GPT2CausalLM()
        pipelined = Functional(model, num_micro_batches=M, devices=DEVICES,
                               split_points=self.SPLIT_POINTS)
        ids, mask = x['token_ids'], x['padding_mask']
        for mode, target in (('logits', None), ('loss', ids)):
            with self.subTest(scoring_mode=mode):
                self.assertNormClose(
                    task.score(ids, mask, scoring_mode=mode, target_ids=target),
                    pipelined.score(ids, mask, scoring_mode=mode, target_ids=target))
        with self.assertRaisesRegex(errors.ConfigError, r'generate is not pipelined .*call '
                                    r'gpt2_causal_lm(_\d+)?\.generate\(\.\.\.\) instead'):
            pipelined.generate({'token_ids': ids, 'padding_mask': mask})
        # The model it names generates with the weights the pipeline trains, where they are.
        prompt = {'token_ids': ids[:2], 'padding_mask': np.arange(12)[None] < [[3], [5]]}
        self.assertAllEqual(model.generate(prompt, max_length=12, stop_token_ids=None)[
            'token_ids'], task.generate(prompt, max_length=12, stop_token_ids=None)['token_ids'])

    def testATiedEmbeddingsStepSumsTheGradientsOfBothItsUses(self):
        """One SGD step moves GPT-2's tied token embedding by the gradient through both its
        uses, the lookup on stage 0 and the logits on stage 3: as the task under Keras, and far
        from where either use's gradient alone would (each a large part of the sum)."""
        x, y = PaddedTokens(5)
        task = GPT2CausalLM()
        embedding = task.backbone.token_embedding
        table = embedding.embeddings

        def Gradient(lookup=True, logits=True):
            """The loss's gradient with respect to the table through the uses asked for (the
            other reads a constant copy)."""
            with tf.GradientTape() as tape:
                hidden = task.backbone(x)
                if not lookup:
                    hidden = tf.stop_gradient(hidden)
                constant = [] if logits else [(table, tf.stop_gradient(table.value))]
                with keras.StatelessScope(state_mapping=constant):
                    loss = self.LOSS(y, embedding(hidden, reverse=True))
            return tf.convert_to_tensor(tape.gradient(loss, table.value)).numpy()

        total, lookup, logits = Gradient(), Gradient(logits=False), Gradient(lookup=False)
        self.assertNormClose(total, lookup + logits, 'the two uses\' gradients add up')
        for part in (lookup, logits):
            self.assertGreater(np.linalg.norm(part), np.linalg.norm(total) / 4)

        model = GPT2CausalLM()
        pipelined = Functional(model, num_micro_batches=M, devices=DEVICES,
                               split_points=self.SPLIT_POINTS, schedule='zero_bubble')
        before = table.numpy()
        self.assertAllEqual(before, model.backbone.token_embedding.embeddings.numpy())
        rate = 0.1
        for m in (pipelined, task):
            m.compile(keras.optimizers.SGD(rate), self.LOSS)
            m.fit(x, y, batch_size=5, epochs=1, verbose=0, shuffle=False)  # One step.
        self.assertNormClose(Weights(task), Weights(model), 'weights')
        step = model.backbone.token_embedding.embeddings.numpy() - before
        self.assertNormClose(table.numpy() - before, step, 'the task\'s step under Keras')
        self.assertNormClose(-rate * total, step, 'the step of the summed gradient')
        # The step of the lookup's gradient alone would be 89% of the step away from it, the
        # logits' alone 41%; the tolerance above is 1e-5 of it.
        for part in (lookup, logits):
            self.assertGreater(np.linalg.norm(step + rate * part),
                               0.1 * np.linalg.norm(step))


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
