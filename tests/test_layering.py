"""The layering of gpipe_tf's BUILD files holds for every import statement in gpipe_tf/.

Reads sources only (no TensorFlow, no gpipe_tf module is imported), so it runs in well under a
second. Each `.py` file under gpipe_tf/ is parsed with `ast` and every gpipe_tf import it makes is
collected, at any depth: function-local ones, and ones under try, if or TYPE_CHECKING. Each module
is mapped to the one py_library of its BUILD file whose `srcs` hold it, and the tests check that
every module has a library, that every import of another library's module is allowed by the
importer's declared deps (transitively), and that neither the module graph nor the library graph
has a cycle.

How this differs from Bazel's //tests:imports_* (tests/import_check.py): those import each
library's modules in a sandbox that holds only the library and its declared deps, so they prove the
deps suffice for what runs at import time; an import inside a function that the import never calls
goes unseen there. This test runs no code: it reads every import statement, function-local ones
included, against the declared layering. Imports by name at run time (`importlib.import_module`,
as model_registry does for the params package and `_moved.py` for old module paths) are not import
statements; the BUILD files' comments say which libraries bring those.
"""

import os
import tempfile

from absl.testing import absltest
import pytest

from layering import ImportCycles
from layering import OwnershipProblems
from layering import ReadTree
from layering import UndeclaredImports

pytestmark = pytest.mark.unit

# Imports the layering allows although the deps do not: (importer module, imported module) ->
# why. None today; an entry needs its reason.
ALLOWED = {}


def WriteFiles(root: str, files: dict[str, str]):
    """Writes each text at its path under root."""
    for path, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
        with open(os.path.join(root, path), 'w') as f:
            f.write(text)


class LayeringTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.tree = ReadTree(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def assertNoProblems(self, problems):
        if problems:
            self.fail('\n' + '\n'.join(problems))

    def testTheBuildFilesAreRead(self):
        libraries = self.tree.libraries
        self.assertIn('gpipe_tf.pipeline.plan', libraries['//gpipe_tf/pipeline:pipeline']['srcs'])
        self.assertIn('//gpipe_tf:core', libraries['//gpipe_tf/pipeline:pipeline']['deps'])

    def testEveryModuleIsInOneLibrary(self):
        self.assertNoProblems(OwnershipProblems(self.tree))

    def testEveryImportIsAllowedByTheImportersDeps(self):
        self.assertNoProblems(UndeclaredImports(self.tree, ALLOWED))

    def testNoImportCycle(self):
        self.assertNoProblems(ImportCycles(self.tree))

    def testTheChecksFindAnOrphanAnArrowUpwardAMissingModuleAndCycles(self):
        root = self.enterContext(tempfile.TemporaryDirectory())
        WriteFiles(root, {
            'gpipe_tf/BUILD': 'py_library(name = "core", srcs = ["__init__.py"])',
            'gpipe_tf/__init__.py': '"""from gpipe_tf.top import b"""',  # A string: no import.
            'gpipe_tf/orphan.py': '',
            'gpipe_tf/low/BUILD':
                'py_library(name = "low", srcs = glob(["*.py"]), deps = ["//gpipe_tf:core"])',
            'gpipe_tf/low/__init__.py': '',
            'gpipe_tf/low/a.py': 'def F():\n    from gpipe_tf.top import b\n',
            'gpipe_tf/top/BUILD': 'py_library(name = "top", srcs = glob(["*.py"]), '
                                  'deps = [":other", "//gpipe_tf/low"])\n'
                                  'py_library(name = "other", deps = [":top"])',
            'gpipe_tf/top/__init__.py': '',
            'gpipe_tf/top/b.py': 'if False:\n    from ..low import a\n'
                                 'try:\n    import gpipe_tf.gone\nexcept ImportError:\n    pass\n',
        })
        tree = ReadTree(root)
        self.assertEqual(OwnershipProblems(tree),
                         ['gpipe_tf.orphan: in 0 libraries [], not one'])
        self.assertEqual(UndeclaredImports(tree), [
            'gpipe_tf/low/a.py:2: gpipe_tf.low.a -> gpipe_tf.top.b '
            '(//gpipe_tf/low:low -> //gpipe_tf/top:top, not in //gpipe_tf/low:low\'s deps)',
            'gpipe_tf/top/b.py:4: gpipe_tf.top.b -> gpipe_tf.gone (no such module)'])
        self.assertEqual(ImportCycles(tree), [
            'import cycle among gpipe_tf.low.a, gpipe_tf.top.b:\n'
            '    gpipe_tf/low/a.py:2: gpipe_tf.low.a -> gpipe_tf.top.b\n'
            '    gpipe_tf/top/b.py:2: gpipe_tf.top.b -> gpipe_tf.low.a',
            'library cycle among //gpipe_tf/top:other, //gpipe_tf/top:top'])


if __name__ == '__main__':
    absltest.main()
