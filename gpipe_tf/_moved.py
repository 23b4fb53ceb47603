"""Old module paths of modules that moved: each old path is the new module itself, after a
DeprecationWarning. They keep users' imports and Params text written before the move working
for one release (0.2 removes them)."""

import importlib
import sys
import warnings


def Alias(old: str, new: str) -> None:
    """Makes module `old` (being imported now) the module `new`."""
    warnings.warn(f'{old} moved to {new}; the old path goes away in gpipe_tf 0.2.',
                  DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
