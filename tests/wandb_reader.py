"""Reads an offline wandb run's ``run-*.wandb`` file back: its protobuf records, history, summary and config.

The file is a LevelDB-style log (wandb's transaction log): a 7-byte header (":W&B", magic
0xBEE1, version), then 32 KiB blocks of chunks, each with a 7-byte header (CRC32, length as
little-endian uint16, type: 1 full, 2 first, 3 middle, 4 last) around a serialized ``Record``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK, _HEADER = 32768, 7


def read_records(path: Path) -> List[Any]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer: padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        pending += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):
            records.append(pb.Record.FromString(pending))
            pending = b""
    return records


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def history(records: List[Any]) -> List[Dict[str, Any]]:
    """Each logged row as {key: value}, in order (``_step`` included)."""
    return [
        {_key(i): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


def summary(records: List[Any]) -> Dict[str, Any]:
    """The run summary as it stands after the last summary update."""
    out: Dict[str, Any] = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            out.update({_key(i): json.loads(i.value_json) for i in r.summary.update})
    return out


def config(records: List[Any]) -> Dict[str, Any]:
    """The run's config as wandb.init received it (nested dicts)."""
    items = [i for r in records if r.WhichOneof("record_type") == "run" for i in r.run.config.update]
    items += [i for r in records if r.WhichOneof("record_type") == "config" for i in r.config.update]
    return {_key(i): json.loads(i.value_json) for i in items}


def run_record(records: List[Any]) -> Any:
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")
