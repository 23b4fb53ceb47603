"""The checking logic of test_layering.py: gpipe_tf's BUILD libraries and import statements,
read from the sources (nothing is imported), and the layering problems found in them. Not a test
module: pytest collects test_*.py only."""

import ast
import collections
import glob
import os
from typing import Iterable, NamedTuple

PACKAGE = 'gpipe_tf'


class Import(NamedTuple):
    """One gpipe_tf import statement: where it is, and the module it names."""
    path: str  # Relative to the root, e.g. 'gpipe_tf/pipeline/plan.py'.
    line: int
    importer: str  # Module, e.g. 'gpipe_tf.pipeline.plan'.
    imported: str  # Module, or the name as written (relative ones resolved) if no file has it.


class Tree(NamedTuple):
    """What the checks read: the BUILD files' libraries, the imports and the modules."""
    libraries: dict[str, dict]  # Label -> {'srcs': module names, 'deps': labels}.
    imports: list[Import]
    modules: list[str]


def ModuleName(path: str) -> str:
    """'gpipe_tf/pipeline/plan.py' -> 'gpipe_tf.pipeline.plan'; a package's __init__ -> it."""
    parts = path[:-len('.py')].split('/')
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def ReadLibraries(root: str, package: str = PACKAGE) -> dict[str, dict]:
    """The py_library targets of the BUILD files under root/package.

    Returns:
      label ('//gpipe_tf/pipeline:pipeline') -> {'srcs': module names, 'deps': labels}.
    """
    libraries = {}
    for directory, _, files in os.walk(os.path.join(root, package)):
        if 'BUILD' not in files:
            continue
        build_package = os.path.relpath(directory, root).replace(os.sep, '/')
        scope = _BuildScope(directory, build_package, libraries)
        path = os.path.join(directory, 'BUILD')
        with open(path) as f:
            # Starlark's BUILD subset is Python: run it with the rules recording what they declare.
            exec(compile(f.read(), path, 'exec'), scope)  # pylint: disable=exec-used
    return libraries


def _BuildScope(directory: str, build_package: str, libraries: dict) -> dict:
    """The Starlark functions a BUILD file calls: py_library records itself, the rest do nothing."""

    def Glob(include, exclude=(), allow_empty=True):
        del allow_empty
        found = set()
        for pattern in include:
            found.update(glob.glob(pattern, root_dir=directory, recursive=True))
        for pattern in exclude:
            found -= set(glob.glob(pattern, root_dir=directory, recursive=True))
        # Bazel's glob stops at a subpackage (a directory with its own BUILD file).
        return sorted(f for f in found if os.path.isfile(os.path.join(directory, f)) and not any(
            os.path.isfile(os.path.join(directory, f[:i], 'BUILD'))
            for i, c in enumerate(f) if c == '/'))

    def PyLibrary(name, srcs=(), deps=(), **kwargs):
        del kwargs
        libraries[f'//{build_package}:{name}'] = {
            'srcs': [ModuleName(f'{build_package}/{src}') for src in srcs if src.endswith('.py')],
            'deps': [Label(dep, build_package) for dep in deps],
        }

    def Ignored(*args, **kwargs):
        del args, kwargs

    scope = {name: Ignored for name in ('exports_files', 'filegroup', 'load', 'package',
                                        'py_binary', 'py_test', 'test_suite')}
    scope.update(glob=Glob, py_library=PyLibrary)
    return scope


def Label(label: str, build_package: str) -> str:
    """A dep as a full label: ':core' -> '//gpipe_tf:core' (in gpipe_tf/BUILD), and
    '//gpipe_tf/pipeline' -> '//gpipe_tf/pipeline:pipeline'."""
    if label.startswith(':'):
        return f'//{build_package}{label}'
    if label.startswith('//') and ':' not in label:
        return f'{label}:{label.rsplit("/", 1)[-1]}'
    return label


def ReadTree(root: str, package: str = PACKAGE) -> Tree:
    """The libraries of the BUILD files under root/package, and every import of its .py files."""
    paths = sorted(os.path.relpath(p, root).replace(os.sep, '/')
                   for p in glob.glob(os.path.join(root, package, '**', '*.py'), recursive=True))
    modules = [ModuleName(p) for p in paths]
    imports = []
    for path, importer in zip(paths, modules):
        with open(os.path.join(root, path)) as f:
            tree = ast.parse(f.read(), path)
        # `from . import x` starts at the importer's package: a package's own module is __init__.
        here = importer.split('.') if path.endswith('/__init__.py') else importer.split('.')[:-1]
        for node in ast.walk(tree):  # Every depth; docstring examples are strings, not nodes.
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = '.'.join(here[:len(here) + 1 - node.level] if node.level else [])
                base = '.'.join(filter(None, [base, node.module]))
                # `from gpipe_tf.pipeline import plan` imports the module plan if there is one.
                names = [f'{base}.{alias.name}' if f'{base}.{alias.name}' in modules else base
                         for alias in node.names]
            else:
                continue
            imports += [Import(path, node.lineno, importer, name) for name in names
                        if name == package or name.startswith(package + '.')]
    return Tree(ReadLibraries(root, package), sorted(imports), modules)


def Reachable(graph: dict[str, Iterable[str]], start: str) -> set[str]:
    """The nodes reachable from start by one edge or more."""
    seen, stack = set(), list(graph.get(start, ()))
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(graph.get(node, ()))
    return seen


def Cycles(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm), sorted."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def Visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph.get(node, ()):
            if successor not in index:
                Visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            Visit(node)
    return sorted(components)


def Owners(tree: Tree) -> dict[str, list[str]]:
    """Module -> the labels of the libraries whose srcs hold it."""
    owners = collections.defaultdict(list)
    for label, library in sorted(tree.libraries.items()):
        for module in library['srcs']:
            owners[module].append(label)
    return owners


def OwnershipProblems(tree: Tree) -> list[str]:
    """Modules in no library or in several."""
    owners = Owners(tree)
    return [f'{module}: in {len(owners[module])} libraries {owners[module]}, not one'
            for module in sorted(tree.modules) if len(owners[module]) != 1]


def UndeclaredImports(tree: Tree, allowed: Iterable[tuple[str, str]] = ()) -> list[str]:
    """Imports of no module, or of a module of another library that the importer's deps miss.

    Args:
      tree: what `ReadTree` read.
      allowed: (importer, imported) module pairs not to report.

    Returns:
      One line per import: 'path:line: importer -> imported (why)'.
    """
    owners = Owners(tree)
    deps = {label: library['deps'] for label, library in tree.libraries.items()}
    problems = []
    for i in tree.imports:
        where = f'{i.path}:{i.line}: {i.importer} -> {i.imported}'
        if i.imported not in tree.modules:
            problems.append(f'{where} (no such module)')
        elif len(owners[i.importer]) == 1 == len(owners[i.imported]):  # Else OwnershipProblems.
            [a], [b] = owners[i.importer], owners[i.imported]
            if a != b and b not in Reachable(deps, a) and (i.importer, i.imported) not in allowed:
                problems.append(f'{where} ({a} -> {b}, not in {a}\'s deps)')
    return problems


def ImportCycles(tree: Tree) -> list[str]:
    """Cycles of modules importing each other, each with its imports; and of libraries' deps."""
    # A module importing itself (launch.py, to run as a module when started as a script) is no
    # cycle.
    edges = [i for i in tree.imports if i.imported in tree.modules and i.imported != i.importer]
    graph = collections.defaultdict(set)
    for i in edges:
        graph[i.importer].add(i.imported)
    problems = []
    for cycle in Cycles(graph):
        problems.append('\n'.join([f'import cycle among {", ".join(cycle)}:'] + [
            f'    {i.path}:{i.line}: {i.importer} -> {i.imported}' for i in edges
            if i.importer in cycle and i.imported in cycle]))
    deps = {label: library['deps'] for label, library in tree.libraries.items()}
    return problems + [f'library cycle among {", ".join(cycle)}' for cycle in Cycles(deps)]
