"""`--mode=check` (`gpipe_tf.train.check`): one batch through the configured pipeline and through
its layers chained directly, no pipeline code (`pipeline.unpartitioned`).

The check passes a pipeline, and one with batch norm, drop-path and dropout (whose reference runs
the pipeline's micro-batches in sequence); its reference runs no cell, executor or micro-batch
code; and it fails, exit 1 with one line naming the worst variable, pipelines whose machinery is
broken in ways that a reference made of the same machinery (the pipeline at one cell, gpipe, no
re-materialization, and one micro-batch, or M for batch norm: the check's reference until issue
30) would share, and so pass: a cell backward that halves its weight gradients, and weight
gradients averaged over the micro-batches instead of summed (batch norm's reference ran M).
"""

import contextlib
import io
import re
import types
from unittest import mock

import pytest
import tensorflow as tf

from gpipe_tf import model_registry
from gpipe_tf import test_utils
from gpipe_tf.layers import normalization
from gpipe_tf.pipeline import cell as cell_lib
from gpipe_tf.pipeline import looped
from gpipe_tf.pipeline import microbatch
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import unrolled
from gpipe_tf.train import check

DEVICES = test_utils.ConfigureVirtualCpus()
MLP = 'examples.PipelinedMLP'
InProcess = test_utils.TrainerInProcess


def ErrorLines(result):
    assert 'Traceback' not in result.stderr, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if line.startswith('error:')]


def CellWeightGradientsHalved():
    """A pipeline bug at any K and M: a cell's backward returns its weight gradients halved
    (`cell_lib.Differentiate`, which every cell's backward runs, re-materializing or not)."""
    original = cell_lib.Differentiate

    def Halved(*args, **kwargs):
        d_theta, d_inputs = original(*args, **kwargs)
        return [None if g is None else tf.convert_to_tensor(g) / 2 for g in d_theta], d_inputs

    return mock.patch.object(cell_lib, 'Differentiate', Halved)


def GradientsAveragedOverMicroBatches():
    """A pipeline bug: each cell's weight gradient is the mean over the M micro-batches, not
    their sum (what a pipeline at M = 1 cannot see; `unrolled.UnrolledSchedule`'s, so the
    pipeline must run unrolled)."""
    original = unrolled.UnrolledSchedule._Sum  # pylint: disable=protected-access

    def Averaged(self, k, m, d_theta):
        num_micro_batches = self.schedule.num_micro_batches
        original(self, k, m, [None if g is None else tf.convert_to_tensor(g) / num_micro_batches
                              for g in d_theta])

    return mock.patch.object(unrolled.UnrolledSchedule, '_Sum', Averaged)


def SmallAmoebaNetCheck(**model_overrides):
    """check.Run on test_utils' small AmoebaNet (K=2, M=4 of 4 examples): (its Parity, what it
    printed)."""
    p = test_utils.SmallAmoebaNetParams()
    p.model.Set(**model_overrides)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        parity = check.Run(p, 'SmallAmoebaNet')
    return parity, stdout.getvalue()


@pytest.mark.unit
class CheckModeTest(tf.test.TestCase):

    def testAPipelineComputesWhatItsLayersDoUnpartitioned(self):
        output = InProcess(f'--model={MLP}', '--mode=check').stdout
        self.assertIn('against its layers un-partitioned (their FProp chained, no pipeline '
                      'code)', output)
        self.assertIn('the un-partitioned layers run the whole batch at once', output)
        self.assertRegex(output, r'worst per-variable gradient difference \(8 variables\)')
        self.assertIn('parity: the pipeline computes what its layers do un-partitioned', output)

    def testTheReferenceRunsNoPipelineCode(self):
        p = model_registry.GetParams(MLP, 'Train')
        task = p.Instantiate()
        batch = next(iter(p.input.Instantiate().TrainDataset(start_step=0)))

        def Refused(*args, **kwargs):
            raise AssertionError('the reference ran pipeline code')

        with contextlib.ExitStack() as stack:
            for owner, name in [(unrolled.UnrolledSchedule, '__init__'),
                                (looped.LoopedSchedule, '__init__'),
                                (cell_lib.CellFunctions, 'Forward'),
                                (cell_lib.CellFunctions, 'Backward'),
                                (microbatch, 'Split'), (microbatch, 'Concat'),
                                (type(task.model), 'FProp'), (type(task.model), 'FPropLoss')]:
                stack.enter_context(mock.patch.object(owner, name, Refused))
            with tf.GradientTape() as tape:
                loss = check.ReferenceLoss(task, batch, [64])
            grads = tape.gradient(loss, task.trainable_variables)
        # The same variables: the pipeline's, read directly.
        self.assertLen(grads, 8)
        self.assertTrue(all(g is not None for g in grads))

    def testTheReferenceRunsBatchNormOnEachReplicasMicroBatches(self):
        p = pipelining_layer.PipeliningLayer.Params().Set(num_replicas=2, num_micro_batches=3)
        batch_norm = normalization.BatchNormLayer.Params().Set(name='bn', dim=2).Instantiate()
        with_batch_norm = types.SimpleNamespace(model=types.SimpleNamespace(p=p),
                                                submodules=(batch_norm,))
        without = types.SimpleNamespace(model=types.SimpleNamespace(p=p), submodules=())
        # 14 examples: two shards of 7, each in micro-batches of 3, 2 and 2 (the pipeline's).
        self.assertEqual(check.ReferenceMicroBatches(with_batch_norm, 14), [3, 2, 2, 3, 2, 2])
        self.assertEqual(check.ReferenceMicroBatches(with_batch_norm, 14),
                         [size for shard in microbatch.Sizes(14, 2)
                          for size in microbatch.Sizes(shard, 3)])
        self.assertEqual(check.ReferenceMicroBatches(without, 14), [14])

    def testWeightGradientsScaledInEveryCellFailInOneLine(self):
        with CellWeightGradientsHalved():
            result = InProcess(f'--model={MLP}', '--mode=check', check=False)
        self.assertEqual(result.returncode, 1, result.stderr)
        [line] = ErrorLines(result)
        match = re.fullmatch(
            r"error: examples\.PipelinedMLP: the pipeline's gradients differ from its layers' "
            r'un-partitioned by ([\d.e-]+) of the largest \(tolerance 0\.0001\), worst at '
            r'PipelinedMLP/model/dense_\d/[wb]:0\.', line)
        self.assertIsNotNone(match, line)
        # Every weight gradient is half what it should be.
        self.assertAllClose(float(match.group(1)), 0.5, rtol=1e-3)


class BatchNormCheckTest(tf.test.TestCase):
    """A model with batch norm, drop-path and dropout: the reference runs the pipeline's
    micro-batches in sequence (batch norm's statistics are per micro-batch); the random masks
    are drawn per example, so they agree."""

    def testABatchNormPipelineComputesWhatItsLayersDoOnItsMicroBatches(self):
        parity, output = SmallAmoebaNetCheck()
        self.assertIn('the un-partitioned layers run the same 4 micro-batches in sequence '
                      '(batch norm\'s statistics are per micro-batch)', output)
        self.assertEqual(parity.reference_micro_batches, 4)
        self.assertLessEqual(parity.worst_difference, check.TOLERANCE)
        self.assertIn('parity: the pipeline computes what its layers do un-partitioned', output)

    def testGradientsAveragedOverMicroBatchesFailWithBatchNorm(self):
        with GradientsAveragedOverMicroBatches(), self.assertRaisesRegex(
                check.ParityError, r"SmallAmoebaNet: the pipeline's gradients differ from its "
                r"layers' un-partitioned by 0\.5\d* of the largest .*, worst at "):
            # M = 2 (a smaller graph than the model's 4): every gradient half the sum.
            SmallAmoebaNetCheck(unroll=True, num_micro_batches=2)
