"""Tests of gpipe_tf.hyperparams: Params, InstantiableParams and their text form."""

import math

import numpy as np
import tensorflow as tf

from gpipe_tf import hyperparams
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import sequential


class ModuleLevelClass:
    """A class the text form can name (`type/<this module>/ModuleLevelClass`)."""

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

    def test_copy_of_frozen_params_is_unfrozen(self):
        p = _Params(child=_Params(x=1)).Freeze()
        q = p.Copy()
        q.child.x = 2
        self.assertFalse(q.frozen)
        self.assertEqual(q.child.x, 2)


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


class TextRoundTripTest(tf.test.TestCase):

    def assertRoundTrips(self, value):
        result = _RoundTrip(value)
        self.assertEqual(result, value)
        self.assertIs(type(result), type(value))

    def test_ints_round_trip(self):
        for value in (0, 7, -3, 2**40):
            with self.subTest(value=value):
                self.assertRoundTrips(value)

    def test_floats_round_trip_exactly(self):
        for value in (0.0, 0.5, -0.5, 1e-8, -1e-8, 1e30, 0.1 + 0.2, math.inf, -math.inf):
            with self.subTest(value=value):
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
            with self.subTest(value=value):
                self.assertRoundTrips(value)

    def test_bools_and_none_round_trip(self):
        for value in (True, False, None):
            with self.subTest(value=value):
                self.assertRoundTrips(value)

    def test_containers_round_trip(self):
        for value in ([], [1, 'a', None], (), (1,), (1, 2.5), {}, {'a': 1, 2: [True, None]},
                      [[1, (2, 3)], {'k': {'n': -1e-8}}]):
            with self.subTest(value=value):
                self.assertRoundTrips(value)

    def test_dtypes_round_trip(self):
        for dtype in (tf.float32, tf.int32, tf.bfloat16, tf.float16, tf.bool, tf.string):
            with self.subTest(dtype=dtype):
                self.assertEqual(_RoundTrip(dtype), dtype)

    def test_dtypes_inside_containers_round_trip(self):
        self.assertEqual(_RoundTrip([tf.float32, (tf.int32,)]), [tf.float32, (tf.int32,)])

    def test_classes_round_trip(self):
        for cls in (int, ModuleLevelClass, ModuleLevelClass.Inner, basic.DenseLayer):
            with self.subTest(cls=cls):
                self.assertIs(_RoundTrip(cls), cls)

    def test_module_level_functions_round_trip(self):
        for fn in (ModuleLevelFunction, math.sqrt, tf.nn.relu, base_layer.PathSeed):
            with self.subTest(fn=fn):
                self.assertIs(_RoundTrip(fn), fn)

    def test_class_text_form_names_module_and_class(self):
        self.assertEqual(_Params(cls=basic.DenseLayer).ToText(),
                         'cls : type/gpipe_tf.layers.basic/DenseLayer\n')

    def test_lambdas_and_local_definitions_have_no_text_form(self):
        class Local:
            pass

        for value in (lambda x: x, Local):
            with self.subTest(value=value):
                with self.assertRaisesRegex(TypeError, 'no text form'):
                    _Params(v=value).ToText()

    def test_params_inside_tuples_or_dicts_have_no_text_form(self):
        for value in ((_Params(x=1),), {'p': _Params(x=1)}):
            with self.subTest(value=value):
                with self.assertRaisesRegex(TypeError, 'no text form'):
                    _Params(v=value).ToText()

    def test_unsupported_values_have_no_text_form(self):
        for value in (np.int64(3), b'bytes', {1, 2}, object()):
            with self.subTest(value=value):
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


class FromTextErrorTest(tf.test.TestCase):

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
        with self.assertRaisesRegex(ValueError, 'Line 1 '):
            _Params(cls=None).FromText('cls : type/gpipe_tf.layers.basic/NoSuchLayer')

    def test_arbitrary_expressions_are_not_evaluated(self):
        for text in ("__import__('os')", '1 + 2', 'x.y', 'print'):
            with self.subTest(text=text):
                with self.assertRaisesRegex(ValueError, 'cannot parse value'):
                    hyperparams.ParseValue(text)


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
