"""AdamW in a rotated basis (optim.name=adamw_rotated): Adam's moments of each hidden matrix taken in the eigenbases
of its gradient's two covariances, as SOAP and Shampoo's eigenbasis Adam do, against the one-step delay of 2bw
(issue 46: "basis rotation for Adam"). docs/design.md ("Optimizers under the one-step delay") states the rule."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch

ROTATION_MAX_DIM = 4096
"""A side of a matrix longer than this is not rotated (the identity on that side): its covariance would hold
dim^2 floats and its eigendecomposition cost dim^3 (SOAP's max_precond_dim, 10000, is the same idea)."""

ROTATION_STATE = ("rot_cov_left", "rot_cov_right", "rot_basis_left", "rot_basis_right")
"""The per-matrix state beside Adam's ``exp_avg`` (original basis) and ``exp_avg_sq`` (rotated basis): the EMAs of
G G^T (rows x rows) and G^T G (cols x cols) and their eigenvectors, absent on a side longer than ROTATION_MAX_DIM."""


def _eigenbasis(cov: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of the symmetric ``cov`` (columns, ascending eigenvalues), found in float64."""
    return torch.linalg.eigh(cov.double())[1].to(cov.dtype)


def _rotate(x: torch.Tensor, left: Optional[torch.Tensor], right: Optional[torch.Tensor]) -> torch.Tensor:
    """Q_L^T x Q_R (None: the identity on that side)."""
    if left is not None:
        x = left.T @ x
    if right is not None:
        x = x @ right
    return x


def _rotate_back(x: torch.Tensor, left: Optional[torch.Tensor], right: Optional[torch.Tensor]) -> torch.Tensor:
    """Q_L x Q_R^T (None: the identity on that side)."""
    if left is not None:
        x = left @ x
    if right is not None:
        x = x @ right.T
    return x


class RotatedAdamW(torch.optim.Optimizer):
    """AdamW whose moments of a 2-D parameter W (rows x cols, gradient G) live in a rotated basis:

        L <- b L + (1 - b) G G^T,  R <- b R + (1 - b) G^T G            (every step; b: ``rotation_beta``)
        every ``rotation_every`` steps (first at step k, before it Q_L = Q_R = I, plain AdamW):
            Q_L', Q_R' <- eigenvectors of L, R;  O = Q^T Q' per side
            V <- (O_L o O_L)^T V (O_R o O_R)    (each second moment carried to the new basis: the variance of a
                                                 new direction is the squared cosines' mix of the old ones')
            Q <- Q'
        M <- b1 M + (1 - b1) G                                          (original basis)
        V <- b2 V + (1 - b2) (Q_L^T G Q_R)^2                            (rotated basis)
        N = Q_L [ (Q_L^T M Q_R / c1) / (sqrt(V / c2) + eps) ] Q_R^T     (c1, c2: Adam's bias corrections)
        W <- W (1 - lr wd) - lr N

    A side longer than ``ROTATION_MAX_DIM`` keeps the identity. Parameters that are not 2-D must not be given to it
    (``optimizers.RotatedWithAdamW`` hands them to AdamW). State per rows x cols matrix: M and V (2 rows cols
    floats), L, R, Q_L, Q_R (2 (rows^2 + cols^2) floats); a refresh costs two float64 eigendecompositions.
    """

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        rotation_every: int = 10,
        rotation_beta: float = 0.95,
    ):
        if rotation_every < 1 or not 0 <= rotation_beta < 1:
            raise ValueError(
                f"rotation_every ({rotation_every}) must be >= 1, rotation_beta ({rotation_beta}) in [0, 1)"
            )
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.rotation_every, self.rotation_beta = rotation_every, rotation_beta

    def _init_state(self, p: torch.Tensor) -> Dict[str, Any]:
        assert p.dim() == 2, "RotatedAdamW steps 2-D parameters only"
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
        for side, n in (("left", p.shape[0]), ("right", p.shape[1])):
            if n <= ROTATION_MAX_DIM:
                state[f"rot_cov_{side}"] = torch.zeros(n, n, dtype=p.dtype, device=p.device)
                state[f"rot_basis_{side}"] = torch.eye(n, dtype=p.dtype, device=p.device)
        return state

    def _refresh(self, state: Dict[str, Any]) -> None:
        """New eigenbases from the covariances; the second moments carried over to them."""
        v = state["exp_avg_sq"]
        for side in ("left", "right"):
            if f"rot_cov_{side}" not in state:
                continue
            new = _eigenbasis(state[f"rot_cov_{side}"])
            mix = (state[f"rot_basis_{side}"].T @ new).square_()  # (O o O): rows old directions, cols new ones
            v = mix.T @ v if side == "left" else v @ mix
            state[f"rot_basis_{side}"] = new
        state["exp_avg_sq"] = v

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (torch's)
        assert closure is None, "closures are not supported"
        b = self.rotation_beta
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p] if self.state[p] else self._init_state(p)
                lacks = [f"rot_cov_{side}" for side, n in zip(("left", "right"), p.shape) if n <= ROTATION_MAX_DIM]
                if any(k not in state for k in lacks):  # another optimizer's state (AdamW's): never step as AdamW
                    raise KeyError(f"RotatedAdamW: a {tuple(p.shape)} matrix's state lacks {lacks}")
                state["step"] += 1
                t = int(state["step"].item())
                if "rot_cov_left" in state:
                    state["rot_cov_left"].lerp_(g @ g.T, 1 - b)
                if "rot_cov_right" in state:
                    state["rot_cov_right"].lerp_(g.T @ g, 1 - b)
                if t % self.rotation_every == 0:
                    self._refresh(state)
                left, right = state.get("rot_basis_left"), state.get("rot_basis_right")
                state["exp_avg"].lerp_(g, 1 - b1)
                rotated = _rotate(g, left, right)
                state["exp_avg_sq"].mul_(b2).addcmul_(rotated, rotated, value=1 - b2)
                c1, c2 = 1 - b1**t, 1 - b2**t
                denom = (state["exp_avg_sq"] / c2).sqrt_().add_(eps)
                update = _rotate_back(_rotate(state["exp_avg"], left, right).div_(c1).div_(denom), left, right)
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr)
        return None
