"""Hugging Face checkpoints in and out: save_pretrained directories read per layer, safetensors written per stage.

In: ``check_pretrained`` compares the tensor names, shapes and dtypes in the safetensors headers
(a few KiB read per file) with the layer list, before any process group starts;
``load_layers`` fills one rank's layers (built on the meta device) with their tensors only,
each read from its byte range, one tensor at a time, as float32 master weights.

Out: ``write_sharded`` has every stage write its own shard into ``.<out>.partial/`` at once;
rank 0, once every shard is posted, writes ``model.safetensors.index.json`` (and
``config.json`` for a Hugging Face export) and renames the directory into place, so the
output is complete or absent and no rank ever holds the whole model. ``export_checkpoint``
does the same from a checkpoint, one stage's layers at a time.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from pipedream2bw.errors import ConfigError
from pipedream2bw.io.fileio import atomic_rename, atomic_write, atomic_write_json, fsync_dir
from pipedream2bw.models.hf import HFModel, tie

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SAFE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
COMPANIONS = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
"""Files of a pretrained directory an export carries over unchanged (what generation and tokenization read)."""
MASTER_DTYPE = torch.float32  # stages keep float32 master weights; train.precision sets the compute dtype


def _read_header(file: Path) -> Tuple[Dict[str, Any], int]:
    """A safetensors file's header (name -> {dtype, shape, data_offsets}) and where its data starts: the
    first 8 + N bytes of the file only."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigError(f"{file} is not a safetensors file (shorter than its 8-byte header length)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 2**20:
            raise ConfigError(f"{file} is not a safetensors file (header length {size})")
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise ConfigError(f"{file} is not a safetensors file (unreadable header: {e})") from e
    header.pop("__metadata__", None)
    return header, 8 + size


class PretrainedDir:
    """A save_pretrained directory's tensors: name -> (file, dtype, shape), from the index and the headers.

    Raises:
        ConfigError: no safetensors weights, an index naming a file that is not there, or a tensor
            the index lists but its file does not hold.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            weight_map = None
        else:
            other = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pt"))
            raise ConfigError(
                f"model.pretrained ({self.path}) holds neither {SINGLE} nor {INDEX}"
                + (
                    f" (it has {other[:3]}: re-save with save_pretrained(..., safe_serialization=True))"
                    if other
                    else ""
                )
            )
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
        missing = [f for f in files if not (self.path / f).is_file()]
        if missing:
            raise ConfigError(f"model.pretrained ({self.path}): {INDEX} lists {missing}, which are not there")
        self.tensors: Dict[str, Tuple[str, str, List[int]]] = {}
        self.offsets: Dict[str, Tuple[int, int]] = {}  # byte range of each tensor after its file's header
        self.data_start: Dict[str, int] = {}
        for file in files:
            header, self.data_start[file] = _read_header(self.path / file)
            for name, entry in header.items():
                if weight_map is None or weight_map.get(name) == file:
                    self.tensors[name] = (file, entry["dtype"], list(entry["shape"]))
                    self.offsets[name] = tuple(entry["data_offsets"])
        absent = [n for n, f in (weight_map or {}).items() if n not in self.tensors]
        if absent:
            raise ConfigError(f"model.pretrained ({self.path}): {INDEX} lists tensors their files lack: {absent[:4]}")

    def read(self, names: Sequence[str], *, dtype: torch.dtype = MASTER_DTYPE) -> Dict[str, torch.Tensor]:
        """The tensors ``names`` in ``dtype``, each read alone from its byte range (never a whole file).

        Bytes go straight from the file into the tensor (a float32 file into the float32 weight
        itself), not through a mapping: ``safe_open`` maps the file copy-on-write, so the pages a
        rank reads stay in its resident set with the copies it keeps (twice its share at the peak,
        measured by scripts/measure_hf_load.py), or, kept uncopied, the weights would go on reading
        a file that may change or vanish.
        """
        if sys.byteorder != "little":
            raise RuntimeError("safetensors files are little-endian; reading them on a big-endian host is not done")
        by_file: Dict[str, List[str]] = defaultdict(list)
        for name in names:
            by_file[self.tensors[name][0]].append(name)
        out = {}
        for file, file_names in sorted(by_file.items()):
            with open(self.path / file, "rb", buffering=0) as f:
                for name in sorted(file_names, key=lambda n: self.offsets[n][0]):
                    _, st_dtype, shape = self.tensors[name]
                    begin, end = self.offsets[name]
                    tensor = torch.empty(shape, dtype=SAFE_DTYPES[st_dtype])
                    raw = tensor.reshape(-1).view(torch.uint8).numpy()
                    f.seek(self.data_start[file] + begin)
                    if end - begin != raw.nbytes or f.readinto(memoryview(raw)) != raw.nbytes:
                        raise ConfigError(f"{self.path / file}: {name} is truncated or its header is wrong")
                    out[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
        return out


def _fmt(items: Sequence[str], limit: int = 6) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def expected_tensors(hf: HFModel, meta_layers: Sequence[nn.Module], ties: Sequence[Any]) -> Dict[str, List[int]]:
    """Hugging Face name -> shape of every tensor the layer list loads, a tie's under its canonical name only."""
    aliases = {n for t in ties for n in t.names[1:]}
    state = nn.Sequential(*meta_layers).state_dict()
    return {hf.to_hf(k): list(v.shape) for k, v in state.items() if k not in aliases}


def check_pretrained(pdir: PretrainedDir, hf: HFModel, expected: Mapping[str, Sequence[int]]) -> None:
    """Refuses a directory whose tensors do not fit the layer list: missing, unexpected, mis-shaped
    or non-float tensors, all named at once (headers only: nothing is loaded).

    Raises:
        ConfigError: naming the tensors and the fix.
    """
    have = pdir.tensors
    tied_head = "lm_head.weight" if hf.tied else None
    missing = [n for n in expected if n not in have]
    unexpected = [n for n in have if n not in expected and n != tied_head and not hf.ignorable(n)]
    shapes = [f"{n} {have[n][2]} (model {list(s)})" for n, s in expected.items() if n in have and have[n][2] != list(s)]
    dtypes = sorted({have[n][1] for n in expected if n in have and have[n][1] not in SAFE_DTYPES})
    problems = (
        ([f"missing: {_fmt(missing)}"] if missing else [])
        + ([f"unexpected: {_fmt(unexpected)}"] if unexpected else [])
        + ([f"shape differs: {_fmt(shapes)}"] if shapes else [])
        + ([f"not floating point: dtypes {dtypes}"] if dtypes else [])
    )
    if problems:
        raise ConfigError(
            f"model.pretrained ({pdir.path}) does not fit its config.json's {hf.model_type} model: "
            f"{'; '.join(problems)}. "
            "Is config.json the one saved with these weights? (A quantized or adapter checkpoint is not loaded.)"
        )
    if tied_head in have:
        log.info("%s holds lm_head.weight although tie_word_embeddings is set: the embedding's is used", pdir.path)


def load_layers(
    pdir: PretrainedDir, hf: HFModel, layers: Sequence[nn.Module], indices: Sequence[int], *, ties: Sequence[Any]
) -> None:
    """Fills ``layers`` (layers ``indices`` of the list, built on the meta device) with their tensors
    from ``pdir``, as float32 parameters; a tied name absent from the files (the tied head) gets the
    canonical tensor (the token embedding)."""
    canonical = {n: t.names[0] for t in ties for n in t.names}
    wanted: Dict[Tuple[int, str], str] = {}  # (position in layers, local name) -> Hugging Face name
    for pos, (i, layer) in enumerate(zip(indices, layers)):
        for local in layer.state_dict():
            name = hf.to_hf(f"{i}.{local}")
            if name not in pdir.tensors and f"{i}.{local}" in canonical:
                name = hf.to_hf(canonical[f"{i}.{local}"])
            wanted[(pos, local)] = name
    start = time.perf_counter()
    dtypes = sorted({pdir.tensors[n][1] for n in wanted.values()})
    tensors = pdir.read(sorted(set(wanted.values())))
    for pos, layer in enumerate(layers):
        state = {local: tensors[name] for (p, local), name in wanted.items() if p == pos}
        layer.load_state_dict(state, strict=True, assign=True)
    tie(hf, layers, indices)
    left = [f"{i}.{n}" for i, layer in zip(indices, layers) for n, t in layer.state_dict().items() if t.is_meta]
    assert not left, f"tensors left on the meta device after loading: {left}"
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    log.info(
        "loaded layers %s from %s: %d tensors (%s -> float32), %.1f MiB in %.2f s",
        list(indices),
        pdir.path,
        len(tensors),
        "/".join(dtypes),
        size / 2**20,
        time.perf_counter() - start,
    )


def shard_name(index: int, count: int) -> str:
    """Hugging Face's shard file names: ``model-00002-of-00004.safetensors``."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def partial_dir(out: Path) -> Path:
    """Where an output directory is assembled before its rename into place."""
    return Path(out).parent / f".{Path(out).name}.partial"


def write_shard(directory: Path, file: str, tensors: Mapping[str, torch.Tensor]) -> Dict[str, Any]:
    """Writes ``tensors`` as safetensors file ``file`` of ``directory`` (complete or absent); returns
    what the index needs: the file, its tensors' names and their bytes."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{file}.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, directory / file)
    fsync_dir(directory)
    return {
        "file": file,
        "names": sorted(tensors),
        "bytes": sum(v.numel() * v.element_size() for v in tensors.values()),
    }


def finish(
    partial: Path,
    out: Path,
    parts: Sequence[Mapping[str, Any]],
    *,
    config: Optional[Dict[str, Any]],
    source_dir: Optional[str] = None,
) -> Path:
    """Completes an output: the index (and ``config.json``; the tokenizer and generation config files of
    ``source_dir``, the pretrained directory) into ``partial``, stale files out, then the rename to
    ``out``; an existing ``out`` is kept as ``<out>.replaced-<time>``."""
    weight_map = {name: p["file"] for p in parts for name in p["names"]}
    companions = [Path(source_dir) / f for f in COMPANIONS if source_dir and (Path(source_dir) / f).is_file()]
    keep = {p["file"] for p in parts} | {INDEX, "config.json"} | {f.name for f in companions}
    for stale in partial.iterdir():  # from an attempt at another layout that crashed
        if stale.name not in keep:
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    index = {"metadata": {"total_size": sum(p["bytes"] for p in parts)}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_json(partial / INDEX, index)
    if config is not None:
        atomic_write_json(partial / "config.json", config)
    for file in companions:
        atomic_write(partial / file.name, file.read_bytes())
    out = Path(out)
    if out.exists():
        aside = out.with_name(f"{out.name}.replaced-{int(time.time())}")
        log.warning("%s exists: keeping it as %s", out, aside)
        out.rename(aside)
    atomic_rename(partial, out)
    return out


def write_sharded(
    out: Path,
    tensors: Optional[Mapping[str, torch.Tensor]],
    *,
    shard: int,
    num_shards: int,
    rank: int,
    writers: Sequence[int],
    post: Callable[[str, str], None],
    read: Callable[[Sequence[str], float], List[str]],
    timeout_s: float,
    key: str,
    config: Optional[Dict[str, Any]] = None,
    source_dir: Optional[str] = None,
) -> Optional[Path]:
    """One rank's part of writing a sharded safetensors directory ``out`` across ranks.

    Args:
        tensors: this rank's shard (names as they go in the file), or None on a rank that writes none.
        shard, num_shards: this shard's index and the count (one per stage).
        writers: the ranks that write a shard (replica 0 of each stage); rank 0 completes ``out``.
        post / read: the rendezvous board (``comm.Board``); ``key`` names this output on it.
        config: ``config.json``'s content, for a Hugging Face export.
        source_dir: the pretrained directory, whose tokenizer files go along (``finish``).

    Returns:
        ``out`` on rank 0, once complete; None elsewhere.

    Raises:
        RuntimeError: on rank 0, when a writer failed or posted nothing within ``timeout_s``.
    """
    partial = partial_dir(out)
    if tensors is not None:
        try:
            part = write_shard(partial, shard_name(shard, num_shards), tensors)
        except BaseException as e:
            post(f"{key}/rank{rank}", json.dumps({"error": f"{type(e).__name__}: {e}"}))
            raise
        post(f"{key}/rank{rank}", json.dumps(part))
    if rank != 0:
        return None
    parts = [json.loads(v) for v in read([f"{key}/rank{r}" for r in writers], timeout_s)]
    errors = [f"rank {r}: {p['error']}" for r, p in zip(writers, parts) if "error" in p]
    if errors:
        raise RuntimeError(f"writing {out} failed: {'; '.join(errors)}")
    out = finish(partial, Path(out), parts, config=config, source_dir=source_dir)
    log.info("wrote %s (%d shards, %.1f MiB)", out, len(parts), sum(p["bytes"] for p in parts) / 2**20)
    return out


def to_hf_shard(hf: HFModel, state: Mapping[str, torch.Tensor], aliases: Sequence[str]) -> Dict[str, torch.Tensor]:
    """A stage's weights (layer-list names) as its shard of a Hugging Face export: Hugging Face names,
    each tie once (the token embedding's; the head's name is left out, as save_pretrained does), in
    the export dtype."""
    skip = set(aliases)
    return {hf.to_hf(k): v.detach().to("cpu", hf.export_dtype) for k, v in state.items() if k not in skip}


def export_checkpoint(path: Path, out: Path) -> Path:
    """Writes the newest weights of the checkpoint at ``path`` (of a model=hf run) as a Hugging Face
    model directory ``out``: one shard per stage of the run, read and written one stage at a time.

    Raises:
        FileNotFoundError: no complete, intact checkpoint at ``path``.
        ConfigError: the checkpoint is not of a model=hf run.
    """
    from pipedream2bw.io import checkpoint

    chosen, manifest = checkpoint.select(Path(path), set_aside=False)
    if chosen is None:
        raise FileNotFoundError(f"no complete checkpoint with intact files at {path}")
    if manifest.get("hf") is None:
        raise ConfigError(
            f"checkpoint {chosen} is not of a model=hf run (its manifest has no Hugging Face config); export-hf "
            "writes only models built by model=hf"
        )
    hf = HFModel.from_manifest(manifest["hf"])
    aliases = [n for names in manifest.get("ties", []) for n in names[1:]]
    balance = manifest["layout"]["balance"]
    partial, parts = partial_dir(out), []
    for s, count in enumerate(balance):
        first = sum(balance[:s])
        state: Dict[str, torch.Tensor] = {}
        for i in range(first, first + count):  # the float32 masters of a weight_dtype=compute run, not its bf16 version
            state.update(checkpoint.layer_weights(chosen, i, list(manifest["files"])))
        parts.append(write_shard(partial, shard_name(s, len(balance)), to_hf_shard(hf, state, aliases)))
        del state
    return finish(partial, Path(out), parts, config=hf.export_config, source_dir=hf.source_dir)
