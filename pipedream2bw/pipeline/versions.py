"""Pure: the weight versions of one stage (double-buffered under 2bw) and which one a batch uses.

2bw contract (docs/design.md section 2), t the batch index:
    batch t runs forward and backward with W(t-1), W(-1) = W(0)
    W(t+1) = W(t) - optimizer_step(g(t))     once the last backward of batch t is done
flush and gpipe: batch t uses W(t) (plain minibatch training).
2bw after N synchronous steps (pipeline.sync_warmup_steps=N): batch t uses W(t) for t <= N, W(t-1) after
(N = 0 is plain 2bw: W(-1) = W(0) is batch 0 reading W(0)).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn

from pipedream2bw.config.newest import PREDICT_HORIZON, prediction_replicas
from pipedream2bw.config.optimizers import (
    PARAM_TAGS,
    PREDICT_STATE,
    delay_corrected,
    predicted_offsets,
    predicts,
)
from pipedream2bw.pipeline import stateful
from pipedream2bw.pipeline.schedule import BACKWARD, FORWARD, STEP, Action, ScheduleError

log = logging.getLogger(__name__)

PREDICTED_WEIGHTS = "predicted_weights"
"""In a checkpoint's optimizer state of a parameter under weight prediction: the prediction P(n) its newest version
holds (the checkpoint's ``weights`` are W(n) = P(n) - d(n-1), which does not round-trip to P(n))."""


def version_of_batch(schedule: str, batch_index: int, *, sync_warmup_steps: int = 0) -> int:
    """The weight version W(v) that every microbatch of batch ``batch_index`` uses: under 2bw W(t-1), except
    that the first batches, t <= ``sync_warmup_steps`` (the flushing warm-up's N, and batch N, which starts the
    2bw pipeline from W(N) as batch 0 starts it from W(0)), read W(t)."""
    if schedule != "2bw" or batch_index <= sync_warmup_steps:
        return batch_index
    return batch_index - 1


def max_versions_alive(
    actions: Sequence[Action], *, schedule: str, num_microbatches: int, sync_warmup_steps: int = 0
) -> int:
    """Walks one stage's actions and returns the most weight versions it must hold at once.

    A version is alive while it is the newest or some batch that has not finished its
    backwards will use it.

    Raises:
        ScheduleError: a forward needs a version that no step has produced yet.
    """
    m = num_microbatches

    def version_of(t: int) -> int:
        return version_of_batch(schedule, t, sync_warmup_steps=sync_warmup_steps)

    newest, peak = 0, 1
    backwards_left = {}  # batch -> backwards still to run, for started batches
    for a in actions:
        t = a.index // m if a.kind != STEP else a.index
        if a.kind == FORWARD:
            if version_of(t) > newest:
                raise ScheduleError(f"{a}: needs W({version_of(t)}), newest is W({newest})")
            backwards_left.setdefault(t, m)
        elif a.kind == BACKWARD:
            backwards_left[t] -= 1
        elif a.kind == STEP:
            newest = t + 1
        unfinished = [b for b, left in backwards_left.items() if left > 0]
        # Batches not started yet will use versions >= those of started ones, up to `newest`.
        next_batch = max(backwards_left, default=-1) + 1
        alive = {newest} | {version_of(b) for b in unfinished + [next_batch]}
        peak = max(peak, len({v for v in alive if v <= newest}))
    return peak


def bucketize(params: Sequence[nn.Parameter], *, bucket_bytes: float) -> List[List[int]]:
    """Groups parameter indices into buckets of about ``bucket_bytes``, last parameters first.

    Backward produces the last layers' gradients first, so bucket 0 fills first and its
    all-reduce can start while earlier layers are still in backward.
    """
    buckets: List[List[int]] = [[]]
    size = 0
    for i in reversed(range(len(params))):
        if buckets[-1] and size + params[i].numel() * params[i].element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += params[i].numel() * params[i].element_size()
    return buckets


def grad_of(p: nn.Parameter) -> Optional[torch.Tensor]:
    """``p``'s accumulated gradient: its float32 ``main_grad`` where the weights are stored in a lower
    dtype (train.weight_dtype=compute, sharding.ShardedVersions), else ``p.grad``."""
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def set_grad(p: nn.Parameter, grad: Optional[torch.Tensor]) -> None:
    """Replaces ``p``'s accumulated gradient (``grad_of``'s)."""
    if hasattr(p, "main_grad"):
        p.main_grad = grad
    else:
        p.grad = grad


def _alias_parameter(p: nn.Parameter) -> nn.Parameter:
    """A parameter on ``p``'s storage with a version counter of its own.

    ``nn.Parameter(p.detach())`` would share ``p``'s counter, so every optimizer step through
    the master, whichever buffer it writes, would look to autograd like an in-place change
    of ``p`` and fail the backward of microbatches still in flight on ``p``.
    """
    alias = nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)
    alias.data = p.data
    return alias


class WeightVersions:
    """The live weight versions of one stage and the optimizers that make new ones.

    Versions live in ``replicas``: two copies of the stage's module under 2bw, one under
    flush and gpipe. The optimizers own separate ``master`` parameters whose storage is
    pointed at the replica being written before each step, so any ``torch.optim`` optimizer
    keeps its state keyed by stable parameter objects while the two buffers alternate.
    Gradients accumulate in the replica that the batch used (summed over its microbatches)
    and are scaled by ``grad_scale`` before the step (1/(m*w): the mean over the batch).
    Parameters are split into ``buckets`` with one optimizer each, so that a bucket can step
    as soon as its own gradients are averaged across replicas.

    ``step`` is the one step logic of every variant; where the masters live is a subclass's
    choice (``_make_masters``, ``_prepare_destination``, ``_attach_master``, ``_detach_master``):
    ``host_optim.HostOptimizerVersions`` keeps them, and the optimizer state, on the host.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        schedule: str,
        optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        buckets: Optional[Sequence[Sequence[int]]] = None,
        sync_warmup_steps: int = 0,
    ):
        self.schedule = schedule
        self.sync_warmup_steps = sync_warmup_steps  # 2bw: the steps before it that run synchronously
        self.replicas: List[nn.Module] = [module] + ([copy.deepcopy(module)] if schedule == "2bw" else [])
        self.holds: List[Optional[int]] = [0] + [None] * (len(self.replicas) - 1)
        # Each step walks the replicas' parameters: list them once (nn.Module.parameters() walks the
        # module tree every call, a millisecond per step of Python on a GPT; parameters are stable objects).
        self._params: List[List[nn.Parameter]] = [list(r.parameters()) for r in self.replicas]
        self.master = self._make_masters(module)
        for p, m in zip(self._params[0], self.master):  # Muon: which optimizer steps it, a split's whole matrix
            for tag in PARAM_TAGS:  # (config.optimizers)
                if hasattr(p, tag):
                    setattr(m, tag, getattr(p, tag))
        self.buckets = [list(b) for b in buckets] if buckets is not None else [list(range(len(self._params[0])))]
        assert sorted(i for b in self.buckets for i in b) == list(range(len(self._params[0]))), (
            "buckets must partition the parameters"
        )
        self.optimizers = [optimizer_factory(self._bucket_masters(k, b)) for k, b in enumerate(self.buckets)]
        if schedule == "2bw":  # buffers are not versioned: one set, which the worker names if training changes it
            stateful.share_buffers(self.replicas[1], module)

    def _make_masters(self, module: nn.Module) -> List[nn.Parameter]:
        """The parameters the optimizers own: here aliases whose storage ``step`` points at a replica."""
        return [_alias_parameter(p) for p in module.parameters()]

    def _bucket_masters(self, bucket_index: int, bucket: Sequence[int]) -> List[nn.Parameter]:
        """What bucket ``bucket_index``'s optimizer steps: here the masters of its parameters."""
        return [self.master[i] for i in bucket]

    def _replica_holding(self, version: int) -> int:
        assert version in self.holds, f"W({version}) is not alive; live versions: {self.holds}"
        return self.holds.index(version)

    def version_of(self, batch_index: int) -> int:
        """The version W(v) batch ``batch_index`` uses (``version_of_batch`` under this run's warm-up)."""
        return version_of_batch(self.schedule, batch_index, sync_warmup_steps=self.sync_warmup_steps)

    def delayed(self, batch_index: int) -> bool:
        """Whether batch t's gradient is taken at an older version than the W(t) its step updates (what a delay
        correction corrects)."""
        return self.version_of(batch_index) < batch_index

    def apply_may_wait(self, batch_index: int) -> bool:
        """Whether the step of batch t may wait past batch t+1's first forwards: batch t+1 reads an older
        version than W(t+1), and not batch t's (whose replica batch t+1 would accumulate its gradients into)."""
        t = batch_index
        return self.version_of(t + 1) <= t and self.version_of(t + 1) != self.version_of(t)

    def replica_for_batch(self, batch_index: int) -> int:
        """The index of the replica holding the version that batch ``batch_index`` uses."""
        return self._replica_holding(self.version_of(batch_index))

    def module_for_batch(self, batch_index: int) -> nn.Module:
        """The replica holding the version that batch ``batch_index`` uses."""
        return self.replicas[self.replica_for_batch(batch_index)]

    def module_for_forward(self, k: int, num_microbatches: int) -> nn.Module:
        """The replica F k runs on (its backward follows the graph onto the same): its batch's
        (``module_for_batch``; ``NewestVersions``: the newest)."""
        return self.module_for_batch(k // num_microbatches)

    def gather_gradients(self, batch_index: int) -> int:
        """Before batch t's last backward: gathers batch t's gradients so far into the replica that backward
        accumulates into and returns its index, where the batch's gradient is whole once it is done (what the
        data-parallel reducer arms on and ``step`` takes). Here nothing to gather: its batch's replica."""
        return self.replica_for_batch(batch_index)

    def newest(self) -> nn.Module:
        """The replica holding the newest version (what a checkpoint or export saves)."""
        return self.replicas[self._replica_holding(max(v for v in self.holds if v is not None))]

    def newest_parameters(self) -> List[nn.Parameter]:
        """``newest()``'s parameters, from the lists made at construction: no walk of the module tree (the finite
        check takes them every step)."""
        newest = self.newest()  # a subclass's first (host_optim: the background step it waits for)
        return next(params for replica, params in zip(self.replicas, self._params) if replica is newest)

    @torch.no_grad()
    def weights(self) -> nn.Module:
        """The newest weights W(n), what validation, the final weights and checkpoints take: ``newest()``, or, where
        it holds a prediction (optim.delay_correction=predict), a copy of it less each parameter's d(n-1)."""
        offsets = predicted_offsets(self.optimizers, self.master)
        if all(d is None for d in offsets):
            return self.newest()
        module = copy.deepcopy(self.newest())
        for p, d in zip(module.parameters(), offsets):
            if d is not None:
                p.sub_(d)
        return module

    @torch.no_grad()
    def step(
        self, batch_index: int, *, grad_scale: float, before_bucket: Callable[[int], None] = lambda i: None
    ) -> None:
        """Closes batch t: W(t+1) = W(t) - optimizer_step(grad_scale * sum of batch t's gradients).

        ``before_bucket(i)`` runs before bucket ``i`` steps (e.g. to wait for its all-reduce).
        """
        t = batch_index
        src = self._params[self._source(t)]
        dst_index = self._destination(t)
        dst = self._params[dst_index]
        self._prepare_destination(dst_index, t)
        for optimizer in self.optimizers:  # the synchronous warm-up's steps have no delay to correct
            delay_corrected(optimizer, now=self.delayed(t), next=self.delayed(t + 1))
        for bucket_index, (bucket, optimizer) in enumerate(zip(self.buckets, self.optimizers)):
            before_bucket(bucket_index)
            self._take_gradients(bucket, src, dst, grad_scale)
            self._step_bucket(bucket, optimizer, dst)
        self.holds[dst_index] = t + 1

    def _take_gradients(
        self, bucket: Sequence[int], src: Sequence[nn.Parameter], dst: Sequence[nn.Parameter], grad_scale: float
    ) -> None:
        """Scales a bucket's gradients and gives them to its masters; the replica ``src`` lets go of them."""
        grads = [src[i].grad for i in bucket if src[i].grad is not None]
        if grads and grad_scale != 1.0:
            # one kernel per bucket, not one per parameter (GPU launch overhead)
            torch._foreach_mul_(grads, grad_scale)
        for i in bucket:
            self._attach_master(i, dst[i], src[i].grad)
            src[i].grad = None

    def _step_bucket(
        self, bucket: Sequence[int], optimizer: torch.optim.Optimizer, dst: Sequence[nn.Parameter]
    ) -> None:
        """A bucket's optimizer step on its masters, whose new weights W(t+1) end in ``dst``."""
        optimizer.step()
        for i in bucket:
            self._detach_master(i, dst[i])

    def settle(self) -> None:
        """Waits for a step still running (``host_optim``'s background host step); here every step is done."""

    def _prepare_destination(self, dst_index: int, t: int) -> None:
        """Before a step: the optimizers step the masters in place on replica ``dst_index``'s storage,
        so it must hold W(t) first."""
        self._copy_newest_into(dst_index, t)

    def _attach_master(self, i: int, dst: nn.Parameter, grad: Optional[torch.Tensor]) -> None:
        """Gives master ``i`` the (scaled) gradient and the storage its step writes: ``dst``'s, W(t+1)'s replica."""
        self.master[i].data = dst.data
        self.master[i].grad = grad

    def _detach_master(self, i: int, dst: nn.Parameter) -> None:
        """After its bucket's step: master ``i`` lets go of the gradient (``dst`` already holds W(t+1))."""
        self.master[i].grad = None

    def _source(self, t: int) -> int:
        """The replica whose gradients step t takes: the one holding the version batch t ran with."""
        return self._replica_holding(self.version_of(t))

    def _destination(self, t: int) -> int:
        """The replica that receives W(t+1): the one not holding the version batch t+1 runs with."""
        still_needed = self.version_of(t + 1)
        return next(i for i, v in enumerate(self.holds) if v != still_needed)

    def _copy_newest_into(self, dst_index: int, t: int) -> None:
        """Puts W(t) into replica ``dst_index`` unless it holds it already (flush and gpipe's one replica)."""
        if self.holds[dst_index] != t:
            for d_param, w_param in zip(self._params[dst_index], self._params[self._replica_holding(t)]):
                d_param.copy_(w_param)

    @torch.no_grad()
    def skip(self, batch_index: int) -> None:
        """Closes batch t without a step: W(t+1) = W(t). Batch t's gradients are dropped and the
        optimizer state is untouched (a non-finite gradient, an fp16 overflow). Under 2bw the
        replica that would have received the step gets a copy of W(t)."""
        t = batch_index
        for p in self.module_for_batch(t).parameters():
            p.grad = None
        dst_index = self._destination(t)
        self._copy_newest_into(dst_index, t)
        self.holds[dst_index] = t + 1

    def optimizer_state_bytes(self) -> int:
        """Bytes of the optimizers' state tensors (a delay correction's copies with them), wherever they live."""
        return sum(
            v.numel() * v.element_size()
            for optimizer in self.optimizers
            for state in optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        )

    def set_lr(self, lr: float) -> None:
        """Sets the learning rate of every parameter group of every bucket's optimizer."""
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def state(self) -> Dict[str, Any]:
        """What a checkpoint saves, copied to the CPU and keyed by parameter name.

        ``weights``: the newest version W(n), n = steps taken; ``previous``: under 2bw the version
        batch n will run with, W(n-1) (else None); ``optimizer``: each parameter's optimizer
        state. Copies are taken now, so training may go on while they are written.
        """
        newest = max(v for v in self.holds if v is not None)
        previous = None
        if self.schedule == "2bw":
            previous = _cpu_copy(self._previous(newest).state_dict())
        names = [n for n, _ in self.replicas[0].named_parameters()]
        optimizer = {}
        for bucket, opt in zip(self.buckets, self.optimizers):
            order = self._state_order(bucket, opt)
            for pos, st in opt.state_dict()["state"].items():
                optimizer[names[order[pos]]] = _cpu_copy(st)
        held = dict(zip(names, self.newest().parameters()))
        for name, st in optimizer.items():  # weight prediction: the prediction P(n) itself, for an exact resume
            if PREDICT_STATE in st:
                st[PREDICTED_WEIGHTS] = held[name].detach().to("cpu", copy=True)
        return {
            "step": newest,
            "weights": _cpu_copy(self.weights().state_dict()),
            "previous": previous,
            "optimizer": optimizer,
        }

    def _previous(self, n: int) -> nn.Module:
        """Under 2bw, what a checkpoint after n steps saves as ``previous``: W(n-1), which batch n runs with."""
        return self.replicas[self._replica_holding(self.version_of(n))]

    @torch.no_grad()
    def load_state(
        self,
        *,
        step: int,
        weights: Dict[str, torch.Tensor],
        previous: Optional[Dict[str, torch.Tensor]],
        optimizer: Dict[str, dict],
    ) -> None:
        """Continues from a checkpoint taken after ``step`` steps (the inverse of ``state``).

        Under 2bw without ``previous`` (a flush or gpipe checkpoint), batch ``step`` runs with
        W(step) instead of W(step-1), as the very first batch does. The optimizers keep the
        hyperparameters of this run's config; only their per-parameter state is loaded.

        Raises:
            RuntimeError: names missing from or unexpected in ``weights`` (strict load).
        """
        self.replicas[0].load_state_dict(weights)
        optimizer = {name: dict(st) for name, st in optimizer.items()}
        predicting = any(predicts(opt) for opt in self.optimizers)
        for name, p in self.replicas[0].named_parameters():  # weight prediction: P(n), not W(n) (``state``)
            held = optimizer.get(name, {})
            if PREDICTED_WEIGHTS in held and predicting:
                p.copy_(held.pop(PREDICTED_WEIGHTS))
            elif not predicting:  # a checkpoint of a run that predicted: this one starts from W(n), no d
                held.pop(PREDICTED_WEIGHTS, None)
                held.pop(PREDICT_STATE, None)
        self.holds[0] = step
        if len(self.replicas) > 1:  # 2bw (``PredictedNewestVersions``: a third replica, which it loads itself)
            self.replicas[1].load_state_dict(previous if previous is not None else weights)
            self.holds[1] = self.version_of(step)
        names = [n for n, _ in self.replicas[0].named_parameters()]
        for bucket, opt in zip(self.buckets, self.optimizers):
            sd = opt.state_dict()
            sd["state"] = {
                pos: optimizer[names[i]]
                for pos, i in enumerate(self._state_order(bucket, opt))
                if names[i] in optimizer
            }
            opt.load_state_dict(sd)

    def _state_order(self, bucket: Sequence[int], optimizer: torch.optim.Optimizer) -> List[int]:
        """The parameter index of each position of ``optimizer.state_dict()["state"]``: positions run
        over its parameter groups in order (e.g. weight-decay groups), not over the bucket's order."""
        index = {id(self.master[i]): i for i in bucket}
        return [index[id(p)] for group in optimizer.param_groups for p in group["params"]]


class NewestVersions(WeightVersions):
    """pipeline.weight_versions=newest under 2bw: F k runs on the newest version the stage holds at that point of its
    schedule, and its backward (the graph's) on the same replica. So a batch's gradients sit in up to two replicas:
    ``gather_gradients`` sums them into W(t)'s before the batch's last backward (which runs there), so that the
    data-parallel reducer averages the whole batch's, and step(t) takes them from there. With APPLY(t) right at
    CLOSE(t) (config/newest.py refuses every deferral), batch t's microbatches forwarded before APPLY(t-1) ran on
    W(t-1), the rest on W(t); the microbatches in flight at APPLY(t), batch t+1's first ones, were forwarded after
    APPLY(t-1) (d - s + lead <= m) and so run on W(t): W(t+1) goes into the replica of W(t-1), which none of them
    needs (``step`` asserts it).

    ``early_forwards``: how many of a batch's forwards the stage runs before its previous batch's step (d - s - 1 +
    its forward lead). A run resumed after n steps starts its pipeline afresh at batch n, with no step n-1 to wait
    for: its first ``early_forwards`` forwards run on W(n-1), the checkpoint's ``previous``, as they did in the run
    that wrote it."""

    def __init__(
        self, module: nn.Module, *, early_forwards: int = 0, num_microbatches: Optional[int] = None, **kwargs: Any
    ):
        super().__init__(module, **kwargs)
        assert self.schedule == "2bw" and self.sync_warmup_steps == 0, "newest: plain 2bw only (config/newest.py)"
        self._ran_on: Dict[int, int] = {}  # microbatch k -> the replica its forward ran on, until its batch's step
        self._m: Optional[int] = num_microbatches
        self._early, self._resumed_early = early_forwards, 0  # the latter: forwards left on W(n-1) after a resume

    def module_for_forward(self, k: int, num_microbatches: int) -> nn.Module:
        """The replica holding the newest version (after a resume, W(n-1) for the first ``early_forwards``), recorded
        for ``step``'s check."""
        self._m = num_microbatches
        if self._resumed_early:
            self._resumed_early -= 1
            self._ran_on[k] = self.replica_for_batch(k // num_microbatches)
        else:
            self._ran_on[k] = self._replica_holding(max(v for v in self.holds if v is not None))
        return self.replicas[self._ran_on[k]]

    def load_state(self, **kwargs: Any) -> None:
        """``WeightVersions.load_state``; the next ``early_forwards`` forwards then run on W(n-1) (``previous``)."""
        super().load_state(**kwargs)
        self._resumed_early = self._early

    @torch.no_grad()
    def gather_gradients(self, batch_index: int) -> int:
        """Before batch t's last backward: the early microbatches' gradients (on W(t-1)) added into the replica its
        last microbatch ran on (W(t): its forward follows step t-1, early forwards < m), which the step takes them
        from (``_source``) and the data-parallel reducer averages as that backward goes."""
        t = batch_index
        late = self._ran_on.get((t + 1) * (self._m or 0) - 1, self._source(t))
        assert late == self._source(t), f"batch {t}'s last microbatch ran on replica {late}, not W({t})'s"
        self._fold_into(late)
        return late

    def _fold_into(self, index: int) -> None:
        """Adds every other replica's gradients into replica ``index``'s; the others let go of theirs. Replica by
        replica in index order, one foreach add each: every parameter's sum is the per-parameter loop's, bit for bit
        (a foreach add is the same elementwise add), without a Python iteration per parameter and replica."""
        into = self._params[index]
        for r, params in enumerate(self._params):
            if r == index:
                continue
            held = [(p, q) for p, q in zip(into, params) if q.grad is not None]
            summed = [(p.grad, q.grad) for p, q in held if p.grad is not None]
            if summed:
                torch._foreach_add_([a for a, _ in summed], [b for _, b in summed])
            for p, q in held:
                if p.grad is None:
                    p.grad = q.grad
                q.grad = None

    def _source(self, t: int) -> int:
        """The replica whose gradients step t takes: W(t)'s, which batch t's last microbatch ran on."""
        return self._replica_holding(t)

    @torch.no_grad()
    def step(self, batch_index: int, **kwargs: Any) -> None:
        """``WeightVersions.step`` on the sum of batch t's gradients over both replicas, in W(t)'s (``_source``):
        ``gather_gradients`` summed them before the last backward; what a caller that did not call it left in the
        other replica is added here. W(t+1) goes into W(t-1)'s replica, first given W(t)."""
        t = batch_index
        self._fold_into(self._source(t))
        dst_index = self._destination(t)
        first_next = (t + 1) * (self._m or 0)  # batch t+1's forwards so far are the microbatches in flight
        in_flight = {k: r for k, r in self._ran_on.items() if k >= first_next}
        assert dst_index not in in_flight.values(), f"step {t} would overwrite the version of microbatches {in_flight}"
        self._ran_on = in_flight
        super().step(t, **kwargs)

    @torch.no_grad()
    def skip(self, batch_index: int) -> None:
        """``WeightVersions.skip``, dropping batch t's gradients in both replicas."""
        for params in self._params:
            for p in params:
                p.grad = None
        super().skip(batch_index)


NEWEST_DELTA = "newest_last_delta"
"""In a checkpoint's optimizer state of a parameter under newest with the prediction: d(n-1) = W(n) - W(n-1), which
the next prediction adds (``PredictedNewestVersions``)."""


class PredictedNewestVersions(NewestVersions):
    """pipeline.weight_versions=newest with optim.delay_correction=predict: a stage's early forwards of batch t (those
    run before its step t-1, ``NewestVersions``) run on the prediction P(t) = W(t-1) + h d(t-2) of the W(t) they miss
    (h: optim.predict_horizon, 1.5 by default; 1 would predict W(t) were the step repeated), d(t-2) = W(t-1) - W(t-2)
    the last step's change (d(-1) = 0); the rest on W(t), as under newest.

    Replica 0 holds the exact W and is stepped in place: at step t no microbatch in flight runs on it (batch t+1's
    early ones run on a prediction). P(t) is written before batch t's first early forward, or at step t-1 if no
    forward of batch t came first (a run's last step, so a checkpoint holds P(n)), into replica 1 where batch t-1's
    early microbatches are through their backwards by then (2E <= m, E = ``early_forwards``), else into replica
    1 + t % 2 (config/newest.py's ``prediction_replicas``): batch t-2's always are (E <= m - 1), so a third buffer
    suffices. d costs 4 B a parameter; no other state.

    ``num_microbatches``: m, which with ``early_forwards`` sets the prediction's replicas; ``horizon``: h in
    P(t) = W(t-1) + h d(t-2) (optim.predict_horizon; 1 predicts W(t))."""

    def __init__(self, module: nn.Module, *, num_microbatches: int, horizon: float = PREDICT_HORIZON, **kwargs: Any):
        super().__init__(module, num_microbatches=num_microbatches, **kwargs)
        self._horizon = horizon
        self._buffers = prediction_replicas(self._early, num_microbatches)
        for _ in range(self._buffers - 1):  # the second prediction: a replica like replica 1 (share_buffers)
            self.replicas.append(copy.deepcopy(module))
            self._params.append(list(self.replicas[-1].parameters()))
            stateful.share_buffers(self.replicas[-1], module)
        self.holds = [self.holds[0]] + [None] * self._buffers  # the predictions' replicas hold no version
        self._delta = [torch.zeros_like(p) for p in self._params[0]]
        self._predicted: Dict[int, int] = {}  # replica -> the batch whose P it holds

    def _prediction_replica(self, t: int) -> int:
        """The replica P(t) goes in: 1, or 1 + t % 2 with two prediction replicas."""
        return 1 + t % self._buffers

    def module_for_forward(self, k: int, num_microbatches: int) -> nn.Module:
        """P(t)'s replica for an early forward of batch t (before step t-1; after a resume, the first
        ``early_forwards``); else replica 0's W(t)."""
        t = k // num_microbatches
        early = self._resumed_early > 0 or self.holds[0] < t
        if self._resumed_early:
            self._resumed_early -= 1
        replica = self._prediction_replica(t) if early else 0
        if early and self._predicted.get(replica) != t:
            self._predict(t)
        self._ran_on[k] = replica
        return self.replicas[replica]

    @torch.no_grad()
    def _predict(self, t: int) -> None:
        """P(t) = W(t-1) + h d(t-2) into its replica, replica 0 holding W(t-1)."""
        assert self.holds[0] == t - 1, f"P({t}) needs W({t - 1}); replica 0 holds W({self.holds[0]})"
        replica = self._prediction_replica(t)
        torch._foreach_copy_(self._params[replica], self._params[0])
        torch._foreach_add_(self._params[replica], self._delta, alpha=self._horizon)
        self._predicted[replica] = t

    def _source(self, t: int) -> int:
        return 0

    def _destination(self, t: int) -> int:
        return 0

    @torch.no_grad()
    def step(self, batch_index: int, **kwargs: Any) -> None:
        """``NewestVersions.step`` in place on replica 0, and d(t) = W(t+1) - W(t); P(t+1) first, where no forward of
        batch t+1 wrote it (it reads d(t-1))."""
        t = batch_index
        if self._predicted.get(self._prediction_replica(t + 1)) != t + 1:  # also with no early forward (the last
            self._predict(t + 1)  # stage): a checkpoint's P(n), which a resume at another layout may run on
        torch._foreach_copy_(self._delta, self._params[0])
        super().step(t, **kwargs)
        torch._foreach_sub_(self._delta, self._params[0])
        torch._foreach_neg_(self._delta)

    def optimizer_state_bytes(self) -> int:
        """The optimizers' state and d, the prediction's state (4 B a parameter, as the batch rule's prediction keeps
        in its optimizer's: config/corrections.py's ``state_copies``)."""
        return super().optimizer_state_bytes() + sum(d.numel() * d.element_size() for d in self._delta)

    def _previous(self, n: int) -> nn.Module:
        """P(n), which batch n's early forwards run on (``step`` wrote it at the latest at step n-1)."""
        return self.replicas[self._prediction_replica(n)]

    def state(self) -> Dict[str, Any]:
        """``WeightVersions.state`` with each parameter's d(n-1) (``NEWEST_DELTA``)."""
        saved = super().state()
        names = [n for n, _ in self.replicas[0].named_parameters()]
        for name, d in zip(names, self._delta):
            saved["optimizer"].setdefault(name, {})[NEWEST_DELTA] = d.detach().to("cpu", copy=True)
        return saved

    @torch.no_grad()
    def load_state(self, *, step: int, optimizer: Dict[str, dict], **kwargs: Any) -> None:
        """``NewestVersions.load_state``: P(n)'s replica takes it (the checkpoint's ``previous``), d its d(n-1).

        Raises:
            ValueError: the checkpoint holds no d (written without the prediction) or no ``previous``.
        """
        optimizer = {name: dict(st) for name, st in optimizer.items()}
        names = [n for n, _ in self.replicas[0].named_parameters()]
        missing = [n for n in names if NEWEST_DELTA not in optimizer.get(n, {})]
        if missing or kwargs.get("previous") is None:
            raise ValueError(
                "this checkpoint was not written under pipeline.weight_versions=newest with optim.delay_correction="
                f"predict (no {NEWEST_DELTA!r} for {missing[:3]} or no previous weights): resume it with the rule "
                "that wrote it"
            )
        deltas = [optimizer[n].pop(NEWEST_DELTA) for n in names]
        super().load_state(step=step, optimizer=optimizer, **kwargs)  # P(n) into replica 1
        replica = self._prediction_replica(step)
        if replica != 1:
            self.replicas[replica].load_state_dict(kwargs["previous"])
        self.holds[1:] = [None] * self._buffers
        for d, saved in zip(self._delta, deltas):
            d.copy_(saved)
        self._predicted = {replica: step}


def _cpu_copy(state: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else copy.deepcopy(v) for k, v in state.items()}
