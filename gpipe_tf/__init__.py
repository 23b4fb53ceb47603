"""gpipe_tf: GPipe pipeline parallelism for TensorFlow, in the style of Lingvo."""
