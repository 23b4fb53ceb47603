"""gpipe_tf: GPipe pipeline parallelism for TensorFlow, in the style of Lingvo.

The public API is re-exported here; everything else is importable but not promised.
"""

from gpipe_tf.hyperparams import InstantiableParams
from gpipe_tf.hyperparams import Params
from gpipe_tf.layers.attention import MultiHeadAttentionLayer
from gpipe_tf.layers.attention import TransformerLayer
from gpipe_tf.layers.base_layer import BaseLayer
from gpipe_tf.layers.base_layer import LayerMeta
from gpipe_tf.layers.base_layer import WeightInit
from gpipe_tf.layers.base_layer import WeightParams
from gpipe_tf.layers.fprop_context import Scope as FPropScope
from gpipe_tf.model_registry import GetParams
from gpipe_tf.model_registry import ListModels
from gpipe_tf.model_registry import RegisterSingleTaskModel
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline.pipelining_layer import PipeliningLayer

__version__ = '0.1.0'

__all__ = [
    'BaseLayer', 'FPropScope', 'GetParams', 'InstantiableParams', 'LayerMeta', 'ListModels',
    'MultiHeadAttentionLayer', 'NestedMap', 'Params', 'PipeliningLayer',
    'RegisterSingleTaskModel', 'TransformerLayer', 'WeightInit', 'WeightParams',
]
