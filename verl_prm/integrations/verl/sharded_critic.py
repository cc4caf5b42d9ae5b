"""The prover critic sharded across its worker group with FSDP2 (``verl_prm.placement.shard=fsdp``), for a
critic that does not fit one GPU (docs/gpu.md, "Critic placement and memory").

Every worker of the group is one FSDP rank: it holds 1/N of each decoder layer's weights (``fully_shard`` from
``torch.distributed.fsdp``, applied per layer by verl's ``apply_fsdp2``, as verl's own FSDP workers shard), and
scores its own token-balanced rows; each layer's weights are all-gathered for the forward and freed after it
(``reshard_after_forward=True``). The value head (H x 1) is small and held whole on every rank, in fp32.

Loading goes straight to the shards: the model is built on the meta device, sharded, given empty storage on the
worker's device, and each rank reads only its rows of every tensor from the safetensors files
(``safe_open(...).get_slice``, a memory-mapped read of those rows). No process ever holds the whole model;
rank 0 loading and broadcasting (verl's ``fsdp2_load_full_state_dict``) would need a full host copy in one
process, 145 GB for a 72B critic in bf16.

FSDP's forward is a collective: every rank must run the same number of forwards, or the all-gathers of the rank
with more micro-batches wait forever. The ranks run their forwards in lockstep (``JoinedForwards``): a rank
whose rows are scored (or that failed) runs one-token forwards until every rank is done.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from verl_prm.checkpoints import CheckpointError, resolve_checkpoint
from verl_prm.choices import SHARDABLE_FORMATS
from verl_prm.critic import ProverCritic
from verl_prm.critic.formats import ValueHeadFormat
from verl_prm.critic.loading import (
    check_vocabulary,
    default_attn_implementation,
    load_critic_tokenizer,
    read_head_from_safetensors,
    resolve_dtype,
    unused_weights_error,
)
from verl_prm.training.calibration import checkpoint_calibration
from verl_prm.integrations.verl.critic_worker import ProverCriticWorker

__all__ = [
    "JoinedForwards",
    "ShardedProverCriticWorker",
    "init_critic_process_group",
    "load_sharded_value_head",
    "shard_rows",
]



def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of dimension 0 that FSDP2's ``Shard(0)`` gives ``rank``: torch.chunk's layout,
    ``c = ceil(rows / world_size)`` rows per rank, ``start = min(rank * c, rows)``, ``stop = min(start + c, rows)``
    (the last ranks may hold fewer rows, or none)."""
    per_rank = math.ceil(rows / world_size) if rows else 0
    start = min(rank * per_rank, rows)
    return start, min(start + per_rank, rows)


class JoinedForwards(nn.Module):
    """The sharded backbone, run in lockstep across the ranks.

    FSDP's per-layer all-gathers pair up in call order, so a rank must not start a collective the others do not
    start. Before each real forward a rank all-reduces (MAX) the flag 1; a rank that has no forward left calls
    ``finish``, which all-reduces 0 and runs a one-token forward while any rank still sends 1, and returns once all
    send 0. Every round is then one flag all-reduce plus one forward on every rank (real or one-token), whatever
    the micro-batch counts; the flag costs one 8-byte all-reduce per micro-batch.
    """

    def __init__(self, backbone: nn.Module, device: torch.device):
        super().__init__()
        self.backbone = backbone
        self.device = device

    def _others_run(self, flag: int) -> bool:
        value = torch.tensor([flag], dtype=torch.long, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def forward(self, *args: Any, **kwargs: Any):
        self._others_run(1)
        return self.backbone(*args, **kwargs)

    @torch.inference_mode()
    def finish(self) -> int:
        """One-token forwards while another rank still runs real ones; returns how many this rank ran."""
        token = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        added = 0
        while self._others_run(0):
            self.backbone(input_ids=token, position_ids=token, use_cache=False)
            added += 1
        return added


def init_critic_process_group(device: torch.device) -> None:
    """The worker group's process group from the environment verl's ``RayWorkerGroup`` sets (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): NCCL for CUDA tensors, gloo for CPU ones."""
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def _safetensors_index(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json; the sharded critic "
                                "reads safetensors only")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _fill_local_shards(module: nn.Module, prefix: str, path: Path, index: dict[str, Path], rank: int,
                       world_size: int) -> set[str]:
    """Copy this rank's rows of every parameter of ``module`` (FSDP2 DTensors, or plain tensors) from the
    checkpoint tensors ``prefix + name``; returns the checkpoint names read. A parameter the checkpoint lacks
    or whose shape differs is an error."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    params = [(prefix + name, param) for name, param in module.named_parameters()]
    missing = [key for key, _ in params if key not in index]
    if missing:
        shown = ", ".join(sorted(missing)[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"critic checkpoint {str(path)!r} lacks weights the model needs: {shown}")
    with torch.no_grad():
        for key, param in params:
            # one mapping per tensor: the file pages read stay resident only while this tensor is copied
            with safe_open(str(index[key]), framework="pt") as f:
                stored = f.get_slice(key)
                if tuple(stored.get_shape()) != tuple(param.shape):
                    raise CheckpointError(
                        f"critic checkpoint {str(path)!r}: {key} has shape {tuple(stored.get_shape())}, the model "
                        f"built from its config.json needs {tuple(param.shape)}"
                    )
                local = param.to_local() if isinstance(param, DTensor) else param
                start, stop = shard_rows(param.shape[0], world_size, rank) if isinstance(param, DTensor) else (
                    0, param.shape[0])
                rows = stored[start:stop]
                if tuple(rows.shape) != tuple(local.shape):
                    raise RuntimeError(f"sharded critic: {key} local shard {tuple(local.shape)} is not rows "
                                       f"[{start}, {stop}) of {tuple(param.shape)}")
                local.copy_(rows.to(local.dtype))
    return {key for key, _ in params}


def load_sharded_value_head(path: str, tokenizer, *, device: torch.device, dtype: torch.dtype,
                            attn_implementation: str, mesh) -> Any:
    """A native-format critic (``value_head``) whose backbone is FSDP2-sharded over ``mesh``, loaded per rank.

    The model is built from ``config.json`` on the meta device (no weights), the backbone's decoder layers and
    the backbone are ``fully_shard``-ed (verl's ``apply_fsdp2``), ``to_empty`` gives the shards storage on
    ``device``, and every rank copies in its rows of each checkpoint tensor (``shard_rows``). Non-persistent
    buffers (rotary inverse frequencies) are computed at construction on the host, kept across ``to_empty``.
    Checks as the unsharded loader: every weight present, none unused, ``num_labels == 1``, the vocabulary.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification
    from verl.utils.fsdp_utils import apply_fsdp2, meta_device_init

    root = Path(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    if getattr(config, "num_labels", None) != 1:
        raise ValueError(f"{path}: format 'value_head' needs num_labels=1, the checkpoint has "
                         f"{getattr(config, 'num_labels', None)}; a two-class head is format 'qwen_prm'")
    with meta_device_init():  # parameters on meta, buffers computed on the host
        model = AutoModelForTokenClassification.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    prefix = model.base_model_prefix
    backbone = getattr(model, prefix)
    head_name = next(name for name in ("score", "classifier") if isinstance(getattr(model, name, None), nn.Module))
    buffers = {name: buffer.detach().clone() for name, buffer in backbone.named_buffers()}
    apply_fsdp2(backbone, {"mesh": mesh, "reshard_after_forward": True}, {})
    backbone.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in backbone.named_buffers():
            buffer.copy_(buffers[name].to(device))
    index = _safetensors_index(root)
    read = _fill_local_shards(backbone, prefix + ".", root, index, dist.get_rank(), dist.get_world_size())
    head_prefix, head = read_head_from_safetensors(root, (head_name,))
    if getattr(head, "out_features", None) != 1 or head.in_features != config.hidden_size:
        raise CheckpointError(f"critic checkpoint {path!r}: head {head_prefix} is {head}, format 'value_head' needs "
                              f"Linear({config.hidden_size}, 1)")
    unused = {key for key in index if key not in read and not key.startswith(head_prefix + ".")}
    if unused:
        raise unused_weights_error(path, model, unused)
    setattr(model, head_name, head)  # the meta head of the model is replaced by the loaded fp32 one
    check_vocabulary(path, tokenizer, model)
    backbone.eval()
    return ValueHeadFormat(model, JoinedForwards(backbone, device), head.to(device))


class ShardedProverCriticWorker(ProverCriticWorker):
    """A ``ProverCriticWorker`` whose critic is sharded across the worker group (FSDP2, one rank per worker).

    Same arguments and calls as ``ProverCriticWorker``; ``critic_kwargs["format"]`` must be one of
    ``SHARDABLE_FORMATS``. Every worker scores the rows ``compute_step_values`` sends it.
    """

    def _load_critic(self, kwargs: dict[str, Any]):
        from torch.distributed.device_mesh import init_device_mesh

        kwargs = dict(kwargs)
        fmt = kwargs.pop("format", "value_head")
        if fmt not in SHARDABLE_FORMATS:
            raise ValueError(f"ShardedProverCriticWorker: format {fmt!r} cannot be sharded; verl_prm.placement."
                             f"shard=fsdp supports {list(SHARDABLE_FORMATS)} (use shard=none for {fmt!r})")
        if kwargs.pop("allow_pickle", False):
            raise ValueError("ShardedProverCriticWorker: the sharded critic reads safetensors only; set "
                             "verl_prm.critic.allow_pickle=false")
        device = torch.device(kwargs.pop("device"))
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        init_critic_process_group(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
        path = resolve_checkpoint(self.model_path, "critic", allow_pickle=False)
        tokenizer = kwargs.pop("tokenizer", None) or load_critic_tokenizer(path)
        dtype = resolve_dtype(kwargs.pop("dtype", None), device)
        attn = kwargs.pop("attn_implementation", None) or default_attn_implementation(device, dtype)
        adapter = load_sharded_value_head(path, tokenizer, device=device, dtype=dtype, attn_implementation=attn,
                                          mesh=mesh)
        calibration = checkpoint_calibration(path, kwargs.pop("calibration", "auto"))
        return ProverCritic(adapter, tokenizer, device=device, calibration=calibration, **kwargs)

    def _score(self, *args: Any, **kwargs: Any):
        try:
            return super()._score(*args, **kwargs)
        finally:  # also after an error: the other ranks' forwards wait for this rank's all-gathers
            # one-token forwards this rank added in its last scoring (0 on the rank with the most micro-batches)
            self.padding_forwards = self.critic.adapter.backbone.finish()

    def local_parameter_count(self) -> tuple[int, int]:
        """(elements of the parameters this rank holds, elements of the whole model's parameters)."""
        from torch.distributed.tensor import DTensor

        local = total = 0
        for module in (self.critic.adapter.backbone, self.critic.adapter.head):
            for param in module.parameters():
                local += (param.to_local() if isinstance(param, DTensor) else param).numel()
                total += param.numel()
        return local, total
