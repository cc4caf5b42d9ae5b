"""The actor's attention, chosen at startup: flash-attention with remove-padding where ``flash-attn`` is
installed, else SDPA with padded batches.

verl 0.9.1 builds the actor and the reference model with ``attn_implementation="flash_attention_2"`` unless
``actor_rollout_ref.model.override_config.attn_implementation`` says otherwise, and its remove-padding path
(``use_remove_padding=True``) calls flash-attn's ``unpad_input``/``pad_input``: without the package both fail
when the model loads. The launchers therefore pass two OmegaConf interpolations instead of fixed values::

    actor_rollout_ref.model.use_remove_padding='${verl_prm.flash_attn:}'
    +actor_rollout_ref.model.override_config.attn_implementation='${verl_prm.attn_implementation:}'

The plugin (``import verl``) registers both resolvers; the first resolution logs one line saying which was
chosen. The choice is made in the process that resolves the config (verl's ``TaskRunner`` resolves it before it
starts the workers), so a run whose workers have flash-attn but whose resolving process has not gets SDPA:
correct, only slower. flash-attn is an optional build (``pip install flash-attn --no-build-isolation``, needs
``nvcc``; docs/gpu.md).
"""

from __future__ import annotations

import importlib.util
import logging

__all__ = ["ATTENTION_RESOLVER", "FLASH_ATTN_RESOLVER", "actor_attention", "flash_attn_installed",
           "register_attention_resolvers"]

logger = logging.getLogger("verl_prm")

FLASH_ATTN_RESOLVER = "verl_prm.flash_attn"
ATTENTION_RESOLVER = "verl_prm.attn_implementation"
_logged = False


def flash_attn_installed() -> bool:
    """Whether the ``flash_attn`` package can be imported here (found on the path; not imported)."""
    return importlib.util.find_spec("flash_attn") is not None


def actor_attention(installed: bool | None = None) -> tuple[str, bool]:
    """``(attn_implementation, use_remove_padding)`` of the actor: ``("flash_attention_2", True)`` with
    flash-attn, ``("sdpa", False)`` without (``installed`` default: :func:`flash_attn_installed`)."""
    installed = flash_attn_installed() if installed is None else installed
    return ("flash_attention_2", True) if installed else ("sdpa", False)


def _log_choice_once(installed: bool) -> None:
    global _logged
    if not _logged:
        _logged = True
        attention, remove_padding = actor_attention(installed)
        logger.warning("verl-prm: flash-attn is %s: the actor uses attn_implementation=%s, use_remove_padding=%s",
                       "installed" if installed else "not installed", attention, remove_padding)


def _resolve_flash_attn() -> bool:
    installed = flash_attn_installed()
    _log_choice_once(installed)
    return actor_attention(installed)[1]


def _resolve_attention() -> str:
    installed = flash_attn_installed()
    _log_choice_once(installed)
    return actor_attention(installed)[0]


def register_attention_resolvers() -> None:
    """Register the ``${verl_prm.flash_attn:}`` and ``${verl_prm.attn_implementation:}`` resolvers. Idempotent."""
    from omegaconf import OmegaConf

    for name, resolver in ((FLASH_ATTN_RESOLVER, _resolve_flash_attn), (ATTENTION_RESOLVER, _resolve_attention)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
