"""Export (gpipe_tf.train.export): a SavedModel that a process without gpipe_tf loads and that
gives the trainer's outputs: a classifier's probabilities and a translation model's greedy
translations, for any number of inputs."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from unittest import mock

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from gpipe_tf import errors
from gpipe_tf import model_registry
from gpipe_tf import test_utils
from gpipe_tf.train import decode
from gpipe_tf.train import export
from gpipe_tf.train import program

DEVICES = test_utils.ConfigureVirtualCpus()

# Loads a SavedModel and runs one of its signatures in a fresh process that cannot import
# gpipe_tf: a None entry in sys.modules makes any `import gpipe_tf[.x]` an ImportError, even
# where the package is installed (CI's `pip install -e .`); -I drops PYTHONPATH and the
# working directory from sys.path.
_LOADER = textwrap.dedent('''
    import json, sys
    sys.modules['gpipe_tf'] = None
    import numpy as np
    import tensorflow as tf
    export_dir, signature, num_devices, inputs_file = sys.argv[1:5]
    if int(num_devices) > 1:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices('CPU')[0],
            [tf.config.LogicalDeviceConfiguration()] * int(num_devices))
    loaded = tf.saved_model.load(export_dir)
    with np.load(inputs_file) as data:
        inputs = {k: tf.constant(data[k]) for k in data.files}
    try:
        outputs = loaded.signatures[signature](**inputs)
    except tf.errors.InvalidArgumentError as error:
        print(json.dumps({'error': error.message}))
        sys.exit(0)
    print(json.dumps({k: [x.decode('utf-8') for x in v.numpy().ravel()] if v.dtype == tf.string
                      else v.numpy().tolist() for k, v in outputs.items()}))
''')


# Runs a signature on the inputs sent in requests of each given size, in a process without
# gpipe_tf (as _LOADER), twice; prints per size the classes of every input, and how many of the
# SavedModel's variables serving changed.
_REQUESTS_LOADER = textwrap.dedent('''
    import json, sys
    sys.modules['gpipe_tf'] = None
    import numpy as np
    import tensorflow as tf
    export_dir, signature, num_devices, inputs_file, sizes = sys.argv[1:6]
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices('CPU')[0],
        [tf.config.LogicalDeviceConfiguration()] * int(num_devices))
    loaded = tf.saved_model.load(export_dir)
    before = [v.numpy().copy() for v in loaded.model_variables]
    images = np.load(inputs_file)
    served = {}
    for _ in range(2):
        for size in map(int, sizes.split(',')):
            served[size] = np.concatenate([
                loaded.signatures[signature](images=tf.constant(images[i:i + size]))[
                    'probabilities'].numpy() for i in range(0, len(images), size)]).tolist()
    changed = sum(not np.array_equal(b, v.numpy())
                  for b, v in zip(before, loaded.model_variables))
    print(json.dumps({'served': served, 'changed': changed}))
''')


def DeviceIndices(export_dir) -> set:
    """The device indices the SavedModel's ops name (its graph and every function's; the
    saver's '/device:CPU:*' names none)."""
    model = saved_model_pb2.SavedModel()
    with open(os.path.join(export_dir, 'saved_model.pb'), 'rb') as f:
        model.ParseFromString(f.read())
    nodes = [n for g in model.meta_graphs for n in g.graph_def.node]
    nodes += [n for g in model.meta_graphs for f in g.graph_def.library.function
              for n in f.node_def]
    indices = {tf.DeviceSpec.from_string(n.device).device_index for n in nodes if n.device}
    return indices - {None}


def Serve(export_dir, signature, inputs, num_devices=len(DEVICES)):
    """The outputs (numpy) of `signature` of the SavedModel, run in a process without gpipe_tf."""
    directory = tempfile.mkdtemp()
    try:
        path = os.path.join(directory, 'inputs.npz')
        np.savez(path, **inputs)
        result = subprocess.run(
            [sys.executable, '-I', '-c', _LOADER, export_dir, signature, str(num_devices), path],
            capture_output=True, text=True, cwd=directory, timeout=600, check=False,
            env={k: v for k, v in os.environ.items() if k != 'PYTHONPATH'})
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if result.returncode:
        raise AssertionError(f'loader failed:\n{result.stderr[-3000:]}')
    values = json.loads(result.stdout.strip().splitlines()[-1])
    return {k: np.asarray(v) if k != 'error' else v for k, v in values.items()}


class ExportTestCase(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.base = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.base, ignore_errors=True)


class ClassifierExportTest(ExportTestCase):

    def setUp(self):
        super().setUp()
        self.p = model_registry.GetParams('examples.PipelinedMLP', 'Test')
        self.task = self.p.Instantiate()
        self.export_dir = export.Export(self.task, self.p, os.path.join(self.base, '1'))

    def _Expected(self, images):
        """The task's probabilities for `images`, in model-sized batches (the last padded)."""
        batch = self.p.input.batch_size
        rows = []
        for start in range(0, len(images), batch):
            chunk = images[start:start + batch]
            padded = np.concatenate([chunk, np.zeros((batch - len(chunk),) + chunk.shape[1:],
                                                     chunk.dtype)])
            rows.append(self.task.Predict(tf.constant(padded)).numpy()[:len(chunk)])
        return np.concatenate(rows)

    def testPredictEqualsTheTaskForAnyNumberOfImages(self):
        size = self.p.input.image_size
        count = self.p.input.batch_size + 3  # One full batch and a padded one.
        images = np.random.RandomState(0).rand(count, size, size, 1).astype(np.float32)
        served = Serve(self.export_dir, 'predict', {'images': images})
        want = self._Expected(images)
        self.assertAllEqual(served['probabilities'], want)
        self.assertAllEqual(served['classes'], want.argmax(-1))
        self.assertAllEqual(served['labels'], want.argmax(-1).astype(str))

    def testServingDefaultTakesRawPixelsOfAnySize(self):
        pixels = np.random.RandomState(1).randint(0, 256, [3, 9, 7, 1]).astype(np.uint8)
        served = Serve(self.export_dir, 'serving_default', {'images': pixels}, num_devices=1)
        size = self.p.input.image_size
        mean = self.p.input.mean if 'mean' in self.p.input else 0.0
        std = self.p.input.std if 'std' in self.p.input else 1.0
        ready = ((tf.image.resize(pixels.astype(np.float32) / 255.0, [size, size]) - mean)
                 / std).numpy()
        # On one device (the cells' devices do not exist there): the same values.
        self.assertAllClose(served['probabilities'], self._Expected(ready), rtol=1e-6)

    def testAVersionIsNeverOverwritten(self):
        with self.assertRaisesRegex(FileExistsError, 'never overwritten'):
            export.Export(self.task, self.p, self.export_dir)


class BatchNormExportTest(ExportTestCase):
    """An AmoebaNet with batch norm (its moving statistics scrambled), drop-path and dropout,
    served in a process without gpipe_tf: in inference mode, whatever the request."""

    def testServedAccuracyEqualsEvalsForRequestsOf1And7And64AndNothingChanges(self):
        p = test_utils.SmallAmoebaNetParams()
        prog = program.EagerProgram(p, os.path.join(self.base, 'logdir'))
        test_utils.ScrambleMovingStatistics(prog.task)
        accuracy = prog.Evaluate(p.input)['accuracy']
        batches = list(p.input.Instantiate().EvalDataset())
        images = np.concatenate([b['images'].numpy() for b in batches])
        labels = np.concatenate([b['labels'].numpy() for b in batches])
        export_dir = export.Export(prog.task, p, os.path.join(self.base, '1'))
        path = os.path.join(self.base, 'images.npy')
        np.save(path, images)
        result = subprocess.run(
            [sys.executable, '-I', '-c', _REQUESTS_LOADER, export_dir, 'predict',
             str(len(DEVICES)), path, '1,7,64'],
            capture_output=True, text=True, cwd=self.base, timeout=600, check=False,
            env={k: v for k, v in os.environ.items() if k != 'PYTHONPATH'})
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        # TensorFlow's own error lines (grappler's "topological sort failed" among them), but
        # for the one a machine without a GPU prints as TensorFlow starts.
        errors = [line for line in result.stderr.splitlines()
                  if re.match(r'E\d{4} ', line) and 'cuInit' not in line]
        self.assertEqual(errors, [])
        values = json.loads(result.stdout.strip().splitlines()[-1])
        self.assertEqual(values['changed'], 0)
        served = {int(k): np.asarray(v) for k, v in values['served'].items()}
        for size in (1, 7, 64):
            self.assertAllClose(np.mean(served[size].argmax(-1) == labels), accuracy, atol=1e-6)
            self.assertAllClose(served[size], served[64], rtol=1e-5, atol=1e-6)


class TranslationExportTest(ExportTestCase):

    SENTENCES = ['Hello.', 'A cat, Ω.', '', 'Guten Tag', 'x' * 5]

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        p = model_registry.GetParams('mt.multilingual.TransformerTiny', 'Test')
        p.input.batch_size = 2
        p.input.max_length = 12
        p.model.num_micro_batches = 2
        cls.p = p
        cls.task = p.Instantiate()
        cls.language = p.input.Instantiate().vocab.languages[0]

    def testTranslationsEqualTheTrainersGreedyDecodeInAProcessWithoutGpipeTf(self):
        export_dir = export.Export(self.task, self.p, os.path.join(self.base, '7'))
        served = Serve(export_dir, 'serving_default', {
            'sentences': np.array(self.SENTENCES, str),
            'target_language': np.array(self.language, str)})
        want = decode.Translate(self.task, self.p, self.SENTENCES, self.language)
        self.assertEqual(list(served['translations']), [text for _, text in want])
        data = self.p.input.Instantiate()
        encoded = data.EncodeSources(self.SENTENCES[:2], self.language)
        self.assertAllEqual(served['ids'][:2],
                            self.task.Decode(encoded.src_ids, encoded.src_paddings))
        _, scores = tf.function(lambda s, q: self.task.BeamIds(s, q, 1), autograph=False)(
            encoded.src_ids, encoded.src_paddings)
        self.assertAllClose(served['scores'][:2], scores, rtol=1e-5)
        self.assertTrue(np.all(served['scores'] < 0))

    def testUnknownLanguageAndTooLongSentenceAreErrorsNamingThem(self):
        export_dir = export.Export(self.task, self.p, os.path.join(self.base, '8'))
        served = Serve(export_dir, 'serving_default', {
            'sentences': np.array(['hi'], str), 'target_language': np.array('xx', str)})
        self.assertIn('unknown target language', served['error'])
        served = Serve(export_dir, 'serving_default', {
            'sentences': np.array(['y' * 11], str),
            'target_language': np.array(self.language, str)})
        self.assertIn('max_length=12', served['error'])


class TrainerExportTest(ExportTestCase):
    """`--mode=export`: the newest checkpoint in TensorFlow Serving's layout, which
    `saved_model_cli` (TensorFlow's own tool) reads and runs."""

    def _Trainer(self, *flags, check=True):
        return test_utils.TrainerInProcess('--model=examples.PipelinedMLP',
                                           f'--logdir={self.base}', *flags, check=check)

    def _AssertFails(self, pattern, *flags):
        result = self._Trainer(*flags, check=False)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertRegex(result.stderr.strip().splitlines()[-1], '^error: ' + pattern)

    def testExportsTheNewestStepThenRefusesToOverwriteIt(self):
        self._AssertFails('export: no checkpoint', '--mode=export')
        self._Trainer('--max_steps=2')
        output = self._Trainer('--mode=export').stdout
        path = os.path.join(self.base, 'export', '2')
        self.assertIn(f'exported step 2 to {path}', output)
        # Progress while it works (a pipelined model takes seconds to a minute to trace).
        self.assertRegex(output, r'export: restoring the newest checkpoint of .*\n'
                         r'export: tracing the serving functions\n'
                         r'export: traced serving_default, predict in \d+ s; writing the '
                         r'SavedModel\nexport: done in \d+ s\n')
        shown = subprocess.run(['saved_model_cli', 'show', '--dir', path, '--all'],
                               capture_output=True, text=True, timeout=300, check=True).stdout
        self.assertIn("signature_def['serving_default']", shown)
        self.assertIn("signature_def['predict']", shown)
        self.assertRegex(shown, r"inputs\['images'\] tensor_info:\s+dtype: DT_UINT8")
        size = model_registry.GetParams('examples.PipelinedMLP', 'Test').input.image_size
        images = os.path.join(self.base, 'images.npy')
        np.save(images, np.full((3, size, size, 1), 200, np.uint8))
        run = subprocess.run(
            ['saved_model_cli', 'run', '--dir', path, '--tag_set', 'serve',
             '--signature_def', 'serving_default', '--inputs', f'images={images}'],
            capture_output=True, text=True, timeout=300, check=False)
        self.assertEqual(run.returncode, 0, run.stderr[-2000:])
        self.assertNotIn('topological', run.stderr)
        self.assertRegex(run.stdout, r'Result for output key probabilities:')
        self._AssertFails('export: .*export/2 exists; a version is never overwritten',
                          '--mode=export')
        self.assertEqual(DeviceIndices(path), {0, 1, 2, 3})  # PipelinedMLP's K=4 cells.

    def testOnOneDeviceEveryOpIsOnTheFirstDevice(self):
        self._Trainer('--max_steps=1')
        self._Trainer('--mode=export', '--export_on_one_device')
        path = os.path.join(self.base, 'export', '1')
        self.assertEqual(DeviceIndices(path), {0})
        size = model_registry.GetParams('examples.PipelinedMLP', 'Test').input.image_size
        images = np.random.RandomState(2).rand(5, size, size, 1).astype(np.float32)
        served = Serve(path, 'predict', {'images': images}, num_devices=1)
        self.assertEqual(served['probabilities'].shape, (5, 10))

    def testTheV1GraphPathIsRefused(self):
        self._AssertFails('export saves TF2 functions', '--mode=export', '--graph_mode=v1')

    def testAFileWhereTheExportDirectoryGoesIsOneLineBeforeRestoring(self):
        with open(os.path.join(self.base, 'export'), 'w', encoding='utf-8') as f:
            f.write('not a directory')
        result = self._Trainer('--mode=export', check=False)  # No checkpoint is needed to know.
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertNotIn('Traceback', result.stderr)
        self.assertEqual(result.stderr.strip().splitlines()[-1],
                         f'error: export: {self.base}/export is a file, not a directory; the '
                         'export base path must be a directory of numeric versions (TensorFlow '
                         'Serving\'s layout): move the file away.')

    def testALanguageModelIsRefusedBeforeAnythingIsBuilt(self):
        result = test_utils.TrainerInProcess('--model=lm.TransformerLTiny',
                                             f'--logdir={self.base}', '--mode=export',
                                             check=False)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn('cannot be exported', result.stderr)


class ExportErrorsTest(ExportTestCase):

    def testABasePathThatIsAFileIsRefusedBeforeTracing(self):
        base = os.path.join(self.base, 'export')
        with open(base, 'w', encoding='utf-8') as f:
            f.write('not a directory')
        p = model_registry.GetParams('examples.PipelinedMLP', 'Test')
        with self.assertRaisesRegex(NotADirectoryError, rf'^export: {base} is a file, not a '
                                    'directory'):
            export.Export(p.Instantiate(), p, os.path.join(base, '1'))

    def testAFullDiskIsOneLineAndLeavesNoHalfWrittenVersion(self):
        p = model_registry.GetParams('examples.PipelinedMLP', 'Test')
        save = tf.saved_model.save

        def SaveUntilTheDiskIsFull(obj, export_dir, signatures):
            save(obj, export_dir, signatures=signatures)  # Half of it: the rename is left.
            raise tf.errors.ResourceExhaustedError(
                None, None, f'{export_dir}/variables; No space left on device')

        with mock.patch.object(tf.saved_model, 'save', SaveUntilTheDiskIsFull):
            with self.assertRaisesRegex(
                    errors.EnvironmentFault,
                    rf'^could not write the SavedModel at {self.base}/1.partial: '
                    r'.*No space left on device\. The checkpoints written before it are kept'):
                export.Export(p.Instantiate(), p, os.path.join(self.base, '1'))
        self.assertEqual(os.listdir(self.base), [])

    def testALanguageModelIsRefused(self):
        p = model_registry.GetParams('lm.TransformerLTiny', 'Test')
        with self.assertRaisesRegex(export.ExportError, 'language model'):
            export.MakeServable(p.Instantiate(), p)


if __name__ == '__main__':
    tf.test.main()
