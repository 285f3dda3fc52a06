"""The only module that calls torch.distributed: store, process groups, p2p, failure propagation."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from pipedream2bw.pipeline.versions import grad_of, set_grad

log = logging.getLogger(__name__)

_FAILED_KEY = "failed"
_LEFT_KEY = "ranks_left_after_failure"
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]
_LOSS_TAG = 7
EVAL_LOSS_TAG = 8  # control-group tag of validation losses (last stages -> rank 0), apart from the training losses'
_META_LEN = 12  # [ndim, dtype code, shape...] padded with zeros
_jobs_started = 0
_MIN_RENDEZVOUS_S = 60.0  # ranks of a loaded machine may start seconds apart, whatever dist.timeout_s


class PipelineShapeError(RuntimeError):
    """A stage sent a tensor whose shape or dtype differs from the one agreed on the first microbatch."""


class PeerFailure(RuntimeError):
    """Another rank failed; this rank stops because of it."""


def free_port() -> int:
    """A TCP port free on this machine right now (for local launches and tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, *options: str) -> List[str]:
    """The start of a command line that runs ``nproc`` local processes under torchrun (this Python's) on a free
    port, with more torchrun ``options`` (e.g. ``--max-restarts``, ``1``); the script or ``-m module`` and its
    arguments follow."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        *options,
        "--master-port",
        str(free_port()),
    ]


def env_rank() -> Tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment; (0, 1, 0) outside it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def _hosts_store(rank: int) -> bool:
    """Whether this rank's process hosts the rendezvous store (rank 0, unless torchrun's agent does)."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def make_store(*, rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """Connects to the rendezvous store named by MASTER_ADDR/MASTER_PORT.

    Under torchrun the agent hosts it (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0 does.
    Keys are prefixed by the restart count, so a restarted job starts from a clean slate.
    """
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", 29500))
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=_hosts_store(rank),
        timeout=timedelta(seconds=max(timeout_s, _MIN_RENDEZVOUS_S)),
        wait_for_workers=False,
    )
    return dist.PrefixStore(f"pd2bw/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def launch_scope(store: dist.Store) -> dist.Store:
    """The keys that every restart of one torchrun launch shares (``make_store``'s are per attempt).

    torchrun's agent keeps its store, and its port, across ``--max-restarts``: what is agreed
    here (the run directory) survives the restart, so the new attempt finds the old one's
    checkpoints.
    """
    return dist.PrefixStore("pd2bw/launch", store.underlying_store)


def agree_on_string(store: dist.Store, key: str, proposal: str) -> str:
    """Every rank gets the value the first caller proposed (e.g. rank 0's timestamp)."""
    return store.compare_set(key, "", proposal).decode()


_runs_prepared = 0


def run_scope(store: dist.Store) -> dist.Store:
    """Keys private to this run, for what ranks agree on before ``init`` (the plan, the checkpoint).

    Named by how many runs this process has prepared: the same on every rank (a Hydra multirun
    runs its jobs in the same processes), unlike a rank's run directory, which the programmatic
    API lets differ between ranks.
    """
    global _runs_prepared
    _runs_prepared += 1
    return dist.PrefixStore(f"run{_runs_prepared}", store)


def share_from_rank0(
    store: dist.Store, key: str, value: Optional[str], *, world_size: int, max_wait_s: float = 60.0
) -> str:
    """Rank 0 passes its ``value``, the others None: every rank returns rank 0's value (the others
    wait for it, up to the store's timeout). Works before any process group exists.

    Rank 0 returns once every rank has read the value (or after ``max_wait_s``): if it hosts
    the store and leaves at once, say on a bad config, the others would never get the answer.
    """
    if value is None:
        value = store.get(key).decode()
        store.add(f"{key}/read", 1)
        return value
    store.set(key, value)
    deadline = time.monotonic() + max_wait_s
    while store.add(f"{key}/read", 0) < world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


class FailureMonitor:
    """Publishes this rank's failure in the store and aborts this rank when another one fails.

    A background thread polls the store; when a failure from another rank appears it logs
    it, naming the rank and the cause, and exits the process with status 1. This bounds the
    time any rank can spend waiting on a peer that died, whatever it is blocked in.
    """

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, poll_s: float = 0.25):
        # A connection of its own: the store client serializes its calls, and a set-up collective
        # (init_process_group, new_group) blocks in it waiting for a rank that failed; on a shared
        # connection the monitor would wait behind it and never see the failure (issue 34)
        self.store, self.rank, self.world_size, self.poll_s = _own_connection(store), rank, world_size, poll_s
        self._stop = threading.Event()
        self._leave_lock, self._left = threading.Lock(), False
        self._thread = threading.Thread(target=self._watch, name="pd2bw-failure-monitor", daemon=True)

    def start(self) -> "FailureMonitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.poll_s + 1)

    def report(self, stage_index: int, exc: BaseException) -> str:
        """Records this rank's failure unless another rank failed first; returns the first failure."""
        mine = f"rank {self.rank} (stage {stage_index}) failed: {type(exc).__name__}: {exc}"
        try:
            return self.store.compare_set(_FAILED_KEY, "", mine).decode()
        except Exception:  # the store may be gone with the rank that hosted it
            return mine

    def leave(self, max_wait_s: float = 10.0) -> None:
        """Counts this rank out after a failure. The rank hosting the store waits (bounded) for
        the others to read the failure first: its exit takes the store, and the cause, with it."""
        with self._leave_lock:  # held throughout: a second caller returns only once the wait is over
            if self._left:
                return
            self._left = True
            try:
                left = self.store.add(_LEFT_KEY, 1)
                deadline = time.monotonic() + max_wait_s
                while _hosts_store(self.rank) and left < self.world_size and time.monotonic() < deadline:
                    time.sleep(0.05)
                    left = self.store.add(_LEFT_KEY, 0)
            except Exception:
                pass

    def _watch(self) -> None:
        store_errors = 0
        while not self._stop.wait(self.poll_s):
            try:
                failed = self.store.check([_FAILED_KEY])
                message = self.store.get(_FAILED_KEY).decode() if failed else ""
                store_errors = 0
            except Exception as e:
                store_errors += 1
                if self._stop.is_set() or store_errors < 3:  # one slow answer on a loaded machine is no failure
                    continue
                message = f"lost the rendezvous store ({type(e).__name__}: {e}); the rank or launcher hosting it died"
                failed = True
            if failed and not message.startswith(f"rank {self.rank} "):
                log.error("aborting because %s", message)
                self.leave()
                logging.shutdown()
                os._exit(1)


def _own_connection(store: dist.Store) -> dist.Store:
    """``store`` (with its key prefixes) on a new connection to the same server, where the store can clone."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):  # a store of another kind (tests' HashStore)
        return store


def _group_timeout(timeout: timedelta) -> timedelta:
    """Groups get a generous default (it also bounds connection set-up); every transfer and
    gradient all-reduce waits with the run's own timeout, passed explicitly."""
    return max(timeout, timedelta(seconds=_MIN_RENDEZVOUS_S))


@dataclass
class DistContext:
    """What a stage needs to talk to the others."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    timeout: timedelta
    control: Any  # a gloo group for CPU-side objects and scalars, whatever the main backend
    monitor: FailureMonitor
    board: "Board"


def init(
    *, store: dist.Store, rank: int, world_size: int, local_rank: int, backend: str, timeout_s: float
) -> DistContext:
    """Starts the process groups: the main one (NCCL on GPUs, gloo on CPU) and a gloo control group."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    global _jobs_started  # a Hydra multirun starts one job after another in the same processes
    _jobs_started += 1
    store = dist.PrefixStore(f"job{_jobs_started}", store)
    monitor = FailureMonitor(store, rank=rank, world_size=world_size).start()
    kwargs = {"device_id": device} if backend == "nccl" else {}
    group_timeout = _group_timeout(timeout)
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", store),
            rank=rank,
            world_size=world_size,
            timeout=group_timeout,
            **kwargs,
        )
        control = dist.new_group(backend="gloo", timeout=group_timeout) if backend != "gloo" else dist.group.WORLD
    except BaseException:  # no context for the caller to stop the monitor with: stop it here
        monitor.stop()
        raise
    return DistContext(rank, world_size, device, backend, timeout, control, monitor, Board(store))


class Board:
    """Short string messages between ranks through the store, outside any process group.

    Safe to use from a background thread: it never blocks in the store client (whose lock a
    blocking ``wait`` would hold, stalling the failure monitor and the training thread).
    """

    def __init__(self, store: dist.Store, poll_s: float = 0.05):
        self.store, self.poll_s = dist.PrefixStore("board", store), poll_s

    def post(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def read(self, keys: Sequence[str], *, timeout_s: float) -> List[str]:
        """The values of ``keys`` once all are posted.

        Raises:
            TimeoutError: naming the keys still missing after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        missing = list(keys)
        while missing:
            missing = [k for k in missing if not self.store.check([k])]
            if missing and time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(missing)} of {len(keys)} messages not posted after {timeout_s:.0f} s: {missing[:4]}"
                )
            if missing:
                time.sleep(self.poll_s)
        return [self.store.get(k).decode() for k in keys]


def shutdown(ctx: DistContext) -> None:
    """Stops the failure monitor once every rank is done, then tears the groups down."""
    dist.barrier(group=ctx.control)
    ctx.monitor.stop()
    dist.barrier(group=ctx.control)  # no rank leaves (and takes the store with it) while another still polls
    dist.destroy_process_group()


ABANDON_WAIT_S = 2.0
"""How long a failed rank waits for its process groups to be torn down before it goes on without."""


def abandon() -> None:
    """After a failure (the monitor already stopped): tears the process groups down without a barrier, so that
    ``run()`` called again in this process can make new ones (it found the default group still initialised;
    issue 34). In a thread, waited on ``ABANDON_WAIT_S`` at most: a backend that blocks on work a dead peer never
    finishes must not hold up the failure's report."""

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - best effort, on the way out of a failure
            log.debug("tearing the process groups down after a failure: %s: %s", type(e).__name__, e)

    if not dist.is_initialized():
        return
    done = threading.Thread(target=destroy, name="pd2bw-abandon", daemon=True)
    done.start()
    done.join(ABANDON_WAIT_S)
    if done.is_alive():
        log.warning("the process groups were not torn down within %.0f s after the failure", ABANDON_WAIT_S)


def new_groups(ctx: DistContext, rank_lists: Sequence[Sequence[int]], *, backend: Optional[str] = None) -> List[Any]:
    """One process group per list, made on every rank in the same order (as torch requires); ``backend``:
    the main one if None, 'gloo' for CPU scalars that must not wait on the device."""
    return [dist.new_group(list(ranks), timeout=_group_timeout(ctx.timeout), backend=backend) for ranks in rank_lists]


def gather_to_rank0(ctx: DistContext, obj: Any) -> Optional[List[Any]]:
    """Every rank's ``obj``, in rank order, on rank 0; None elsewhere."""
    out = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=ctx.control)
    return out


class P2P:
    """Point-to-point transfers between neighbouring stages over named channels.

    The first transfer on a channel sends the tensor's shape and dtype; later ones are checked against it, so a
    stage that changes shapes fails with a clear message rather than corrupting its neighbour. Sends are
    asynchronous (the tensor is kept alive until its send completes); receives can be posted early and waited on
    later. Every wait has the run's timeout.

    A send's tensor is freed once the send is known to be complete: when its work says so (NCCL), or when the caller
    ``release``s it, having proof that the peer received it. gloo reports a send complete only once somebody waits
    on it, and waiting blindly could block on a peer that is itself waiting for us; so the stage worker passes each
    send a ``token`` (its microbatch) and releases tokens as the peer's later transfers prove their receipt.

    With ``batch_sends`` (NCCL), a send made with ``defer=True`` is held back and started in one batch with the next
    receive. NCCL runs the transfers between two ranks in order and a large send waits for its receiver, so in 1F1B
    "send activation k+1, receive gradient k" on one side and "send gradient k, receive activation k+1" on the other
    would wait on each other unless each pair is started together (as Megatron's send_forward_recv_backward).
    """

    def __init__(self, ctx: DistContext, *, batch_sends: bool = False, group: Any = None):
        self.ctx, self.batch_sends, self.group = ctx, batch_sends, group  # group: None is the default group
        # ("send" or "recv", peer, tag) -> shape and dtype: under zbv two ranks send each other on one tag
        self._agreed: Dict[Tuple[str, int, int], Tuple[torch.Size, torch.dtype]] = {}
        # (work, what it keeps alive, peer, token)
        self._sends: Deque[Tuple[Any, Any, Optional[int], Optional[int]]] = deque()
        self._deferred: List[Tuple[Any, int, Optional[int]]] = []  # (P2POp, peer, token) waiting for the next receive
        self._loss_sends: Deque[Tuple[Any, torch.Tensor]] = deque()
        self._value_sends: List[Tuple[Any, torch.Tensor, int]] = []  # send_value's: (work, value, peer)
        self._in_group: Dict[int, int] = {}  # global rank -> its rank in the group, asked once (``_post``)

    def _wait(self, work: Any, what: str) -> None:
        wait_work(self.ctx, work, what)

    def _post(self, kind: str, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        """``dist.isend``/``dist.irecv`` (``kind``) minus their per-call Python: the group's own call (issue 47); a post
        refused (gloo: the peer's connection already reset) names the transfer and the peer, as a failed wait does."""
        group = self.group if self.group is not None else dist.group.WORLD
        rank = self._in_group.get(peer)
        if rank is None:
            rank = self._in_group[peer] = dist.get_group_rank(group, peer)
        try:
            return (group.send if kind == "send" else group.recv)([tensor], rank, tag)
        except Exception as e:
            what = f"a send to rank {peer} (posting it)" if kind == "send" else f"receiving from rank {peer}"
            raise RuntimeError(f"rank {self.ctx.rank}: {what} failed: {e}") from e

    def send(
        self, tensor: torch.Tensor, *, peer: int, tag: int, defer: bool = False, token: Optional[int] = None
    ) -> None:
        """Sends ``tensor`` to ``peer`` (held for the next receive if ``defer`` and batching);
        ``release(peer, t)`` with ``t >= token`` frees it.

        Raises:
            PipelineShapeError: the shape or dtype differs from this channel's first transfer.
        """
        agreed = self._agreed.get(("send", peer, tag))
        if agreed is None:
            meta = torch.zeros(_META_LEN, dtype=torch.int64)
            meta[0], meta[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
            meta[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
            self._sends.append(
                (dist.isend(meta.to(self.ctx.device), peer, tag=tag, group=self.group), meta, peer, None)
            )
            agreed = self._agreed[("send", peer, tag)] = (tensor.shape, tensor.dtype)
        shape, dtype = agreed
        if tensor.shape != shape or tensor.dtype != dtype:
            raise PipelineShapeError(
                f"rank {self.ctx.rank} sends {tuple(tensor.shape)} {tensor.dtype} to rank {peer} (tag {tag}), "
                f"but the first microbatch agreed on {tuple(shape)} {dtype}; stages must keep their "
                f"output shapes fixed (same microbatch_size and seq_len for every microbatch) and their "
                f"dtype (activations and gradients travel in train.precision's compute dtype)"
            )
        tensor = tensor.contiguous()
        if defer and self.batch_sends:
            self._deferred.append((dist.P2POp(dist.isend, tensor, peer, tag=tag, group=self.group), peer, token))
        else:
            self._sends.append((self._post("send", tensor, peer, tag), tensor, peer, token))
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()

    def release(self, peer: int, token: int) -> None:
        """Frees the sends to ``peer`` with tokens up to ``token``: the caller knows the peer has
        received them, so waiting on them returns at once (and marks them complete for gloo). A token
        ``(flow, k)`` (zbv: two chunks send to one peer) frees only that flow's sends up to k."""
        kept: Deque[Tuple[Any, Any, Optional[int], Optional[int]]] = deque()
        flow = token[0] if isinstance(token, tuple) else None
        for entry in self._sends:
            work, _, to, t = entry
            if flow is not None:
                covered = isinstance(t, tuple) and t[0] == flow and t[1] <= token[1]
            else:
                covered = t is not None and not isinstance(t, tuple) and t <= token
            if to == peer and covered:
                self._wait(work, f"a send to rank {peer} that rank {peer} has received")
            else:
                kept.append(entry)
        self._sends = kept

    @property
    def pending_sends(self) -> int:
        """Sends whose tensors are still held (for tests and memory accounting)."""
        return len(self._sends)

    def _start_deferred(self, recv: Optional[Any] = None) -> List[Any]:
        """Starts the held sends (and ``recv``) as one batch; returns the receive's works."""
        held, self._deferred = self._deferred, []
        ops = [op for op, _, _ in held] + ([recv] if recv is not None else [])
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):  # one request per op (gloo): the receive is the last
            self._sends.extend((w, op.tensor, peer, token) for w, (op, peer, token) in zip(works, held))
            return works[-1:] if recv is not None else []
        kept = [op.tensor for op in ops]  # one coalesced request for the batch (NCCL): it tells when it is done
        self._sends.extend((w, kept, None, None) for w in works)
        return list(works) if recv is not None else []

    def post_recv(self, *, peer: int, tag: int) -> Tuple[List[Any], torch.Tensor]:
        """Posts a receive from ``peer``; returns (works, buffer) to pass to ``wait_recv``."""
        key = ("recv", peer, tag)
        agreed = self._agreed.get(key)
        if agreed is None:
            # The first receive on a channel blocks for the shape, which the peer may send only
            # after it got what we hold back: start held sends now.
            self._start_deferred()
            meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.ctx.device)
            self._wait(dist.irecv(meta, peer, tag=tag, group=self.group), f"receiving tensor metadata from rank {peer}")
            meta = meta.cpu()
            ndim = int(meta[0])
            agreed = self._agreed[key] = (torch.Size(meta[2 : 2 + ndim].tolist()), _DTYPES[int(meta[1])])
        shape, dtype = agreed
        buf = torch.empty(shape, dtype=dtype, device=self.ctx.device)
        if self._deferred:
            return self._start_deferred(dist.P2POp(dist.irecv, buf, peer, tag=tag, group=self.group)), buf
        return [self._post("recv", buf, peer, tag)], buf

    def wait_recv(self, pending: Tuple[List[Any], torch.Tensor], *, peer: int) -> torch.Tensor:
        works, buf = pending
        for work in works:
            self._wait(work, f"receiving from rank {peer}")
        return buf

    def send_loss(self, value: torch.Tensor) -> None:
        """A last stage: starts sending its batch's mean loss to rank 0 over the CPU control group.

        Rank 0 receives batch t's loss in its step t. This stage cannot compute batch t+2's
        loss before rank 0's stage has stepped t+1 (its in-flight limit, d - s <= m, holds the
        forwards of batch t+2 back until the backwards of batch t+1 are done; flush and gpipe
        step in between batches), so the send of the loss two batches back is complete:
        waiting on it frees it without blocking.
        """
        loss = value.detach().to("cpu", torch.float64).reshape(1)
        self._loss_sends.append((dist.isend(loss, 0, group=self.ctx.control, tag=_LOSS_TAG), loss))
        while len(self._loss_sends) > 2:
            self._wait(self._loss_sends.popleft()[0], "sending a loss to rank 0")

    def post_loss(self, *, peer: int, tag: int = _LOSS_TAG) -> Tuple[Any, torch.Tensor, int]:
        """Rank 0: posts the receive of the next batch's mean loss (or, with ``EVAL_LOSS_TAG``, the next
        validation loss) from the last stage on rank ``peer``; ``take_loss`` waits for it. Posted ahead
        of its use, the transfer (a rendezvous on gloo) runs behind rank 0's compute."""
        loss = torch.zeros(1, dtype=torch.float64)
        return dist.irecv(loss, peer, group=self.ctx.control, tag=tag), loss, peer

    def take_loss(self, posted: Tuple[Any, torch.Tensor, int]) -> float:
        """The loss a ``post_loss`` receive brings, once it has arrived."""
        work, loss, peer = posted
        self._wait(work, f"receiving the loss from rank {peer}")
        return float(loss)

    def recv_loss(self, *, peer: int, tag: int = _LOSS_TAG) -> float:
        """Rank 0: ``take_loss(post_loss(...))``, the next loss from rank ``peer`` at once."""
        return self.take_loss(self.post_loss(peer=peer, tag=tag))

    def send_value(self, value: torch.Tensor, *, peer: int, tag: int) -> None:
        """Starts sending a scalar to ``peer`` over the CPU control group; only ``flush`` waits for it
        (a blind wait could block on a peer that receives it later than this rank goes on)."""
        v = value.detach().to("cpu", torch.float64).reshape(1)
        self._value_sends.append((dist.isend(v, peer, group=self.ctx.control, tag=tag), v, peer))

    def flush(self) -> None:
        """Starts any held sends and waits until every send has completed."""
        self._start_deferred()
        self._sends.extend((work, loss, 0, None) for work, loss in self._loss_sends)
        self._loss_sends.clear()
        self._sends.extend((work, value, peer, None) for work, value, peer in self._value_sends)
        self._value_sends.clear()
        while self._sends:
            work = self._sends.popleft()[0]
            self._wait(work, "a send")


class GradReducer:
    """Averages a stage's coalesced gradient across its replicas, bucket by bucket, during backward.

    Armed for the last backward of a batch, it hears (post-accumulate-grad hooks) when each
    parameter's gradient is final; once a bucket is complete and every earlier bucket has
    started, it starts that bucket's all-reduce (sum) asynchronously, so communication
    overlaps the rest of backward. Buckets start in index order on every replica, as
    collectives must.

    Each armed batch gets a ``BatchReduction`` of its own, which ``take()`` hands to that batch's
    step at CLOSE(t): under 2bw the next batch's last backward arms the reducer again before a
    deferred APPLY(t), and must not touch batch t's buckets (docs/design.md section 7).
    """

    def __init__(
        self,
        ctx: DistContext,
        *,
        group: Any,
        replicas: Sequence[Sequence[torch.nn.Parameter]],
        buckets: Sequence[Sequence[int]],
        sharded: bool = False,
        autograd_hooks: bool = True,
    ):
        self.ctx, self.group, self.buckets = ctx, group, [list(b) for b in buckets]
        # optim.sharded: buckets reduce-scatter, each replica receiving the sum of its shard (sharding.py)
        self.num_shards = dist.get_world_size(group) if sharded else 1
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self.replicas = [list(params) for params in replicas]
        self.num_collectives = 0
        self.exposed_s = 0.0  # time spent waiting in BatchReduction.wait: all-reduce not hidden behind backward
        self._armed: Optional[BatchReduction] = None
        # autograd_hooks false: the caller reports each final gradient (``gradient_ready``) itself, as a streamed
        # stage does once its host accumulator has it (issue 42: autograd also ran these hooks on the host
        # parameters, with no gradient, which counted a parameter twice and, once the adds left the training
        # thread, started buckets before their gradients were in)
        for replica_index, params in enumerate(self.replicas if autograd_hooks else []):
            for param_index, p in enumerate(params):
                if param_index in self.bucket_of:  # parameters in no bucket (tied across stages) are reduced elsewhere
                    p.register_post_accumulate_grad_hook(self._hook(replica_index, param_index))

    def _hook(self, replica_index: int, param_index: int):
        return lambda _: self.gradient_ready(replica_index, param_index)

    def gradient_ready(self, replica_index: int, param_index: int) -> None:
        """Parameter ``param_index``'s gradient of that replica is final for the armed batch (autograd's hook, or a
        streamed stage's host accumulator: ``WeightStream.on_grad``)."""
        if self._armed is not None and self._armed.replica_index == replica_index:
            self._armed.gradient_ready(self.bucket_of[param_index])

    def arm(self, replica_index: int) -> None:
        """The next backward is a batch's last on this replica of the weights: reduce as it goes."""
        assert self._armed is None, "a batch's reduction was armed and never taken by its CLOSE"
        self._armed = (ShardedReduction if self.num_shards > 1 else BatchReduction)(self, replica_index)

    def take(self) -> "BatchReduction":
        """CLOSE(t): batch t's reduction (its buckets in flight), for its step to wait on."""
        reduction, self._armed = self._armed, None
        assert reduction is not None, "CLOSE without an armed reduction"
        return reduction


class BatchReduction:
    """One batch's gradient all-reduce over a stage's replicas: buckets started as their gradients
    become final, each flattened into one tensor that replaces the parameters' gradients (they are freed);
    ``wait(b)`` puts views of bucket ``b``'s sums back as that batch's gradients."""

    def __init__(self, reducer: GradReducer, replica_index: int):
        self.reducer, self.replica_index = reducer, replica_index
        self._missing = [len(b) for b in reducer.buckets]
        self._started: List[Tuple[Any, torch.Tensor]] = []
        self._done: set = set()  # buckets already waited for

    def gradient_ready(self, b: int) -> None:
        self._missing[b] -= 1
        while len(self._started) < len(self._missing) and self._missing[len(self._started)] == 0:
            self._start(len(self._started))

    def _start(self, b: int) -> None:
        r = self.reducer
        params = r.replicas[self.replica_index]
        flat = torch.cat(
            [
                (grad_of(params[i]) if grad_of(params[i]) is not None else torch.zeros_like(params[i])).reshape(-1)
                for i in r.buckets[b]
            ]
        )
        # The flat copy is the gradient now: ``wait`` puts views of it back. Freeing the parameters' own
        # gradients here keeps one gradient per parameter, not two, from here to the step (the step's peak).
        for i in r.buckets[b]:
            set_grad(params[i], None)
        self._started.append((dist.all_reduce(flat, group=r.group, async_op=True), flat))
        r.num_collectives += 1

    def wait(self, b: int) -> None:
        """Blocks until bucket ``b`` is summed across replicas, and puts the sums in the gradients.
        Buckets past the reducer's (the stage's tied parameters, after its own) return at once."""
        flat = self._wait(b)
        if flat is None:
            return
        r = self.reducer
        params, offset = r.replicas[self.replica_index], 0
        for i in r.buckets[b]:
            n = params[i].numel()
            set_grad(params[i], flat[offset : offset + n].view_as(params[i]))
            offset += n

    def _wait(self, b: int) -> Optional[torch.Tensor]:
        """Bucket ``b``'s summed tensor once its collective is done (None: not one of the reducer's buckets)."""
        r = self.reducer
        if b >= len(r.buckets):
            return None
        if b in self._done:
            return self._started[b][1]
        start = time.perf_counter()
        while len(self._started) <= b:  # a bucket whose gradients never came (unused parameters)
            self._start(len(self._started))
        work, out = self._started[b]
        wait_work(r.ctx, work, "gradient all-reduce" if r.num_shards == 1 else "gradient reduce-scatter")
        r.exposed_s += time.perf_counter() - start
        self._done.add(b)
        return out


class ShardedReduction(BatchReduction):
    """One batch's gradient reduce-scatter (optim.sharded): bucket ``b`` flattened, padded to w equal
    shards (sharding.BucketShard's layout) and summed so that replica r receives shard r; the batch's
    gradients are freed as each bucket starts. ``wait(b)`` returns this replica's summed shard."""

    def _start(self, b: int) -> None:
        self.release_done()
        r = self.reducer
        params = r.replicas[self.replica_index]
        grads = [
            grad_of(params[i]) if grad_of(params[i]) is not None else torch.zeros_like(params[i]) for i in r.buckets[b]
        ]
        numel = sum(g.numel() for g in grads)
        shard = max(1, -(-numel // r.num_shards))  # ceil(numel / w), as sharding.BucketShard.shard_numel
        flat = torch.zeros(shard * r.num_shards, dtype=torch.float32, device=grads[0].device)
        torch.cat([g.reshape(-1).float() for g in grads], out=flat[:numel])
        for i in r.buckets[b]:  # the flat copy is the gradient now; only this replica's shard of it is kept
            set_grad(params[i], None)
        if self._gloo:  # gloo's reduce-scatter all-reduces a clone of the whole input: all-reduce it in place
            out, work = None, dist.all_reduce(flat, group=r.group, async_op=True)
        else:
            out = torch.empty(shard, dtype=torch.float32, device=flat.device)
            work = _REDUCE_SCATTER(out, flat, group=r.group, async_op=True)
        self._started.append((work, out))
        self._inputs.append(flat)  # kept alive until the collective is done
        r.num_collectives += 1

    def __init__(self, reducer: "GradReducer", replica_index: int):
        super().__init__(reducer, replica_index)
        self._inputs: List[Optional[torch.Tensor]] = []
        self._gloo = dist.get_backend(reducer.group) == "gloo"
        self._shard_index = dist.get_rank(reducer.group)  # group ranks are sorted global ranks, as the shards

    def release_done(self) -> None:
        """Frees the flat inputs of the reductions already done: under 2bw APPLY(t), which waits for
        them, comes after batch t+1's first backwards, whose gradients would otherwise meet them all."""
        for k, (work, _) in enumerate(self._started):
            if self._inputs[k] is not None and work is not None and work.is_completed():
                self._keep_shard(k)

    def _keep_shard(self, b: int) -> None:
        """Bucket ``b``'s collective is done: keeps this replica's summed shard, frees the flat input."""
        work, out = self._started[b]
        if out is None:  # gloo: the whole bucket was summed in place
            size = self._inputs[b].numel() // self.reducer.num_shards
            out = self._inputs[b][self._shard_index * size : (self._shard_index + 1) * size].clone()
        self._started[b], self._inputs[b] = (None, out), None  # the work may hold the input too
        self._done.add(b)

    def wait(self, b: int) -> Optional[torch.Tensor]:  # type: ignore[override]
        """Blocks until bucket ``b``'s shard is summed across replicas; returns it (float32, shard-sized)."""
        if b >= len(self.reducer.buckets):
            return None
        self._wait(b)
        if self._inputs[b] is not None:
            self._keep_shard(b)
        return self._started[b][1]


# torch's current names for the flat collectives; the older ones (all_gather_into_tensor, reduce_scatter_tensor)
# warn FutureWarning on every rank from torch 2.13 (issue 35: eight warnings per optim.sharded=true run).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_async(ctx: DistContext, shard: torch.Tensor, full: torch.Tensor, *, group: Any):
    """Starts gathering every replica's ``shard`` of ``group`` into ``full`` (in rank order); returns the wait,
    which has the run's timeout. ``shard`` may be this rank's own slice of ``full`` (in place, as FSDP gathers)."""
    work = _ALL_GATHER(full, shard, group=group, async_op=True)
    return lambda: wait_work(ctx, work, "weight all-gather (optim.sharded)")


class AsyncSum:
    """Sums one small tensor over a group in the background: ``start`` it, keep working, ``wait``.

    The step agreement (``agreement.py``) runs one per batch over a group of all ranks of its
    own (``new_groups(ctx, [range(world_size)])``, made on every rank in the same order), so it
    never queues behind the p2p transfers of the default group or a stage's gradient all-reduce.
    One sum is in flight at a time.
    """

    def __init__(self, ctx: DistContext, *, group: Any):
        self.ctx, self.group = ctx, group
        self._pending: Optional[Tuple[Any, torch.Tensor, str]] = None

    def start(self, tensor: torch.Tensor, *, what: str) -> None:
        """Starts summing ``tensor`` in place; ``what`` names it in errors (e.g. 'the step agreement of batch 3')."""
        assert self._pending is None, f"{self._pending[2]} was started and never waited on"
        self._pending = (all_reduce_async(tensor, group=self.group), tensor, what)

    def wait(self) -> torch.Tensor:
        """The sum over the group.

        Raises:
            RuntimeError: it failed or took longer than ``dist.timeout_s``, naming what it was.
        """
        work, tensor, what = self._pending
        self._pending = None
        wait_work(self.ctx, work, f"{what} (a sum over all ranks)")
        return tensor


def all_reduce_async(tensor: torch.Tensor, *, group: Any) -> Any:
    """Starts summing ``tensor`` in place across ``group``; returns the work to ``wait_work`` on."""
    return dist.all_reduce(tensor, group=group, async_op=True)


def wait_work(ctx: DistContext, work: Any, what: str) -> None:
    """Waits for a collective with the run's timeout, naming ``what`` if it fails."""
    try:
        work.wait(ctx.timeout)
    except Exception as e:
        raise RuntimeError(f"rank {ctx.rank}: {what} failed or timed out after {ctx.timeout}: {e}") from e


def all_reduce_min_max(tensor: torch.Tensor, *, group: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """Elementwise minimum and maximum of ``tensor`` across ``group``."""
    low, high = tensor.clone(), tensor.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    return low, high


def broadcast(tensor: torch.Tensor, *, src: int, group: Any) -> None:
    """Overwrites ``tensor`` with global rank ``src``'s, on every rank of ``group``."""
    dist.broadcast(tensor, src=src, group=group)
