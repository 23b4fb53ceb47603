"""The names gpipe_tf.keras's classes are saved under in Keras files.

Keras finds a saved class by its registered name, `package>ClassName`. When the class is not
registered (`gpipe_tf.keras` not imported), Keras's error says "Could not locate class
'Sequential'", easy to take for keras.Sequential; the registered name, in the config Keras
prints with that error, then says which package to import: `gpipe_tf.keras>Sequential`.
"""

import keras

PACKAGE = 'gpipe_tf.keras'
# The package of the names files saved before were written with (`gpipe_tf>Sequential`).
OLD_PACKAGE = 'gpipe_tf'


def Registered(cls: type) -> type:
    """Registers `cls` with Keras's serialization as `gpipe_tf.keras>Name`, and makes files
    that name it `gpipe_tf>Name` load too (a class decorator)."""
    keras.saving.register_keras_serializable(package=PACKAGE)(cls)
    # Only looked up: the registered name saved from now on stays the new one.
    keras.saving.get_custom_objects()[f'{OLD_PACKAGE}>{cls.__name__}'] = cls
    return cls
