"""What crosses a stage boundary: a tensor, or a tuple/list/dict of tensors, sent element by element over P2P.

Training's activations and input gradients and validation's activations all go through a
``Channel``, so a structure that trains also validates. The receiver learns the structure (a
pytree spec) once, from the first crossing, before its tensors; every later crossing must
send the same structure. Element ``i`` travels on a tag of its own, so P2P agrees shape and
dtype per element.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from pipedream2bw.pipeline.comm import P2P, PipelineShapeError

_STRUCTURE_TAG_OFFSET = 2  # a channel's structure goes on tag + 2 (channels use tags 0 and 1)


def leaf_tag(tag: int, i: int) -> int:
    """Tag of element ``i`` of a boundary's tuple/dict: element 0 keeps the channel's tag, so P2P
    agrees shape and dtype per element (tags 10, 11, 12, ... for the others)."""
    return tag if i == 0 else 8 + 2 * i + tag


_LEAF = pytree.tree_flatten(torch.empty(0))[1]  # the structure of a boundary that is one tensor


def flat_sequence(spec: Any) -> Optional[Tuple[type, int]]:
    """(list or tuple, n) when ``spec`` is a plain list or tuple of n tensors (a backward's input gradients are a
    list), else None: such a boundary crosses without pytree (issue 47)."""
    n = spec.num_children  # n children, n leaves and no other node than the list itself: each child is a leaf
    if spec.type in (list, tuple) and spec.num_leaves == n and spec.num_nodes == n + 1:
        return spec.type, n
    return None


def _is_flat(tree: Any, flat: Optional[Tuple[type, int]]) -> bool:
    """``tree`` is a plain list or tuple of ``flat``'s length (its type exactly: a namedtuple is another structure)
    of tensors only."""
    return (
        flat is not None
        and type(tree) is flat[0]
        and len(tree) == flat[1]
        and all(isinstance(t, torch.Tensor) for t in tree)
    )


def flatten(tree: Any, what: str) -> Tuple[List[torch.Tensor], Any]:
    """The tensors of a stage boundary (a tensor, or a tuple/list/dict of them) and its structure.

    Raises:
        TypeError: ``tree`` holds something other than tensors, or nothing.
    """
    leaves, spec = pytree.tree_flatten(tree)
    bad = [type(x).__name__ for x in leaves if not torch.is_tensor(x)]
    if bad or not leaves:
        raise TypeError(
            f"{what} must be a tensor or a tuple, list or dict of tensors; got {type(tree).__name__} "
            f"holding {bad or 'nothing'}"
        )
    return leaves, spec


def to_wire(tree: Any, dtype: torch.dtype) -> Any:
    """The float32 elements of a boundary in ``dtype`` (the compute dtype travels); others as they are."""
    return pytree.tree_map(lambda t: t.to(dtype) if t.dtype == torch.float32 else t, tree)


def from_wire(tree: Any, dtype: torch.dtype) -> Any:
    """The ``dtype`` elements of a received boundary back in float32, as one process would go on."""
    return pytree.tree_map(lambda t: t.float() if t.dtype == dtype else t, tree)


def to_device(tree: Any, device: torch.device) -> Any:
    """A tensor, or each tensor of a tuple/list/dict (packed documents' ids and positions), on ``device``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device, non_blocking=True)
    return pytree.tree_map(lambda t: t.to(device, non_blocking=True), tree)


class Channel:
    """One kind of crossing (``tag``) of this rank's stage boundaries over ``p2p``: what it sends to
    one neighbour and receives from the other, with the structure agreed on the first crossing.

    Args:
        p2p: the transfers (training's group, or validation's).
        tag: 0 or 1; ``tag + 2`` carries the structure, ``leaf_tag(tag, i)`` element ``i``.
        what: names the crossing in errors ('a stage's output', 'an input gradient').
        device: where the structure's bytes are staged (the backend's device).
    """

    def __init__(self, p2p: P2P, *, tag: int, what: str, device: torch.device):
        self.p2p, self.tag, self.what, self.device = p2p, tag, what, device
        self._sent: Optional[Any] = None  # the spec this rank sends (first crossing)
        self._received: Optional[Any] = None  # the spec the neighbour sends (its first crossing)
        self._received_leaf = False  # ... and it is one tensor
        self._sent_flat: Optional[Tuple[type, int]] = None  # the sent spec is a plain list/tuple of n tensors
        self._received_flat: Optional[Tuple[type, int]] = None  # ... the received one

    def send(self, tree: Any, *, peer: int, defer: bool = False, token: Optional[int] = None) -> None:
        """Sends ``tree``'s tensors to ``peer`` (``defer``/``token``: as ``P2P.send``).

        Raises:
            TypeError: ``tree`` is not a tensor or a tuple, list or dict of tensors.
            PipelineShapeError: its structure differs from the first crossing's.
        """
        # The usual boundaries, a tensor (activations) or a list of tensors (input gradients), cross without
        # pytree's flattening and spec comparison once the first crossing agreed on them (issue 47)
        if self._sent is _LEAF and isinstance(tree, torch.Tensor):
            leaves, spec = [tree], _LEAF
        elif _is_flat(tree, self._sent_flat):
            leaves, spec = tree, self._sent
        else:
            leaves, spec = flatten(tree, self.what)
        if self._sent is None:  # the receiver learns the structure once, before the first tensors
            self._sent = _LEAF if spec == _LEAF else spec
            self._sent_flat = flat_sequence(spec)
            text = torch.tensor(list(pytree.treespec_dumps(spec).encode()), dtype=torch.uint8, device=self.device)
            self.p2p.send(text, peer=peer, tag=self.tag + _STRUCTURE_TAG_OFFSET, defer=defer, token=token)
        elif spec is not self._sent and spec != self._sent:
            raise PipelineShapeError(
                f"rank {self.p2p.ctx.rank} sends {spec} to rank {peer}, but the first microbatch agreed on "
                f"{self._sent}; a stage must return the same structure for every microbatch"
            )
        for i, leaf in enumerate(leaves):
            self.p2p.send(leaf, peer=peer, tag=leaf_tag(self.tag, i), defer=defer, token=token)

    def post_recv(self, peer: int) -> List[tuple]:
        """Posts the receives of one crossing from ``peer``: one per element of its structure, which
        the first crossing brings (waited here, once)."""
        if self._received is None:
            tag = self.tag + _STRUCTURE_TAG_OFFSET
            spec = self.p2p.wait_recv(self.p2p.post_recv(peer=peer, tag=tag), peer=peer)
            self._received = pytree.treespec_loads(bytes(spec.cpu().tolist()).decode())
            self._received_leaf = self._received.is_leaf()
            self._received_flat = flat_sequence(self._received)
        return [self.p2p.post_recv(peer=peer, tag=leaf_tag(self.tag, i)) for i in range(self._received.num_leaves)]

    def wait_recv(self, posted: List[tuple], *, peer: int) -> Any:
        """What ``post_recv``'s receives brought, in the structure ``peer`` sends."""
        if self._received_leaf:  # one tensor (issue 47: tree_unflatten's Python calls)
            return self.p2p.wait_recv(posted[0], peer=peer)
        if self._received_flat is not None:  # a list or tuple of tensors, as the sender's ``_is_flat``
            return self._received_flat[0](self.p2p.wait_recv(p, peer=peer) for p in posted)
        return pytree.tree_unflatten([self.p2p.wait_recv(p, peer=peer) for p in posted], self._received)

    def recv(self, peer: int) -> Any:
        """One crossing from ``peer``, posted and waited."""
        return self.wait_recv(self.post_recv(peer), peer=peer)
