"""Registry keys read without importing the params modules (nor TensorFlow): what lets the
command line answer a model name that is none at once; and the message for one.

`model_registry` owns the registry; a key is the registering class's module path below the
params package and its name (`model_registry.RegistryKey`).
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os

PARAMS_PACKAGE = 'gpipe_tf.params'


def UnknownModel(name: str, keys) -> str:
    """The message for a model `name` that is none of the registry `keys`: the closest keys."""
    by_lower = {key.lower(): key for key in keys}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.5)
    closest = ', '.join(repr(by_lower[c]) for c in close) if close else 'none'
    return (f'Unknown model {name!r}; closest registered models: {closest} '
            f'({len(by_lower)} registered, see ListModels()).')


def DeclaredKeys(package: str = PARAMS_PACKAGE) -> set[str]:
    """The keys of the classes that `package`'s modules register with the decorator
    (`@model_registry.RegisterSingleTaskModel`), read from their source without importing
    them, so without TensorFlow: what lets the command line answer an unknown model name at
    once. A module registering otherwise is not seen: `GetClass` has the last word."""
    spec = importlib.util.find_spec(package)
    keys = set()
    for root in (spec.submodule_search_locations or []) if spec else []:
        for directory, _, files in os.walk(root):
            for file_name in sorted(files):
                if not file_name.endswith('.py') or file_name == '__init__.py':
                    continue
                path = os.path.join(directory, file_name)
                module = os.path.relpath(path, root)[:-len('.py')].replace(os.sep, '.')
                with open(path, encoding='utf-8') as f:
                    tree = ast.parse(f.read(), path)
                keys.update(f'{module}.{node.name}' for node in ast.walk(tree)
                            if isinstance(node, ast.ClassDef) and any(
                                _Names(d, 'RegisterSingleTaskModel') for d in node.decorator_list))
    return keys


def _Names(node, name: str) -> bool:
    """Whether the expression `node` is `name` or an attribute `<...>.name`."""
    return (isinstance(node, ast.Name) and node.id == name) or (
        isinstance(node, ast.Attribute) and node.attr == name)
