"""Pure: float32 master weights and optimizer state held per bucket, sharded over a stage's replicas (ZeRO-1).

docs/design.md section 10. A bucket's parameters, flattened in bucket order, are one vector of
N elements, padded to ``w * S`` (S = ceil(N / w)); replica r of the stage's w replicas owns elements
[r*S, (r+1)*S): their float32 master weights and the optimizer state of those elements only.
Closing batch t (docs/design.md sections 2 and 7)::

    g(t)       reduce-scatter of the bucket over the w replicas: replica r receives the sum of its shard
    APPLY(t)   replica r steps its shard of the masters (the optimizer sees one piece per parameter)
    W(t+1)     all-gather of the stepped shards into the replica that batch t+2 will read

The collectives are the caller's (``comm.ShardedReduction`` and ``comm.all_gather_async``); this
module only lays out and steps the shards. The same class keeps float32 masters for one replica
(``num_shards=1``, no collective) when the weight versions are stored in the compute dtype
(``train.weight_dtype=compute``), and for the buckets of weights tied across stages, which are summed
by their own exchange (ties.py) and so are not sharded.

The optimizer must be elementwise (SGD, Adam, AdamW, RMSprop, ...): it sees pieces of parameters.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from pipedream2bw.memory.host_optim import synchronous_host_step
from pipedream2bw.pipeline.versions import WeightVersions, _cpu_copy, grad_of, set_grad, version_of_batch

# (shard, full) -> a wait: starts gathering every replica's ``shard`` into ``full`` (comm.all_gather_async)
Gather = Callable[[torch.Tensor, torch.Tensor], Callable[[], None]]


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``param`` that one replica's shard holds: its flat elements [start, stop),
    at [offset, offset + stop - start) of the shard."""

    param: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class BucketShard:
    """One bucket flattened (parameters in bucket order) and the shard that replica ``index`` of ``count`` owns."""

    params: Tuple[int, ...]  # parameter indices, in the order of the flat vector
    numels: Tuple[int, ...]
    index: int
    count: int

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        """S: every replica's shard has S elements (the last ones padded)."""
        return max(1, math.ceil(self.numel / self.count))

    def bounds(self, index: Optional[int] = None) -> Tuple[int, int]:
        """Replica ``index``'s (default: this one's) elements [lo, hi) of the flat bucket, padding excluded."""
        r = self.index if index is None else index
        return min(r * self.shard_numel, self.numel), min((r + 1) * self.shard_numel, self.numel)

    def pieces(self) -> List[Piece]:
        lo, hi = self.bounds()
        out, start = [], 0
        for i, n in zip(self.params, self.numels):
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                out.append(Piece(i, a - start, b - start, a - lo))
            start += n
        return out


class ShardedVersions(WeightVersions):
    """``WeightVersions`` whose optimizers step float32 masters of their own, sharded per bucket.

    Args:
        module: the stage (replica 0 of the weights; its float32 values are the first masters).
        schedule: '2bw', 'flush' or 'gpipe'.
        optimizer_factory: builds one bucket's optimizer over its pieces (elementwise optimizers only).
        buckets: parameter indices per bucket; the first ``num_sharded`` are sharded over the replicas.
        num_sharded: buckets whose gradients arrive reduce-scattered (``step``'s ``before_bucket``
            returns this replica's summed shard); the others (ties) are read whole from the gradients.
        shard_index: this replica r; num_shards: w (1: masters only, nothing sharded).
        host: masters and optimizer state in host memory (swap.optimizer=host).
        weight_dtype: the dtype the weight versions are stored in (float32, or the compute dtype).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        schedule: str,
        optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        buckets: Sequence[Sequence[int]],
        num_sharded: int,
        shard_index: int = 0,
        num_shards: int = 1,
        host: bool = False,
        weight_dtype: torch.dtype = torch.float32,
    ):
        params = list(module.parameters())
        self.layouts = [
            BucketShard(
                tuple(b),
                tuple(params[i].numel() for i in b),
                shard_index if k < num_sharded else 0,
                num_shards if k < num_sharded else 1,
            )
            for k, b in enumerate(buckets)
        ]
        self.num_sharded, self.host, self.weight_dtype = num_sharded, host, weight_dtype
        # host: its optimizer steps there, on the training thread (host_optim.synchronous_host_step)
        self.host_step_s = self.host_step_wait_s = self.host_step_cpu_s = 0.0
        self.shard_index = shard_index
        self.master_device = torch.device("cpu") if host else params[0].device
        self.gather: Optional[Gather] = None  # comm's all-gather, connected once the stage's group exists
        with torch.no_grad():  # masters first, from the float32 module; then the versions take their dtype
            self.shards = [self._initial_shard(layout, params) for layout in self.layouts]
        self.pieces = [
            [self._piece(shard, p, params[p.param]) for p in layout.pieces()] or [self._empty_piece(shard)]
            for layout, shard in zip(self.layouts, self.shards)
        ]
        module.to(weight_dtype)
        super().__init__(module, schedule=schedule, optimizer_factory=optimizer_factory, buckets=buckets)
        # Each replica's parameters of a sharded bucket are views of one flat tensor, padded to w * S: the
        # all-gather writes W(t+1) straight into them (no copy, no second buffer while it travels).
        self.flat = [[self._flatten(params, layout) for layout in self.layouts] for params in self._params]
        self._pending: Dict[int, List[Callable[[], None]]] = {}  # replica -> the waits of its all-gathers
        self.gather_wait_s = 0.0  # time spent waiting for all-gathers (exposed: not hidden behind compute)
        if weight_dtype != torch.float32:  # before the GradReducer's hooks, which read the float32 sum
            for replica in self._params:
                for p in replica:
                    p.main_grad = None
                    p.register_post_accumulate_grad_hook(_accumulate_in_float32)

    def _flatten(self, params: Sequence[nn.Parameter], layout: BucketShard) -> Optional[torch.Tensor]:
        """A sharded bucket's parameters moved onto one flat tensor of ``w * S`` elements (None if not sharded)."""
        if layout.count == 1:
            return None
        first = params[layout.params[0]]
        flat = torch.zeros(layout.count * layout.shard_numel, dtype=first.dtype, device=first.device)
        start = 0
        for i, n in zip(layout.params, layout.numels):
            flat[start : start + n].copy_(params[i].detach().reshape(-1))
            params[i].data = flat[start : start + n].view_as(params[i])
            start += n
        return flat

    def _initial_shard(self, layout: BucketShard, params: Sequence[nn.Parameter]) -> torch.Tensor:
        flat = torch.cat([params[i].detach().reshape(-1).float() for i in layout.params])
        lo, hi = layout.bounds()
        shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.master_device)
        shard[: hi - lo].copy_(flat[lo:hi])
        if self.host and params[0].device.type == "cuda":
            shard = shard.pin_memory()
        return shard

    @staticmethod
    def _piece(shard: torch.Tensor, piece: Piece, param: nn.Parameter) -> nn.Parameter:
        """A master parameter on ``shard``'s storage. A piece of a matrix is shaped (1, n): the optimizer's
        parameter groups tell weights from biases and norms by dimension (config.param_groups)."""
        view = shard[piece.offset : piece.offset + piece.stop - piece.start]
        master = nn.Parameter(torch.empty(0, device=shard.device), requires_grad=param.requires_grad)
        master.data = view.view(1, -1) if param.dim() >= 2 else view
        return master

    @staticmethod
    def _empty_piece(shard: torch.Tensor) -> nn.Parameter:
        """A bucket smaller than its replicas leaves some with padding only: an empty master keeps the
        bucket's optimizer (torch refuses an empty parameter list), stepping nothing."""
        return nn.Parameter(shard[:0])

    def _make_masters(self, module: nn.Module) -> List[nn.Parameter]:
        """The optimizers' parameters, in bucket order (``__init__`` maps them back to buckets)."""
        return [piece for pieces in self.pieces for piece in pieces]

    def _bucket_masters(self, bucket_index: int, bucket: Sequence[int]) -> List[nn.Parameter]:
        return self.pieces[bucket_index]

    @torch.no_grad()
    def step(
        self,
        batch_index: int,
        *,
        grad_scale: float,
        before_bucket: Callable[[int], Optional[torch.Tensor]] = lambda i: None,
    ) -> None:
        """Closes batch t: each bucket's shard steps on its gradient x ``grad_scale``; W(t+1) goes to the
        replica that does not hold W(t) (2bw: the one batch t+2 reads; flush, gpipe: the only one).

        ``before_bucket(b)`` waits for bucket b's reduction and returns this replica's summed shard of
        its gradient (a sharded bucket), or None (the gradient is in the parameters' ``.grad``).
        """
        t = batch_index
        self.settle()
        src = self._params[self._replica_holding(version_of_batch(self.schedule, t))]
        dst_index = self._destination(t)
        dst = self._params[dst_index]
        gathers = []
        for b, (layout, optimizer) in enumerate(zip(self.layouts, self.optimizers)):
            grad = before_bucket(b)
            if grad is not None:  # a sharded bucket: this replica's summed shard of its gradient
                grad.mul_(grad_scale)
            for master, piece in zip(self.pieces[b], layout.pieces()):
                master.grad = (
                    grad[piece.offset : piece.offset + piece.stop - piece.start].view_as(master)
                    if grad is not None
                    else self._whole_gradient(src[piece.param], master, grad_scale)
                )
            with synchronous_host_step(self) if self.host else contextlib.nullcontext():
                optimizer.step()
            for master in self.pieces[b]:
                master.grad = None
            for i in layout.params:
                set_grad(src[i], None)
            # bucket b's all-gather travels while bucket b+1 steps, and on until W(t+1)'s first reader
            gathers.append(self._gather(b, layout, dst_index, dst))
        self._pending[dst_index] = gathers
        self.holds[dst_index] = t + 1

    def settle(self, replica: Optional[int] = None) -> None:
        """Waits for the all-gathers still writing into ``replica`` (default: any)."""
        for r in [replica] if replica is not None else list(self._pending):
            waits = self._pending.pop(r, [])
            start = time.perf_counter()
            for wait in waits:
                wait()
            self.gather_wait_s += time.perf_counter() - start if waits else 0.0

    def module_for_batch(self, batch_index: int) -> nn.Module:
        """``WeightVersions.module_for_batch``, once the all-gathers into that replica are done: under 2bw
        W(t+1)'s gather, started at APPLY(t), is waited here by batch t+2's first forward."""
        index = self.replica_for_batch(batch_index)
        self.settle(index)
        return self.replicas[index]

    def newest(self) -> nn.Module:
        self.settle()
        return super().newest()

    @staticmethod
    def _whole_gradient(param: nn.Parameter, master: nn.Parameter, grad_scale: float) -> Optional[torch.Tensor]:
        """A bucket not sharded: the parameter's own float32 gradient, scaled in place (no flat copy: the
        step's peak holds no second gradient); None (no step, as unsharded) if it got none."""
        grad = grad_of(param)
        if grad is None:
            return None
        return grad.float().mul_(grad_scale).reshape(master.shape).to(master.device)

    def _gather(self, b: int, layout: BucketShard, dst_index: int, dst: Sequence[nn.Parameter]) -> Callable[[], None]:
        """Starts putting every replica's stepped shard into replica ``dst_index``'s flat bucket (a bucket
        not sharded: its masters copied at once); returns the wait.

        The shard is cast (the weights' dtype) and moved (a host shard) straight into this replica's own
        slice of the flat bucket, which the all-gather then sends in place: no copy of the shard is held
        while the gather travels (under 2bw until batch t+2's first forward, past batch t+1's backwards).
        """
        shard = self.shards[b]
        if layout.count == 1:
            start = 0
            for i, n in zip(layout.params, layout.numels):
                dst[i].view(-1).copy_(shard[start : start + n], non_blocking=True)
                start += n
            return lambda: None
        assert self.gather is not None, "a sharded bucket needs connect(gather) before the first step"
        full = self.flat[dst_index][b]
        own = full[layout.index * layout.shard_numel : (layout.index + 1) * layout.shard_numel]
        own.copy_(shard, non_blocking=True)
        return self.gather(own, full)

    @torch.no_grad()
    def skip(self, batch_index: int) -> None:
        """``WeightVersions.skip``; the float32 gradient sums are dropped too (the masters hold W(t))."""
        self.settle()
        for p in self.module_for_batch(batch_index).parameters():
            set_grad(p, None)
        super().skip(batch_index)

    def connect(self, gather: Gather) -> None:
        """Gives the versions the all-gather over the stage's replicas (comm.all_gather_async on its group)."""
        self.gather = gather

    def grad_sq_norm(
        self, shard_grad: Callable[[int], Optional[torch.Tensor]], t: int, *, excluded=(), count_whole: bool
    ) -> torch.Tensor:
        """This replica's part of batch t's squared gradient norm (float64, unscaled): its shards of the
        sharded buckets (each element counted by one replica; an ``excluded`` parameter's pieces left out: at t > 1
        another tensor rank counts a whole parameter), and, if ``count_whole`` (replica 0: the replicas hold the same
        whole gradients), the other buckets' gradients but ``excluded`` parameters."""
        from pipedream2bw.pipeline.agreement import sq_norm

        module_params = list(self.module_for_batch(t).parameters())
        grads = []
        for b, layout in enumerate(self.layouts):
            if b < self.num_sharded and layout.count > 1:
                shard = shard_grad(b)
                if shard is None or not excluded or not set(layout.params) & set(excluded):
                    grads.append(shard)
                else:
                    grads += [
                        shard[p.offset : p.offset + p.stop - p.start]
                        for p in layout.pieces()
                        if p.param not in excluded
                    ]
            elif count_whole:
                grads += [grad_of(module_params[i]) for i in layout.params if i not in excluded]
        return sq_norm([g for g in grads if g is not None])

    def state(self) -> Dict[str, Any]:
        """``WeightVersions.state`` but ``optimizer`` (empty): ``shards`` holds this replica's float32
        masters and optimizer state (``shard_state``), which checkpoint.py writes per replica and
        reassembles, whole, for any (d, w) with sharding on or off."""
        self.settle()
        newest = max(v for v in self.holds if v is not None)
        return {
            "step": newest,
            "weights": _float(_cpu_copy(self.newest().state_dict())),
            "previous": self._previous_state(newest),
            "optimizer": {},
            "shards": self.shard_state(),
        }

    def _previous_state(self, newest: int) -> Optional[Dict[str, torch.Tensor]]:
        """2bw's older version (the one batch ``newest`` + 1 reads), float32 on the CPU; None under flush and gpipe."""
        if self.schedule != "2bw":
            return None
        return _float(_cpu_copy(self.replicas[self._replica_holding(version_of_batch("2bw", newest))].state_dict()))

    def whole_state(self, *, keep: bool = True) -> Optional[Dict[str, Any]]:
        """``state()`` with every parameter of this stage whole and no shards (pipeline.tensor_parallel's checkpoints,
        whose whole tensors come from pieces, not from shards of flat buckets): the float32 masters as the weights
        (the versions are their rounding: ``final_state``) and the optimizer state (``whole_optimizer``), both
        all-gathered over the stage's replicas - collectives, which every replica calls.

        Args:
            keep: false on a replica that writes nothing: it takes part in the gathers and returns None.
        """
        weights = self.final_state(keep=keep)
        optimizer = self.whole_optimizer(keep=keep)
        if not keep:
            return None
        newest = max(v for v in self.holds if v is not None)
        return {"step": newest, "weights": weights, "previous": self._previous_state(newest), "optimizer": optimizer}

    def _gathered(self, layout: BucketShard, own: torch.Tensor) -> torch.Tensor:
        """The whole flat bucket from every replica's ``own`` shard of it (a sharded bucket's all-gather over the
        stage's replicas, waited for; not sharded: ``own`` is the bucket)."""
        if layout.count == 1:
            return own
        device = self._params[0][layout.params[0]].device
        flat = torch.empty(layout.count * layout.shard_numel, dtype=torch.float32, device=device)
        assert self.gather is not None, "a sharded bucket needs connect(gather) before its state is gathered"
        self.gather(own.to(device, torch.float32), flat)()
        return flat

    @torch.no_grad()
    def final_state(self, *, keep: bool = True) -> Optional[Dict[str, torch.Tensor]]:
        """The newest weights at full precision, on the CPU: the newest version's state_dict in float32 with
        every parameter's float32 master in its place (under train.weight_dtype=compute the versions are
        rounded; the masters are the weights training holds). A sharded bucket's masters are all-gathered
        over the stage's replicas, one bucket at a time: a collective, which every replica calls.

        Args:
            keep: false on a replica that writes nothing: it takes part in the gathers and returns None.
        """
        self.settle()
        state = _float(_cpu_copy(self.newest().state_dict())) if keep else None
        params = self._params[0]
        names = [n for n, _ in self.replicas[0].named_parameters()]
        for layout, shard in zip(self.layouts, self.shards):
            flat = self._gathered(layout, shard)
            start = 0
            for i, n in zip(layout.params, layout.numels):
                if state is not None:
                    state[names[i]] = flat[start : start + n].view(params[i].shape).to("cpu", copy=True)
                start += n
        return state

    @torch.no_grad()
    def whole_optimizer(self, *, keep: bool = True) -> Optional[Dict[str, Dict[str, Any]]]:
        """Every parameter's optimizer state whole, as ``WeightVersions.state()['optimizer']`` holds it (per-element
        tensors shaped as the parameter, on the CPU): a sharded bucket's all-gathered over the stage's replicas, one
        bucket and state key at a time - a collective, which every replica calls (``keep`` false: it takes part and
        returns None)."""
        self.settle()
        params, names = self._params[0], [n for n, _ in self.replicas[0].named_parameters()]
        out: Dict[str, Dict[str, Any]] = {}
        for b, (layout, optimizer) in enumerate(zip(self.layouts, self.optimizers)):
            states = [optimizer.state.get(m, {}) for m in self.pieces[b]]
            held = next((i for i, st in enumerate(states) if st), None)  # a piece the optimizer has stepped
            first = states[held] if held is not None else {}
            flat_keys = sorted(k for k, v in first.items() if _per_element(v, self.pieces[b][held]))
            flats = {}
            for key in flat_keys:
                own = torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.master_device)
                for piece, st in zip(layout.pieces(), states):
                    own[piece.offset : piece.offset + piece.stop - piece.start] = st[key].reshape(-1)
                flats[key] = self._gathered(layout, own)
            if not keep:
                continue
            start = 0
            for i, n in zip(layout.params, layout.numels):
                state = {k: _cpu_value(v) for k, v in first.items() if k not in flats}
                shape = params[i].shape
                state.update({k: f[start : start + n].view(shape).to("cpu", copy=True) for k, f in flats.items()})
                out[names[i]] = state
                start += n
        return out if keep else None

    def shard_state(self) -> Dict[str, Dict[str, Any]]:
        """Per parameter name, the piece of it this replica writes to a checkpoint: ``range`` [start, stop)
        of its flat elements, ``numel`` (the whole parameter's), its float32 ``master`` values (flat) and
        its optimizer ``state`` (per-element tensors flat, the rest, e.g. Adam's step, as they are).
        Buckets not sharded (ties; the masters of train.weight_dtype=compute) are written by shard 0 only:
        every replica holds the same."""
        names = [n for n, _ in self.replicas[0].named_parameters()]
        out = {}
        for b, (layout, optimizer) in enumerate(zip(self.layouts, self.optimizers)):
            if layout.count == 1 and self.shard_index != 0:
                continue
            for master, piece in zip(self.pieces[b], layout.pieces()):
                numel = layout.numels[layout.params.index(piece.param)]
                out[names[piece.param]] = piece_state(
                    master, optimizer, start=piece.start, stop=piece.stop, numel=numel
                )
        return out

    @torch.no_grad()
    def load_state(
        self,
        *,
        step: int,
        weights: Dict[str, torch.Tensor],
        previous: Optional[Dict[str, torch.Tensor]],
        optimizer: Dict[str, dict],
        masters: Optional[Dict[str, torch.Tensor]] = None,
    ) -> None:
        """Continues from a checkpoint (``WeightVersions.load_state``'s arguments, ``optimizer`` holding
        whole tensors per parameter name): the masters are the checkpoint's float32 ``masters`` where it
        has them (a run with float32 masters of its own), else its ``weights``, sliced to this shard;
        each piece takes its elements of the optimizer state."""
        names = [n for n, _ in self.replicas[0].named_parameters()]
        masters = masters or {}
        for layout, shard in zip(self.layouts, self.shards):
            flat = torch.cat([masters.get(names[i], weights[names[i]]).reshape(-1).float() for i in layout.params])
            lo, hi = layout.bounds()
            shard.zero_()
            shard[: hi - lo].copy_(flat[lo:hi])
        cast = {k: v.to(self.weight_dtype) if v.is_floating_point() else v for k, v in weights.items()}
        prev = (
            None
            if previous is None
            else {k: v.to(self.weight_dtype) if v.is_floating_point() else v for k, v in previous.items()}
        )
        self.replicas[0].load_state_dict(cast)
        self.holds[0] = step
        if len(self.replicas) == 2:
            self.replicas[1].load_state_dict(prev if prev is not None else cast)
            self.holds[1] = version_of_batch("2bw", step)
        for b, (layout, opt) in enumerate(zip(self.layouts, self.optimizers)):
            for master, piece in zip(self.pieces[b], layout.pieces()):
                whole = optimizer.get(names[piece.param])
                if not whole:
                    continue
                opt.state[master] = {
                    k: v.reshape(-1)[piece.start : piece.stop].to(master.device, copy=True).view_as(master)
                    if torch.is_tensor(v) and v.numel() == layout.numels[layout.params.index(piece.param)]
                    else (v.clone() if torch.is_tensor(v) else v)
                    for k, v in whole.items()
                }


def _accumulate_in_float32(p: nn.Parameter) -> None:
    """Post-accumulate hook of a weight stored in the compute dtype: adds its microbatch gradient to the
    float32 sum ``main_grad`` and frees it, so that a batch's m microbatches are summed in float32."""
    p.main_grad = p.grad.float() if p.main_grad is None else p.main_grad.add_(p.grad)
    p.grad = None


def piece_state(master: nn.Parameter, optimizer, *, start: int, stop: int, numel: int) -> Dict[str, Any]:
    """One entry of ``shard_state``: the float32 master piece ``[start, stop)`` of a parameter of ``numel`` elements
    and its optimizer state, flat and on the CPU (per-element state flattened as the piece, the rest copied)."""
    return {
        "range": (start, stop),
        "numel": numel,
        "master": master.detach().reshape(-1).to("cpu", copy=True),
        "state": {
            k: v.detach().reshape(-1).to("cpu", copy=True) if _per_element(v, master) else _cpu_value(v)
            for k, v in optimizer.state.get(master, {}).items()
        },
    }


def _per_element(value: Any, master: nn.Parameter) -> bool:
    """An optimizer-state tensor with one value per element of its parameter (Adam's moments), not its step."""
    return torch.is_tensor(value) and value.numel() == master.numel() and value.dim() > 0


def _cpu_value(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


def _float(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A checkpoint's weights in float32, whatever dtype the versions are stored in."""
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
