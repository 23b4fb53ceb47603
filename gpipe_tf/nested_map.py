"""NestedMap: a dict with attribute access, flattened and packed through `tf.nest`."""

from __future__ import annotations

import re
from typing import Any, Callable

import tensorflow as tf

_KEY_RE = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*$')


class NestedMap(dict):
    """A dict whose string keys are also attributes: `m.x` is `m['x']`.

    Values may be tensors, shapes, other NestedMaps, lists or tuples. Because it is a dict, `tf.nest`
    (and so tf.function, tf.custom_gradient and tf.data) flattens it in sorted-key order and packs it
    back into a NestedMap.
    """


    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for key in self:
            self._CheckKey(key)

    @classmethod
    def _CheckKey(cls, key) -> None:
        if not isinstance(key, str) or not _KEY_RE.match(key) or key in cls._RESERVED:
            raise ValueError(
                f'NestedMap key {key!r} is invalid: expected an identifier that is not a dict '
                f'attribute name.')

    def __setitem__(self, key, value):
        self._CheckKey(key)
        super().__setitem__(key, value)

    # dict's C implementations of these bypass __setitem__, so they check keys themselves.
    def update(self, *args, **kwargs) -> None:
        other = dict(*args, **kwargs)
        for key in other:
            self._CheckKey(key)
        super().update(other)

    def setdefault(self, key, default=None):
        self._CheckKey(key)
        return super().setdefault(key, default)

    def __ior__(self, other) -> 'NestedMap':
        self.update(other)
        return self

    def copy(self) -> 'NestedMap':
        """A shallow copy that is still a NestedMap (dict.copy() returns a plain dict)."""
        return type(self)(self)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f'NestedMap has no key {name!r}; keys: {sorted(self)}.') from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise AttributeError(name) from None

    def Copy(self) -> 'NestedMap':
        """A copy whose nested NestedMaps are copied too (leaves are shared)."""
        return self.Transform(lambda x: x)

    def Flatten(self) -> list:
        """The leaves, in `tf.nest` order (sorted keys, depth first)."""
        return tf.nest.flatten(self)

    def FlattenItems(self) -> list[tuple[str, Any]]:
        """(dotted path, leaf) pairs in Flatten() order; list items appear as `name.<i>`."""
        items = []

        def Visit(prefix, value):
            if isinstance(value, dict):
                for key in sorted(value):
                    Visit(f'{prefix}.{key}' if prefix else key, value[key])
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    Visit(f'{prefix}.{i}', item)
            else:
                items.append((prefix, value))

        Visit('', self)
        return items

    def Pack(self, leaves: list) -> 'NestedMap':
        """A NestedMap of this structure holding `leaves` (in Flatten() order)."""
        return tf.nest.pack_sequence_as(self, list(leaves))

    def Transform(self, fn: Callable[[Any], Any]) -> 'NestedMap':
        """A NestedMap of this structure with `fn` applied to every leaf."""
        return tf.nest.map_structure(fn, self)

    def IsCompatible(self, other) -> bool:
        """Whether `other` has the same structure (keys and nesting)."""
        try:
            tf.nest.assert_same_structure(self, other)
        except (ValueError, TypeError):
            return False
        return True

    def DebugString(self) -> str:
        return '\n'.join(f'{k}: {v}' for k, v in self.FlattenItems())


# Keys that would be hidden behind dict or NestedMap attributes.
NestedMap._RESERVED = frozenset(dir(NestedMap)) | {'_RESERVED'}
