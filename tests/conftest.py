"""pytest: configure TensorFlow for the tests before any test touches it, and the test tiers.

Tiers: `python -m pytest -q -m unit tests` runs the fast tier (pure Python and small graphs), the
contributor's inner loop; `python -m pytest -q -n 2 tests` runs everything on two worker processes
(the README's and `.ci/run`'s command); docs/contributing.md says how long each takes. A test
module joins the fast tier with `pytestmark = pytest.mark.unit`, a class with
`@pytest.mark.unit`; the marker is declared in pytest.ini, whose `--strict-markers` makes a
mistyped one an error.
"""

import os

# The BFC allocator keeps the CPU's allocation statistics, which the memory tests read.
os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')

from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top

test_utils.ConfigureVirtualCpus()


def pytest_collection_modifyitems(config, items):
    """Drops tf.test.TestCase's `test_session`: a deprecated context manager, not a test, that
    pytest collects for its name and reports as skipped in every test class."""
    del config
    items[:] = [item for item in items if item.name != 'test_session']
