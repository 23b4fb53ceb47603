"""gpipe_tf in Keras 3 models (TensorFlow backend): `Pipeline`, a PipeliningLayer as a layer
(of gpipe_tf layers, or of Keras layers with `Pipeline.FromKeras`), `Sequential`, a model
that is one pipeline of Keras layers, and `Functional`, a functional Keras model's graph cut into
stages; both train with every schedule."""

from gpipe_tf.keras.functional import Functional
from gpipe_tf.keras.pipeline import Pipeline
from gpipe_tf.keras.sequential import Sequential

__all__ = ['Functional', 'Pipeline', 'Sequential']
