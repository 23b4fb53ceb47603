"""gpipe_tf in Keras 3 models (TensorFlow backend): `Pipeline`, a PipeliningLayer as a layer
(of gpipe_tf layers, or of Keras layers with `Pipeline.FromKeras`), and `Sequential`, a model
that is one pipeline of Keras layers and trains with every schedule."""

from gpipe_tf.keras.pipeline import Pipeline
from gpipe_tf.keras.sequential import Sequential

__all__ = ['Pipeline', 'Sequential']
