"""Tests of gpipe_tf.model_registry, and of the example model registered in gpipe_tf.params."""

import importlib
import os
import shutil
import sys
import tempfile
import textwrap
import uuid

import pytest
import tensorflow as tf

from gpipe_tf import hyperparams
from gpipe_tf import model_keys
from gpipe_tf import model_registry
from gpipe_tf.layers import basic
from gpipe_tf.params import examples
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.tasks import classifier

pytestmark = pytest.mark.unit

EXAMPLE = 'examples.PipelinedMLP'


def _InputParams(batch_size: int = 4) -> hyperparams.Params:
    p = hyperparams.Params()
    p.Define('batch_size', batch_size, 'Examples per mini-batch.')
    return p


class DeclaredKeysTest(tf.test.TestCase):

    def testTheSourcesDeclareEveryRegisteredModel(self):
        # Read without importing: what the command line checks a model name against.
        self.assertEqual(sorted(model_keys.DeclaredKeys()), model_registry.ListModels())

    def testAnUnknownNameNamesTheClosestKeys(self):
        self.assertEqual(
            model_keys.UnknownModel('lm.TransformerLtiny', ['lm.TransformerLTiny', 'examples.A']),
            "Unknown model 'lm.TransformerLtiny'; closest registered models: "
            "'lm.TransformerLTiny' (2 registered, see ListModels()).")


class RegistryTestCase(tf.test.TestCase):
    """Registers test-local classes and removes them from the registry afterwards."""

    def Register(self, cls: type) -> str:
        key = model_registry.RegistryKey(cls)
        self.addCleanup(model_registry._MODEL_PARAMS.pop, key, None)
        model_registry.RegisterSingleTaskModel(cls)
        return key


class RegistrationTest(RegistryTestCase):

    def test_key_is_module_path_below_params_and_class_name(self):
        self.assertEqual(model_registry.RegistryKey(examples.PipelinedMLP), EXAMPLE)

    def test_key_of_class_outside_params_is_its_full_module_path(self):
        class Outside:
            pass

        self.assertEqual(model_registry.RegistryKey(Outside), f'{__name__}.Outside')

    def test_decorator_registers_and_returns_the_class(self):
        class Registered:
            def Task(self):
                return _InputParams()

            def Train(self):
                return _InputParams()

        self.assertIs(model_registry.RegisterSingleTaskModel(Registered), Registered)
        self.addCleanup(model_registry._MODEL_PARAMS.pop, f'{__name__}.Registered', None)
        self.assertIs(model_registry.GetClass(f'{__name__}.Registered'), Registered)

    def test_duplicate_key_raises_naming_key_and_both_classes(self):
        class First:
            def Task(self):
                return _InputParams()

            def Train(self):
                return _InputParams()

        class Second(First):
            pass

        Second.__name__ = 'First'  # Same key as First; its qualified name still says Second.
        key = self.Register(First)
        with self.assertRaises(ValueError) as cm:
            model_registry.RegisterSingleTaskModel(Second)
        message = str(cm.exception)
        self.assertIn(repr(key), message)
        self.assertIn(First.__qualname__, message)
        self.assertIn(Second.__qualname__, message)
        self.assertIs(model_registry.GetClass(key), First)

    def test_registering_the_same_class_again_is_a_no_op(self):
        class Again:
            def Task(self):
                return _InputParams()

            def Train(self):
                return _InputParams()

        key = self.Register(Again)
        model_registry.RegisterSingleTaskModel(Again)
        self.assertIs(model_registry.GetClass(key), Again)

    def test_class_without_task_or_model_is_rejected(self):
        class NoTask:
            def Train(self):
                return _InputParams()

        with self.assertRaisesRegex(TypeError, 'NoTask defines neither Task'):
            model_registry.RegisterSingleTaskModel(NoTask)

    def test_class_without_train_is_rejected(self):
        class NoTrain:
            def Task(self):
                return _InputParams()

            def Test(self):
                return _InputParams()

        with self.assertRaisesRegex(TypeError, 'NoTrain defines no Train'):
            model_registry.RegisterSingleTaskModel(NoTrain)


class LookupTest(RegistryTestCase):

    def test_list_models_is_sorted_and_includes_the_example(self):
        models = model_registry.ListModels()
        self.assertIn(EXAMPLE, models)
        self.assertEqual(models, sorted(models))

    def test_get_class_returns_the_registered_class(self):
        self.assertIs(model_registry.GetClass(EXAMPLE), examples.PipelinedMLP)

    def test_get_datasets_lists_defined_datasets_in_order(self):
        self.assertEqual(model_registry.GetDatasets(EXAMPLE), ['Train', 'Test'])

    def test_unknown_model_raises_lookup_error_naming_closest(self):
        for name in ('examples.PipelinedMlp', 'PipelinedMLP', 'example.PipelinedMLP'):
            with self.subTest(name=name):
                with self.assertRaisesRegex(LookupError, f"Unknown model '{name}'.*'{EXAMPLE}'"):
                    model_registry.GetParams(name, 'Train')

    def test_unknown_dataset_raises_lookup_error_listing_available(self):
        with self.assertRaisesRegex(LookupError,
                                    r"no dataset 'Dev'; available: \['Train', 'Test'\]"):
            model_registry.GetParams(EXAMPLE, 'Dev')


class GetParamsTest(RegistryTestCase):

    def test_input_params_of_the_dataset_are_attached(self):
        p = model_registry.GetParams(EXAMPLE, 'Train')
        self.assertEqual(p.input, examples.PipelinedMLP().Train())
        self.assertEqual(model_registry.GetParams(EXAMPLE, 'Test').input,
                         examples.PipelinedMLP().Test())

    def test_task_params_are_returned_with_the_input_added(self):
        p = model_registry.GetParams(EXAMPLE, 'Train')
        task = examples.PipelinedMLP().Task()
        task.input = examples.PipelinedMLP().Train()
        self.assertEqual(p, task)

    def test_dataset_name_is_case_insensitive(self):
        self.assertEqual(model_registry.GetParams(EXAMPLE, 'train'),
                         model_registry.GetParams(EXAMPLE, 'Train'))

    def test_each_call_returns_an_independent_copy(self):
        first = model_registry.GetParams(EXAMPLE, 'Train')
        first.model.layer_tpl[0].output_dim = 99
        first.input.batch_size = 1
        second = model_registry.GetParams(EXAMPLE, 'Train')
        self.assertEqual(second.model.layer_tpl[0].output_dim, 64)
        self.assertEqual(second.input.batch_size, 64)
        self.assertFalse(second.frozen)

    def test_shared_params_returned_by_task_are_copied(self):
        shared = _InputParams()
        shared.Define('input', None, 'Input params.')

        class Shared:
            def Task(self):
                return shared

            def Train(self):
                return _InputParams(batch_size=8)

        key = self.Register(Shared)
        p = model_registry.GetParams(key, 'Train')
        self.assertEqual(p.input.batch_size, 8)
        self.assertIsNone(shared.input)

    def test_model_is_used_when_the_class_defines_it(self):
        class LingvoStyle:
            def Model(self):
                return _InputParams(batch_size=2)

            def Train(self):
                return _InputParams()

        key = self.Register(LingvoStyle)
        self.assertEqual(model_registry.GetParams(key, 'Train').batch_size, 2)

    def test_classmethods_work_as_well_as_methods(self):
        class WithClassmethods:
            @classmethod
            def Task(cls):
                return _InputParams(batch_size=3)

            @classmethod
            def Train(cls):
                return _InputParams(batch_size=5)

        key = self.Register(WithClassmethods)
        p = model_registry.GetParams(key, 'Train')
        self.assertEqual((p.batch_size, p.input.batch_size), (3, 5))

    def test_non_params_task_raises_type_error(self):
        class NotParams:
            def Task(self):
                return {'batch_size': 1}

            def Train(self):
                return _InputParams()

        key = self.Register(NotParams)
        with self.assertRaisesRegex(TypeError, r'NotParams.Task\(\) returned dict'):
            model_registry.GetParams(key, 'Train')


class ImportAllParamsTest(RegistryTestCase):

    def MakePackage(self, modules: dict[str, str]) -> str:
        """Writes a uniquely named package of `modules` (name -> source) and returns its name."""
        # tempfile, not create_tempdir(): that needs absl flags, which pytest does not parse.
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root)
        package = f'tmp_params_{uuid.uuid4().hex}'
        os.mkdir(os.path.join(root, package))
        modules = {'__init__': '', **modules}
        for name, source in modules.items():
            with open(os.path.join(root, package, name + '.py'), 'w') as f:
                f.write(textwrap.dedent(source))
        sys.path.insert(0, root)
        importlib.invalidate_caches()
        self.addCleanup(sys.path.remove, root)
        for name in modules:
            full = package if name == '__init__' else f'{package}.{name}'
            self.addCleanup(sys.modules.pop, full, None)
        return package

    GOOD = """
        from gpipe_tf import hyperparams, model_registry

        @model_registry.RegisterSingleTaskModel
        class Good:
            def Task(self):
                return hyperparams.Params()

            def Train(self):
                return hyperparams.Params()
        """

    def test_imports_the_example_params_module(self):
        model_registry.ImportAllParams()
        self.assertIn('gpipe_tf.params.examples', sys.modules)

    def test_registers_models_of_every_module(self):
        package = self.MakePackage({'good': self.GOOD})
        self.addCleanup(model_registry._MODEL_PARAMS.pop, f'{package}.good.Good', None)
        self.assertTrue(model_registry.ImportAllParams(package))
        self.assertIn(f'{package}.good.Good', model_registry.ListModels())

    def test_a_broken_module_is_reported_and_others_still_register(self):
        package = self.MakePackage({'broken': 'raise RuntimeError("boom")', 'good': self.GOOD})
        self.addCleanup(model_registry._MODEL_PARAMS.pop, f'{package}.good.Good', None)
        self.assertFalse(model_registry.ImportAllParams(package))
        self.assertIn(f'{package}.good.Good', model_registry.ListModels())

    def test_require_success_raises_naming_the_broken_module(self):
        package = self.MakePackage({'broken': 'raise RuntimeError("boom")'})
        with self.assertRaisesRegex(ImportError, f'{package}.broken failed: RuntimeError: boom'):
            model_registry.ImportAllParams(package, require_success=True)


class ExampleModelTest(tf.test.TestCase):

    def test_task_is_a_classifier_over_a_pipelined_stack_of_dense_layers(self):
        p = model_registry.GetParams(EXAMPLE, 'Train')
        self.assertIs(p.cls, classifier.ClassifierTask)
        model = p.model
        self.assertIs(model.cls, pipelining_layer.PipeliningLayer)
        self.assertEqual((model.num_cells, model.num_micro_batches), (4, 8))
        self.assertEqual([s.cls for s in model.layer_tpl], [basic.DenseLayer] * 4)
        self.assertEqual([(s.input_dim, s.output_dim) for s in model.layer_tpl],
                         [(16, 64), (64, 64), (64, 64), (64, 10)])

    def test_task_and_input_shapes_agree(self):
        for dataset in model_registry.GetDatasets(EXAMPLE):
            with self.subTest(dataset=dataset):
                p = model_registry.GetParams(EXAMPLE, dataset)
                self.assertEqual(p.input.image_size ** 2 * p.input.num_channels,
                                 p.model.layer_tpl[0].input_dim)
                self.assertEqual(p.input.num_classes, p.model.layer_tpl[-1].output_dim)

    def test_example_instantiates_and_computes_metrics_on_its_input(self):
        for dataset in model_registry.GetDatasets(EXAMPLE):
            with self.subTest(dataset=dataset):
                p = model_registry.GetParams(EXAMPLE, dataset)
                task = p.Instantiate()
                batch = next(iter(p.input.Instantiate().EvalDataset()))
                metrics = task.FPropTower(batch)
                loss, weight = metrics.loss
                self.assertEqual(float(weight), p.input.batch_size)
                self.assertBetween(float(loss), 0.5, 10.0)
                self.assertBetween(float(metrics.accuracy[0]), 0.0, 1.0)

    def test_params_text_round_trips(self):
        p = model_registry.GetParams(EXAMPLE, 'Train')
        fresh = classifier.ClassifierTask.Params()
        self.assertEqual(fresh.FromText(p.ToText()), p)


if __name__ == '__main__':
    tf.test.main()
