"""The README's Python snippets run as printed, each in a process of its own (as a reader pastes
one into a fresh interpreter: the virtual devices it makes come first), after the set-up
command (keras_hub comes with `.[test]`)."""

import os
import re
import subprocess
import sys

import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')
TIMEOUT_S = 600


def Run(snippet: str, cwd: str):
    """`snippet` in a fresh interpreter in `cwd`, away from the repository's directory (the
    package found as installed, or from the checkout where it is not)."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get('PYTHONPATH')) if p)
    return subprocess.run([sys.executable, '-c', snippet], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=cwd,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=path))


def Snippets() -> list[str]:
    with open(README, encoding='utf-8') as f:
        return re.findall(r'```python\n(.*?)```', f.read(), re.S)


class ReadmeTest(tf.test.TestCase):

    def testEverySnippetRunsAsPrinted(self):
        snippets = Snippets()
        self.assertLen(snippets, 2)  # PipeliningLayer in a graph, and Keras.
        # The first also says where its cells are: one virtual device each, as it says.
        checks = ['print("DEVICES", pipe.devices)\n', '']
        for i, (snippet, check) in enumerate(zip(snippets, checks)):
            with self.subTest(snippet=i):
                result = Run(snippet + check, self.get_temp_dir())
                self.assertEqual(result.returncode, 0, result.stderr[-3000:])
                self.assertNotIn('Traceback', result.stderr)
                if check:
                    self.assertIn("DEVICES ['/device:CPU:0', '/device:CPU:1', "
                                  "'/device:CPU:2', '/device:CPU:3']", result.stdout)


if __name__ == '__main__':
    tf.test.main()
