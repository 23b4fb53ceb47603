"""Registered model params, one module per model family (see `gpipe_tf.model_registry`).

Each module defines model-params classes decorated with
`model_registry.RegisterSingleTaskModel`; a class `Foo` in `gpipe_tf/params/image/amoebanet.py` is
registered as `image.amoebanet.Foo`. Nothing is imported here: `model_registry.ImportAllParams()`
imports the modules when a model is first looked up, so importing this package stays cheap.
"""
