"""Registered image-classification models (AmoebaNet); see `gpipe_tf.model_registry`."""
