"""Training backends of the learner: plain (one process), DDP, DeepSpeed ZeRO-2, HF Accelerate.

Each wraps the same BDQ network and presents one interface to the training loop:
`forward(macro, micro)` (the wrapped model, gradients synchronised by the backend),
`module` (the bare network: target copies, acting, checkpoints), `step(loss)` (backward,
gradient clipping, optimiser step) and `optimizer_state()` / `load_optimizer_state()`.
All three run inside a Ray Train worker, whose torch.distributed process group (gloo on
CPU, NCCL on GPU) they reuse.

Pitfalls handled here (measured, `../shared/KNOWN.md`): Accelerate needs `cpu=True` on CPU,
or under Ray Train it runs undistributed without saying so; DeepSpeed needs
`DS_ACCELERATOR=cpu` in the worker's environment on CPU (the trainer passes it through the
runtime env, since workers do not inherit the driver's environment).
"""

from __future__ import annotations

import os

import torch

from apex_bdq.config import BACKENDS, AgentConfig
from apex_bdq.networks import BDQNetwork



class _Backend:
    name = "base"

    def __init__(self, net: BDQNetwork, cfg: AgentConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device

    def forward(self, macro: torch.Tensor, micro: torch.Tensor, *pref_obs: torch.Tensor, **kw):
        """Q [B, D, n] (and preference utilities of pref_obs = (macro, micro)) through the
        wrapper, so every gradient is synchronised by it; kw reaches the network's forward."""
        return self.model(macro, micro, *pref_obs, **kw)

    def optimizer_state(self) -> dict:
        return self.opt.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        self.opt.load_state_dict(state)


class PlainBackend(_Backend):
    """One process: Adam, gradient clipping, step (the one-process trainer's backend)."""

    name = "plain"

    def __init__(self, net, cfg, device) -> None:
        super().__init__(net, cfg, device)
        self.model = self.module = net.to(device)
        self.opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)

    def step(self, loss: torch.Tensor) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip)
        self.opt.step()
        return float(gn)


class DDPBackend(PlainBackend):
    """PyTorch DistributedDataParallel over the worker group's process group (plain when
    the group has one worker: nothing to synchronise)."""

    name = "ddp"

    def __init__(self, net, cfg, device) -> None:
        super().__init__(net, cfg, device)
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.model = DDP(self.module, device_ids=[device.index] if device.type == "cuda" else None)


class AccelerateBackend(_Backend):
    name = "accelerate"

    def __init__(self, net, cfg, device) -> None:
        super().__init__(net, cfg, device)
        from accelerate import Accelerator
        # cpu=True on CPU: a plain Accelerator() under Ray Train silently runs undistributed.
        self.acc = Accelerator(cpu=device.type == "cpu")
        opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
        self.model, self.opt = self.acc.prepare(net, opt)
        self.module = self.acc.unwrap_model(self.model)
        self.device = self.acc.device

    @property
    def num_processes(self) -> int:
        return self.acc.num_processes

    def step(self, loss: torch.Tensor) -> float:
        self.opt.zero_grad(set_to_none=True)
        self.acc.backward(loss)
        gn = self.acc.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        return float(gn)


class DeepSpeedBackend(_Backend):
    name = "deepspeed"

    def __init__(self, net, cfg, device, micro_batch: int = 1) -> None:
        super().__init__(net, cfg, device)
        if device.type == "cpu" and os.environ.get("DS_ACCELERATOR") != "cpu":
            raise RuntimeError("DeepSpeed on CPU needs DS_ACCELERATOR=cpu in the worker's environment "
                               "(launch.train passes it through the Ray runtime env)")
        import deepspeed
        import torch.distributed as dist
        world = dist.get_world_size() if dist.is_initialized() else 1
        ds_cfg = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "train_batch_size": micro_batch * world,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.grad_clip,
            "zero_optimization": {"stage": 2},
            "steps_per_print": 10 ** 9,
        }
        opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)  # a client optimiser, sharded by ZeRO-2
        self.model, self.opt, _, _ = deepspeed.initialize(model=net.to(device), optimizer=opt, config=ds_cfg,
                                                          dist_init_required=False)
        self.module = self.model.module

    def step(self, loss: torch.Tensor) -> float:
        self.model.backward(loss)
        self.model.step()
        gn = self.model.get_global_grad_norm()
        return float(gn) if gn is not None else float("nan")

    def optimizer_state(self) -> dict:
        # ZeRO-2 shards the optimiser state: each rank holds its partition.
        return self.model.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        self.model.optimizer.load_state_dict(state)


def make_backend(name: str, net: BDQNetwork, cfg: AgentConfig, device: torch.device | str,
                 micro_batch: int = 1) -> _Backend:
    dev = torch.device(device)
    if name == "plain":
        return PlainBackend(net, cfg, dev)
    if name == "ddp":
        return DDPBackend(net, cfg, dev)
    if name == "accelerate":
        return AccelerateBackend(net, cfg, dev)
    if name == "deepspeed":
        return DeepSpeedBackend(net, cfg, dev, micro_batch=micro_batch)
    raise ValueError(f"unknown backend {name!r}: choose from plain, {', '.join(BACKENDS)}")
