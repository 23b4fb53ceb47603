"""A gpipe_tf layer's tf.Variables as Keras variables, without copying them.

Keras 3 tracks only `keras.Variable`s: the tf.Variables of a tf.Module that a Keras layer holds
are invisible to `trainable_weights`, to the optimizer of `model.fit` and to `save_weights`.
Keras's TensorFlow backend keeps a tf.Variable given as a variable's initializer as the
variable's own storage instead of copying it (`keras.layers.TFSMLayer` tracks a SavedModel's
variables this way), so each Keras variable made here *is* the gpipe_tf variable: an optimizer
update through Keras, a read in `FProp`'s theta and batch norm's `ApplyUpdate` all act on the
one tf.Variable, on the device its cell placed it on.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from gpipe_tf.nested_map import NestedMap

# tf.VariableAggregation -> Keras's name for it: batch norm's moving statistics say how
# replicas would combine them (MEAN), and the Keras variable repeats it.
_AGGREGATION = {
    tf.VariableAggregation.NONE: 'none',
    tf.VariableAggregation.SUM: 'sum',
    tf.VariableAggregation.MEAN: 'mean',
    tf.VariableAggregation.ONLY_FIRST_REPLICA: 'only_first_replica',
}


def Wrap(variables: NestedMap) -> list:
    """One `keras.Variable` per tf.Variable of `variables` (a layer's `vars`), in
    `FlattenItems` order, each named by its dotted key (`layer_003.w`) and backed by that very
    tf.Variable.

    The order is by layer name, so it is the same at every number of cells and on every
    device list: Keras's weight files, which store a layer's variables by position, load into
    the same layers partitioned otherwise.

    Raises:
      RuntimeError: if Keras made a copy instead of keeping the tf.Variable (a Keras version
        that no longer does would leave the pipeline's weights untrained without a word).
    """
    wrapped = []
    for key, variable in variables.FlattenItems():
        keras_variable = keras.Variable(
            initializer=variable, dtype=variable.dtype, trainable=variable.trainable,
            autocast=False,
            aggregation=_AGGREGATION.get(variable.aggregation, 'none'), name=key)
        if keras_variable.value is not variable:
            raise RuntimeError(
                f'Keras {keras.__version__} copied the tf.Variable {variable.name} instead of '
                'keeping it as its Keras variable\'s storage: the pipeline would train a copy. '
                'gpipe_tf.keras needs Keras 3 with the TensorFlow backend.')
        wrapped.append(keras_variable)
    return wrapped
