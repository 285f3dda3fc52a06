"""memprobe.tensor_peak on the CPU: what other threads free and allocate is counted."""

from __future__ import annotations

import threading

import torch

from pipedream2bw.memory.memprobe import tensor_peak

MB = 1 << 20


def _in_thread(fn) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def test_regression_a_tensor_freed_by_another_thread_is_counted_freed():
    # Bug: the profiler's running total counted a free only on the profiled thread, so a collective's input
    # whose last reference gloo's worker thread dropped stayed counted, and bench_memory's sharded peaks
    # rose by up to a bucket per collective, by how the collectives happened to finish.
    holder = []
    with tensor_peak(torch.device("cpu")) as box:
        holder.append(torch.ones(4 * MB, dtype=torch.uint8))
        _in_thread(holder.clear)
        after = torch.ones(MB, dtype=torch.uint8)
        _in_thread(lambda: holder.append(torch.ones(2 * MB, dtype=torch.uint8)))  # another thread allocates
        last = torch.ones(16, dtype=torch.uint8)  # noqa: F841 (an event of this thread sees the running total)
    assert box["bytes"] == 4 * MB
    assert box["end_bytes"] == MB + 2 * MB + 16
    del after
