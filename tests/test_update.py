"""One synchronous update (`gpipe_tf.train.update`): the learning rate is the base rate times the
schedule at the global step; clipping scales the whole gradient to a global norm; under a
tf.distribute strategy the replicas' gradients are combined, weighted by their shards' weights,
into the whole batch's gradient; and `Update` applies the gradients of all M micro-batches of a
pipeline once, equal to a hand computation on the un-partitioned network (float64 numpy) and to an
un-pipelined tf.GradientTape step with the same optimizer, in eager and in a v1 graph, with the
weight decay, clipping and metrics it adds, and a clear error for variables without gradient."""

import functools

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import hyperparams
from gpipe_tf import learning_rate
from gpipe_tf import model_registry
from gpipe_tf import optimizer
from gpipe_tf import test_utils
from gpipe_tf.layers import basic
from gpipe_tf.layers import fprop_context
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.tasks import base_task
from gpipe_tf.tasks import classifier
from gpipe_tf.train import update

DEVICES = test_utils.ConfigureVirtualCpus()
MLP = 'examples.PipelinedMLP'  # 16 -> 64 -> 64 -> 64 -> 10, ReLU, over 4 cells.
NUM_LAYERS = 4
BATCH = 16
NUM_MICRO_BATCHES = 8
WEIGHT_DECAY = 1e-2
# Example weights of the test batch: uneven, some 0, so a loss that is not the weighted mean of
# the whole batch (a plain mean, or a mean of micro-batch means) shows.
EXAMPLE_WEIGHTS = np.resize(np.array([1.0, 0.0, 2.0, 1.0, 3.0, 1.0, 0.0, 1.0], np.float32),
                            BATCH)


@functools.lru_cache(maxsize=None)
def _Strategy():
    """Two replicas on the last two virtual CPUs, reducing on one device: the collective
    all-reduces of two MirroredStrategies in one process collide (their group keys both start
    at 1: 'joining a group that is already full'), and test_strategy.py holds one."""
    return tf.distribute.MirroredStrategy(
        DEVICES[-2:], cross_device_ops=tf.distribute.ReductionToOneDevice())


# ---- The pipelined MLP and its hand-computed oracle ---------------------------------------------
def _MlpParams(**train) -> hyperparams.Params:
    p = model_registry.GetParams(MLP, 'Train')
    p.input.batch_size = BATCH
    p.model.num_micro_batches = NUM_MICRO_BATCHES
    p.train.Set(**train)
    return p


@functools.lru_cache(maxsize=None)
def _BatchArrays() -> NestedMap:
    """The MLP's first training batch as numpy arrays, with EXAMPLE_WEIGHTS."""
    batch = next(iter(_MlpParams().input.Instantiate().TrainDataset()))
    return NestedMap(images=batch.images.numpy(), labels=batch.labels.numpy(),
                     weights=EXAMPLE_WEIGHTS)


def _Batch() -> NestedMap:
    return _BatchArrays().Transform(tf.constant)


def _ByLayer(variables) -> dict:
    """{'dense_i/w': variable} whatever cell holds the layer."""
    return {'/'.join(v.name.split(':')[0].split('/')[-2:]): v for v in variables}


def _Values(variables, session=None) -> dict:
    by_layer = _ByLayer(variables)
    values = (session.run(by_layer) if session else
              {k: v.numpy() for k, v in by_layer.items()})
    return {k: np.asarray(v, np.float64) for k, v in values.items()}


def _MlpOracle(values: dict, batch: NestedMap, weight_decay: float = 0.0):
    """(loss, total loss, {name: gradient of the total loss}) of the MLP run un-partitioned on
    the whole batch, by hand in float64: the weighted mean cross-entropy plus
    weight_decay * 0.5 * the sum of squares of the weight matrices."""
    x = batch.images.reshape(len(batch.labels), -1).astype(np.float64)
    rows = np.arange(len(batch.labels))
    layer_inputs, pre_activations = [], []
    for i in range(NUM_LAYERS):
        layer_inputs.append(x)
        z = x @ values[f'dense_{i}/w'] + values[f'dense_{i}/b']
        pre_activations.append(z)
        x = np.maximum(z, 0.0) if i < NUM_LAYERS - 1 else z
    shifted = x - x.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    share = batch.weights.astype(np.float64) / batch.weights.sum()
    loss = -(share * log_probs[rows, batch.labels]).sum()
    d = np.exp(log_probs)
    d[rows, batch.labels] -= 1.0
    d *= share[:, None]
    grads = {}
    for i in reversed(range(NUM_LAYERS)):
        if i < NUM_LAYERS - 1:
            d = d * (pre_activations[i] > 0)
        w = values[f'dense_{i}/w']
        grads[f'dense_{i}/w'] = layer_inputs[i].T @ d + weight_decay * w
        grads[f'dense_{i}/b'] = d.sum(0)
        d = d @ w.T
    decay = weight_decay * 0.5 * sum(np.sum(values[f'dense_{i}/w'] ** 2)
                                     for i in range(NUM_LAYERS))
    return loss, loss + decay, grads


def _GlobalNorm(grads: dict) -> float:
    return float(np.sqrt(sum(np.sum(g ** 2) for g in grads.values())))


def _EagerUpdate(task, opt, batch, global_step=None, metrics_fn=None):
    """Update's (train_op, metrics as numpy) after one eager update from a tape."""
    if global_step is None:
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
    with tf.GradientTape() as tape:
        with fprop_context.Scope(training=True, step=global_step):
            metrics = (metrics_fn or task.FPropTower)(batch)
        train_op, out = update.Update(task, opt, global_step, metrics,
                                      lambda loss, variables: tape.gradient(loss, variables))
    return train_op, out.Transform(np.asarray)


# ---- LearningRateFn -----------------------------------------------------------------------------
@pytest.mark.unit
class LearningRateFnTest(tf.test.TestCase):

    def testTheRateIsTheBaseRateTimesTheScheduleAtTheCurrentStep(self):
        train = base_task.TrainParams().Set(
            learning_rate=0.1, lr_schedule=learning_rate.ExponentialDecay.Params().Set(
                decay_rate=0.5, decay_steps=2, staircase=True))
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
        rate = update.LearningRateFn(train, global_step)
        for step, expected in ((0, 0.1), (1, 0.1), (2, 0.05), (5, 0.025)):
            global_step.assign(step)  # The same callable follows the variable.
            self.assertAllClose(rate(), expected, msg=f'step {step}')

    def testTheWarmUpScalesTheBaseRate(self):
        train = base_task.TrainParams().Set(
            learning_rate=0.2, lr_schedule=learning_rate.Constant.Params().Set(warmup_steps=4))
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
        rate = update.LearningRateFn(train, global_step)
        for step, expected in ((0, 0.05), (1, 0.1), (3, 0.2), (10, 0.2)):
            global_step.assign(step)
            self.assertAllClose(rate(), expected, msg=f'step {step}')

    def testEachUpdateUsesTheRateOfTheStepItApplies(self):
        train = base_task.TrainParams().Set(
            learning_rate=0.1, lr_schedule=learning_rate.ExponentialDecay.Params().Set(
                decay_rate=0.5, decay_steps=1))
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
        opt = optimizer.SGD.Params().Instantiate().Create(
            update.LearningRateFn(train, global_step))
        variable = tf.Variable(0.0)
        for _ in range(3):
            opt.apply_gradients([(tf.constant(1.0), variable)], global_step=global_step)
        self.assertAllClose(variable, -(0.1 + 0.05 + 0.025))
        self.assertEqual(int(global_step.numpy()), 3)


# ---- ClipGradients ------------------------------------------------------------------------------
@pytest.mark.unit
class ClipGradientsTest(tf.test.TestCase):

    def testIndexedSlicesCountAndAreScaledLikeTheirDenseGradient(self):
        dense = tf.constant([1.0, 2.0])
        rows = tf.IndexedSlices(values=tf.constant([[2.0, 0.0], [0.0, 4.0]]),
                                indices=tf.constant([3, 0]), dense_shape=tf.constant([5, 2]))
        norm_before = np.sqrt(1 + 4 + 4 + 16)
        grads, norm = update.ClipGradients([dense, rows], 1.0)
        self.assertAllClose(norm, norm_before)
        self.assertIsInstance(grads[1], tf.IndexedSlices)
        scale = 1.0 / norm_before
        self.assertAllClose(grads[0], [scale, 2 * scale])
        expected_rows = np.zeros([5, 2])
        expected_rows[3, 0], expected_rows[0, 1] = 2 * scale, 4 * scale
        self.assertAllClose(tf.convert_to_tensor(grads[1]), expected_rows)


# ---- GlobalBatchGradients -----------------------------------------------------------------------
@pytest.mark.unit
class GlobalBatchGradientsTest(tf.test.TestCase):

    def _Combine(self, weights, dense, rows):
        """GlobalBatchGradients on 2 replicas; replica r has weight weights[r], a dense gradient
        dense[r] and an IndexedSlices gradient of rows[r] at rows [1, 3] of a [4, 2] variable.
        Returns each replica's result as dense numpy arrays."""
        strategy = _Strategy()

        @tf.function
        def Run():
            def Replica():
                r = tf.distribute.get_replica_context().replica_id_in_sync_group
                pick = lambda values: tf.gather(tf.constant(values, tf.float32), r)
                sliced = tf.IndexedSlices(pick(rows), tf.constant([1, 3]), tf.constant([4, 2]))
                grads = update.GlobalBatchGradients(
                    [pick(dense), sliced], pick(weights), tf.distribute.get_replica_context())
                return [tf.convert_to_tensor(g) for g in grads]
            return strategy.run(Replica)

        return [[np.asarray(g) for g in strategy.experimental_local_results(per_replica)]
                for per_replica in Run()]

    def testEveryReplicaGetsTheWeightedSumOfTheReplicasGradients(self):
        dense = [[1.0, -2.0], [5.0, 6.0]]
        rows = [[[1.0, 0.0], [0.0, 1.0]], [[3.0, 3.0], [-1.0, 2.0]]]
        dense_got, rows_got = self._Combine([1.0, 3.0], dense, rows)
        expected_dense = 0.25 * np.array(dense[0]) + 0.75 * np.array(dense[1])
        expected_rows = np.zeros([4, 2])
        expected_rows[[1, 3]] = 0.25 * np.array(rows[0]) + 0.75 * np.array(rows[1])
        for replica in range(2):
            self.assertAllClose(dense_got[replica], expected_dense, msg=f'replica {replica}')
            self.assertAllClose(rows_got[replica], expected_rows, msg=f'replica {replica}')

    def testNoWeightAtAllGivesZeroGradientsNotNaN(self):
        dense_got, rows_got = self._Combine([0.0, 0.0], [[1.0, 2.0], [3.0, 4.0]],
                                            [[[1.0, 1.0], [1.0, 1.0]]] * 2)
        for got in dense_got + rows_got:
            self.assertAllEqual(got, np.zeros_like(got))


# ---- Update -------------------------------------------------------------------------------------
class UpdateTest(tf.test.TestCase):
    """One update of the MLP pipelined over 4 cells and 8 micro-batches of 2 examples."""

    LEARNING_RATE = 0.5

    def _SgdUpdate(self, **train):
        """(values before, values after, Update's metrics) of one SGD update on the batch."""
        task = _MlpParams(**train).Instantiate()
        before = _Values(task.trainable_variables)
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
        opt = optimizer.SGD.Params().Instantiate().Create(self.LEARNING_RATE)
        train_op, metrics = _EagerUpdate(task, opt, _Batch(), global_step)
        self.assertIsNone(train_op)  # Eager: applied already.
        self.assertEqual(int(global_step.numpy()), 1)  # Once for all 8 micro-batches.
        return before, _Values(task.trainable_variables), metrics

    def testOneUpdateAppliesTheWholeBatchsGradientOnce(self):
        before, after, _ = self._SgdUpdate(weight_decay=WEIGHT_DECAY)
        _, _, grads = _MlpOracle(before, _BatchArrays(), WEIGHT_DECAY)
        self.assertLen(after, 2 * NUM_LAYERS)
        for name, grad in grads.items():
            self.assertAllClose(before[name] - after[name], self.LEARNING_RATE * grad,
                                rtol=1e-4, atol=1e-7, msg=name)

    def testMetricsAreTheBatchsLossTotalLossAndUnclippedGradNorm(self):
        before, _, metrics = self._SgdUpdate(weight_decay=WEIGHT_DECAY,
                                             clip_gradient_norm_to_value=1e-3)
        loss, total_loss, grads = _MlpOracle(before, _BatchArrays(), WEIGHT_DECAY)
        weight = EXAMPLE_WEIGHTS.sum()
        self.assertGreater(total_loss - loss, 1e-3)  # The decay counts.
        self.assertAllClose(metrics.loss, (loss, weight), rtol=1e-5)
        self.assertAllClose(metrics.total_loss, (total_loss, weight), rtol=1e-5)
        self.assertAllClose(metrics.grad_norm, (_GlobalNorm(grads), 1.0), rtol=1e-5)

    def testClippingScalesTheWholeBatchsGradientToTheBound(self):
        _, _, grads = _MlpOracle(
            _Values(_MlpParams().Instantiate().trainable_variables), _BatchArrays(),
            WEIGHT_DECAY)
        norm = _GlobalNorm(grads)
        clip = 0.25 * norm
        before, after, metrics = self._SgdUpdate(weight_decay=WEIGHT_DECAY,
                                                 clip_gradient_norm_to_value=clip)
        self.assertAllClose(metrics.grad_norm[0], norm, rtol=1e-5)
        for name, grad in grads.items():
            self.assertAllClose(before[name] - after[name],
                                self.LEARNING_RATE * grad * clip / norm,
                                rtol=1e-4, atol=1e-7, msg=name)

    def testUpdatesEqualUnpipelinedTapeStepsWithTheSameOptimizer(self):
        # Adam with an epsilon that keeps near-zero gradients (which a sum over micro-batches
        # and a whole-batch gradient round differently) from taking sign-sized steps.
        recipes = {'Momentum': optimizer.Momentum.Params(),
                   'Adam': optimizer.Adam.Params().Set(epsilon=1e-3)}
        for name, recipe in recipes.items():
            with self.subTest(name):
                self._CheckAgainstUnpipelinedSteps(recipe, num_steps=2)

    def _CheckAgainstUnpipelinedSteps(self, recipe, num_steps):
        task = _MlpParams(weight_decay=WEIGHT_DECAY).Instantiate()
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
        opt = recipe.Instantiate().Create(1e-2)

        # The oracle: the same layers as plain matmuls on copies of the variables.
        copies = {k: tf.Variable(v, name=k.replace('/', '_'))
                  for k, v in _ByLayer(task.trainable_variables).items()}
        oracle_step = tf.Variable(0, dtype=tf.int64, trainable=False)
        oracle_opt = recipe.Instantiate().Create(1e-2)
        arrays = _BatchArrays()

        def OracleLoss():
            x = tf.reshape(tf.constant(arrays.images), [BATCH, -1])
            for i in range(NUM_LAYERS):
                x = tf.matmul(x, copies[f'dense_{i}/w']) + copies[f'dense_{i}/b']
                if i < NUM_LAYERS - 1:
                    x = tf.nn.relu(x)
            xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=tf.constant(arrays.labels), logits=x)
            mean = tf.reduce_sum(xent * arrays.weights) / arrays.weights.sum()
            return mean + WEIGHT_DECAY * tf.add_n(
                [tf.nn.l2_loss(copies[f'dense_{i}/w']) for i in range(NUM_LAYERS)])

        for step in range(num_steps):
            _, metrics = _EagerUpdate(task, opt, _Batch(), global_step)
            with tf.GradientTape() as tape:
                oracle_loss = OracleLoss()
            names = sorted(copies)
            oracle_grads = tape.gradient(oracle_loss, [copies[k] for k in names])
            oracle_opt.apply_gradients(zip(oracle_grads, [copies[k] for k in names]),
                                       global_step=oracle_step)
            self.assertAllClose(metrics.total_loss[0], oracle_loss, rtol=1e-5,
                                msg=f'step {step}')
            for k, v in _ByLayer(task.trainable_variables).items():
                self.assertAllClose(v, copies[k], rtol=1e-5, atol=1e-6,
                                    msg=f'{k} after step {step}')
        self.assertEqual(int(global_step.numpy()), num_steps)

    def testInAV1GraphTheTrainOpAppliesTheSameUpdate(self):
        arrays = _BatchArrays()
        with tf.Graph().as_default():
            task = _MlpParams(weight_decay=WEIGHT_DECAY).Instantiate()
            global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
            opt = optimizer.SGD.Params().Instantiate().Create(self.LEARNING_RATE)
            with fprop_context.Scope(training=True, step=global_step):
                metrics = task.FPropTower(arrays.Transform(tf.constant))
            train_op, metrics = update.Update(
                task, opt, global_step, metrics,
                lambda loss, variables: tf.compat.v1.gradients(loss, variables))
            self.assertIsInstance(train_op, tf.Operation)
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                before = _Values(task.trainable_variables, session)
                grad_norm, _ = session.run([metrics.grad_norm[0], train_op])
                after = _Values(task.trainable_variables, session)
                self.assertEqual(session.run(global_step), 1)
        _, _, grads = _MlpOracle(before, arrays, WEIGHT_DECAY)
        self.assertAllClose(grad_norm, _GlobalNorm(grads), rtol=1e-5)
        for name, grad in grads.items():
            self.assertAllClose(before[name] - after[name], self.LEARNING_RATE * grad,
                                rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.unit
class MissingGradientsTest(tf.test.TestCase):
    """A loss that some trainable variables do not reach is an error, before any update."""

    def _Raise(self, weight_decay):
        task = _MlpParams(weight_decay=weight_decay).Instantiate()
        before = _Values(task.trainable_variables)
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
        opt = optimizer.SGD.Params().Instantiate().Create(1.0)
        constant_loss = lambda batch: NestedMap(loss=(tf.constant(1.0), tf.constant(1.0)))
        with self.assertRaisesRegex(ValueError, 'every trainable variable needs a gradient') as e:
            _EagerUpdate(task, opt, _Batch(), global_step, constant_loss)
        self.assertEqual(int(global_step.numpy()), 0)
        for name, value in _Values(task.trainable_variables).items():
            self.assertAllEqual(value, before[name], msg=name)
        return str(e.exception)

    def testAtMostFiveOfTheVariablesAreNamed(self):
        message = self._Raise(weight_decay=0.0)  # No variable has a gradient: 8 of them.
        self.assertLen([n for n in message.split("'") if n.startswith('PipelinedMLP/')], 5)
        self.assertIn('] ...;', message)

    def testTheNamedVariablesAreThoseWithoutGradient(self):
        # The weight decay reaches the weight matrices, so only the biases lack a gradient.
        message = self._Raise(weight_decay=WEIGHT_DECAY)
        named = sorted(n for n in message.split("'") if n.startswith('PipelinedMLP/'))
        self.assertEqual(named, [f'PipelinedMLP/model/dense_{i}/b:0'
                                 for i in range(NUM_LAYERS)])
        self.assertNotIn('...', message)


# ---- Update under a tf.distribute strategy ------------------------------------------------------
class UpdateUnderAStrategyTest(tf.test.TestCase):
    """Two replicas, each with half of a batch whose halves weigh differently, apply the one
    clipped update of the whole batch."""

    LEARNING_RATE = 1.0

    def testReplicasApplyTheWholeBatchsClippedUpdate(self):
        strategy = _Strategy()
        rng = np.random.RandomState(3)
        images = rng.standard_normal([8, 2, 2, 1]).astype(np.float32)
        labels = rng.randint(0, 3, [8]).astype(np.int32)
        weights = np.array([1, 1, 0, 0, 1, 1, 1, 1], np.float32)  # Shard weights 2 and 4.
        p = classifier.ClassifierTask.Params().Set(
            name='cls', flatten_images=True,
            model=basic.DenseLayer.Params().Set(name='dense', input_dim=4, output_dim=3))
        # Initial values are a function of Params: a task built outside the strategy has them.
        probe = p.Instantiate()
        w0, b0 = (np.asarray(v.numpy(), np.float64) for v in (probe.model.vars.w,
                                                              probe.model.vars.b))

        # The oracle: the whole batch's weighted-mean cross-entropy and its gradient.
        logits = images.reshape(8, -1) @ w0 + b0
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        d = probs
        d[np.arange(8), labels] -= 1.0
        d *= (weights / weights.sum())[:, None]
        grad_w, grad_b = images.reshape(8, -1).T @ d, d.sum(0)
        norm = np.sqrt(np.sum(grad_w ** 2) + np.sum(grad_b ** 2))
        clip = 0.5 * norm
        p.train.clip_gradient_norm_to_value = clip
        with strategy.scope():
            task = p.Instantiate()
            global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
            opt = optimizer.SGD.Params().Instantiate().Create(self.LEARNING_RATE)
        self.assertAllEqual(task.model.vars.w, w0.astype(np.float32))

        shards = [NestedMap(images=images[s], labels=labels[s], weights=weights[s])
                  for s in (slice(0, 4), slice(4, 8))]
        inputs = strategy.experimental_distribute_values_from_function(
            lambda context: dict(shards[context.replica_id_in_sync_group]))

        @tf.function
        def Step(shard):
            def Replica(shard):
                with tf.GradientTape() as tape:
                    metrics = task.FPropTower(NestedMap(shard))
                    _, out = update.Update(task, opt, global_step, metrics,
                                           lambda loss, variables: tape.gradient(loss, variables))
                return out.grad_norm[0]
            return strategy.run(Replica, args=(shard,))

        grad_norms = strategy.experimental_local_results(Step(inputs))
        self.assertAllClose(grad_norms, [norm, norm], rtol=1e-5)
        scale = self.LEARNING_RATE * clip / norm
        for variable, start, grad in ((task.model.vars.w, w0, grad_w),
                                      (task.model.vars.b, b0, grad_b)):
            for replica, value in enumerate(strategy.experimental_local_results(variable)):
                self.assertAllClose(start - np.asarray(value, np.float64), scale * grad,
                                    rtol=1e-4, atol=1e-7,
                                    msg=f'{variable.name} on replica {replica}')
        self.assertEqual(int(global_step.numpy()), 1)


if __name__ == '__main__':
    tf.test.main()
