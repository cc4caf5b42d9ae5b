"""A runtime fix of verl 0.9.1 with TRL >= 1.x installed, on every device (``patches/0006-trl-without-value-head.diff``).

verl's ``apply_monkey_patch`` (every FSDP model build) imports ``AutoModelForCausalLMWithValueHead`` from
``trl.experimental.ppo`` or ``trl`` whenever TRL is installed; TRL 1.16 has it in neither, so the import error
ends the run (on any device). Fix: when the installed TRL lacks the class, ``apply_monkey_patch`` sees TRL as
absent (the patch it would apply is to that class only). On a verl with the patch applied it changes nothing.
"""

from __future__ import annotations

from verl_prm.integrations.verl.import_hooks import register_when_imported

__all__ = ["install_trl_fix", "trl_fix_installed", "trl_has_value_head"]

MONKEY_PATCH_MODULE = "verl.models.transformers.monkey_patch"

_installed: list[bool] = []


def trl_fix_installed() -> bool:
    """True when this process has switched verl's TRL import off (TRL installed without the class)."""
    return bool(_installed)


def trl_has_value_head() -> bool:
    """True when the installed TRL provides ``AutoModelForCausalLMWithValueHead`` where verl 0.9.1 looks."""
    for module_name in ("trl.experimental.ppo", "trl"):
        try:
            module = __import__(module_name, fromlist=["AutoModelForCausalLMWithValueHead"])
        except ImportError:
            continue
        if hasattr(module, "AutoModelForCausalLMWithValueHead"):
            return True
    return False


def _fix_trl_value_head_import() -> None:
    import verl.models.transformers.monkey_patch as monkey_patch

    if monkey_patch.is_trl_available() and not trl_has_value_head():
        monkey_patch.is_trl_available = lambda: False
        _installed.append(True)


def install_trl_fix() -> None:
    """Attach the fix to the import of verl's monkey-patch module (now if it is imported). Idempotent."""
    if getattr(install_trl_fix, "_done", False):
        return
    install_trl_fix._done = True
    register_when_imported(MONKEY_PATCH_MODULE, _fix_trl_value_head_import)
