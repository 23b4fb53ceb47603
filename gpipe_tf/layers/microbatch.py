"""Moved to `gpipe_tf.pipeline.microbatch`; this path works until gpipe_tf 0.2."""

from gpipe_tf import _moved

_moved.Alias(__name__, 'gpipe_tf.pipeline.microbatch')
