"""Tests of gpipe_tf.hyperparams: Params, InstantiableParams and their text form."""

import importlib
import math
import os
import re
import shutil
import sys
import tempfile
import uuid
from unittest import mock

import pytest
import numpy as np
import tensorflow as tf

import gpipe_tf
from gpipe_tf import hyperparams
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import sequential
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.train import tpu


class ModuleLevelClass:
    """A class outside the gpipe_tf package: written as `type/<this module>/ModuleLevelClass`,
    never read back."""

    class Inner:
        pass


def ModuleLevelFunction(x):
    return x


class Recorder:
    """Instantiated by InstantiableParams: keeps what it was built from."""

    def __init__(self, params, **kwargs):
        self.params = params
        self.kwargs = kwargs


def _Params(**values) -> hyperparams.Params:
    p = hyperparams.Params()
    for name, value in values.items():
        p.Define(name, value, f'The {name}.')
    return p


def _RoundTrip(value):
    """Writes `value` with ToText and reads it back into a fresh Params."""
    fresh = _Params(v=None)
    fresh.FromText(_Params(v=value).ToText())
    return fresh.v


def _DenseParams(name: str, input_dim: int, output_dim: int) -> hyperparams.Params:
    return basic.DenseLayer.Params().Set(name=name, input_dim=input_dim, output_dim=output_dim)


def _MlpParams() -> hyperparams.Params:
    p = sequential.SequentialLayer.Params().Set(name='mlp', repeat=2)
    p.sub = [_DenseParams('fc0', 4, 8).Set(activation='relu', random_seed=7),
             basic.DropoutLayer.Params().Set(name='drop', keep_prob=0.9,
                                             noise_shape_broadcast_dims=[1]),
             _DenseParams('fc1', 8, 2).Set(dtype=tf.bfloat16,
                                           params_init=base_layer.WeightInit.Gaussian(0.02))]
    return p


@pytest.mark.unit
class DefineGetSetTest(tf.test.TestCase):

    def test_define_sets_default_and_description(self):
        p = hyperparams.Params()
        p.Define('num_micro_batches', 1, 'Number of micro-batches.')
        self.assertEqual(p.num_micro_batches, 1)
        self.assertEqual(p.Describe('num_micro_batches'), 'Number of micro-batches.')
        self.assertIn('num_micro_batches', p)

    def test_attribute_assignment_changes_value(self):
        p = _Params(x=1)
        p.x = 5
        self.assertEqual(p.x, 5)

    def test_define_copies_a_mutable_default(self):
        default = [1, 2]
        p = _Params(x=default)
        default.append(3)
        self.assertEqual(p.x, [1, 2])

    def test_malformed_names_are_rejected(self):
        for name in ('Upper', '1st', 'a.b', 'a-b', 'a b', '', 'a[0]'):
            with self.subTest(name=name):
                with self.assertRaisesRegex(ValueError, 'malformed'):
                    hyperparams.Params().Define(name, 0, '')

    def test_redefinition_raises(self):
        p = _Params(x=1)
        with self.assertRaisesRegex(AttributeError, "'x' is already defined"):
            p.Define('x', 2, '')

    def test_unknown_name_on_get_suggests_closest(self):
        p = _Params(num_micro_batches=1, num_layers=2)
        with self.assertRaisesRegex(AttributeError, "'num_micro_batches'"):
            _ = p.num_micro_batch

    def test_unknown_name_on_set_suggests_closest(self):
        p = _Params(num_micro_batches=1)
        with self.assertRaisesRegex(AttributeError, "'num_micro_batches'"):
            p.num_micro_batchs = 4

    def test_set_dotted_names_into_nested_params_returns_self(self):
        p = _Params(a=_Params(b=0, c=_Params(d=0)), e=0)
        self.assertIs(p.Set(**{'a.b': 1, 'a.c.d': 2, 'e': 3}), p)
        self.assertEqual((p.a.b, p.a.c.d, p.e), (1, 2, 3))

    def test_set_through_a_non_params_value_raises(self):
        p = _Params(a=5)
        with self.assertRaisesRegex(AttributeError, "'a' is int, not Params"):
            p.Set(**{'a.b': 1})

    def test_get_reads_dotted_names(self):
        p = _Params(a=_Params(b=_Params(c=3)))
        self.assertEqual(p.Get('a.b.c'), 3)


@pytest.mark.unit
class CopyTest(tf.test.TestCase):

    def test_copy_is_independent_of_nested_params(self):
        p = _Params(child=_Params(x=1))
        q = p.Copy()
        q.child.x = 2
        self.assertEqual(p.child.x, 1)

    def test_copy_is_independent_of_lists_and_params_in_them(self):
        p = _Params(values=[1, [2]], layers=[_Params(x=1)])
        q = p.Copy()
        q.values[1].append(3)
        q.layers[0].x = 2
        q.layers.append(_Params(x=3))
        self.assertEqual(p.values, [1, [2]])
        self.assertEqual(p.layers[0].x, 1)
        self.assertLen(p.layers, 1)

    def test_copy_keeps_the_params_subclass(self):
        init = base_layer.WeightInit.Gaussian(0.5)
        copied = init.Copy()
        self.assertIsInstance(copied, base_layer.WeightInit)
        self.assertEqual(copied, init)

    def test_copy_shares_classes_functions_and_dtypes(self):
        p = _Params(cls=ModuleLevelClass, fn=ModuleLevelFunction, dtype=tf.int32)
        q = p.Copy()
        self.assertIs(q.cls, ModuleLevelClass)
        self.assertIs(q.fn, ModuleLevelFunction)
        self.assertEqual(q.dtype, tf.int32)

    def test_copy_keeps_namedtuples_and_their_fields(self):
        # tf.config.list_logical_devices lists namedtuples, a natural `devices` value.
        devices = [tf.config.LogicalDevice('/device:CPU:0', 'CPU')]
        q = _Params(devices=devices, pair=(1, [2])).Copy()
        self.assertEqual(q.devices, devices)
        self.assertIsInstance(q.devices[0], tf.config.LogicalDevice)
        self.assertEqual(q.pair, (1, [2]))

    def test_copy_of_frozen_params_is_unfrozen(self):
        p = _Params(child=_Params(x=1)).Freeze()
        q = p.Copy()
        q.child.x = 2
        self.assertFalse(q.frozen)
        self.assertEqual(q.child.x, 2)


@pytest.mark.unit
class FreezeTest(tf.test.TestCase):

    def test_freeze_blocks_top_level_assignment(self):
        p = _Params(x=1).Freeze()
        with self.assertRaisesRegex(TypeError, "frozen; cannot set 'x'"):
            p.x = 2

    def test_freeze_blocks_nested_assignment(self):
        p = _Params(child=_Params(x=1)).Freeze()
        with self.assertRaisesRegex(TypeError, 'frozen'):
            p.child.x = 2

    def test_freeze_blocks_params_inside_lists(self):
        p = _Params(layers=[_Params(x=1)]).Freeze()
        with self.assertRaisesRegex(TypeError, 'frozen'):
            p.layers[0].x = 2

    def test_freeze_blocks_set_define_and_from_text(self):
        p = _Params(child=_Params(x=1)).Freeze()
        with self.assertRaisesRegex(TypeError, 'frozen'):
            p.Set(**{'child.x': 2})
        with self.assertRaisesRegex(TypeError, 'frozen'):
            p.Define('y', 0, '')
        with self.assertRaisesRegex(ValueError, 'Line 1.*frozen'):
            p.FromText('child.x : 2')
        self.assertEqual(p.child.x, 1)

    def test_freeze_returns_self(self):
        p = _Params(x=1)
        self.assertIs(p.Freeze(), p)
        self.assertTrue(p.frozen)


@pytest.mark.unit
class EqualityTest(tf.test.TestCase):

    def test_params_with_equal_values_are_equal(self):
        self.assertEqual(_MlpParams(), _MlpParams())

    def test_a_different_nested_value_makes_params_unequal(self):
        p, q = _MlpParams(), _MlpParams()
        q.sub[1].keep_prob = 0.5
        self.assertNotEqual(p, q)
        self.assertTrue(p != q)

    def test_different_names_make_params_unequal(self):
        self.assertNotEqual(_Params(x=1), _Params(y=1))

    def test_values_of_different_types_are_unequal(self):
        self.assertNotEqual(_Params(x=1), _Params(x=True))
        self.assertNotEqual(_Params(x=1), _Params(x=1.0))
        self.assertNotEqual(_Params(x=[1]), _Params(x=(1,)))

    def test_params_are_not_equal_to_other_types(self):
        self.assertNotEqual(_Params(x=1), {'x': 1})


@pytest.mark.unit
class TextRoundTripTest(tf.test.TestCase):

    def assertRoundTrips(self, value):
        result = _RoundTrip(value)
        self.assertEqual(result, value)
        self.assertIs(type(result), type(value))

    def test_ints_round_trip(self):
        for value in (0, 7, -3, 2**40):
            with self.subTest(value=repr(value)):
                self.assertRoundTrips(value)

    def test_floats_round_trip_exactly(self):
        for value in (0.0, 0.5, -0.5, 1e-8, -1e-8, 1e30, 0.1 + 0.2, math.inf, -math.inf):
            with self.subTest(value=repr(value)):
                self.assertRoundTrips(value)

    def test_nan_round_trips(self):
        self.assertTrue(math.isnan(_RoundTrip(math.nan)))

    def test_numpy_float_is_written_as_a_python_float(self):
        result = _RoundTrip(np.float64(0.25))
        self.assertEqual(result, 0.25)
        self.assertIs(type(result), float)

    def test_strings_round_trip_with_quotes_separators_and_newlines(self):
        for value in ('', 'abc', "it's", 'say "hi"', '\'"mixed"\'', 'a : b', 'x :', '# no comment',
                      'line1\nline2\r\n', 'tab\there', '  padded  ', 'back\\slash', 'ünï→code',
                      'a\u2028b'):
            with self.subTest(value=repr(value)):
                self.assertRoundTrips(value)

    def test_bools_and_none_round_trip(self):
        for value in (True, False, None):
            with self.subTest(value=repr(value)):
                self.assertRoundTrips(value)

    def test_containers_round_trip(self):
        for value in ([], [1, 'a', None], (), (1,), (1, 2.5), {}, {'a': 1, 2: [True, None]},
                      [[1, (2, 3)], {'k': {'n': -1e-8}}]):
            with self.subTest(value=repr(value)):
                self.assertRoundTrips(value)

    def test_dtypes_round_trip(self):
        for dtype in (tf.float32, tf.int32, tf.bfloat16, tf.float16, tf.bool, tf.string):
            with self.subTest(dtype=repr(dtype)):
                self.assertEqual(_RoundTrip(dtype), dtype)

    def test_dtypes_inside_containers_round_trip(self):
        self.assertEqual(_RoundTrip([tf.float32, (tf.int32,)]), [tf.float32, (tf.int32,)])

    def test_classes_of_the_package_round_trip(self):
        for cls in (basic.DenseLayer, pipelining_layer.PipeliningLayer, hyperparams.InstantiableParams):
            with self.subTest(cls=repr(cls)):
                self.assertIs(_RoundTrip(cls), cls)

    def test_functions_of_the_package_round_trip(self):
        for fn in (base_layer.PathSeed, tpu.AssignToLogicalDevice):
            with self.subTest(fn=repr(fn)):
                self.assertIs(_RoundTrip(fn), fn)

    def test_classes_and_functions_outside_the_package_are_written_but_not_read(self):
        for value, text in ((ModuleLevelClass, f'type/{__name__}/ModuleLevelClass'),
                            (ModuleLevelClass.Inner, f'type/{__name__}/ModuleLevelClass.Inner'),
                            (ModuleLevelFunction, f'callable/{__name__}/ModuleLevelFunction'),
                            (int, 'type/builtins/int'), (math.sqrt, 'callable/math/sqrt'),
                            (tf.nn.relu, f'callable/{tf.nn.relu.__module__}/relu')):
            with self.subTest(value=repr(value)):
                written = _Params(v=value).ToText()
                self.assertEqual(written, f'v : {text}\n')
                with self.assertRaisesRegex(ValueError, f'{text} is not allowed'):
                    _Params(v=None).FromText(written)

    def test_class_text_form_names_module_and_class(self):
        self.assertEqual(_Params(cls=basic.DenseLayer).ToText(),
                         'cls : type/gpipe_tf.layers.basic/DenseLayer\n')

    def test_lambdas_and_local_definitions_have_no_text_form(self):
        class Local:
            pass

        for value in (lambda x: x, Local):
            with self.subTest(value=repr(value)):
                with self.assertRaisesRegex(TypeError, 'no text form'):
                    _Params(v=value).ToText()

    def test_params_inside_tuples_or_dicts_have_no_text_form(self):
        for value in ((_Params(x=1),), {'p': _Params(x=1)}):
            with self.subTest(value=repr(value)):
                with self.assertRaisesRegex(TypeError, 'no text form'):
                    _Params(v=value).ToText()

    def test_unsupported_values_have_no_text_form(self):
        for value in (np.int64(3), b'bytes', {1, 2}, object()):
            with self.subTest(value=repr(value)):
                with self.assertRaisesRegex(TypeError, 'no text form'):
                    _Params(v=value).ToText()

    def test_nested_params_round_trip_into_same_structure(self):
        p = _Params(a=1, child=_Params(b='x', grandchild=_Params(c=[1.5])))
        q = _Params(a=0, child=_Params(b='', grandchild=_Params(c=[])))
        q.FromText(p.ToText())
        self.assertEqual(q, p)

    def test_nested_params_are_flattened_to_dotted_names(self):
        p = _Params(child=_Params(x=1), layers=[_Params(y=2), 3])
        self.assertEqual(p.ToText(), 'child.x : 1\nlayers[0].y : 2\nlayers[1] : 3\n')

    def test_layer_params_with_sub_layers_round_trip_into_fresh_params(self):
        p = _MlpParams()
        q = sequential.SequentialLayer.Params().FromText(p.ToText())
        self.assertEqual(q, p)
        self.assertEqual(q.ToText(), p.ToText())
        self.assertIsInstance(q.sub[2].params_init, base_layer.WeightInit)

    def test_nested_sequential_params_round_trip_into_fresh_params(self):
        inner = sequential.SequentialLayer.Params().Set(name='inner', sub=[_DenseParams('d', 2, 2)])
        p = sequential.SequentialLayer.Params().Set(name='outer',
                                                    sub=[inner, _DenseParams('e', 2, 3)])
        q = sequential.SequentialLayer.Params().FromText(p.ToText())
        self.assertEqual(q, p)

    def test_instantiable_params_in_a_none_field_are_created_from_text(self):
        p = _Params(layer=_DenseParams('d', 2, 3))
        q = _Params(layer=None).FromText(p.ToText())
        self.assertEqual(q, p)

    def test_round_tripped_layer_params_instantiate(self):
        p = _MlpParams().Set(repeat=1)
        p.sub[2].dtype = tf.float32
        layer = sequential.SequentialLayer.Params().FromText(p.ToText()).Instantiate()
        self.assertEqual(layer(tf.ones([3, 4])).shape, [3, 2])

    def test_empty_list_of_params_round_trips(self):
        p = sequential.SequentialLayer.Params().Set(name='empty')
        q = sequential.SequentialLayer.Params().Set(sub=[_DenseParams('d', 1, 1)])
        q.FromText(p.ToText())
        self.assertEqual(q.sub, [])

    def test_to_text_lines_are_sorted_name_colon_value(self):
        p = _Params(zeta=1, alpha='a', mid=_Params(x=None))
        self.assertEqual(p.ToText(), "alpha : 'a'\nmid.x : None\nzeta : 1\n")

    def test_from_text_skips_blank_lines_and_comments_and_returns_self(self):
        p = _Params(x=0, y=0)
        self.assertIs(p.FromText('\n# a comment\n  x : 1\n\ny : -2\n'), p)
        self.assertEqual((p.x, p.y), (1, -2))


@pytest.mark.unit
class FromTextErrorTest(tf.test.TestCase):

    def test_the_separator_may_go_without_spaces(self):
        p = _Params(x=0, y='', z=None).FromText('x:1\ny: "a : b"\nz :None')
        self.assertEqual((p.x, p.y, p.z), (1, 'a : b', None))

    def test_line_without_separator_names_its_line(self):
        with self.assertRaisesRegex(ValueError, 'Line 2: expected "name : value"'):
            _Params(x=0, y=0).FromText('x : 1\ny = 2\n')

    def test_unparsable_value_names_its_line(self):
        with self.assertRaisesRegex(ValueError, r"Line 3 .*cannot parse value '\[1, 2'"):
            _Params(x=0, y=0).FromText('x : 1\n\ny : [1, 2\n')

    def test_unknown_name_names_its_line_and_closest_name(self):
        with self.assertRaisesRegex(ValueError, "Line 1 .*'num_layer'.*'num_layers'"):
            _Params(num_layers=0).FromText('num_layer : 3')

    def test_malformed_name_names_its_line(self):
        with self.assertRaisesRegex(ValueError, "Line 1 .*malformed name 'X.y'"):
            _Params(x=0).FromText('X.y : 3')

    def test_index_past_the_list_names_its_line(self):
        with self.assertRaisesRegex(ValueError, 'Line 1 .*index 2 out of range'):
            _Params(xs=[0]).FromText('xs[2] : 5')

    def test_unknown_class_names_its_line(self):
        with self.assertRaisesRegex(ValueError, 'Line 1 .*gpipe_tf.layers.basic has no '
                                    'NoSuchLayer'):
            _Params(cls=None).FromText('cls : type/gpipe_tf.layers.basic/NoSuchLayer')

    def test_an_unquoted_string_is_named(self):
        with self.assertRaisesRegex(ValueError, "Line 1 .*cannot parse value 'never': a string "
                                                'is quoted, as in "never"'):
            _Params(mode='always').FromText('mode : never')

    def test_arbitrary_expressions_are_not_evaluated(self):
        for text in ("__import__('os')", '1 + 2', 'x.y', 'print'):
            with self.subTest(text=text):
                with self.assertRaisesRegex(ValueError, 'cannot parse value'):
                    hyperparams.ParseValue(text)


def _PlantModule(directory: str, marker: str) -> str:
    """Writes a module into `directory` that creates the file `marker` when imported; returns
    its name (unique, so no earlier import can stand in for it)."""
    name = f'planted_{uuid.uuid4().hex}'
    with open(os.path.join(directory, name + '.py'), 'w') as f:
        f.write(f'open({marker!r}, "w").close()\nclass X:\n    pass\ndef f():\n    pass\n')
    importlib.invalidate_caches()
    return name


@pytest.mark.unit
class TextNamesOnlyThePackageTest(tf.test.TestCase):
    """`type/` and `callable/` values resolve to the gpipe_tf package's own classes and
    functions; nothing else is imported, let alone run."""

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)
        self.marker = os.path.join(self.dir, 'imported')

    def assertRefused(self, text, pattern):
        with self.assertRaisesRegex(ValueError, pattern):
            hyperparams.ParseValue(text)

    def test_modules_outside_the_package_are_refused_naming_the_value_and_what_is_allowed(self):
        for text in ('type/this/X', 'callable/os/system', 'type/subprocess/Popen',
                     'callable/builtins/eval', 'type/gpipe_tf_evil/X', 'type/gpipe_tfx.y/X',
                     'callable/tensorflow.python.ops.gen_nn_ops/relu', 'type/numpy/float32'):
            with self.subTest(text=text):
                self.assertRefused(text, f'^{text} is not allowed in Params text: only classes '
                                         'and functions of the gpipe_tf package can be named')

    def test_a_refused_module_is_not_imported(self):
        before = set(sys.modules)
        for text in ('type/this/X', 'type/antigravity/X', 'callable/turtle/done'):
            with self.subTest(text=text):
                self.assertRefused(text, 'not allowed')
        self.assertEqual(set(sys.modules) - before, set())

    def test_a_module_planted_on_the_path_is_not_imported(self):
        name = _PlantModule(self.dir, self.marker)
        sys.path.insert(0, self.dir)
        self.addCleanup(sys.path.remove, self.dir)
        for text in (f'type/{name}/X', f'callable/{name}/f'):
            with self.subTest(text=text):
                self.assertRefused(text, 'not allowed')
        self.assertFalse(os.path.exists(self.marker))
        self.assertNotIn(name, sys.modules)

    def test_a_module_of_the_package_name_outside_its_directory_is_not_imported(self):
        # As if the package's search path reached another directory: what would be found there
        # under gpipe_tf's name is refused before it runs.
        name = _PlantModule(self.dir, self.marker)
        with mock.patch.object(gpipe_tf, '__path__', list(gpipe_tf.__path__) + [self.dir]):
            self.assertRefused(f'type/gpipe_tf.{name}/X',
                               f'module gpipe_tf.{name} is at .*outside the installed gpipe_tf '
                               'package')
        self.assertFalse(os.path.exists(self.marker))
        self.assertNotIn(f'gpipe_tf.{name}', sys.modules)

    def test_names_imported_into_package_modules_are_refused(self):
        for text in ('callable/gpipe_tf.hyperparams/importlib.import_module',
                     'callable/gpipe_tf.hyperparams/os.system',
                     'type/gpipe_tf.hyperparams/tf.DType',
                     'type/gpipe_tf.layers/basic.DenseLayer',
                     'callable/gpipe_tf.hyperparams/Params.__init__',
                     'type/gpipe_tf.hyperparams/Params.__class__'):
            with self.subTest(text=text):
                self.assertRefused(text, 'not allowed')

    def test_missing_modules_and_names_and_wrong_kinds_are_errors(self):
        self.assertRefused('type/gpipe_tf.no_such_module/X',
                           'there is no module gpipe_tf.no_such_module in the gpipe_tf package')
        self.assertRefused('type/gpipe_tf.layers.basic/NoSuchLayer',
                           'gpipe_tf.layers.basic has no NoSuchLayer')
        self.assertRefused('type/gpipe_tf.layers.base_layer/PathSeed', 'is not a class')
        self.assertRefused('callable/gpipe_tf.layers.basic/DenseLayer', 'is not a function')

    def test_from_text_names_the_line_and_the_field(self):
        with self.assertRaisesRegex(
                ValueError, r"^Line 2 \('model.cls : type/subprocess/Popen'\): "
                r'type/subprocess/Popen is not allowed'):
            _Params(x=0, model=_Params(cls=None)).FromText(
                'x : 1\nmodel.cls : type/subprocess/Popen\n')


@pytest.mark.unit
class CheckTest(tf.test.TestCase):
    """Checks declared with Define hold for every value a param takes."""

    def test_integer(self):
        check = hyperparams.Integer(at_least=1)
        self.assertEqual(check.expected, 'a positive integer')
        for value in (1, 7, 2**40, np.int64(3)):
            self.assertTrue(check.Accepts(value), value)
        for value in (0, -1, 1.0, 2.5, True, None, '3', math.nan):
            self.assertFalse(check.Accepts(value), value)
        self.assertEqual(hyperparams.Integer(at_least=0).expected, 'an integer >= 0')
        self.assertTrue(hyperparams.Integer(at_least=0).Accepts(0))

    def test_number(self):
        check = hyperparams.Number(greater_than=0)
        self.assertEqual(check.expected, 'a finite number > 0')
        for value in (1e-30, 0.5, 3, 1e300, np.float32(0.1)):
            self.assertTrue(check.Accepts(value), value)
        for value in (0, 0.0, -1e-8, math.nan, math.inf, float('1e309'), True, None, '1'):
            self.assertFalse(check.Accepts(value), value)
        fraction = hyperparams.Number(at_least=0, less_than=1)
        self.assertEqual(fraction.expected, 'a finite number >= 0 and < 1')
        self.assertEqual([fraction.Accepts(v) for v in (0, 0.999, 1, -0.1)],
                         [True, True, False, False])
        self.assertTrue(hyperparams.Number().Accepts(-5.0))
        self.assertFalse(hyperparams.Number().Accepts(-math.inf))

    def test_or_none(self):
        check = hyperparams.OrNone(hyperparams.Integer(at_least=1))
        self.assertEqual(check.expected, 'None or a positive integer')
        self.assertTrue(check.Accepts(None))
        self.assertTrue(check.Accepts(4))
        self.assertFalse(check.Accepts(0))

    def test_one_of(self):
        check = hyperparams.OneOf(True, False, 'auto')
        self.assertEqual(check.expected, "one of (True, False, 'auto')")
        for value in (True, False, 'auto'):
            self.assertTrue(check.Accepts(value), value)
        for value in (1, 0, 1.0, 'True', 'Auto', None):
            self.assertFalse(check.Accepts(value), value)
        self.assertTrue(hyperparams.OneOf(1, 2).Accepts(2))
        self.assertFalse(hyperparams.OneOf(1, 2).Accepts(True))

    def test_check_of(self):
        p = self._Checked()
        self.assertEqual(p.CheckOf('child.steps').expected, 'a positive integer')
        self.assertIsNone(p.CheckOf('child.free'))

    def _Checked(self):
        p = hyperparams.Params()
        p.Define('steps', 10, 'Steps.', check=hyperparams.Integer(at_least=1))
        p.Define('free', 0, 'Unchecked.')
        return _Params(child=p)

    def test_the_default_is_checked(self):
        with self.assertRaisesRegex(ValueError, 'The default of steps must be a positive integer, '
                                    'got 0'):
            hyperparams.Params().Define('steps', 0, '', check=hyperparams.Integer(at_least=1))

    def test_assignment_is_checked_and_keeps_the_old_value(self):
        p = self._Checked()
        with self.assertRaisesRegex(ValueError, '^steps must be a positive integer, got 0.$'):
            p.child.steps = 0
        self.assertEqual(p.child.steps, 10)
        p.child.steps = 3
        p.child.free = -3
        self.assertEqual((p.child.steps, p.child.free), (3, -3))

    def test_set_names_the_dotted_name(self):
        with self.assertRaisesRegex(ValueError, '^child.steps must be a positive integer, got -2'):
            self._Checked().Set(**{'child.steps': -2})

    def test_from_text_names_the_line_and_dotted_name(self):
        with self.assertRaisesRegex(ValueError, r"^Line 1 \('child.steps : 0'\): child.steps "
                                    'must be a positive integer, got 0.$'):
            self._Checked().FromText('child.steps : 0')

    def test_copies_keep_the_check(self):
        q = self._Checked().Copy()
        with self.assertRaisesRegex(ValueError, 'steps must be a positive integer'):
            q.child.steps = 0


class TrainingParamsAreCheckedTest(tf.test.TestCase):
    """Values that are surely mistakes are refused when set, naming the field."""

    def _Task(self):
        from gpipe_tf import model_registry  # pylint: disable=g-import-not-at-top
        return model_registry.GetParams('examples.PipelinedMLP', 'Train')

    def test_bad_values_are_refused_by_from_text(self):
        for line, message in (
                ('train.save_interval_steps : 0',
                 'train.save_interval_steps must be a positive integer, got 0.'),
                ('train.summary_interval_steps : -5', 'train.summary_interval_steps must be'),
                ('train.learning_rate : nan', 'train.learning_rate must be a finite number > 0, '
                                              'got nan.'),
                ('train.learning_rate : 1e309', 'train.learning_rate must be a finite number > 0, '
                                                'got inf.'),
                ('train.learning_rate : 0.0', 'train.learning_rate must be'),
                ('train.max_steps : -1', 'train.max_steps must be an integer >= 0'),
                ('train.max_steps : 10.5', 'train.max_steps must be an integer >= 0'),
                ('train.save_max_to_keep : 0', 'train.save_max_to_keep must be'),
                ('train.eval_interval_steps : -1', 'train.eval_interval_steps must be None or'),
                ('train.clip_gradient_norm_to_value : -1.0',
                 'train.clip_gradient_norm_to_value must be'),
                ('train.weight_decay : inf', 'train.weight_decay must be'),
                ('train.progress_interval_seconds : -1.0',
                 'train.progress_interval_seconds must be'),
                ('train.optimizer.beta2 : 1.0', 'train.optimizer.beta2 must be a finite number '
                                                '>= 0 and < 1'),
                ('train.optimizer.epsilon : 0.0', 'train.optimizer.epsilon must be'),
                ('train.lr_schedule.warmup_steps : -1', 'train.lr_schedule.warmup_steps must be'),
                ('input.batch_size : 0', 'input.batch_size must be a positive integer'),
                ('input.num_examples : 0', 'input.num_examples must be None or a positive'),
                ('model.num_cells : 0', 'model.num_cells must be a positive integer'),
                ('model.num_micro_batches : 0', 'model.num_micro_batches must be None or a '
                                                'positive integer'),
                ('model.micro_batch_size : -4', 'model.micro_batch_size must be None or'),
                ('model.num_replicas : 0', 'model.num_replicas must be a positive integer')):
            with self.subTest(line=line):
                with self.assertRaisesRegex(ValueError, f'Line 1 .*: {re.escape(message)}'):
                    self._Task().FromText(line)

    def test_values_that_mean_something_are_accepted(self):
        p = self._Task().FromText(
            'train.eval_interval_steps : None\ntrain.max_steps : 0\n'
            'train.clip_gradient_norm_to_value : 0.0\ntrain.progress_interval_seconds : 0.0\n'
            'model.num_micro_batches : None\nmodel.micro_batch_size : 4\n')
        self.assertIsNone(p.train.eval_interval_steps)
        self.assertEqual(p.model.micro_batch_size, 4)

    def test_every_registered_models_params_pass_their_checks_and_round_trip(self):
        from gpipe_tf import model_registry  # pylint: disable=g-import-not-at-top
        for name in model_registry.ListModels():
            with self.subTest(name=name):
                p = model_registry.GetParams(name, 'Train')
                self.assertEqual(model_registry.GetParams(name, 'Train').FromText(p.ToText()), p)


@pytest.mark.unit
class TextDiffTest(tf.test.TestCase):

    def test_equal_params_have_empty_diff(self):
        self.assertEqual(_MlpParams().TextDiff(_MlpParams()), '')

    def test_diff_lists_ours_then_theirs_for_changed_and_one_sided_lines(self):
        p = _Params(a=1, b='x', only_ours=0)
        q = _Params(a=2, b='x', only_theirs=None)
        self.assertEqual(p.TextDiff(q), '- a : 1\n+ a : 2\n- only_ours : 0\n+ only_theirs : None\n')

    def test_diff_reaches_into_sub_layers(self):
        p, q = _MlpParams(), _MlpParams()
        q.sub[0].output_dim = 16
        self.assertEqual(p.TextDiff(q), '- sub[0].output_dim : 8\n+ sub[0].output_dim : 16\n')


@pytest.mark.unit
class InstantiableParamsTest(tf.test.TestCase):

    def test_instantiate_calls_cls_with_params_and_kwargs(self):
        p = hyperparams.InstantiableParams(Recorder)
        obj = p.Instantiate(extra=3)
        self.assertIsInstance(obj, Recorder)
        self.assertIs(obj.params, p)
        self.assertEqual(obj.kwargs, {'extra': 3})

    def test_instantiate_without_cls_raises(self):
        with self.assertRaisesRegex(ValueError, 'cls is None'):
            hyperparams.InstantiableParams().Instantiate()

    def test_layer_params_instantiate_the_layer(self):
        layer = _DenseParams('dense', 2, 3).Instantiate()
        self.assertIsInstance(layer, basic.DenseLayer)
        self.assertEqual(layer.p.output_dim, 3)


if __name__ == '__main__':
    tf.test.main()
