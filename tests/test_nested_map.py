"""Tests of gpipe_tf.nested_map.NestedMap."""

import copy
import pickle

import pytest
import tensorflow as tf

from gpipe_tf.nested_map import NestedMap

pytestmark = pytest.mark.unit


def _Example() -> NestedMap:
    """Nested maps, a list holding a map, and a tuple; keys deliberately out of order."""
    return NestedMap(z=1, a=NestedMap(y=[2, NestedMap(q=3, p=4)], b=(5, 6)))


class AttributeAccessTest(tf.test.TestCase):

    def test_attribute_reads_the_item(self):
        m = NestedMap(x=1)
        self.assertEqual(m.x, 1)
        self.assertEqual(m.x, m['x'])

    def test_attribute_assignment_writes_the_item(self):
        m = NestedMap()
        m.x = 2
        self.assertEqual(m['x'], 2)
        self.assertEqual(dict(m), {'x': 2})

    def test_missing_attribute_raises_attribute_error_listing_keys(self):
        m = NestedMap(alpha=1, beta=2)
        with self.assertRaisesRegex(AttributeError, r"no key 'gamma'; keys: \['alpha', 'beta'\]"):
            _ = m.gamma
        self.assertFalse(hasattr(m, 'gamma'))

    def test_attribute_deletion_removes_the_item(self):
        m = NestedMap(x=1, y=2)
        del m.x
        self.assertEqual(dict(m), {'y': 2})
        with self.assertRaises(AttributeError):
            del m.x

    def test_nested_maps_chain_attribute_access(self):
        self.assertEqual(_Example().a.y[1].q, 3)


class InvalidKeyTest(tf.test.TestCase):

    RESERVED = ('keys', 'items', 'values', 'get', 'update', 'pop', 'copy', 'Flatten', 'Pack',
                'Transform', 'IsCompatible', '_RESERVED', '__class__')
    NON_IDENTIFIERS = ('1x', 'a-b', 'a.b', 'a b', '', 3, ('t',))

    def test_reserved_names_are_rejected(self):
        for key in self.RESERVED:
            with self.subTest(key=key):
                with self.assertRaisesRegex(ValueError, 'invalid'):
                    NestedMap()[key] = 1

    def test_non_identifier_keys_are_rejected(self):
        for key in self.NON_IDENTIFIERS:
            with self.subTest(key=key):
                with self.assertRaisesRegex(ValueError, 'invalid'):
                    NestedMap()[key] = 1

    def test_every_way_of_adding_a_key_checks_it(self):
        adders = {
                'constructor': lambda key: NestedMap({key: 1}),
                'attribute': lambda key: setattr(NestedMap(), key, 1),
                'update': lambda key: NestedMap().update({key: 1}),
                'setdefault': lambda key: NestedMap().setdefault(key, 1),
                'in_place_or': lambda key: NestedMap().__ior__({key: 1}),
        }
        for how, add in adders.items():
            for key in ('keys', 'a-b'):
                with self.subTest(how=how, key=key):
                    with self.assertRaisesRegex(ValueError, 'invalid'):
                        add(key)

    def test_valid_keys_are_accepted_by_every_way_of_adding(self):
        m = NestedMap({'a': 1}, b=2)
        m.update(c=3)
        m.setdefault('d', 4)
        m |= {'e': 5}
        self.assertEqual(dict(m), {'a': 1, 'b': 2, 'c': 3, 'd': 4, 'e': 5})


class CopyTest(tf.test.TestCase):

    def test_copy_method_returns_nested_map(self):
        m = NestedMap(x=1)
        self.assertIsInstance(m.copy(), NestedMap)
        self.assertEqual(m.copy().x, 1)

    def test_copy_duplicates_nested_maps_and_shares_leaves(self):
        leaf = tf.constant(1)
        m = NestedMap(inner=NestedMap(t=leaf))
        c = m.Copy()
        c.inner.t = tf.constant(2)
        self.assertIs(m.inner.t, leaf)
        self.assertIs(m.Copy().inner.t, leaf)

    def test_deepcopy_and_pickle_keep_the_type_at_every_level(self):
        for how, clone in (('deepcopy', copy.deepcopy(_Example())),
                           ('pickle', pickle.loads(pickle.dumps(_Example())))):
            with self.subTest(how=how):
                self.assertEqual(clone, _Example())
                self.assertIsInstance(clone, NestedMap)
                self.assertIsInstance(clone.a.y[1], NestedMap)


class FlattenPackTransformTest(tf.test.TestCase):

    def test_flatten_orders_leaves_by_sorted_key_depth_first(self):
        self.assertEqual(_Example().Flatten(), [5, 6, 2, 4, 3, 1])

    def test_flatten_items_gives_dotted_paths_with_list_indices(self):
        self.assertEqual(_Example().FlattenItems(),
                         [('a.b.0', 5), ('a.b.1', 6), ('a.y.0', 2), ('a.y.1.p', 4),
                          ('a.y.1.q', 3), ('z', 1)])

    def test_flatten_items_agrees_with_flatten(self):
        m = _Example()
        self.assertEqual([leaf for _, leaf in m.FlattenItems()], m.Flatten())

    def test_pack_of_flatten_restores_the_map(self):
        m = _Example()
        packed = m.Pack(m.Flatten())
        self.assertEqual(packed, m)
        self.assertIsInstance(packed, NestedMap)
        self.assertIsInstance(packed.a, NestedMap)
        self.assertIsInstance(packed.a.y[1], NestedMap)
        self.assertIsInstance(packed.a.b, tuple)

    def test_pack_places_new_leaves_by_position(self):
        m = _Example()
        packed = m.Pack([str(x) for x in m.Flatten()])
        self.assertEqual(packed.a.y[1].p, '4')
        self.assertEqual(packed.z, '1')

    def test_pack_with_wrong_number_of_leaves_raises(self):
        with self.assertRaises(ValueError):
            _Example().Pack([1, 2])

    def test_transform_applies_fn_to_every_leaf_keeping_structure(self):
        m = _Example()
        doubled = m.Transform(lambda x: 2 * x)
        self.assertEqual(doubled.Flatten(), [2 * x for x in m.Flatten()])
        self.assertTrue(doubled.IsCompatible(m))
        self.assertIsInstance(doubled.a.y[1], NestedMap)

    def test_transform_does_not_change_the_original(self):
        m = _Example()
        m.Transform(lambda x: 0)
        self.assertEqual(m, _Example())

    def test_debug_string_lists_paths_and_values(self):
        self.assertEqual(NestedMap(b=NestedMap(c=2), a=[1]).DebugString(), 'a.0: 1\nb.c: 2')


class IsCompatibleTest(tf.test.TestCase):

    def test_same_structure_with_different_leaves_is_compatible(self):
        m = _Example()
        self.assertTrue(m.IsCompatible(m.Transform(str)))

    def test_different_keys_are_incompatible(self):
        self.assertFalse(NestedMap(x=1).IsCompatible(NestedMap(y=1)))

    def test_different_list_lengths_are_incompatible(self):
        self.assertFalse(NestedMap(x=[1, 2]).IsCompatible(NestedMap(x=[1])))

    def test_leaf_versus_subtree_is_incompatible(self):
        self.assertFalse(NestedMap(x=1).IsCompatible(NestedMap(x=NestedMap(y=1))))


class TensorFlowTest(tf.test.TestCase):

    def test_tf_nest_map_structure_returns_nested_maps(self):
        out = tf.nest.map_structure(lambda x: x + 1, _Example())
        self.assertIsInstance(out, NestedMap)
        self.assertIsInstance(out.a.y[1], NestedMap)
        self.assertEqual(out.a.y[1].q, 4)

    def test_tf_function_receives_and_returns_nested_maps(self):
        seen = []

        @tf.function
        def Double(m):
            seen.append((type(m), type(m.a), type(m.a.y[1])))
            return m.Transform(lambda t: 2 * t)

        m = _Example().Transform(tf.constant)
        out = Double(m)
        self.assertEqual(seen, [(NestedMap, NestedMap, NestedMap)])
        self.assertIsInstance(out, NestedMap)
        self.assertIsInstance(out.a.y[1], NestedMap)
        self.assertTrue(out.IsCompatible(m))
        self.assertAllEqual(out.Flatten(), [10, 12, 4, 8, 6, 2])

    def test_tf_function_gradient_flows_through_nested_map(self):
        theta = NestedMap(w=tf.constant(3.0), inner=NestedMap(b=tf.constant(1.0)))

        @tf.function
        def Grads(theta):
            with tf.GradientTape() as tape:
                tape.watch(theta)
                loss = theta.w * theta.w + theta.inner.b
            return tape.gradient(loss, theta)

        grads = Grads(theta)
        self.assertIsInstance(grads, NestedMap)
        self.assertAllClose(grads.Flatten(), [1.0, 6.0])


if __name__ == '__main__':
    tf.test.main()
