"""Module paths from before the layout of 0.1 (pipeline/, models/) still import, as the moved
module itself, with a DeprecationWarning, whether imported by path or from their package; Params
text that names them still loads. They are one table (`gpipe_tf._moved.MOVED`), no file each."""

import importlib
import os
import sys
import warnings

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import gpipe_tf
from gpipe_tf import _moved
from gpipe_tf import model_registry

pytestmark = pytest.mark.unit

MOVED = {
    'gpipe_tf.layers.pipeline': 'gpipe_tf.pipeline.pipelining_layer',
    'gpipe_tf.layers.unrolled': 'gpipe_tf.pipeline.unrolled',
    'gpipe_tf.layers.partition': 'gpipe_tf.pipeline.partition',
    'gpipe_tf.layers.schedule': 'gpipe_tf.pipeline.schedule',
    'gpipe_tf.layers.microbatch': 'gpipe_tf.pipeline.microbatch',
    'gpipe_tf.layers.recompute': 'gpipe_tf.pipeline.cell',
    'gpipe_tf.train.devices': 'gpipe_tf.pipeline.devices',
    'gpipe_tf.layers.amoebanet': 'gpipe_tf.models.amoebanet.network',
    'gpipe_tf.layers.amoebanet_ops': 'gpipe_tf.models.amoebanet.ops',
    'gpipe_tf.layers.transformer_model': 'gpipe_tf.models.transformer.network',
}


class MovedModulesTest(parameterized.TestCase):

    @parameterized.parameters(*MOVED.items())
    def testOldPathIsTheNewModuleWithAWarning(self, old, new):
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            module = importlib.import_module(old)
        self.assertIs(module, importlib.import_module(new))
        self.assertEqual([str(w.message) for w in caught if w.category is DeprecationWarning],
                         [f'{old} moved to {new}; the old path goes away in gpipe_tf 0.2.'])

    @parameterized.parameters(*MOVED.items())
    def testFromItsPackageTheOldNameIsTheNewModuleWithAWarning(self, old, new):
        package, _, name = old.rpartition('.')
        sys.modules.pop(old, None)
        parent = importlib.import_module(package)
        if name in vars(parent):
            delattr(parent, name)  # Bound by an earlier import of the old path.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            scope = {}
            exec(f'from {package} import {name}', scope)  # pylint: disable=exec-used
        self.assertIs(scope[name], importlib.import_module(new))
        self.assertEqual([str(w.message) for w in caught if w.category is DeprecationWarning],
                         [f'{old} moved to {new}; the old path goes away in gpipe_tf 0.2.'])

    def testTheTableHoldsEveryOldPathAndNoFileIsLeftAtOne(self):
        self.assertEqual(_moved.MOVED, MOVED)
        root = os.path.dirname(os.path.dirname(os.path.abspath(gpipe_tf.__file__)))
        for old in MOVED:
            self.assertFalse(os.path.exists(os.path.join(root, *old.split('.')) + '.py'), old)

    def testAnImportOfAPathNeverMovedStillFails(self):
        with self.assertRaises(ModuleNotFoundError):
            importlib.import_module('gpipe_tf.layers.no_such_module')

    def testParamsTextNamingAnOldPathLoads(self):
        p = model_registry.GetParams('examples.PipelinedMLP', 'Train')
        text = p.ToText()
        old = text.replace('gpipe_tf.pipeline.pipelining_layer', 'gpipe_tf.layers.pipeline')
        self.assertNotEqual(old, text)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', DeprecationWarning)
            loaded = model_registry.GetParams('examples.PipelinedMLP', 'Train').FromText(old)
        self.assertEqual(loaded, p)


if __name__ == '__main__':
    absltest.main()
