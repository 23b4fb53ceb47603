"""Old module paths of modules that moved: each old path is the new module itself, after a
DeprecationWarning. They keep users' imports (`import gpipe_tf.layers.pipeline`, `from
gpipe_tf.layers import pipeline`) and Params text written before the move working for one
release (0.2 removes them).

`MOVED` is the one table of them. No file is left at an old path: `Install` (called by
`gpipe_tf/__init__.py`, so before any import below the package) puts a finder on
`sys.meta_path` that Python asks for a module no other finder has; for an old path it loads the
new module in its place. Python's import system has no alias of its own, hence this finder.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

# Old module path -> the module it moved to.
MOVED = {
    'gpipe_tf.layers.amoebanet': 'gpipe_tf.models.amoebanet.network',
    'gpipe_tf.layers.amoebanet_ops': 'gpipe_tf.models.amoebanet.ops',
    'gpipe_tf.layers.microbatch': 'gpipe_tf.pipeline.microbatch',
    'gpipe_tf.layers.partition': 'gpipe_tf.pipeline.partition',
    'gpipe_tf.layers.pipeline': 'gpipe_tf.pipeline.pipelining_layer',
    'gpipe_tf.layers.recompute': 'gpipe_tf.pipeline.cell',
    'gpipe_tf.layers.schedule': 'gpipe_tf.pipeline.schedule',
    'gpipe_tf.layers.transformer_model': 'gpipe_tf.models.transformer.network',
    'gpipe_tf.layers.unrolled': 'gpipe_tf.pipeline.unrolled',
    'gpipe_tf.train.devices': 'gpipe_tf.pipeline.devices',
}


def Message(old: str) -> str:
    """The DeprecationWarning of importing `old`."""
    return f'{old} moved to {MOVED[old]}; the old path goes away in gpipe_tf 0.2.'


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of `MOVED` and loads each as its new module."""

    def find_spec(self, fullname, path=None, target=None):
        del path, target  # An old path names its module whatever the parent's path.
        new = MOVED.get(fullname)
        if new is None:
            return None
        found = importlib.util.find_spec(new)
        # The new module's file is what runs: Params text (`hyperparams`) resolves only names
        # whose module lies inside the installed package.
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=found.origin)
        spec.has_location = found.has_location
        return spec

    def create_module(self, spec):
        return None  # Python's default module, which `exec_module` replaces.

    def exec_module(self, module):
        old = module.__name__
        # Attributed to the import statement (the import machinery's frames are skipped).
        warnings.warn(Message(old), DeprecationWarning, stacklevel=2)
        # The import system returns what sys.modules holds under the old name once this
        # returns (a module may replace itself), and binds it in the parent package.
        sys.modules[old] = importlib.import_module(MOVED[old])


def Install() -> None:
    """Puts the finder of old paths on sys.meta_path, once."""
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())
