"""gpipe_tf in Keras 3 models (TensorFlow backend): `Pipeline`, a PipeliningLayer as a layer."""

from gpipe_tf.keras.pipeline import Pipeline

__all__ = ['Pipeline']
