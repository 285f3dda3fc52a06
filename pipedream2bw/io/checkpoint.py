"""Checkpoints: complete or absent, per layer with the unpartitioned model's names, so that a
checkpoint written at any ``(d, w)`` resumes at any other.

A checkpoint taken after ``n`` steps (batches) is a directory::

    <run dir>/checkpoints/step_00000040/
        layer_00003.pt      layer 3: {"weights": W(n), "previous": W(n-1) under 2bw else None,
                            "optimizer": per-parameter optimizer state}, names as in
                            nn.Sequential(*all_layers) ("3.attn.qkv.weight")
        layer_00003.shard_rank00005.pt
                            optim.sharded / train.weight_dtype=compute: the piece of each parameter
                            of layer 3 that rank 5 steps, {name: {"range": [start, stop) of its flat
                            elements, "numel", "master": float32 values, "state": optimizer state}};
                            loading reassembles whole tensors (any (d, w), sharded or not)
        rng_rank0.pt ...    every rank's RNG states as tensors and plain values (restored when the
                            layout is the same)
        manifest.json       written last: step, losses (learning rates, gradient norms, skipped
                            steps) so far, layout, parameter shapes, the lineage (run id), the model
                            and training settings a resume must match, the SHA-256 of every file

Stages write their own layers at once (replica 0 of each stage) into
``.step_00000040.partial/``, in a background thread from copies taken at the step; rank 0
waits until every rank has posted its files' checksums, writes the manifest and renames the
directory into place, then prunes this lineage's older checkpoints (rename to ``.trash``, then
delete; never another lineage's). A crash leaves a ``.partial`` or ``.trash`` directory that no
resume reads and the next start removes. A checkpoint whose files do not match their checksums is
reported, renamed aside and skipped in favour of the previous complete one; if none is left, the
resume is refused. Files are only ever loaded with ``weights_only=True``: nothing is unpickled.

Parameters tied across layers (``manifest.json``'s ``ties``, canonical name first) are stored
once, in the layer file of the canonical name; loading gives every holder that entry.

``python -m pipedream2bw.checkpoint consolidate PATH`` writes the newest weights as one plain
``state_dict`` (a tie's names all on one tensor, as torch's ``state_dict`` of the tied model);
``export-hf PATH --out DIR`` (a model=hf run's) a Hugging Face model directory, one stage at a time.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import pickle
import random
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from pipedream2bw.config.corrections import RECORDED_OFF_DEFAULT
from pipedream2bw.config.newest import layout_hint, recorded_rule
from pipedream2bw.errors import ConfigError
from pipedream2bw.io.fileio import atomic_rename, atomic_torch_save, atomic_write_json
from pipedream2bw.io.manifests import (  # noqa: F401 - DIRNAME, complete_checkpoints: checkpoint's names, as before
    DIRNAME,
    MANIFEST,
    candidates,
    checkpoints_root,
    complete_checkpoints,
    read_manifest,
)

log = logging.getLogger(__name__)

FORMAT = 1


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _partial_dir(root: Path, step: int) -> Path:
    return Path(root) / f".step_{step:08d}.partial"


def layer_file(index: int) -> str:
    return f"layer_{index:05d}.pt"


def shard_file(index: int, rank: int) -> str:
    """The file of layer ``index``'s parameter pieces that ``rank`` holds (sharding.ShardedVersions.shard_state)."""
    return f"layer_{index:05d}.shard_rank{rank:05d}.pt"


def _layer_index(name: str) -> int:
    """Layer index of a parameter name of ``nn.Sequential(*layers)``: "3.attn.qkv.weight" -> 3."""
    return int(name.split(".", 1)[0])


def _save(obj: Any, path: Path) -> str:
    """Writes ``obj`` atomically; returns the SHA-256 of the bytes written."""
    return hashlib.sha256(atomic_torch_save(obj, path)).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> Dict[str, Any]:
    """This process's RNG states (torch, Python ``random``, numpy; CUDA if present) as tensors and plain
    values: what ``torch.load(weights_only=True)`` reads back, so that a resume never unpickles code."""
    version, mt, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        # the same int64 tensor as torch.tensor(mt) at a third of its cost: step_hooks takes it at every CLOSE where a
        # preemption may checkpoint
        "python": {
            "version": version,
            "state": torch.from_numpy(np.array(mt, dtype=np.int64)),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restores what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def split_by_layer(stage_state: Mapping[str, Any], indices: Sequence[int]) -> Dict[int, Dict[str, Any]]:
    """A stage's ``WeightVersions.state()`` as one payload per layer of ``indices`` (a layer
    file's content; layers without parameters get one too, so every layer has a file)."""
    has_previous = stage_state["previous"] is not None
    layers = {i: {"weights": {}, "previous": {} if has_previous else None, "optimizer": {}} for i in indices}
    for part in ("weights", "previous", "optimizer"):
        for name, value in (stage_state[part] or {}).items():
            layers[_layer_index(name)][part][name] = value
    return layers


def split_shards_by_layer(shards: Mapping[str, Any], indices: Sequence[int]) -> Dict[int, Dict[str, Any]]:
    """A replica's ``shard_state`` (name -> piece) as one payload per layer of ``indices`` that has pieces."""
    layers: Dict[int, Dict[str, Any]] = {}
    for name, piece in shards.items():
        if _layer_index(name) in indices:
            layers.setdefault(_layer_index(name), {})[name] = piece
    return layers


def assemble_shards(pieces: Sequence[Mapping[str, Any]], shapes: Mapping[str, Sequence[int]]) -> Dict[str, Any]:
    """Whole tensors from the pieces of shard files: {"masters": name -> float32 tensor, "optimizer":
    name -> optimizer state}, each shaped as ``shapes`` says.

    Raises:
        RuntimeError: a parameter's pieces do not cover its elements exactly once.
    """
    by_name: Dict[str, List[Mapping[str, Any]]] = {}
    for file in pieces:
        for name, piece in file.items():
            by_name.setdefault(name, []).append(piece)
    masters, optimizer = {}, {}
    for name, parts in by_name.items():
        parts = sorted(parts, key=lambda p: p["range"][0])
        edges = [0] + [e for p in parts for e in p["range"]] + [parts[0]["numel"]]
        if any(edges[k] != edges[k + 1] for k in range(0, len(edges), 2)):
            raise RuntimeError(
                f"the checkpoint's pieces of {name} cover {[tuple(p['range']) for p in parts]}, not "
                f"[0, {parts[0]['numel']}) once: a shard file is missing or from another run"
            )
        shape = tuple(shapes[name])
        masters[name] = torch.cat([p["master"] for p in parts]).view(shape)
        state = {}
        for key, value in parts[0]["state"].items():
            if (
                torch.is_tensor(value)
                and value.dim() == 1
                and value.numel() == parts[0]["range"][1] - parts[0]["range"][0]
            ):
                state[key] = torch.cat([p["state"][key] for p in parts]).view(shape)
            else:  # per parameter, not per element (Adam's step): every piece has the same
                state[key] = value
        optimizer[name] = state
    return {"masters": masters, "optimizer": optimizer}


class Checkpointer:
    """Writes this rank's part of a checkpoint after chosen steps; on rank 0, also completes it.

    Args:
        root: the checkpoints directory (shared by all ranks).
        every: checkpoint after steps ``every``, ``2*every``, ... and after the last, ``num_steps``.
        layers: the layer indices whose files this rank writes (replica 0 of each stage; empty
            for the other replicas, which hold the same weights).
        shard_layers: the layer indices whose shard files this rank writes (every replica of a stage
            whose versions are ``sharding.ShardedVersions``: its ``state()['shards']``).
        post / read: the rendezvous board (``comm.Board``), to post this rank's checksums and,
            on rank 0, to read everybody's.
        manifest: what rank 0 puts in every manifest besides step, losses and files.
    """

    def __init__(
        self,
        root: Path,
        *,
        every: int,
        num_steps: int,
        keep: int,
        rank: int,
        world_size: int,
        layers: Sequence[int],
        post: Callable[[str, str], None],
        read: Callable[[Sequence[str], float], List[str]],
        timeout_s: float,
        manifest: Dict[str, Any],
        shard_layers: Sequence[int] = (),
    ):
        self.shard_layers = list(shard_layers)
        self.root, self.every, self.num_steps, self.keep = Path(root), every, num_steps, keep
        self.rank, self.world_size, self.layers = rank, world_size, list(layers)
        self.post, self.read, self.timeout_s, self.manifest = post, read, timeout_s, manifest
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.write_s = 0.0  # time the training thread spent on checkpoints: copies, and waits for the previous write

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.num_steps)

    def after_step(
        self,
        step: int,
        state: Callable[[], Dict[str, Any]],
        losses: Optional[Sequence[float]],
        *,
        history: Optional[Dict[str, Any]] = None,
        rng: Optional[Dict[str, Any]] = None,
        force: bool = False,
    ) -> None:
        """Starts writing the checkpoint of ``step`` steps if one is due. ``state`` makes the stage's
        copies (``WeightVersions.state``); ``losses`` are all losses so far (rank 0, else None);
        ``history``: more per-step records for the manifest (rank 0: learning rates, gradient
        norms, skipped steps; the fp16 loss scaler's state, which a resume at any layout loads);
        ``rng``: the RNG states to save, if not this moment's (a deferred step saves those taken
        where the step's batch ended); ``force``: write one even if none is due (preemption).

        Raises:
            RuntimeError: the previous checkpoint's write failed on this rank.
        """
        if not (force or self.due(step)):
            return
        start = time.perf_counter()
        st = state() if self.layers or self.shard_layers else {}
        payload = {layer_file(i): p for i, p in split_by_layer(st, self.layers).items()} if self.layers else {}
        if self.shard_layers:
            shards = split_shards_by_layer(st["shards"], self.shard_layers)
            payload.update({shard_file(i, self.rank): p for i, p in shards.items()})
        rng = rng if rng is not None else rng_state()
        self.wait()  # one checkpoint at a time: its copies are in memory until written
        self.write_s += time.perf_counter() - start
        losses = list(losses) if losses is not None else None
        history = copy.deepcopy(history or {})  # a snapshot: training goes on appending to the lists
        self._thread = threading.Thread(
            target=self._write, args=(step, payload, rng, losses, history), name="pd2bw-checkpoint", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Waits for the write in progress.

        Raises:
            RuntimeError: it failed (on rank 0: also when another rank's part failed or never came).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint write failed: {type(error).__name__}: {error}") from error

    def _write(
        self,
        step: int,
        payload: Dict[str, Dict[str, Any]],  # file name -> its content
        rng: Dict[str, Any],
        losses: Optional[List[float]],
        history: Dict[str, Any],
    ) -> None:
        key = f"checkpoint/{step}/rank{self.rank}"
        try:
            partial = _partial_dir(self.root, step)
            partial.mkdir(parents=True, exist_ok=True)
            files = {name: _save(p, partial / name) for name, p in sorted(payload.items())}
            files[f"rng_rank{self.rank}.pt"] = _save(rng, partial / f"rng_rank{self.rank}.pt")
            self.post(key, json.dumps({"files": files}))
        except BaseException as e:
            self._error = e
            try:
                self.post(key, json.dumps({"error": f"{type(e).__name__}: {e}"}))
            except Exception:
                pass
            return
        if self.rank == 0:
            try:
                self._complete(step, losses, history)
            except BaseException as e:
                self._error = e

    def _complete(self, step: int, losses: Optional[List[float]], history: Dict[str, Any]) -> None:
        parts = [
            json.loads(v)
            for v in self.read([f"checkpoint/{step}/rank{r}" for r in range(self.world_size)], self.timeout_s)
        ]
        errors = [f"rank {r}: {p['error']}" for r, p in enumerate(parts) if "error" in p]
        if errors:
            raise RuntimeError(f"checkpoint of step {step} is incomplete: {'; '.join(errors)}")
        files = {name: sha for p in parts for name, sha in p["files"].items()}
        missing = [i for i in range(self.manifest["num_layers"]) if layer_file(i) not in files]
        if missing:
            raise RuntimeError(f"checkpoint of step {step}: no rank wrote layers {missing}")
        partial, final = _partial_dir(self.root, step), step_dir(self.root, step)
        manifest = {
            **self.manifest,
            **history,
            "format": FORMAT,
            "step": step,
            "losses": losses,
            "files": files,
            "written_at": time.time(),
        }
        atomic_write_json(partial / MANIFEST, manifest, indent=1)
        if final.exists():  # from an attempt that crashed after this step: keep it, out of the way
            final.rename(final.with_name(f"{final.name}.replaced-{int(time.time())}"))
        atomic_rename(partial, final)  # the checkpoint exists once this rename is on disk
        log.info(
            "checkpoint of step %d written to %s%s", step, final, " (preempted)" if history.get("preempted") else ""
        )
        prune(self.root, lineage=self.manifest.get("lineage"), keep=self.keep, newest=final)
        for stale in self.root.glob(".step_*.partial"):
            if int(stale.name[len(".step_") : -len(".partial")]) < step:
                shutil.rmtree(stale, ignore_errors=True)


def new_lineage() -> str:
    """A fresh run id: the lineage of a run that starts from step 0 (a resume keeps its checkpoint's)."""
    return uuid.uuid4().hex


def lineage_of(path: Path) -> Optional[str]:
    """The lineage a checkpoint's manifest records; None if unreadable or written before lineages were."""
    manifest = read_manifest(path)
    return manifest.get("lineage") if manifest is not None else None


def _discard(path: Path) -> None:
    """Removes a directory crash-safely: renamed to a ``.trash`` name (durably) first, then deleted. A kill
    in between leaves a trash directory that ``clean_leftovers`` removes, never a half-deleted checkpoint
    that looks like one."""
    trash = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.trash")
    atomic_rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune(root: Path, *, lineage: Optional[str], keep: int, newest: Path) -> List[Path]:
    """Removes this lineage's complete checkpoints beyond the ``keep`` newest, never ``newest`` (the one
    just written) nor another lineage's (an earlier run in the same directory keeps its checkpoints).

    Returns:
        The checkpoints removed.
    """
    if lineage is None:  # nothing tells this run's checkpoints from another's: remove none
        return []
    mine = [p for p in complete_checkpoints(root) if p != Path(newest) and lineage_of(p) == lineage]
    gone = mine[max(keep - 1, 0) :]
    for old in gone:
        _discard(old)
    return gone


def clean_leftovers(root: Path) -> List[Path]:
    """Removes what an interrupted prune left (rank 0, before training): ``.trash`` directories and
    ``step_*`` directories without a manifest (a checkpoint is renamed into place with its manifest,
    so one without is never a checkpoint: earlier versions deleted old checkpoints in place).

    Returns:
        The directories removed.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    gone = [
        p
        for p in root.iterdir()
        if p.is_dir()
        and (
            (p.name.startswith(".step_") and p.name.endswith(".trash"))
            or (p.name.startswith("step_") and p.name[5:].isdigit() and not (p / MANIFEST).exists())
        )
    ]
    for p in gone:
        log.warning("removing %s, left by an interrupted removal of old checkpoints", p)
        shutil.rmtree(p, ignore_errors=True)
    return gone


def verify(path: Path) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """(manifest, None) if every file of checkpoint ``path`` is there with its checksum and its layer
    files hold only tensors and plain values, else (None, why)."""
    manifest = read_manifest(path)
    if manifest is None:
        return None, "unreadable manifest"
    if manifest.get("format") != FORMAT:
        return None, f"format {manifest.get('format')!r}, this version reads {FORMAT}"
    for name, sha in manifest["files"].items():
        if not _plain_name(name):
            return None, f"its manifest names a file outside it ({name!r})"
        file = Path(path) / name
        if file.is_symlink():
            return None, f"{name} is a symbolic link (to {os.readlink(file)}), not a file of the checkpoint"
        if not file.is_file():
            return None, f"{name} is missing"
        if _sha256(file) != sha:
            return None, f"{name} does not match its checksum (truncated or corrupted)"
    for name in manifest["files"]:
        if name.startswith("layer_"):
            try:
                safe_load(Path(path) / name, mmap=True)  # the pickle's structure only: tensors stay on disk
            except UnsafeCheckpointError as e:
                return None, str(e)
            except Exception as e:  # not a torch file at all
                return None, f"{name} does not load ({type(e).__name__}: {e})"
    return manifest, None


def _plain_name(name: Any) -> bool:
    """A file name inside the checkpoint directory: no separator, no ``..``, not absolute (issue 34)."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that holds more than tensors and plain values: loading it would run code."""


def safe_load(path: Path, *, mmap: bool = False) -> Any:
    """``torch.load`` restricted to tensors and plain values (``weights_only=True``): a file that would
    run code when unpickled (a planted payload) is refused, never executed.

    Raises:
        UnsafeCheckpointError: naming the file.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsafeCheckpointError(
            f"{Path(path).name} holds more than tensors and plain values (an object that would run code when "
            f"unpickled); it is not loaded ({first})"
        ) from None


class NoLoadableCheckpoint(ConfigError):
    """Checkpoints are there, but none is complete and intact: resuming would silently start over."""


def select(path: Path, *, set_aside: bool = True) -> Tuple[Optional[Path], Optional[Dict[str, Any]]]:
    """The newest complete, intact checkpoint at ``path`` (a checkpoint, a checkpoints/ directory
    or a run directory), with its manifest; (None, None) if there is none at all.

    In a directory, the checkpoints of the latest lineage (``candidates``) are tried newest first;
    one that fails ``verify`` is logged and, with ``set_aside`` and an intact one to fall back to,
    renamed to ``*.corrupt-<time>`` (kept for inspection; never read again), so that training continues
    from the previous one and later writes the same step afresh.

    Raises:
        NoLoadableCheckpoint: checkpoints are there but none verifies (none is renamed then), naming
            them and the ways out.
    """
    path = Path(path)
    tried = [path] if (path / MANIFEST).is_file() else candidates(checkpoints_root(path))
    problems = []
    for candidate in tried:
        manifest, problem = verify(candidate)
        if manifest is not None:
            for bad, _ in problems if set_aside else ():
                bad.rename(bad.with_name(f"{bad.name}.corrupt-{int(time.time())}"))
            return candidate, manifest
        log.error("skipping checkpoint %s: %s", candidate, problem)
        problems.append((candidate, problem))
    if problems:
        listed = "; ".join(f"{p.name}: {why}" for p, why in problems)
        raise NoLoadableCheckpoint(
            f"none of the {len(problems)} checkpoint(s) at {path} can be loaded ({listed}); nothing was changed. "
            f"Start afresh with train.resume=never (they stay, and are never pruned), or resume from another "
            f"checkpoint with train.resume=<path>"
        )
    return None, None


def clear_partials(root: Path) -> None:
    """Removes the unfinished checkpoints that a crashed attempt left (rank 0, before training)."""
    for stale in Path(root).glob(".step_*.partial"):
        shutil.rmtree(stale, ignore_errors=True)


def check_model(manifest: Mapping[str, Any], shapes: Mapping[str, Sequence[int]], where: Path) -> None:
    """Refuses a checkpoint of another model.

    Raises:
        ConfigError: naming the parameters missing, unexpected or of another shape.
    """
    saved = {k: list(v) for k, v in manifest["param_shapes"].items()}
    wanted = {k: list(v) for k, v in shapes.items()}
    problems = [
        f"{k}: checkpoint {saved[k]}, model {wanted[k]}" for k in wanted if k in saved and saved[k] != wanted[k]
    ]
    problems += [f"{k}: not in the checkpoint" for k in wanted if k not in saved]
    problems += [f"{k}: not in the model" for k in saved if k not in wanted]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ConfigError(
            f"checkpoint {where} was written for another model ({len(problems)} parameters differ: {shown}); "
            f"use the model config it was trained with, or train.resume=never to start afresh"
        )


def check_ties(manifest: Mapping[str, Any], ties: Sequence[Sequence[str]], where: Path) -> None:
    """Refuses a checkpoint whose model shares parameters otherwise than this one (a tied model
    resumed untied, or the reverse, would silently train another model).

    Raises:
        ConfigError: naming both sets of ties.
    """
    saved = sorted(list(t) for t in manifest.get("ties", []))
    if saved != sorted(list(t) for t in ties):
        raise ConfigError(
            f"checkpoint {where} was written for a model with tied parameters {saved or 'none'}, but this model ties "
            f"{sorted(list(t) for t in ties) or 'none'}; use the model config it was trained with (e.g. "
            "model.tie_embeddings), "
            f"or train.resume=never to start afresh"
        )


def settings_differences(
    manifest: Mapping[str, Any], *, model: Mapping[str, Any], training: Mapping[str, Any]
) -> List[str]:
    """What differs between the model and training settings a checkpoint records (``model_settings``,
    ``training_settings``; absent in checkpoints of earlier versions: nothing to compare) and this run's,
    as ``"<setting>: checkpoint <value>, this run <value>"``."""
    out = []
    for part, ours in (("model_settings", model), ("training_settings", training)):
        saved = manifest.get(part)
        if saved is None:
            continue
        keys = set(saved) & set(ours)  # a key one version does not record is not compared, but for
        if saved.get("pipeline.schedule") == ours.get("pipeline.schedule") == "2bw":  # what 2bw records off its default
            keys |= {k for k in RECORDED_OFF_DEFAULT if k in saved or k in ours}
        for key in sorted(keys):
            a, b = (v.get(key, RECORDED_OFF_DEFAULT.get(key)) for v in (saved, ours))
            b = json.loads(json.dumps(b))  # as JSON has it: tuples are lists
            if a == b:
                continue
            if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and key == "fingerprint":
                out += [f"layer {i}: checkpoint {x}, this run {y}" for i, (x, y) in enumerate(zip(a, b)) if x != y]
            elif key in ("optim.delay_correction", "pipeline.weight_versions"):  # what 'auto' chose may differ
                fix = f"{key}={a} to resume as trained"
                if recorded_rule(a) != a:  # 2026-11-27's newest with its layout (config/newest.py's layout_hint)
                    fix = f"{layout_hint(a)} to resume as trained: newest's prediction written then resumes at it"
                out.append(f"{key}: checkpoint {a!r}, this run {b!r} (set {fix})")
            else:
                out.append(f"{key}: checkpoint {a!r}, this run {b!r}")
    return out


def check_settings(
    manifest: Mapping[str, Any], *, model: Mapping[str, Any], training: Mapping[str, Any], where: Path, strict: bool
) -> List[str]:
    """Refuses a checkpoint whose model settings (same shapes, another model: e.g. another head count) or
    training settings (precision, optimizer, schedule semantics, learning-rate schedule) differ from this
    run's; with ``strict`` false, logs the differences and goes on.

    Returns:
        The differences (empty when none).

    Raises:
        ConfigError: ``strict`` and something differs, naming every difference.
    """
    differences = settings_differences(manifest, model=model, training=training)
    if not differences:
        return []
    shown = "; ".join(differences[:8]) + (f"; and {len(differences) - 8} more" if len(differences) > 8 else "")
    if strict:
        raise ConfigError(
            f"checkpoint {where} was written with other settings ({shown}); use the settings it was trained with, "
            f"train.resume_strict=false to resume anyway, or train.resume=never to start afresh"
        )
    log.warning("train.resume_strict=false: resuming from %s although its settings differ: %s", where, shown)
    return differences


def load_layers(path: Path, indices: Sequence[int], *, ties: Sequence[Sequence[str]] = ()) -> Dict[str, Any]:
    """The part of checkpoint ``path`` that a stage holding layers ``indices`` loads, in the form
    of ``WeightVersions.state()``.

    A tie (names of one shared parameter, canonical first) is stored once, under its canonical
    name; every name of it in these layers gets that entry (read from the canonical's layer).
    """
    out: Dict[str, Any] = {"weights": {}, "previous": {}, "optimizer": {}, "masters": {}}
    has_previous = True
    cache: Dict[int, Dict[str, Any]] = {}
    files = list(json.loads((Path(path) / MANIFEST).read_text())["files"])

    def layer(i: int) -> Dict[str, Any]:
        if i not in cache:
            cache[i] = _read_layer(Path(path), i, files)
        return cache[i]

    for i in indices:
        out["weights"].update(layer(i)["weights"])
        out["optimizer"].update(layer(i)["optimizer"])
        out["masters"].update(layer(i)["masters"])
        if layer(i)["previous"] is None:
            has_previous = False
        else:
            out["previous"].update(layer(i)["previous"])
    for names in ties:
        here = [n for n in names if _layer_index(n) in indices]
        if not here:
            continue
        source = layer(_layer_index(names[0]))
        for part in ("weights", "previous", "optimizer", "masters"):
            if source[part] is not None and names[0] in source[part]:
                for n in here:
                    out[part][n] = source[part][names[0]]
    if not has_previous:
        out["previous"] = None
    return out


def _read_layer(path: Path, index: int, files: Sequence[str]) -> Dict[str, Any]:
    """Layer ``index``'s file, its optimizer state completed and its float32 ``masters`` (empty if
    the run kept none of its own) reassembled from the shard files among ``files``."""
    out = safe_load(path / layer_file(index))
    prefix = layer_file(index)[: -len(".pt")] + ".shard_"
    pieces = [safe_load(path / f) for f in files if f.startswith(prefix)]
    whole = assemble_shards(pieces, {k: v.shape for k, v in out["weights"].items()})
    return {**out, "optimizer": {**out["optimizer"], **whole["optimizer"]}, "masters": whole["masters"]}


def layer_weights(path: Path, index: int, files: Sequence[str]) -> Dict[str, torch.Tensor]:
    """Layer ``index``'s newest weights in checkpoint ``path`` at full precision: its float32 masters where the
    run kept its own (optim.sharded, train.weight_dtype=compute; reassembled from the shard files among
    ``files``), else the stored version, which then is the masters. A compute run's stored version is
    rounded to its compute dtype: consolidate and export-hf read the masters."""
    layer = _read_layer(Path(path), index, files)
    return {**layer["weights"], **layer["masters"]}


def load_rng(path: Path, rank: int) -> Optional[Dict[str, Any]]:
    """Rank ``rank``'s RNG states in checkpoint ``path`` (``rng_state``), None if absent or unsafe to load
    (a file of an earlier version, which pickled numpy's state, or one tampered with: never unpickled)."""
    file = Path(path) / f"rng_rank{rank}.pt"
    if not file.is_file():
        return None
    try:
        return safe_load(file)
    except UnsafeCheckpointError as e:
        log.warning("%s: RNG states not restored: %s", path, e)
        return None


def consolidate(path: Path, out: Optional[Path] = None) -> Path:
    """Writes the newest weights of the checkpoint at ``path`` as one plain state_dict.

    Returns:
        The file written (default: ``consolidated_step_<n>.pt`` beside the checkpoints directory).

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        NoLoadableCheckpoint: checkpoints there, none intact.
    """
    chosen, manifest = select(Path(path), set_aside=False)
    if chosen is None:
        raise FileNotFoundError(f"no complete checkpoint with intact files at {path}")
    state: Dict[str, torch.Tensor] = {}
    for i in range(manifest["num_layers"]):
        state.update(layer_weights(chosen, i, list(manifest["files"])))
    for names in manifest.get("ties", []):  # as the tied model's state_dict: every name on the one stored tensor
        for alias in names[1:]:
            state[alias] = state[names[0]]
    out = Path(out) if out is not None else chosen.parent.parent / f"consolidated_step_{manifest['step']:08d}.pt"
    atomic_torch_save(state, out)
    return out
