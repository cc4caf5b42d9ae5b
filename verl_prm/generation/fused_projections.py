"""One matrix product for the projections of a decoder layer that read the same input.

A decode step multiplies a few rows (one token per sequence) by every weight matrix of the model; on the CPU such
thin products run far below the machine's peak, and the fewer and wider they are, the better (SmolLM2-135M, 32
rows, bf16 on an AMX Xeon, one thread: a layer's seven projections 2.4 ms, the same work as four products
1.3-1.5 ms).
Llama-style layers compute ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` and ``gate_proj(x)``, ``up_proj(x)`` from one
``x`` each, so each group is computed as one product with the group's weights stacked::

    [q | k | v] = x [W_q | W_k | W_v]^T (+ [b_q | b_k | b_v])

The modules stay as they are (their names, parameters and state dict): each one's weight becomes a view of the
stacked matrix, so an in-place weight update (``copy_`` into the state dict, as the ``hf`` rollout loads the actor's
weights) updates the stacked matrix too, and each module's ``forward`` returns its slice of the group's product,
computed at the first member's call and again whenever a member is called with another input or a second time.
Weights replaced rather than written in place are restacked by calling :func:`fuse_projections` again; a call with
gradients on computes the module's own product (the stacked product is for inference).
"""

from __future__ import annotations

import types
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GROUPS", "fuse_projections"]

# per submodule of a decoder layer, the projections that read one input, in the order the layer calls them
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class _SharedInputGroup:
    """Projections of one input computed by one product; each member's call returns its slice of it."""

    def __init__(self, modules: Sequence[nn.Linear]) -> None:
        self.modules = list(modules)
        self.sizes = [m.out_features for m in self.modules]
        self.weight = torch.cat([m.weight.detach() for m in self.modules])
        self.bias: Optional[torch.Tensor] = None
        if self.modules[0].bias is not None:
            self.bias = torch.cat([m.bias.detach() for m in self.modules])
        begin = 0
        for module, size in zip(self.modules, self.sizes):  # the modules' parameters become views of the stack
            module.weight.data = self.weight[begin: begin + size]
            if self.bias is not None:
                module.bias.data = self.bias[begin: begin + size]
            begin += size
        self._input: Optional[torch.Tensor] = None
        self._parts: Optional[tuple[torch.Tensor, ...]] = None
        self._served: set[int] = set()

    def intact(self) -> bool:
        """Whether every member's weight is still a view of the stacked matrix."""
        return all(m.weight.data_ptr() == self.weight[sum(self.sizes[:i]):].data_ptr()
                   for i, m in enumerate(self.modules))

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x or index in self._served:
            self._input, self._served = x, set()
            self._parts = F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        self._served.add(index)
        out = self._parts[index]
        if len(self._served) == len(self.modules):  # every member served: hold no reference to the input
            self._input = self._parts = None
        return out


def _member_forward(group: _SharedInputGroup, index: int):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # a backward pass needs the member's own parameters in the graph
            return F.linear(x, self.weight, self.bias)
        return group.part(index, x)
    return forward


def fuse_projections(model: nn.Module) -> int:
    """Stack the same-input projections of every decoder layer of ``model`` (module docstring); returns the number
    of groups fused. Layers without such projections (other architectures) are left alone. Calling it again
    restacks groups whose weights were replaced."""
    fused = 0
    for module in model.modules():
        for child_name, names in GROUPS:
            child = getattr(module, child_name, None)
            if child is None:
                continue
            members = [getattr(child, name, None) for name in names]
            if not all(type(m) is nn.Linear for m in members):
                continue
            existing = getattr(child, "_verl_prm_fused", None)
            if existing is not None and existing.intact():
                fused += 1
                continue
            first = members[0]
            if any(m.in_features != first.in_features or (m.bias is None) != (first.bias is None)
                   or m.weight.dtype != first.weight.dtype or m.weight.device != first.weight.device
                   for m in members):
                continue
            group = _SharedInputGroup(members)
            for index, member in enumerate(members):
                member.forward = types.MethodType(_member_forward(group, index), member)
            child._verl_prm_fused = group
            fused += 1
    return fused
