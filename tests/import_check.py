"""Imports every module of one gpipe_tf package directory from Bazel's runfiles, where only the
files of the library under test and of its declared deps exist: an import that fails names a
dependency its BUILD file leaves out (or an arrow back up the layering). Run by the
//tests:imports_* targets; not a pytest module (pytest sees every file)."""

import importlib
import os
import sys


def main(argv):
    if len(argv) != 2:
        print('usage: import_check.py <package directory, e.g. gpipe_tf/pipeline>',
              file=sys.stderr)
        return 2
    directory = argv[1]
    root = next((p for p in sys.path if os.path.isdir(os.path.join(p, directory))), None)
    if root is None:
        print(f'{directory}: not in the runfiles (sys.path: {sys.path})', file=sys.stderr)
        return 1
    modules = []
    for dirpath, _, files in os.walk(os.path.join(root, directory)):
        package = os.path.relpath(dirpath, root).replace(os.sep, '.')
        for name in sorted(files):
            if name.endswith('.py'):
                modules.append(package if name == '__init__.py' else f'{package}.{name[:-3]}')
    if not modules:
        print(f'{directory}: no module found under {root}', file=sys.stderr)
        return 1
    failed = 0
    for module in sorted(modules):
        try:
            importlib.import_module(module)
        except Exception as error:  # pylint: disable=broad-except
            print(f'FAIL {module}: {type(error).__name__}: {error}', file=sys.stderr)
            failed += 1
        else:
            print(f'ok   {module}')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
