"""The inner optimizer: AdamW through torch's functional `adamw`, with torch.optim.AdamW's
state_dict.

Why not `torch.optim.AdamW` itself: its `add_param_group` (called by the constructor), `step`,
`zero_grad`, `state_dict` and `load_state_dict` are wrapped by `torch._disable_dynamo`, which
imports `torch._dynamo` on first use; that import costs about as much as `import torch` and sat
on every start's path to the first inner step (`python -m bench.restart`, docs/goodput.md).
The functional `torch.optim.adamw.adamw` is the very function `AdamW.step` calls, with the same
defaults (foreach chosen by torch), so the steps are bit-identical; `state_dict` and
`load_state_dict` keep torch's format, so checkpoints written by either load into the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw

GROUP_DEFAULTS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}
"""torch.optim.AdamW's group settings besides lr, betas, eps and weight decay, as it saves them."""


class InnerAdamW:
    """AdamW over one parameter group, as torch.optim.AdamW(params, lr, betas, eps,
    weight_decay, fused) computes it and saves it."""

    def __init__(
        self,
        params: Iterable[Tensor],
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
        fused: bool = False,
    ) -> None:
        group: dict[str, Any] = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        group.update(GROUP_DEFAULTS, fused=fused)
        group["params"] = list(params)
        self.param_groups: list[dict[str, Any]] = [group]
        self.state: dict[Tensor, dict[str, Tensor]] = {}

    @property
    def params(self) -> list[Tensor]:
        return list(self.param_groups[0]["params"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state.get(param) or self._init_state(param, group)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            has_complex=any(torch.is_complex(p) for p in params),
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )

    def _init_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        on_device = group["fused"] or group["capturable"]  # as torch.optim.Adam._init_group
        state = {
            "step": torch.zeros((), dtype=torch.float32, device=param.device)
            if on_device
            else torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu"),
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        self.state[param] = state
        return state

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Optimizer.state_dict's layout: state by parameter index, groups with
        their settings and parameter indices."""
        index = {id(p): i for i, p in enumerate(self.params)}
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [index[id(p)] for p in g["params"]],
            }
            for g in self.param_groups
        ]
        return {"state": {index[id(p)]: s for p, s in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """A state_dict of this class or of torch.optim.AdamW over the same parameters; the
        saved settings win (as torch's does), tensors move to their parameter's dtype and
        device ("step" stays a CPU scalar unless fused or capturable)."""
        groups = saved["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError("the optimizer state is of another parameter layout")
        group = {**GROUP_DEFAULTS, **{k: v for k, v in groups[0].items() if k != "params"}}
        group["params"] = self.params
        by_index = dict(zip(groups[0]["params"], self.params, strict=True))
        state: dict[Tensor, dict[str, Tensor]] = {}
        for key, values in saved["state"].items():
            param = by_index[int(key)]
            state[param] = {
                name: _placed(name, value, param, group) for name, value in values.items()
            }
        self.param_groups, self.state = [group], state


def _placed(name: str, value: Tensor, param: Tensor, group: dict[str, Any]) -> Tensor:
    """torch.optim.Optimizer._process_value_according_to_param_policy, for AdamW's keys."""
    if name != "step":
        if param.is_floating_point():
            return value.to(dtype=param.dtype, device=param.device)
        return value.to(device=param.device)
    if group["capturable"] or group["fused"]:
        return value.to(dtype=torch.float32, device=param.device)
    return value


def _scalar_dtype() -> torch.dtype:
    """torch.optim.optimizer._get_scalar_dtype: float64 only under a float64 default dtype."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
