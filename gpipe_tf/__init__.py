"""gpipe_tf: GPipe pipeline parallelism for TensorFlow, in the style of Lingvo.

The public API is re-exported here; everything else is importable but not promised. The names
load on first use (PEP 562), so that `import gpipe_tf` alone does not import TensorFlow: the
trainer and the launcher decide how TensorFlow starts (its logging, a private network) first.
"""

import importlib

from gpipe_tf import _moved

__version__ = '0.1.0'

# Module paths from before 0.1's layout (`gpipe_tf.layers.pipeline`, ...) import the modules
# that moved until 0.2, with a DeprecationWarning.
_moved.Install()

_EXPORTS = {
    'BaseLayer': 'gpipe_tf.layers.base_layer',
    'DynamicLossScale': 'gpipe_tf.loss_scale',
    'FPropScope': ('gpipe_tf.layers.fprop_context', 'Scope'),
    'GetParams': 'gpipe_tf.model_registry',
    'InstantiableParams': 'gpipe_tf.hyperparams',
    'LayerMeta': 'gpipe_tf.layers.base_layer',
    'ListModels': 'gpipe_tf.model_registry',
    'MultiHeadAttentionLayer': 'gpipe_tf.layers.attention',
    'NestedMap': 'gpipe_tf.nested_map',
    'Params': 'gpipe_tf.hyperparams',
    'PipeliningLayer': 'gpipe_tf.pipeline.pipelining_layer',
    'RegisterSingleTaskModel': 'gpipe_tf.model_registry',
    'TransformerLayer': 'gpipe_tf.layers.attention',
    'WeightInit': 'gpipe_tf.layers.base_layer',
    'WeightParams': 'gpipe_tf.layers.base_layer',
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    module, attribute = (_EXPORTS[name] if isinstance(_EXPORTS[name], tuple) else
                         (_EXPORTS[name], name))
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
