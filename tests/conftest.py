"""pytest: configure TensorFlow for the tests before any test touches it, and the test tiers.

Tiers: `python -m pytest -q -m unit tests` runs the fast tier (pure Python and small graphs, about
a minute on 2 cores), the contributor's inner loop; `python -m pytest -q -n 2 tests` runs
everything on two worker processes (the README's and `.ci/run`'s command). A test module joins the fast tier with
`pytestmark = pytest.mark.unit`, a class with `@pytest.mark.unit`.
"""

import os

# The BFC allocator keeps the CPU's allocation statistics, which the memory tests read.
os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')

from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top

test_utils.ConfigureVirtualCpus()


def pytest_configure(config):
    config.addinivalue_line(
        'markers', 'unit: the fast tier (pure Python and small graphs); '
        '`python -m pytest -q -m unit tests`')


# The slowest modules, slowest first (`--durations`, 2 cores): the suite runs on two workers
# (`-n 2`, one test class each at a time: `--dist loadscope` in pytest.ini), which finish
# together when the long classes start first instead of last.
SLOWEST_FIRST = ('test_trainer.py', 'test_cluster.py', 'test_pipeline.py', 'test_amoebanet.py',
                 'test_strategy.py', 'test_trace.py', 'test_launch.py',
                 'test_transformer_model.py', 'test_params_safety.py', 'test_memory.py')


def pytest_collection_modifyitems(config, items):
    """Drops tf.test.TestCase's `test_session` (a deprecated context manager, not a test, that
    pytest collects for its name and reports as skipped in every test class), and moves the
    slowest modules first (their order within is kept)."""
    del config
    items[:] = [item for item in items if item.name != 'test_session']

    def Rank(item):
        name = item.path.name
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=Rank)  # Stable: each module's tests keep their order.
