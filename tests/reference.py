"""Single-process oracles: the 2BW update rule, plain minibatch training and validation, on the whole model
(fixed windows or packed documents, as data.packing says)."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn

from pipedream2bw.config import Config, build_optimizer
from pipedream2bw.config.optimizers import Muon
from pipedream2bw.data import make_feeds
from pipedream2bw.memory import precision as precisions
from pipedream2bw.memory.loss_scale import LossScaler
from pipedream2bw.models.factory import model_source
from pipedream2bw.pipeline import stateful
from pipedream2bw.run.lr_schedule import lr_at


class Reference(NamedTuple):
    weights: Dict[str, torch.Tensor]  # final state_dict
    losses: List[float]  # mean loss of each batch
    lrs: List[float]  # learning rate of each step
    grad_norms: List[float]  # global norm of g(t) before clipping, as the pipeline agrees on it (grad_norm)
    skipped_steps: List[int]  # steps with a non-finite loss or gradient, not taken
    loss_scales: List[float]  # fp16: the loss scale each batch ran with
    snapshots: Dict[int, Dict[str, torch.Tensor]]  # n -> the weights after n steps, for n in ``keep``


class StageBoundaries(nn.Sequential):
    """The whole model in one process, with the activation rounded to ``dtype`` and back after the
    layers ``after`` (a pipeline's p2p transfers in the compute dtype); float32 rounds nothing.
    A boundary that is a tuple or dict has each floating element rounded (the stage sends each in
    the compute dtype and the next one goes on in float32); integer elements (masks, ids) pass as they are."""

    def __init__(self, layers: Sequence[nn.Module], *, after: Sequence[int], dtype: torch.dtype, upcast: bool = True):
        super().__init__(*layers)
        self.after, self.dtype, self.upcast = set(after), dtype, upcast  # upcast False: weights in the compute dtype

    def _round(self, t: Any) -> Any:
        if torch.is_tensor(t) and t.dtype in (torch.float32, self.dtype):
            return t.to(self.dtype).float() if self.upcast else t.to(self.dtype)
        return t

    def forward(self, x: Any) -> Any:
        key = stateful.current_key()
        for i, layer in enumerate(self):
            stateful.reseed(key, i)  # each layer's random stream on this microbatch, as a pipeline's stage draws it
            x = layer(x)
            if i in self.after and self.dtype != torch.float32:
                x = pytree.tree_map(self._round, x)
        return x


def boundaries(balance: Sequence[int]) -> List[int]:
    """The last layer of every stage but the last: where a pipeline of ``balance`` sends."""
    return [sum(balance[: s + 1]) - 1 for s in range(len(balance) - 1)]


def reference_train(
    cfg: Config,
    *,
    delayed: bool,
    balance: Sequence[int] = (),
    layers: Optional[Sequence[nn.Module]] = None,
    info: Optional[Dict[str, Any]] = None,
) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    """``reference_run``'s final weights and losses; ``info`` receives ``loss_scales`` and ``skipped_steps``."""
    ref = reference_run(cfg, delayed=delayed, balance=balance, layers=layers)
    if info is not None:
        info.update(loss_scales=ref.loss_scales, skipped_steps=ref.skipped_steps)
    return ref.weights, ref.losses


def reference_run(
    cfg: Config,
    *,
    delayed: bool,
    layers: Optional[Sequence[nn.Module]] = None,
    balance: Sequence[int] = (),
    relayout: Optional[Tuple[int, Sequence[int]]] = None,
    keep: Sequence[int] = (),
    replicas: Sequence[int] = (1, 1),
) -> Reference:
    """Trains the unpartitioned model (``layers``, by default the model of ``cfg.model``) for
    ``cfg.train.num_steps`` batches.

    delayed=True applies the 2BW rule: g(t) is the mean gradient over batch t at W(t-1),
    W(-1) = W(0), and W(t+1) = W(t) - optimizer_step(g(t)). delayed=False is plain
    minibatch training: g(t) at W(t). delayed=True with ``pipeline.sync_warmup_steps`` N: batches t <= N take
    g(t) at W(t), later ones at W(t-1); error feedback corrects only steps t > N. Step t uses ``lr_at(t)``; with
    ``optim.clip_grad_norm``,
    g(t) is clipped as ``torch.nn.utils.clip_grad_norm_`` clips, over the whole model, but from the norm the pipeline
    agrees on (``grad_norm``); a batch whose loss or gradient is not finite is skipped (W(t+1) = W(t)), as
    train.on_nonfinite=skip and fp16's loss scaler do.

    Under ``cfg.train.precision`` bf16/fp16 it is a plain autocast loop (float32 weights, forward
    under autocast, loss in float32) whose activations are rounded to the compute dtype where a
    pipeline of ``balance`` sends them. fp16 scales the loss by the scale the ``LossScaler`` had
    after the update of batch t-2 (2BW, delayed) or t-1: a pipeline applies step t-1 only while
    batch t runs under 2bw. ``relayout`` = (step n, balance'): from batch n on, round where a pipeline
    of balance' sends (a run resumed at another layout at step n). ``keep``: steps n after which the
    weights are kept in ``snapshots`` (what validation after n steps evaluates). ``replicas``: the
    pipeline's data_parallel w before and after ``relayout``'s step (1 or 2); w = 2 sums each batch's
    microbatch gradients as its replicas do, each replica's half first, then the two halves (the
    all-reduce of two: exact, whatever the order): the other order of float32 additions moves a
    weight by ~1e-7, which fp16's forward and Muon's normalized step can turn into ~4e-4 (issue 32).
    """
    threads = torch.get_num_threads()
    # As the ranks run: Adam turns reduction-order noise in ~zero gradients into lr-sized steps
    torch.set_num_threads(1)
    try:
        return _train(
            cfg, delayed=delayed, layers=layers, balance=balance, relayout=relayout, keep=keep, replicas=replicas
        )
    finally:
        torch.set_num_threads(threads)


def _train(
    cfg: Config,
    *,
    delayed: bool,
    layers: Optional[Sequence[nn.Module]],
    balance: Sequence[int],
    relayout: Optional[Tuple[int, Sequence[int]]],
    keep: Sequence[int],
    replicas: Sequence[int],
) -> Reference:
    assert set(replicas) <= {1, 2}, f"replicas {replicas}: the reference sums the gradients of 1 or 2 replicas"
    torch.manual_seed(cfg.seed)
    m = cfg.pipeline.num_microbatches
    precision = precisions.resolve(cfg.train.precision, "cpu")
    source = model_source(cfg.model, seed=cfg.seed)  # the GPT, or a factory's layers (tied ones stay tied)
    after = boundaries(balance)
    layers = layers if layers is not None else source.build()
    # train.weight_dtype=compute: the versions that batches run with are the float32 masters (model) rounded
    weight_dtype = precisions.weight_dtype(precision, cfg.train.weight_dtype)
    rounded = weight_dtype != torch.float32
    model = StageBoundaries(layers, after=after, dtype=precisions.compute_dtype(precision), upcast=not rounded)  # W(t)
    lm_loss = source.loss_fn
    stale = copy.deepcopy(model).to(weight_dtype) if delayed or rounded else model  # W(t-1): batch t runs with
    # flush, gpipe (not delayed): no delay, so no correction
    opt = ReferenceOptimizer(model, cfg.optim if delayed else dataclasses.replace(cfg.optim, delay_correction="none"))
    # windows, or packed documents (data.packing): one replica of m microbatches reads the batch a pipeline's
    # w replicas read (the reference's m is their w * m)
    feed = _train_feed(cfg, m)
    t_cfg = cfg.train
    scaler = (
        LossScaler(init_scale=t_cfg.loss_scale, growth_interval=t_cfg.loss_scale_growth_interval)
        if precision == "fp16"
        else None
    )
    lag = 2 if delayed else 1
    # pipeline.sync_warmup_steps=N: batches t <= N run with W(t), no correction at their steps (t <= N)
    warmup = cfg.pipeline.sync_warmup_steps if delayed else 0
    scales_after: List[float] = []  # fp16: the scale each step's update left
    out = Reference(None, [], [], [], [], [], {})
    for t in range(cfg.train.num_steps):
        if relayout is not None and t == relayout[0]:
            model.after = stale.after = set(boundaries(relayout[1]))
        stale.zero_grad(set_to_none=True)
        scale = 1.0 if scaler is None else (scales_after[t - lag] if t >= lag else t_cfg.loss_scale)
        batch_losses = []
        w = replicas[1] if relayout is not None and t >= relayout[0] else replicas[0]
        halves: List[Optional[torch.Tensor]] = []  # w = 2: the first replica's sums
        for j in range(m):
            if w == 2 and j == m // 2:
                halves = _take_grads(stale, rounded)
            x, y = feed.microbatch(t * m + j)
            cpu = torch.device("cpu")
            with precisions.autocast(precision, "cpu"), stateful.microbatch_streams(cfg.seed, t * m + j, cpu):
                logits = stale(x)
            loss = lm_loss(logits.float(), y)
            (loss * scale if scaler is not None else loss).backward()
            batch_losses.append(loss.detach())
            if rounded:  # the microbatches' gradients summed in float32
                for p in stale.parameters():
                    if p.grad is not None:
                        p.main_grad = p.grad.float() if getattr(p, "main_grad", None) is None else p.main_grad + p.grad
                        p.grad = None
        if halves:  # the second replica's sums added to the first's, as the all-reduce adds them
            for p, h, g in zip(stale.parameters(), halves, _take_grads(stale, rounded)):
                _set_grad(p, rounded, h if g is None else g if h is None else h + g)
        out.losses.append(float(torch.stack(batch_losses).mean()))
        out.lrs.append(lr_at(t, cfg.optim, num_steps=cfg.train.num_steps))
        sums = [getattr(p, "main_grad", None) if rounded else p.grad for p in stale.parameters()]
        grads = [None if g is None else g / (m * scale) for g in sums]
        for p in stale.parameters() if rounded else ():
            p.main_grad = None
        if delayed and t + 1 > warmup:
            _load_parameters(stale, model)  # batch t+1 runs with W(t)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        norm = grad_norm(model.parameters())
        out.grad_norms.append(norm)
        skip = not math.isfinite(out.losses[-1]) or not math.isfinite(norm)
        if scaler is not None:
            out.loss_scales.append(scale)
            scaler.update(skip)
            scales_after.append(scaler.scale)
        if skip:
            out.skipped_steps.append(t)  # W(t+1) = W(t), optimizer state untouched
        else:
            if cfg.optim.clip_grad_norm is not None:
                clip_grads(model.parameters(), cfg.optim.clip_grad_norm, norm)
            opt.step(out.lrs[-1], correct=delayed and t > warmup, predict=delayed and t + 1 > warmup)
        if (rounded and not delayed) or (delayed and t + 1 <= warmup):
            _load_parameters(stale, model)  # batch t+1 runs with W(t+1) (rounded; or the synchronous warm-up's)
        if t + 1 in keep:
            out.snapshots[t + 1] = opt.weights(copy.deepcopy(_with_buffers(model, stale)))
    return out._replace(weights=opt.weights(_with_buffers(model, stale)))


def reference_newest(
    cfg: Config,
    *,
    balance: Sequence[int],
    relayout: Optional[Tuple[int, Sequence[int], int]] = None,
    on_step: Optional[Callable[[int, nn.Module], None]] = None,
) -> Reference:
    """pipeline.weight_versions=newest's rule on the unpartitioned model, written out from its statement (not from
    the runtime's code), float32 weights, no correction (bf16: the forward under autocast, the activation rounded
    where a stage sends it, as ``reference_run``): on stage s of d = len(``balance``) (its layers, in order), microbatch
    j of batch t >= 1 runs on W(t) iff j >= d - s - 1 + L(s), with L(s) = min(pipeline.forward_lead, m - (d - s)) on
    the stages before the last, 0 on the last (the forwards run after that stage's step t-1); the others, and batch
    0, on W(t-1) (W(-1) = W(0)). Each of pipeline.data_parallel w replicas reads its own m microbatches of the batch
    (``make_feeds``' replica r) under that rule; g(t) = (sum over the replicas of each one's sum of its gradients at
    W(t-1) and at W(t)) / (m * w), each replica's sum first, as its stages sum them before the all-reduce, and in
    their order: the early sum added to the fresh one before the last microbatch's gradient; W(t+1) =
    W(t) - optimizer_step(g(t)). At d = 1 that is plain minibatch training. With optim.delay_correction=predict
    the microbatches of batch t >= 1 not on W(t) run on P(t) = W(t-1) + h d(t-2) instead (h: optim.predict_horizon),
    d(t) = W(t+1) - W(t) in float32, d(-1) = 0. ``relayout`` = (step n, balance', w'): from batch n on, the rule (and
    the rounding, and the replicas' sums) of a pipeline of balance' with w' replicas of m * w / w' microbatches each:
    a run resumed at another layout after n steps, its batch n's early microbatches on the checkpoint's W(n-1) (or
    P(n)). ``on_step(t, model)``, if given, is called after step t with ``model`` holding W(t+1)
    (scripts/screen_newest.py validates there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run (``reference_run``)
    try:
        return _train_newest(cfg, balance, relayout, on_step)
    finally:
        torch.set_num_threads(threads)


def _train_newest(
    cfg: Config,
    balance: Sequence[int],
    relayout: Optional[Tuple[int, Sequence[int], int]],
    on_step: Optional[Callable[[int, nn.Module], None]] = None,
) -> Reference:
    torch.manual_seed(cfg.seed)
    source = model_source(cfg.model, seed=cfg.seed)
    precision = precisions.resolve(cfg.train.precision, "cpu")
    dtype = precisions.compute_dtype(precision)
    model = StageBoundaries(source.build(), after=boundaries(balance), dtype=dtype)  # W(t)
    stale = copy.deepcopy(model)  # W(t-1)
    opt = ReferenceOptimizer(model, dataclasses.replace(cfg.optim, delay_correction="none"))
    m0, w0 = cfg.pipeline.num_microbatches, cfg.pipeline.data_parallel

    def layout(balance: Sequence[int], w: int):
        """The rule of a pipeline of ``balance`` with w replicas: each replica's feed, its m, each layer's stage, the
        stages' leads and their boundaries."""
        m, d, lead = m0 * w0 // w, len(balance), cfg.pipeline.forward_lead
        feeds = [_train_feed(cfg, m, num_replicas=w, replica=r) for r in range(w)]
        stage_of = [s for s, n in enumerate(balance) for _ in range(n)]
        leads = [0 if s == d - 1 else max(0, min(lead, m - (d - s))) for s in range(d)]
        return feeds, m, d, stage_of, leads, boundaries(balance)

    rule = layout(balance, w0)
    predict = cfg.optim.delay_correction == "predict"
    delta = [torch.zeros_like(p) for p in model.parameters()]  # d(t-1)
    out = Reference(None, [], [], [], [], [], {})
    for t in range(cfg.train.num_steps):
        if relayout is not None and t == relayout[0]:
            rule = layout(relayout[1], relayout[2])
        feeds, m, d, stage_of, leads, after = rule
        model.after = stale.after = set(after)
        losses, sums = [], [None] * len(delta)
        for feed in feeds:  # each replica: the same rule on its own microbatches, its sums first
            for j in range(m):
                if j == m - 1 and t >= 1:  # the early sums added into the fresh ones first, as a stage gathers them
                    for p, q in zip(model.parameters(), stale.parameters()):
                        p.grad, q.grad = _add(p.grad, q.grad), None
                fresh = [t >= 1 and j >= d - s - 1 + leads[s] for s in range(d)]
                layers = [(model if fresh[stage_of[i]] else stale)[i] for i in range(len(model))]
                mixed = StageBoundaries(layers, after=after, dtype=dtype)
                x, y = feed.microbatch(t * m + j)
                cpu = torch.device("cpu")
                with precisions.autocast(precision, "cpu"), stateful.microbatch_streams(cfg.seed, t * m + j, cpu):
                    loss = source.loss_fn(mixed(x).float(), y)
                loss.backward()
                losses.append(loss.detach())
            own = [_add(a, b) for a, b in zip(_take_grads(stale, False), _take_grads(model, False))]
            sums = [_add(a, b) for a, b in zip(sums, own)]
        out.losses.append(float(torch.stack(losses).mean()))
        out.lrs.append(lr_at(t, cfg.optim, num_steps=cfg.train.num_steps))
        _load_parameters(stale, model)  # batch t+1's early microbatches run on W(t) (predict: + d(t-1))
        if predict:
            with torch.no_grad():
                for p, dp in zip(stale.parameters(), delta):
                    p.add_(dp, alpha=cfg.optim.predict_horizon)
            before = [p.detach().clone() for p in model.parameters()]
        for p, g in zip(model.parameters(), sums):
            p.grad = None if g is None else g / (m0 * w0)
        out.grad_norms.append(grad_norm(model.parameters()))
        opt.step(out.lrs[-1], correct=False, predict=False)
        model.zero_grad(set_to_none=True)  # g(t) stays out of batch t+1's sums
        if predict:
            delta = [p.detach() - b for p, b in zip(model.parameters(), before)]
        if on_step is not None:
            on_step(t, model)
    return out._replace(weights=model.state_dict())


def _train_feed(cfg: Config, m: int, *, num_replicas: int = 1, replica: int = 0):
    """The training batches of ``cfg`` as replica ``replica`` of ``num_replicas``, of ``m`` microbatches each, reads
    them (one replica: the whole batch)."""
    return make_feeds(
        cfg.data,
        seq_len=cfg.model.seq_len,
        microbatch_size=cfg.pipeline.microbatch_size,
        num_microbatches=m,
        seed=cfg.seed,
        num_replicas=num_replicas,
        replica=replica,
    )[0]


def _add(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """a + b, either of them absent (a parameter no microbatch reached)."""
    return a if b is None else b if a is None else a + b


def grad_norm(params: Iterable[nn.Parameter]) -> float:
    """The global 2-norm of ``params``' gradients as the pipeline agrees on it (pipeline/agreement.py, a sum over
    stages and ranks): each gradient's 2-norm in its dtype, squared and summed in float64, its square root.

    Not ``clip_grad_norm_``'s norm: torch reduces the per-tensor norms in float32, which lands one float32 unit away
    from this in some steps (1.8339472 for 1.8339471, step 0 of zb1p-d1w2-bf16-clip-hostopt-val-muon); the clip
    coefficient is then a unit off, and bf16's forward with Muon's normalized step grew that unit to 1.4e-2 at
    1.fc.weight by step 6, a failure of the reference, not of the pipeline (float64 is the nearer of the two).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return math.sqrt(float(torch.stack(torch._foreach_norm(grads, 2)).double().square().sum()))


@torch.no_grad()
def clip_grads(params: Iterable[nn.Parameter], max_norm: float, norm: float) -> None:
    """Scales ``params``' gradients as ``clip_grad_norm_`` does (its float32 coefficient, at most 1), from the
    global ``norm`` given (``grad_norm``'s) rather than one of its own."""
    grads = [p.grad for p in params if p.grad is not None]
    coef = torch.clamp(max_norm / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)


def _take_grads(model: nn.Module, rounded: bool) -> List[Optional[torch.Tensor]]:
    """The gradient sums of ``model``'s parameters (``main_grad`` where the weights are rounded), unset there."""
    sums = [getattr(p, "main_grad", None) if rounded else p.grad for p in model.parameters()]
    for p in model.parameters():
        _set_grad(p, rounded, None)
    return sums


def _set_grad(p: nn.Parameter, rounded: bool, g: Optional[torch.Tensor]) -> None:
    if rounded:
        p.main_grad = g
    else:
        p.grad = g


@torch.no_grad()
def _load_parameters(dst: nn.Module, src: nn.Module) -> None:
    """``src``'s parameters into ``dst``; buffers stay: one set of statistics (BatchNorm's), updated by every
    forward in order, whatever version it runs with (the pipeline's 2bw versions share theirs)."""
    for p, q in zip(dst.parameters(), src.parameters()):
        p.copy_(q)


def _with_buffers(model: nn.Module, ran: nn.Module) -> Dict[str, torch.Tensor]:
    """``model``'s state_dict with the buffers of ``ran``, the module the forwards ran on."""
    buffers = {n: b.to(model.state_dict()[n].dtype) for n, b in ran.named_buffers() if n in model.state_dict()}
    return {**model.state_dict(), **buffers}


def _hidden_matrices(model: nn.Module) -> Tuple[List[nn.Parameter], List[nn.Parameter]]:
    """(the 2-D parameters that are neither an nn.Embedding's nor under a module whose class name ends in 'Head', nor
    in a layer list's first or last layer; the rest): what Muon and the rotation take, and what AdamW does."""
    heads = {id(p) for mod in model.modules() if type(mod).__name__.endswith("Head") for p in mod.parameters()}
    embeds = {id(p) for mod in model.modules() if isinstance(mod, nn.Embedding) for p in mod.parameters()}
    if isinstance(model, nn.Sequential) and len(model):  # the layer list's input and output layers, by role
        embeds |= {id(p) for i in (0, len(model) - 1) for p in model[i].parameters()}
    params = list(model.parameters())
    mu = [p for p in params if p.dim() == 2 and id(p) not in heads | embeds]
    return mu, [p for p in params if all(p is not q for q in mu)]


class ReferenceRotatedAdamW(torch.optim.Optimizer):
    """optim.name=adamw_rotated's rule for matrices, written out apart from config/rotation.py (docs/design.md):
    per matrix W with gradient G at step t (from 1),

        L = b L + (1 - b) G G^T, R = b R + (1 - b) G^T G;  at t % k == 0: P, S = eigenvectors of L, R,
            V = A^T V C with A = (Q_L^T P)^2, C = (Q_R^T S)^2 (elementwise squares), then Q_L = P, Q_R = S
        M = b1 M + (1 - b1) G;  V = b2 V + (1 - b2) (Q_L^T G Q_R)^2
        W = W (1 - lr wd) - lr Q_L [(Q_L^T M Q_R / (1 - b1^t)) / (sqrt(V / (1 - b2^t)) + eps)] Q_R^T

    with Q_L = Q_R = I before the first refresh."""

    def __init__(self, params, lr, every, beta, *, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr))
        self.every, self.beta, self.betas, self.eps, self.wd = every, beta, betas, eps, weight_decay

    @torch.no_grad()
    def step(self, closure=None):
        b, (b1, b2) = self.beta, self.betas
        for group in self.param_groups:
            for w in group["params"]:
                if w.grad is None:
                    continue
                g = w.grad.double()
                st = self.state[w]
                if not st:
                    rows, cols = w.shape
                    st.update(t=0, L=torch.zeros(rows, rows).double(), R=torch.zeros(cols, cols).double())
                    st.update(QL=torch.eye(rows).double(), QR=torch.eye(cols).double())
                    st.update(M=torch.zeros_like(g), V=torch.zeros_like(g))
                st["t"] += 1
                t = st["t"]
                st["L"] = b * st["L"] + (1 - b) * (g @ g.T)
                st["R"] = b * st["R"] + (1 - b) * (g.T @ g)
                if t % self.every == 0:
                    p_new, s_new = torch.linalg.eigh(st["L"])[1], torch.linalg.eigh(st["R"])[1]
                    a, c = (st["QL"].T @ p_new) ** 2, (st["QR"].T @ s_new) ** 2
                    st.update(V=a.T @ st["V"] @ c, QL=p_new, QR=s_new)
                st["M"] = b1 * st["M"] + (1 - b1) * g
                st["V"] = b2 * st["V"] + (1 - b2) * (st["QL"].T @ g @ st["QR"]) ** 2
                inner = (st["QL"].T @ st["M"] @ st["QR"] / (1 - b1**t)) / ((st["V"] / (1 - b2**t)).sqrt() + self.eps)
                w.mul_(1 - group["lr"] * self.wd)
                w.sub_((group["lr"] * (st["QL"] @ inner @ st["QR"].T)).to(w.dtype))


class ReferenceOptimizer:
    """The update rule of ``optim`` written out on the whole model, apart from ``pipedream2bw.optimizers``:

    - optim.name=muon: torch.optim.Muon's step (config.optimizers.Muon; adjust_lr_fn 'match_rms_adamw' unless
      optim.muon_kwargs says otherwise)
      for the 2-D parameters that are neither an nn.Embedding's nor under a module whose class name ends in
      'Head', nor in a layer list's first or last layer; optim.muon_others (with optim.kwargs) for the rest; one
      learning rate for both.
    - optim.delay_correction=lookahead: AdamW becomes NAdam(betas=(0.99, beta2), decoupled_weight_decay=True, its
      weight decay AdamW's), Muon's momentum 0.99 with Nesterov.
    - optim.delay_correction=predict: between steps the weights hold P(t) = W(t) + d(t-1), d(t-1) = W(t) - W(t-1)
      (what batch t+1 then reads); a step subtracts d(t-1), steps, takes d(t) = W after - W before and adds it;
      ``predict`` false: no d added nor kept. ``weights`` gives W = P - d.
    - optim.delay_correction=error_feedback: with u(t) = W after the step - W before, the step sets
      W(t+1) = W(t) + u(t) + beta * (u(t) - u(t-1)); no correction at the first step taken, nor at a step
      whose gradient was not delayed (``correct`` false: it still records u(t)); a skipped step (``step`` not
      called) changes nothing.
    - optim.delay_correction=predict_error_feedback: both, error feedback inside the prediction: a step subtracts
      d(t-1), steps and corrects as error feedback does (its own u(t-1)), then d(t) = W after all that - W before.
    """

    def __init__(self, model: nn.Module, optim) -> None:
        self.cfg = optim
        lookahead = optim.delay_correction == "lookahead"
        muon = not optim.target and optim.name.lower() == "muon"
        rotated = not optim.target and optim.name.lower() == "adamw_rotated"
        if rotated:  # the matrices Muon would take: the rotation's rule written out; AdamW for the rest
            mu, rest = _hidden_matrices(model)
            self.opts = [
                torch.optim.AdamW(rest, lr=optim.lr, **optim.kwargs),
                ReferenceRotatedAdamW(mu, optim.lr, optim.rotation_every, optim.rotation_beta, **optim.kwargs),
            ]
        elif not muon and not lookahead:  # predict, error_feedback: written out in ``step``
            self.opts = [build_optimizer(model.parameters(), dataclasses.replace(optim, delay_correction="none"))]
        else:
            kwargs = dict(optim.kwargs)
            others = optim.muon_others if muon else optim.name
            if lookahead:
                assert others.lower() == "adamw"
                b2 = tuple(kwargs.pop("betas", (0.9, 0.999)))[1]
                cls, kwargs = torch.optim.NAdam, dict(kwargs, betas=(0.99, b2), decoupled_weight_decay=True)
                kwargs.setdefault("weight_decay", 1e-2)
            else:
                cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "adam": torch.optim.Adam}[others.lower()]
            mu, rest = _hidden_matrices(model) if muon else ([], list(model.parameters()))
            self.opts = [cls(rest, lr=optim.lr, **kwargs)]
            if mu:
                muon_kwargs = dict({"adjust_lr_fn": "match_rms_adamw"}, **optim.muon_kwargs)
                if lookahead:
                    muon_kwargs.update(momentum=0.99, nesterov=True)
                # torch.optim.Muon's step with its Newton-Schulz in optim.muon_kwargs.ns_dtype (float32 on a CPU):
                # test_corrections checks it against torch's, bit for bit in bfloat16 and to float64 in float32
                self.opts.append(Muon(mu, lr=optim.lr, **muon_kwargs))
        self.params, self.model = list(model.parameters()), model
        self.prev: Optional[List[torch.Tensor]] = None  # predict: d(t-1), if held
        self.prev_update: Optional[List[torch.Tensor]] = None  # error feedback: u(t-1)

    def weights(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The weights W of a state_dict of the model this steps (P less d(t-1) where a prediction is held)."""
        if not self.cfg.delay_correction.startswith("predict") or self.prev is None:
            return state
        # every name of a tied parameter (the state_dict lists each, on one tensor): named_parameters() would give
        # its first only, leaving the others at P (a tied head's 5.out.weight, one update d off)
        names: Dict[int, List[str]] = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        out = dict(state)
        for p, d in zip(self.params, self.prev):
            weights = state[names[id(p)][0]] - d
            out.update({n: weights for n in names[id(p)]})
        return out

    @torch.no_grad()
    def step(self, lr: float, *, correct: bool = True, predict: bool = True) -> None:
        """One step at ``lr``; ``correct`` false: no error-feedback correction (u(t) is still recorded);
        ``predict`` false: the weights are left at W(t+1), no d kept."""
        predicting = self.cfg.delay_correction in ("predict", "predict_error_feedback")
        if predicting and self.prev is not None:  # P(t) -> W(t)
            for p, d in zip(self.params, self.prev):
                p.sub_(d)
        before = [p.detach().clone() for p in self.params]
        for opt in self.opts:
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        if self.cfg.delay_correction in ("error_feedback", "predict_error_feedback"):
            update = [p.detach() - b for p, b in zip(self.params, before)]
            if self.prev_update is not None and correct:
                for p, u, q in zip(self.params, update, self.prev_update):
                    p.add_(u - q, alpha=self.cfg.error_feedback_beta)
            self.prev_update = update
        if predicting:  # d(t): the update applied, error feedback's correction included
            self.prev = [p.detach() - b for p, b in zip(self.params, before)] if predict else None
            for p, d in zip(self.params, self.prev or ()):
                p.add_(d)


def reference_eval(cfg: Config, weights: Dict[str, torch.Tensor], *, balance: Sequence[int] = ()) -> float:
    """The validation loss of ``weights`` in one process: the mean microbatch loss over the
    ``train.eval_batches`` global batches of held-out windows that the pipeline evaluates. Under
    bf16/fp16, forward under autocast with the activation rounded where a pipeline of ``balance``
    sends it, as ``reference_run`` trains."""
    p = cfg.pipeline
    precision = precisions.resolve(cfg.train.precision, "cpu")
    source = model_source(cfg.model, seed=cfg.seed)
    model = StageBoundaries(source.build(), after=boundaries(balance), dtype=precisions.compute_dtype(precision))
    lm_loss = source.loss_fn
    model.load_state_dict(weights)
    model.eval()
    # One replica of w*m microbatches draws the same windows, in the same order, as w replicas of m.
    feed = make_feeds(
        cfg.data,
        seq_len=cfg.model.seq_len,
        microbatch_size=p.microbatch_size,
        num_microbatches=p.data_parallel * p.num_microbatches,
        seed=cfg.seed,
        num_replicas=1,
        replica=0,
    )[1]
    losses = []
    with torch.no_grad():
        for x, y in map(feed.microbatch, range(cfg.train.eval_batches * p.data_parallel * p.num_microbatches)):
            with precisions.autocast(precision, "cpu"):
                out = model(x)
            losses.append(lm_loss(out.float(), y))
    return float(torch.stack(losses).mean())
