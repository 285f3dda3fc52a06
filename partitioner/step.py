"""Pure: the optimizer step's transient bytes of the GPT's layers, whole or split over t tensor ranks.

Per layer kind, its parameters as ``step_memory.layer_step_bytes`` takes them (the whole shape, whether Muon steps
it: a block's four matrices under optim.name=muon, the default optim.muon_exclude leaving the embedding and the head
to the other optimizer; and the tensor ranks it is split over, as ``partitioner.tensor`` splits it).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from pipedream2bw.memory.step_memory import StepModel, layer_step_bytes


def gpt_tensors(
    kind: str, *, d_model: int, vocab_size: int, seq_len: int, t: int = 1
) -> List[Tuple[int, int, bool, int]]:
    """(rows, cols, Muon's, ranks split over) of each parameter of a GPT layer of ``kind`` at tensor width ``t``:
    a block's matrices and column-parallel biases split, its row-parallel biases and norms whole; the embedding's and
    the head's vocabulary matrices split where ``t`` divides the vocabulary."""
    C, V, T = d_model, vocab_size, seq_len
    vocab = t if V % t == 0 else 1
    if kind == "block":  # qkv, proj, fc, fc_proj (Linear weights: out x in), then the biases and the two norms
        mats = [(r, c, True, t) for r, c in ((3 * C, C), (C, C), (4 * C, C), (C, 4 * C))]
        return mats + [(3 * C, 1, False, t), (4 * C, 1, False, t)] + [(C, 1, False, 1)] * 6
    if kind == "embedding":
        return [(V, C, False, vocab), (T, C, False, 1)]
    if kind == "head":
        return [(V, C, False, vocab)]
    return [(C, 1, False, 1)] * 2  # the final norm


def gpt_step_fields(
    model: StepModel, kind: str, *, d_model: int, vocab_size: int, seq_len: int, t: int = 1
) -> Dict[str, int]:
    """``LayerCost``'s step fields of a GPT layer of ``kind`` on one of ``t`` tensor ranks."""
    tensors = gpt_tensors(kind, d_model=d_model, vocab_size=vocab_size, seq_len=seq_len, t=t)
    return layer_step_bytes(model, tensors)
