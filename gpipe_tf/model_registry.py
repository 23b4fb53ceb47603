"""Registry of model params, looked up by name: `RegisterSingleTaskModel`, `GetParams`.

A model-params class (Lingvo's convention) bundles everything needed to train and evaluate one
model: `Task()` returns the task's Params (or `Model()`, Lingvo's name, used when defined), and one
method per dataset, `Train()`, `Dev()` and `Test()` (any subset, `Train()` at least), returns that
dataset's input Params:

    @model_registry.RegisterSingleTaskModel
    class PipelinedMLP:

        def Task(self):
            return sequential.SequentialLayer.Params().Set(name='mlp', ...)

        def Train(self):
            return SyntheticInputParams().Set(batch_size=32)

The registry key is the class's module path below `gpipe_tf.params` and its name, e.g.
`image.amoebanet.AmoebaNetD_18_256` for a class in `gpipe_tf/params/image/amoebanet.py`; a class
registered from elsewhere keeps its full module path. `GetParams(key, 'Train')` returns a fresh copy
of the task Params with the dataset's input Params in its `input` field.

Registration happens when a params module is imported; `ListModels` and `GetParams` import every
module under `gpipe_tf/params` on first use, so the command line finds every model by name.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

from absl import logging

from gpipe_tf import hyperparams
from gpipe_tf import model_keys

PARAMS_PACKAGE = model_keys.PARAMS_PACKAGE
# The dataset methods a model-params class may define, in the order they are listed.
DATASETS = ('Train', 'Dev', 'Test')

# Registry key -> model-params class.
_MODEL_PARAMS: dict[str, type] = {}
# Whether ImportAllParams() ran for PARAMS_PACKAGE; modules that failed, with their errors.
_imported_all = False
_import_errors: dict[str, str] = {}


def _ClassName(cls: type) -> str:
    return f'{cls.__module__}.{cls.__qualname__}'


def RegistryKey(cls: type) -> str:
    """The key a model-params class is registered under, e.g. `examples.PipelinedMLP`."""
    module = cls.__module__
    if module.startswith(PARAMS_PACKAGE + '.'):
        module = module[len(PARAMS_PACKAGE) + 1:]
    return f'{module}.{cls.__name__}'


def RegisterSingleTaskModel(cls: type) -> type:
    """Class decorator: registers a model-params class under `RegistryKey(cls)`.

    Args:
        cls: a class defining `Task()` (or `Model()`) and at least `Train()` of the dataset
            methods `Train()`, `Dev()`, `Test()`. It is instantiated without arguments, so these
            may be plain methods, classmethods or staticmethods.

    Returns:
        `cls`, unchanged.

    Raises:
        TypeError: if `cls` is not a class or lacks `Task()`/`Model()` or `Train()`.
        ValueError: if another class is already registered under the same key.
    """
    if not isinstance(cls, type):
        raise TypeError(f'RegisterSingleTaskModel decorates a class, got {cls!r}.')
    if not (callable(getattr(cls, 'Task', None)) or callable(getattr(cls, 'Model', None))):
        raise TypeError(f'{_ClassName(cls)} defines neither Task() nor Model().')
    if not callable(getattr(cls, 'Train', None)):
        raise TypeError(f'{_ClassName(cls)} defines no Train() input params.')
    key = RegistryKey(cls)
    registered = _MODEL_PARAMS.get(key)
    if registered is not None and registered is not cls:
        hint = (' (the class is defined twice, or its module was imported twice)'
                if _ClassName(registered) == _ClassName(cls) else '')
        raise ValueError(f'Model key {key!r} is already registered by {_ClassName(registered)}; '
                         f'cannot register {_ClassName(cls)} under it too{hint}.')
    _MODEL_PARAMS[key] = cls
    return cls


def ImportAllParams(package: str = PARAMS_PACKAGE, require_success: bool = False) -> bool:
    """Imports every module under `package`, so that their models register.

    Args:
        package: dotted name of the package to walk (with its sub-packages).
        require_success: raise on the first module that fails to import, instead of logging it
            and going on (one broken params module then hides only its own models).

    Returns:
        Whether every module imported.

    Raises:
        ImportError: with `require_success`, naming the module that failed and why.
    """
    global _imported_all
    root = importlib.import_module(package)
    failed = {}

    def Failed(name: str, error: BaseException) -> None:
        if require_success:
            raise ImportError(f'Importing params module {name} failed: '
                              f'{type(error).__name__}: {error}') from error
        failed[name] = f'{type(error).__name__}: {error}'

    # walk_packages imports each sub-package to look inside it, and reports failures to onerror
    # from within its `except` clause.
    for module_info in pkgutil.walk_packages(
            root.__path__, prefix=package + '.',
            onerror=lambda name: Failed(name, sys.exc_info()[1])):
        if module_info.ispkg:
            continue
        try:
            importlib.import_module(module_info.name)
        except Exception as e:  # pylint: disable=broad-except
            Failed(module_info.name, e)
    for name, error in sorted(failed.items()):
        logging.warning('Params module %s not imported, so its models are not registered: %s',
                        name, error)
    if package == PARAMS_PACKAGE:
        _imported_all = True
        _import_errors.clear()
        _import_errors.update(failed)
    return not failed


def _EnsureAllImported() -> None:
    if not _imported_all:
        ImportAllParams()


def ListModels() -> list[str]:
    """The registry keys of all models, sorted (after importing every params module)."""
    _EnsureAllImported()
    return sorted(_MODEL_PARAMS)


def GetClass(name: str) -> type:
    """The model-params class registered as `name`.

    Raises:
        LookupError: if no model is registered as `name`; names the closest registered keys.
    """
    if name not in _MODEL_PARAMS:
        _EnsureAllImported()
    if name not in _MODEL_PARAMS:
        failed = (f' Params modules that failed to import: {sorted(_import_errors)}.'
                  if _import_errors else '')
        raise LookupError(model_keys.UnknownModel(name, _MODEL_PARAMS) + failed)
    return _MODEL_PARAMS[name]


def GetDatasets(name: str) -> list[str]:
    """Which of `DATASETS` (`Train`, `Dev`, `Test`) model `name` defines, in that order."""
    cls = GetClass(name)
    return [d for d in DATASETS if callable(getattr(cls, d, None))]


def GetParams(name: str, dataset: str) -> hyperparams.Params:
    """A fresh copy of model `name`'s task Params with `dataset`'s input Params attached.

    The input Params go into the task Params' `input` field, which is defined (described as the
    input of `dataset`) when the task Params lack one, as Lingvo's task Params have it.

    Args:
        name: registry key, e.g. `examples.PipelinedMLP`.
        dataset: `Train`, `Dev` or `Test`; case does not matter (`train` works too).

    Returns:
        Unfrozen Params, owned by the caller: changing them changes no later GetParams result.

    Raises:
        LookupError: for an unknown model (naming the closest ones) or a dataset the model does
            not define (naming those it does).
        TypeError: if `Task()`/`Model()` or the dataset method does not return Params.
    """
    cls = GetClass(name)
    available = GetDatasets(name)
    method = next((d for d in available if d.lower() == str(dataset).lower()), None)
    if method is None:
        raise LookupError(f'Model {name!r} has no dataset {dataset!r}; available: {available}.')
    model_params = cls()
    # Lingvo's Model() wraps Task(); a class defining it means the outermost Params.
    task_fn = getattr(model_params, 'Model', None) or model_params.Task
    task = _CheckParams(task_fn(), f'{_ClassName(cls)}.{task_fn.__name__}()').Copy()
    input_params = _CheckParams(getattr(model_params, method)(),
                                f'{_ClassName(cls)}.{method}()').Copy()
    if 'input' in task:
        task.input = input_params
    else:
        task.Define('input', input_params, f'Input params of the {method} dataset.')
    return task


def _CheckParams(value, what: str) -> hyperparams.Params:
    if not isinstance(value, hyperparams.Params):
        raise TypeError(f'{what} returned {type(value).__name__} {value!r}, not Params.')
    return value
