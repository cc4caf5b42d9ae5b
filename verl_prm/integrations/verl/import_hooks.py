"""Registration on import: run a function right after a named module has executed, before its importer gets it.

The plugin registers names in verl registries that live in packages verl imports late (or never, in most of a
run's processes). A meta-path finder wraps the loader of exactly those packages; a package that is already
imported is handled at once. A module of ours that verl's plugin loader asked to register while that module
was still executing (it imported verl, which loaded the plugin) is deferred: it calls
:func:`run_deferred_registration` at its end.

This module imports nothing of verl-prm or verl: every part of the verl glue may use it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import Callable

__all__ = ["register_or_defer", "register_when_imported", "run_deferred_registration"]

# module name -> the function of that module that registers it, deferred until the module has executed
_deferred: dict[str, str] = {}


def register_or_defer(module_name: str, function_name: str) -> None:
    """Call ``module_name.function_name()``; if that module is still being imported, defer the call to the
    module's own :func:`run_deferred_registration` at its end."""
    module = sys.modules.get(module_name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False):
        _deferred[module_name] = function_name
        return
    getattr(importlib.import_module(module_name), function_name)()


def run_deferred_registration(module_name: str) -> None:
    """Called at the end of a registering module: run its registration if :func:`register_or_defer` deferred it."""
    function_name = _deferred.pop(module_name, None)
    if function_name is not None:
        getattr(sys.modules[module_name], function_name)()


class _CallbackLoader(importlib.abc.Loader):
    """Wraps a module's loader: runs ``callback`` after the module has executed."""

    def __init__(self, loader, callback: Callable[[], None]):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._callback()

    def __getattr__(self, name):  # is_package, get_resource_reader, get_code, ...: the wrapped loader's
        return getattr(self._loader, name)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Meta-path finder that attaches callbacks to the import of named modules (each fires once)."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[], None]]] = {}

    def find_spec(self, fullname, path, target=None):
        callbacks = self.callbacks.pop(fullname, None)
        if not callbacks:
            return None

        def callback() -> None:
            for registration in callbacks:
                registration()

        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _CallbackLoader(spec.loader, callback)
                return spec
        return None


_after_import = _RegisterAfterImport()


def register_when_imported(module_name: str, register: Callable[[], None]) -> None:
    """Run ``register`` now if ``module_name`` is imported (or has executed and is in its post-import
    callbacks), else right after its import."""
    if module_name in sys.modules:
        register()
        return
    _after_import.callbacks.setdefault(module_name, []).append(register)
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)
