"""Lingvo-style hyperparameters: `Params` and `InstantiableParams`.

A `Params` object is a typed-by-example record of named, documented values. Layers, models and
inputs are configured through them, never constructed ad hoc, so a Params dump is at once the
configuration and its documentation.

Text form (Lingvo's): one `dotted.name : value` per line. Values are written as Python literals
(`1`, `0.5`, `'abc'`, `True`, `None`, `[1, 2]`, `{'a': 1}`), TF dtypes by their name (`float32`),
classes as `type/module/Name` and module-level functions as `callable/module/name`. Params nested
in Params or in lists are flattened: `cell_tpl[0].name : 'dense'`.

Reading text never runs code that the text names: `type/`/`callable/` values resolve only to
classes and functions of the gpipe_tf package itself (see `_ResolveName`), and a value that a
param's `check` refuses is an error naming the param (`Integer`, `Number`, `OrNone`).
"""

from __future__ import annotations

import ast
import copy
import difflib
import importlib
import importlib.util
import inspect
import math
import numbers
import operator
import os
import re
import sys
from typing import Any, Callable, Iterator

import tensorflow as tf

_NAME_RE = re.compile(r'^[a-z_][a-z0-9_]*$')
# A flattened key: `a.b[2].c`.
_KEY_RE = re.compile(r'^[a-z_][a-z0-9_]*(\[\d+\])*(\.[a-z_][a-z0-9_]*(\[\d+\])*)*$')


class Check:
    """A condition a param's value must meet whenever it is set (see `Params.Define`).

    Args:
        predicate: value -> bool, True for an acceptable value.
        expected: the condition in words, completing "<name> must be ...": 'an integer >= 1'.
    """

    def __init__(self, predicate: Callable[[Any], bool], expected: str):
        self._predicate = predicate
        self.expected = expected

    def Accepts(self, value: Any) -> bool:
        return bool(self._predicate(value))

    def Enforce(self, name: str, value: Any) -> None:
        """Raises ValueError naming `name` unless `value` meets the condition."""
        if not self.Accepts(value):
            raise ValueError(f'{name} must be {self.expected}, got {value!r}.')

    def __repr__(self) -> str:
        return f'Check({self.expected!r})'


def Integer(at_least: int) -> Check:
    """An int (not a bool) >= `at_least`: a count, a number of steps."""
    return Check(lambda v: (isinstance(v, numbers.Integral) and not isinstance(v, bool) and
                            v >= at_least),
                 'a positive integer' if at_least == 1 else f'an integer >= {at_least}')


def Number(greater_than: float | None = None, at_least: float | None = None,
           less_than: float | None = None, at_most: float | None = None) -> Check:
    """A finite real number (not a bool) within the bounds given: a rate, a coefficient.

    `Number(greater_than=0)` is 'a finite number > 0'; `Number(at_least=0, less_than=1)`
    'a finite number >= 0 and < 1'. NaN and infinities never pass: they are never meant.
    """
    bounds = [(bound, word, test) for bound, word, test in (
        (greater_than, '>', operator.gt), (at_least, '>=', operator.ge),
        (less_than, '<', operator.lt), (at_most, '<=', operator.le)) if bound is not None]

    def Predicate(v) -> bool:
        return (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
                and all(test(v, bound) for bound, _, test in bounds))

    words = ' and '.join(f'{word} {bound!r}' for bound, word, _ in bounds)
    return Check(Predicate, 'a finite number' + (f' {words}' if words else ''))


def OneOf(*values) -> Check:
    """One of `values` (a bool only as itself: 1 is not True)."""
    def Predicate(v) -> bool:
        return any(v is x if isinstance(x, bool) or isinstance(v, bool) else v == x
                   for x in values)
    return Check(Predicate, f'one of ({", ".join(repr(x) for x in values)})')


def OrNone(check: Check) -> Check:
    """`check`, or None (a param whose None means "not set" or "derive it")."""
    return Check(lambda v: v is None or check.Accepts(v), f'None or {check.expected}')


class _Param:
    """One named value with its description and the check its values must pass."""

    __slots__ = ('name', 'value', 'description', 'check')

    def __init__(self, name: str, value: Any, description: str, check: Check | None = None):
        self.name = name
        self.value = value
        self.description = description
        self.check = check


def _ClosestNames(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.5)
    return ', '.join(repr(c) for c in close) if close else 'none'


class Params:
    """A set of named, documented hyperparameters.

    Example:
        p = Params()
        p.Define('num_micro_batches', 1, 'Number of micro-batches the mini-batch is split into.')
        p.num_micro_batches = 8
    """

    def __init__(self):
        object.__setattr__(self, '_params', {})
        object.__setattr__(self, '_frozen', False)

    # ---- definition and access -------------------------------------------------------------------
    def Define(self, name: str, default: Any, description: str,
               check: Check | None = None) -> None:
        """Defines a new parameter.

        Args:
            name: the param's name.
            default: its initial value (deep-copied).
            description: one line saying what it is.
            check: a condition every value of it must meet (`Integer(at_least=1)`,
                `Number(greater_than=0)`, ...), enforced on the default and whenever the value
                is set (assignment, `Set`, `FromText`), and kept by `Copy`.

        Raises:
            ValueError: if the name is malformed or the default fails `check`.
            AttributeError: if the name is already defined.
            TypeError: if these Params are frozen.
        """
        self._CheckNotFrozen(name)
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f'Param name {name!r} is malformed: expected ^[a-z_][a-z0-9_]*$.')
        if name in self._params:
            raise AttributeError(f'Param {name!r} is already defined.')
        if check is not None:
            check.Enforce(f'The default of {name}', default)
        self._params[name] = _Param(name, copy.deepcopy(default), description, check)

    def _CheckNotFrozen(self, name: str) -> None:
        if self._frozen:
            raise TypeError(f'Params are frozen; cannot set {name!r}. Copy() them to change values.')

    def _Lookup(self, name: str) -> _Param:
        try:
            return self._params[name]
        except KeyError:
            raise AttributeError(
                    f'Unknown param {name!r}; closest defined names: '
                    f'{_ClosestNames(name, self._params)}.') from None

    def __getattr__(self, name: str) -> Any:
        if name.startswith('__'):
            raise AttributeError(name)
        return self._Lookup(name).value

    def __setattr__(self, name: str, value: Any) -> None:
        self._SetValue(name, value, name)

    def _SetValue(self, name: str, value: Any, path: str) -> None:
        """Sets param `name` to `value`; `path` is its dotted name for messages."""
        self._CheckNotFrozen(name)
        param = self._Lookup(name)
        if param.check is not None:
            param.check.Enforce(path, value)
        param.value = value

    def __contains__(self, name: str) -> bool:
        return name in self._params

    def __dir__(self):
        return sorted(self._params)

    def Get(self, dotted_name: str) -> Any:
        """Returns the value at a dotted name (`a.b.c`)."""
        parent, leaf = self._Resolve(dotted_name)
        return parent._Lookup(leaf).value

    def CheckOf(self, dotted_name: str) -> Check | None:
        """The check of the param at a dotted name (None if it has none)."""
        parent, leaf = self._Resolve(dotted_name)
        return parent._Lookup(leaf).check

    def Describe(self, name: str) -> str:
        return self._Lookup(name).description

    def Set(self, **kwargs) -> 'Params':
        """Sets values; keys may be dotted (`p.Set(**{'a.b': 1})`). Returns self."""
        for dotted_name, value in kwargs.items():
            parent, leaf = self._Resolve(dotted_name)
            parent._SetValue(leaf, value, dotted_name)
        return self

    def _Resolve(self, dotted_name: str) -> tuple['Params', str]:
        parts = dotted_name.split('.')
        node = self
        for i, part in enumerate(parts[:-1]):
            node = node._Lookup(part).value
            if not isinstance(node, Params):
                raise AttributeError(
                        f'{".".join(parts[:i + 1])!r} is {type(node).__name__}, not Params; '
                        f'cannot resolve {dotted_name!r}.')
        return node, parts[-1]

    def IterParams(self) -> Iterator[tuple[str, Any]]:
        for name in sorted(self._params):
            yield name, self._params[name].value

    # ---- copy, freeze, compare -----------------------------------------------------------------
    def Copy(self) -> 'Params':
        """A deep, unfrozen copy."""
        return self._CopyInto(type(self).__new__(type(self)))

    def _CopyInto(self, other: 'Params') -> 'Params':
        object.__setattr__(other, '_params', {})
        object.__setattr__(other, '_frozen', False)
        for name, param in self._params.items():
            other._params[name] = _Param(name, _CopyValue(param.value), param.description,
                                         param.check)
        return other

    def Freeze(self) -> 'Params':
        """Makes these Params and all nested ones read-only. Returns self."""
        object.__setattr__(self, '_frozen', True)
        for _, value in self.IterParams():
            for nested in _NestedParams(value):
                nested.Freeze()
        return self

    @property
    def frozen(self) -> bool:
        return self._frozen

    def __eq__(self, other) -> bool:
        if not isinstance(other, Params) or set(self._params) != set(other._params):
            return False
        return all(_ValuesEqual(v, other._params[k].value) for k, v in self.IterParams())

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = None

    def __repr__(self) -> str:
        return f'{type(self).__name__}(\n{self.ToText()})'

    # ---- text form ----------------------------------------------------------------------------
    def ToText(self) -> str:
        """Lingvo's `dotted.name : value` text, one line per leaf value, sorted."""
        return ''.join(f'{key} : {text}\n' for key, text in self._Flatten())

    def _Flatten(self, prefix: str = '') -> list[tuple[str, str]]:
        lines = []
        for name, value in self.IterParams():
            key = prefix + name
            if isinstance(value, Params):
                lines.extend(value._Flatten(key + '.'))
            elif _IsParamsList(value):
                for i, item in enumerate(value):
                    if isinstance(item, Params):
                        lines.extend(item._Flatten(f'{key}[{i}].'))
                    else:
                        lines.append((f'{key}[{i}]', _ValueToText(item)))
                if not value:
                    lines.append((key, _ValueToText(value)))
            else:
                lines.append((key, _ValueToText(value)))
        return lines

    def FromText(self, text: str) -> 'Params':
        """Sets values from `ToText()` output onto these Params. Returns self.

        Raises:
            ValueError: naming the line number, for a malformed line, an unknown name or a value that
                cannot be parsed.
        """
        entries = []
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith('#'):
                continue
            # `name : value` as ToText writes it; `name: value` and `name:value` too (a name has
            # no colon, so the first one separates).
            key, colon, value_text = line.partition(':')
            if not colon or (not _KEY_RE.match(key.strip()) and ' : ' not in line):
                raise ValueError(f'Line {lineno}: expected "name : value", got {raw!r}.')
            entries.append((lineno, line, key.strip(), value_text.strip()))
        # `x.cls` lines go first, shallowest first: they create Params missing from lists or
        # None-valued fields, so text from a fuller config can fill a fresh one.
        cls_entries = sorted((e for e in entries if e[2].endswith('.cls')),
                             key=lambda e: e[2].count('.') + e[2].count('['))
        for create, batch in ((True, cls_entries), (False, entries)):
            for lineno, line, key, value_text in batch:
                try:
                    self._SetPath(key, ParseValue(value_text), create=create)
                except (ValueError, AttributeError, TypeError, IndexError, ImportError) as e:
                    raise ValueError(f'Line {lineno} ({line!r}): {e}') from None
        return self

    def _SetPath(self, key: str, value: Any, create: bool = False) -> None:
        """Sets the value at a flattened key; with `create`, a `....cls` key whose Params is
        missing (one past the end of a list, or a None field) creates `value.Params()`."""
        if not _KEY_RE.match(key):
            raise ValueError(f'malformed name {key!r}.')
        tokens = re.findall(r'\w+|\[\d+\]', key)
        node: Any = self
        for i, token in enumerate(tokens[:-1]):
            creating = create and i == len(tokens) - 2 and isinstance(value, type)
            if token.startswith('['):
                index = int(token[1:-1])
                if creating and isinstance(node, list) and index == len(node):
                    node.append(_NewParams(value))
                if not isinstance(node, list) or index >= len(node):
                    raise IndexError(f'{key!r}: index {index} out of range.')
                node = node[index]
            else:
                if not isinstance(node, Params):
                    raise AttributeError(f'{key!r}: {token!r} is not inside Params.')
                if creating and node._Lookup(token).value is None:
                    setattr(node, token, _NewParams(value))
                elif (create and isinstance(value, type) and tokens[i + 1].startswith('[') and
                      node._Lookup(token).value is None):
                    setattr(node, token, [])  # A None list field that the text fills.
                node = node._Lookup(token).value
        last = tokens[-1]
        if last.startswith('['):
            index = int(last[1:-1])
            if not isinstance(node, list) or index >= len(node):
                raise IndexError(f'{key!r}: index {index} out of range.')
            node[index] = value
        elif not isinstance(node, Params):
            raise AttributeError(f'{key!r}: {last!r} is not inside Params.')
        else:
            node._SetValue(last, value, key)

    def TextDiff(self, other: 'Params') -> str:
        """A unified-diff-like listing of lines that differ: `- ours` / `+ theirs`."""
        ours, theirs = dict(self._Flatten()), dict(other._Flatten())
        out = []
        for key in sorted(set(ours) | set(theirs)):
            if ours.get(key) != theirs.get(key):
                if key in ours:
                    out.append(f'- {key} : {ours[key]}')
                if key in theirs:
                    out.append(f'+ {key} : {theirs[key]}')
        return '\n'.join(out) + ('\n' if out else '')


class InstantiableParams(Params):
    """Params with a `cls` that `Instantiate()` constructs as `cls(params)`."""

    def __init__(self, cls: type | None = None):
        super().__init__()
        self.Define('cls', cls, 'The class these params instantiate.')

    def Instantiate(self, **kwargs):
        if self.cls is None:
            raise ValueError('Params.cls is None; nothing to instantiate.')
        return self.cls(self, **kwargs)


def _NewParams(cls: type) -> Params:
    """Default Params for `cls`: its own `Params()` when it has one."""
    if hasattr(cls, 'Params'):
        return cls.Params()
    return InstantiableParams(cls)


# ---- value helpers ----------------------------------------------------------------------------
def _IsParamsList(value) -> bool:
    return isinstance(value, list) and any(isinstance(v, Params) for v in value)


def _NestedParams(value) -> list[Params]:
    if isinstance(value, Params):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _NestedParams(item)]
    if isinstance(value, dict):
        return [v for item in value.values() for v in _NestedParams(item)]
    return []


def _CopyValue(value):
    if isinstance(value, Params):
        return value.Copy()
    if isinstance(value, tuple) and hasattr(value, '_fields'):  # A namedtuple: by position.
        return type(value)(*(_CopyValue(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_CopyValue(v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _CopyValue(v)) for k, v in value.items())
    if isinstance(value, (type, tf.DType)) or callable(value):
        return value
    return copy.deepcopy(value)


def _ValuesEqual(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
                _ValuesEqual(x, y) for x, y in zip(a, b))
    if type(a) is not type(b) and not (isinstance(a, tf.DType) and isinstance(b, tf.DType)):
        return False
    return a == b


def _ValueToText(value) -> str:
    if isinstance(value, tf.DType):
        return value.name
    # Any module-level class or function is written, so that a dump documents Params holding
    # one of the user's; reading back resolves only the gpipe_tf package's (`_ResolveName`).
    if isinstance(value, type):
        return f'type/{value.__module__}/{_ImportableName(value)}'
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        return f'callable/{value.__module__}/{_ImportableName(value)}'
    if isinstance(value, list):
        return '[' + ', '.join(_ValueToText(v) for v in value) + ']'
    if isinstance(value, tuple):
        inner = ', '.join(_ValueToText(v) for v in value)
        return '(' + inner + (',)' if len(value) == 1 else ')')
    if isinstance(value, dict):
        return '{' + ', '.join(
                f'{_ValueToText(k)}: {_ValueToText(v)}' for k, v in value.items()) + '}'
    # Subclasses (numpy.float64 is a float) are written as the base type: their own repr
    # (`np.float64(0.5)`) would not parse back.
    if value is None or isinstance(value, bool):
        return repr(value)
    for base in (int, float, str):
        if isinstance(value, base):
            return repr(base(value))
    if isinstance(value, Params):
        raise TypeError('Params inside a tuple or dict have no text form; use a list.')
    raise TypeError(f'Value {value!r} of type {type(value).__name__} has no text form.')


def _ImportableName(value) -> str:
    # Lambdas and local definitions (`f.<locals>.g`) cannot be imported back by name.
    if '<' in value.__qualname__:
        raise TypeError(f'{value.__qualname__} in {value.__module__} has no text form: only '
                        f'module-level classes and functions can be written.')
    return value.__qualname__


def ParseValue(text: str) -> Any:
    """Parses one value written by `ToText` (a safe subset of Python expressions)."""
    try:
        tree = ast.parse(text, mode='eval')
    except SyntaxError:
        raise ValueError(f'cannot parse value {text!r}.') from None
    return _Eval(tree.body, text)


def _DottedName(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _DottedName(node.value)
        return None if base is None else f'{base}.{node.attr}'
    return None


# The package whose classes and functions Params text may name.
_PACKAGE = 'gpipe_tf'
_PACKAGE_MODULE_RE = re.compile(rf'^{_PACKAGE}(\.[A-Za-z_][A-Za-z0-9_]*)*$')
_ATTRIBUTE_RE = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*$')


def _NotAllowed(value_text: str) -> ValueError:
    return ValueError(f'{value_text} is not allowed in Params text: only classes and functions '
                      f'of the {_PACKAGE} package can be named (type/{_PACKAGE}.<module>/<Class>, '
                      f'callable/{_PACKAGE}.<module>/<function>).')


def _PackageDir() -> str:
    return os.path.dirname(os.path.realpath(sys.modules[_PACKAGE].__file__))


def _InPackageDir(path: str | None) -> bool:
    if not path:
        return False
    root, path = _PackageDir(), os.path.realpath(path)
    return os.path.commonpath([root, path]) == root


# Modules of the package, by name, once checked to be its files and imported.
_PACKAGE_MODULES: dict[str, Any] = {}


def _PackageModule(module: str, value_text: str):
    """Module `module` of the gpipe_tf package, imported only after checking (before any of its
    code runs) that it and each package above it are files of the installed package: a module
    of that name planted elsewhere on sys.path (the working directory) is never imported."""
    if module in _PACKAGE_MODULES:
        return _PACKAGE_MODULES[module]
    parent, _, _ = module.rpartition('.')
    if parent:
        _PackageModule(parent, value_text)  # find_spec below imports the parent.
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ValueError(f'{value_text}: there is no module {module} in the {_PACKAGE} package.')
    locations = ([spec.origin] if spec.has_location else
                 list(spec.submodule_search_locations or []))
    if not locations or not all(_InPackageDir(p) for p in locations):
        raise ValueError(f'{value_text}: module {module} is at {locations or spec.origin}, '
                         f'outside the installed {_PACKAGE} package ({_PackageDir()}); it is not '
                         'imported.')
    try:
        _PACKAGE_MODULES[module] = importlib.import_module(module)
    except Exception as e:  # pylint: disable=broad-except
        # Text may name a module that cannot be imported here (gpipe_tf.trainer, which defines
        # flags, inside the trainer): the user's mistake, reported as one.
        raise ValueError(f'{value_text}: importing {module} failed: {type(e).__name__}: '
                         f'{e}') from None
    return _PACKAGE_MODULES[module]


def _ResolveName(kind: str, module: str, qualname: str) -> Any:
    """The class (`kind` 'type') or function ('callable') a `kind/module/qualname` value names.

    Only the gpipe_tf package's own classes and functions resolve: Params text is data, and
    importing a module it names would run that module's code (any installed module, or one
    planted in the working directory). No module outside the package is imported.

    Raises:
        ValueError: naming the value, for anything else.
    """
    value_text = f'{kind}/{module}/{qualname}'
    attributes = qualname.split('.')
    if (not _PACKAGE_MODULE_RE.match(module) or
            not all(_ATTRIBUTE_RE.match(a) and not a.startswith('__') for a in attributes)):
        raise _NotAllowed(value_text)
    obj = _PackageModule(module, value_text)
    for part in attributes:
        if inspect.ismodule(obj) and obj is not _PACKAGE_MODULES[module]:
            raise _NotAllowed(value_text)  # A module imported by ours: `gpipe_tf.x/os.system`.
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f'{value_text}: {module} has no {qualname}.') from None
    # The object itself must be defined in the package, not merely imported into one of its
    # modules (`gpipe_tf.hyperparams/importlib.import_module` would reach any module).
    defined_in = getattr(obj, '__module__', None)
    if not isinstance(defined_in, str) or not _PACKAGE_MODULE_RE.match(defined_in):
        raise _NotAllowed(value_text)
    try:
        _PackageModule(defined_in, value_text)
    except ValueError:
        raise _NotAllowed(value_text) from None
    if kind == 'type' and not isinstance(obj, type):
        raise ValueError(f'{value_text}: {module}.{qualname} is not a class.')
    if kind == 'callable' and (isinstance(obj, type) or not callable(obj)):
        raise ValueError(f'{value_text}: {module}.{qualname} is not a function.')
    return obj


def _Eval(node, text: str) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _Eval(node.operand, text)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.List):
        return [_Eval(e, text) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_Eval(e, text) for e in node.elts)
    if isinstance(node, ast.Dict):
        return {_Eval(k, text): _Eval(v, text) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Name):
        if node.id in ('inf', 'nan'):  # repr() of non-finite floats.
            return float(node.id)
        try:
            return tf.as_dtype(node.id)
        except TypeError:
            # A bare word is most often a string without its quotes (`recompute : never`).
            raise ValueError(f'cannot parse value {text!r}: a string is quoted, as in '
                             f'"{node.id}".') from None
    # `type/pkg.module/Name` parses as ((type / pkg.module) / Name).
    if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and
            isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.Div)):
        kind = _DottedName(node.left.left)
        module = _DottedName(node.left.right)
        qualname = _DottedName(node.right)
        if kind in ('type', 'callable') and module and qualname:
            return _ResolveName(kind, module, qualname)
    raise ValueError(f'cannot parse value {text!r}.')
