"""Finding the checkpoint to resume from: the files on disk are the truth, a damaged checkpoint
is skipped for the previous intact one, and nothing is deleted (`gpipe_tf.train.checkpoints`).
The trainer's use of it is tested on real processes in test_trainer.py (RecoveryTest)."""

import os
import shutil
import tempfile
from unittest import mock

import pytest
import numpy as np
import tensorflow as tf

from gpipe_tf import test_utils
from gpipe_tf.train import checkpoints

pytestmark = pytest.mark.unit

STEPS = (1, 2, 3)


Damage = test_utils.DamageFile
Files = test_utils.FileNames


class CheckpointsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp(prefix='checkpoints_test_')
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.variable = tf.Variable(tf.zeros([1000]))
        self.checkpoint = tf.train.Checkpoint(v=self.variable)
        manager = tf.train.CheckpointManager(self.checkpoint, self.dir, max_to_keep=5)
        for step in STEPS:
            self.variable.assign(tf.fill([1000], float(step)))
            manager.save(checkpoint_number=step)

    def Prefix(self, step):
        return os.path.join(self.dir, f'ckpt-{step}')

    def Data(self, step):
        return self.Prefix(step) + '.data-00000-of-00001'

    def testASoundDirectoryGivesTheNewest(self):
        found = checkpoints.Find(self.dir)
        self.assertEqual(found.path, self.Prefix(3))
        self.assertEqual(found.step, 3)
        self.assertEmpty(found.damaged)
        self.assertIsNone(found.index_problem)
        self.assertEmpty(checkpoints.Warnings(found))

    def testAnEmptyOrMissingDirectoryHasNothing(self):
        for directory in (tempfile.mkdtemp(dir=self.dir), os.path.join(self.dir, 'nothing')):
            found = checkpoints.Find(directory)
            self.assertIsNone(found.path)
            self.assertFalse(found.any_files)

    def testAMissingIndexStillGivesTheNewestAndSaysSo(self):
        os.remove(os.path.join(self.dir, 'checkpoint'))
        found = checkpoints.Find(self.dir)
        self.assertEqual(found.path, self.Prefix(3))
        self.assertRegex(found.index_problem, 'checkpoint is missing')
        self.assertLen(checkpoints.Warnings(found), 1)

    def testAGarbledIndexStillGivesTheNewest(self):
        with open(os.path.join(self.dir, 'checkpoint'), 'w') as f:
            f.write('model_checkpoint_path: "ckpt-3\n\x00garbage {{{')
        found = checkpoints.Find(self.dir)
        self.assertEqual(found.path, self.Prefix(3))
        self.assertRegex(found.index_problem, 'is garbled')

    def testACompleteCheckpointNewerThanTheIndexWins(self):
        # A crash between writing ckpt-N and updating the index.
        tf.compat.v1.train.update_checkpoint_state(self.dir, self.Prefix(2))
        self.assertEqual(checkpoints.Find(self.dir).path, self.Prefix(3))

    def testEachKindOfDamageToTheNewestFallsBackToThePrevious(self):
        for what, path, how, problem in (
                ('truncated data', self.Data(3), 'truncate', 'Read less bytes'),
                ('flipped data', self.Data(3), 'flip', 'Checksum does not match'),
                ('truncated index', self.Prefix(3) + '.index', 'truncate', ''),
                ('missing data', self.Data(3), 'remove', '')):
            with self.subTest(what):
                backup = path + '.backup'
                shutil.copy(path, backup)
                if how == 'remove':
                    os.remove(path)
                else:
                    Damage(path, how)
                found = checkpoints.Find(self.dir)
                shutil.move(backup, path)
                self.assertEqual(found.path, self.Prefix(2))
                self.assertEqual([d.prefix for d in found.damaged], [self.Prefix(3)])
                self.assertIn(problem, found.damaged[0].problem)
                [warning] = checkpoints.Warnings(found)
                self.assertIn(f'checkpoint {self.Prefix(3)} is damaged', warning)
                self.assertIn(f'skipped for {self.Prefix(2)}', warning)

    def testTheFoundCheckpointRestoresItsValues(self):
        Damage(self.Data(3), 'flip')
        found = checkpoints.Find(self.dir)
        self.checkpoint.restore(found.path).assert_existing_objects_matched()
        self.assertAllEqual(self.variable.numpy(), np.full([1000], 2.0))

    def testUnfinishedSavesAreFound(self):
        os.mkdir(self.Prefix(4) + '_temp')
        shutil.copy(self.Data(3), self.Data(5))  # Data renamed into place, index not yet.
        found = checkpoints.Find(self.dir)
        self.assertEqual(found.path, self.Prefix(3))
        self.assertEqual(found.unfinished, (self.Prefix(4) + '_temp', self.Data(5)))

    def testOnlyUnfinishedSavesLetATrainerStartAtZeroAndStopAReader(self):
        # A first save that failed (a full disk) left only its temporary folder: the trainer's
        # message says to run the same command again, which must then start, losing nothing.
        directory = tempfile.mkdtemp(dir=self.dir)
        os.mkdir(os.path.join(directory, 'ckpt-1_temp'))
        with self.assertRaisesRegex(checkpoints.NoCheckpointRestoresError,
                                    'train in this logdir again'):
            checkpoints.Choose(directory, writer=False)
        found = checkpoints.Choose(directory, writer=True)
        self.assertIsNone(found.path)
        self.assertEqual(os.listdir(os.path.join(directory, checkpoints.DAMAGED_DIR)),
                         ['ckpt-1_temp'])
        # With a damaged checkpoint beside it, the trainer still asks before starting over.
        Damage(self.Data(3), 'truncate')
        for step in (1, 2):
            for name in os.listdir(self.dir):
                if name.startswith(f'ckpt-{step}.'):
                    os.remove(os.path.join(self.dir, name))
        os.mkdir(self.Prefix(4) + '_temp')
        with self.assertRaisesRegex(checkpoints.NoCheckpointRestoresError,
                                    'pass --start_from_scratch'):
            checkpoints.Choose(self.dir, writer=True)

    def testACheckpointThisUserMayNotReadIsNotDamage(self):
        denied = tf.errors.PermissionDeniedError(None, None, f'{self.Data(3)}; Permission denied')
        with mock.patch.object(tf.train, 'load_checkpoint', side_effect=denied):
            with self.assertRaisesRegex(checkpoints.UnreadableCheckpointError,
                                        'Permission denied.*nothing was moved'):
                checkpoints.Choose(self.dir, writer=True)
        self.assertEqual(checkpoints.Find(self.dir).path, self.Prefix(3))
        self.assertFalse(os.path.exists(os.path.join(self.dir, checkpoints.DAMAGED_DIR)))

    def testSetAsideMovesWithoutDeletingAndTheManagerKeepsManagingEverything(self):
        Damage(self.Data(3), 'truncate')
        os.remove(os.path.join(self.dir, 'checkpoint'))
        os.mkdir(self.Prefix(4) + '_temp')
        before = Files(self.dir)
        found = checkpoints.Find(self.dir)
        moved = checkpoints.SetAside(self.dir, found)
        damaged_dir = os.path.join(self.dir, checkpoints.DAMAGED_DIR)
        self.assertCountEqual(moved, [os.path.join(damaged_dir, n) for n in (
            'ckpt-3.index', 'ckpt-3.data-00000-of-00001', 'ckpt-4_temp')])
        self.assertContainsSubset(before - {'checkpoint'}, Files(self.dir))
        # The index lists every checkpoint on disk, newest sound one last; the manager deletes
        # only the oldest beyond max_to_keep, after a newer save.
        manager = tf.train.CheckpointManager(self.checkpoint, self.dir, max_to_keep=2)
        self.assertEqual(manager.checkpoints, [self.Prefix(1), self.Prefix(2)])
        self.assertEqual(manager.latest_checkpoint, self.Prefix(2))
        self.assertEmpty(checkpoints.Warnings(checkpoints.Find(self.dir)))
        manager.save(checkpoint_number=3)
        self.assertEqual(manager.checkpoints, [self.Prefix(2), self.Prefix(3)])
        self.assertEqual(checkpoints.Find(self.dir).path, self.Prefix(3))

    def testNoneRestoresNamesThemAndTheWayOut(self):
        for step in STEPS:
            Damage(self.Data(step), 'truncate')
        found = checkpoints.Find(self.dir)
        self.assertIsNone(found.path)
        self.assertTrue(found.any_files)
        message = checkpoints.NoneRestoresMessage(self.dir, found, writer=True)
        for step in STEPS:
            self.assertIn(self.Prefix(step), message)
        self.assertIn('pass --start_from_scratch', message)
        self.assertNotIn('\n', message)
        # Eval, export and decode read: training again is the way out.
        message = checkpoints.NoneRestoresMessage(self.dir, found, writer=False)
        self.assertIn('train in this logdir again with --start_from_scratch', message)
        self.assertNotIn('\n', message)
        # Starting over deliberately moves them aside, the index with them.
        checkpoints.SetAside(self.dir, found)
        self.assertFalse(checkpoints.Find(self.dir).any_files)
        self.assertFalse(os.path.exists(os.path.join(self.dir, 'checkpoint')))
        self.assertLen(os.listdir(os.path.join(self.dir, checkpoints.DAMAGED_DIR)), 7)


if __name__ == '__main__':
    tf.test.main()
