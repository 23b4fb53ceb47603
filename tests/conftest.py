"""pytest: configure TensorFlow for the tests before any test touches it."""

import os

# The BFC allocator keeps the CPU's allocation statistics, which the memory tests read.
os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')

from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top

test_utils.ConfigureVirtualCpus()
