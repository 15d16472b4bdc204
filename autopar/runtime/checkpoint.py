"""Checkpoints that survive a crash and reshard to any plan.

Layout of ``<root>``::

    step-00000100/            one complete checkpoint
        .metadata, __*_0.distcp   torch.distributed.checkpoint (model + optimizer)
        rng/rank-<r>.pt       each rank's RNG states
        autopar.json          step, data position, world size, plan, fp16 loss scale and the
                              size of every file above (written last)
    latest                    the name of the newest complete checkpoint

Model and optimizer go through ``get_state_dict``/``set_state_dict`` with the optimizer
state flattened per parameter FQN (``flatten_optimizer_state_dict``, as torchtitan does),
so any plan, world size or single process can load what any other saved: DCP reads each
rank's shards from whatever shards were written. Parameters tied across pipeline stages
are saved under every one of their names, so a plan that splits them finds each name.

Atomicity: every rank writes into ``.step-<n>.tmp``; after a barrier rank 0 writes
``autopar.json``, renames the directory to ``step-<n>`` (atomic on POSIX) and then
replaces ``latest``. A save killed midway leaves only a ``.tmp`` directory, which the
next save of that step removes; ``latest`` and every complete checkpoint are untouched.
Loading without a step takes ``latest``'s; when ``latest`` is stale (a save killed
between its two renames leaves it naming a directory that is gone) it falls back to the
newest complete checkpoint and warns saying so.

Loading first checks every file the manifest in ``autopar.json`` lists against its
recorded size, so a missing or truncated shard (a copy cut short, a disk full) is
refused with the step and the file named before any tensor is read; a failure inside
torch's reader (its ``CheckpointException`` is a ``BaseException``, which ``except
Exception`` does not catch) becomes the same typed error. A checkpoint holding optimizer
state is not loaded into a job without an optimizer (``job.optimizer(...)`` first, or
``weights_only=True``): the state would be dropped without a word.

RNG states are restored only when the world size matches the saving run (ranks map one
to one); under another layout each rank keeps its RNG, which changes nothing for models
without dropout.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from autopar.errors import first_line
from autopar.runtime.errors import CheckpointError

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
"""Format 1 had no manifest of file sizes; it loads without that check."""
_META = "autopar.json"
_LATEST = "latest"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(kw_only=True)
class CheckpointParts:
    """What a rank saves: its stage modules, their optimizers (None where it owns no
    optimizer state), the names of tied parameters, and its place in the world; the
    plan's short form, and the model's name and fingerprint (``ModelSummary``), which a
    load checks."""

    modules: list[nn.Module]
    optimizers: list[Optimizer | None]
    rank: int
    world_size: int
    aliases: tuple[tuple[str, ...], ...] = field(default_factory=tuple)
    summary: str = ""
    model: str = ""
    model_fingerprint: str = ""


@dataclass(frozen=True, kw_only=True)
class LoadedState:
    """What ``load`` restored besides tensors."""

    step: int
    data_position: int
    path: str
    loss_scale: dict[str, float] | None = None


def step_dir(root: str | Path, step: int) -> Path:
    """The directory of checkpoint ``step`` under ``root``."""
    return Path(root) / f"step-{step:08d}"


def latest_step(root: str | Path) -> int | None:
    """The step ``latest`` names, if that checkpoint is complete; else None."""
    pointer = Path(root) / _LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not (Path(root) / name / _META).exists():
        return None
    return int(name.split("-")[1])


def newest_complete_step(root: str | Path) -> tuple[int | None, str]:
    """The step to load when none is asked for: ``latest``'s, or, when ``latest`` is
    missing, stale or names an incomplete checkpoint (a save killed between its renames,
    a copy without the pointer), the newest complete ``step-*`` directory, with a note
    saying so ("" when ``latest`` was used)."""
    step = latest_step(root)
    if step is not None:
        return step, ""
    complete = sorted(
        int(d.name.split("-")[1])
        for d in Path(root).glob("step-*")
        if d.name.split("-")[1].isdigit() and (d / _META).exists()
    )
    if not complete:
        return None, ""
    pointer = Path(root) / _LATEST
    named = pointer.read_text().strip() if pointer.exists() else ""
    why = f"'latest' names {named}, which is incomplete or missing" if named else "there is no 'latest' pointer"
    return complete[-1], f"{why}; loading {step_dir(root, complete[-1]).name}, the newest complete checkpoint"


def save(
    parts: CheckpointParts,
    root: str | Path,
    *,
    step: int,
    data_position: int,
    global_batch_size: int | None = None,
    loss_scale: Mapping[str, float] | None = None,
) -> str:
    """Write a checkpoint collectively (every rank calls it); returns its directory.
    ``data_position`` counts global batches of ``global_batch_size`` samples, recorded
    so that a plan of another batch size resumes at the same sample (:func:`load`)."""
    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".{final.name}.tmp"
    if parts.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    state = {"model": _model_state(parts), "optim": _optim_state(parts)}
    try:
        dcp.save(state, checkpoint_id=str(tmp))
    except dcp.api.CheckpointException as exc:  # a BaseException, raised on every rank alike
        _abandon(parts, tmp, step, root, _cause(exc))
    try:  # each rank's generators: a disk that fills now fails some ranks, and every rank must know
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(_rng_state(), tmp / "rng" / f"rank-{parts.rank}.pt")
        failure = None
    except (OSError, RuntimeError) as exc:  # torch.save's writer says a short write as a RuntimeError
        failure = f"rank {parts.rank}: {type(exc).__name__}: {first_line(exc)}"
    _abandon_on(_first_failure(failure), parts, tmp, step, root)
    failure = None
    if parts.rank == 0:
        meta = {
            "format": FORMAT_VERSION,
            "step": step,
            "data_position": data_position,
            "global_batch_size": global_batch_size,
            "world_size": parts.world_size,
            "plan": parts.summary,
            "model": parts.model,
            "model_fingerprint": parts.model_fingerprint,
            "loss_scale": dict(loss_scale) if loss_scale is not None else None,
            "files": _manifest(tmp),
        }
        try:
            _write_synced(tmp / _META, json.dumps(meta, indent=1))
        except OSError as exc:
            failure = f"rank 0: {type(exc).__name__}: {first_line(exc)}"
    _abandon_on(_first_failure(failure), parts, tmp, step, root)
    if parts.rank == 0:
        if final.exists():
            old = root / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _write_synced(root / f".{_LATEST}.tmp", final.name)
        os.replace(root / f".{_LATEST}.tmp", root / _LATEST)
    dist.barrier()
    return str(final)


def load(
    parts: CheckpointParts,
    root: str | Path,
    *,
    step: int | None = None,
    weights_only: bool = False,
    global_batch_size: int | None = None,
) -> LoadedState:
    """Load a checkpoint written by any plan into this job (every rank calls it);
    ``weights_only`` loads the model's tensors and leaves any saved optimizer state. The
    data position is returned in global batches of ``global_batch_size`` (this job's):
    the saved run's samples over it, refused where no batch boundary falls there."""
    if step is None:
        step, note = newest_complete_step(root)
        if step is None:
            raise CheckpointError(
                f"no complete checkpoint under {str(root)!r} (no step-* directory with {_META}). Save one "
                f"with job.save_checkpoint first, or check the path."
            )
        if note:
            warnings.warn(f"autopar checkpoint under {str(root)!r}: {note}.", stacklevel=3)
    path = step_dir(root, step)
    meta_file = path / _META
    if not meta_file.exists():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete or missing ({_META} not found): it was never "
            f"finished. Load another step (latest is {latest_step(root)})."
        )
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has a damaged {_META} ({first_line(exc)}): it was cut short or edited. Load "
            f"another step (the complete ones are the step-* directories with a readable {_META})."
        ) from None
    if meta.get("format") not in READABLE_FORMATS:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format {meta.get('format')!r}; this autopar reads formats "
            f"{', '.join(map(str, READABLE_FORMATS))}. Load it with the autopar version that wrote it."
        )
    _check_model(meta, parts, path)
    _check_files(path, meta.get("files", {}), step)
    position = _data_position(meta, global_batch_size, path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    saved_optim = any(key.startswith("optim.") for key in metadata.state_dict_metadata)
    if saved_optim and not weights_only and all(o is None for o in parts.optimizers):
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds optimizer state but this job has no optimizer yet, so it "
            f"would be dropped: call job.optimizer(...) before job.load_checkpoint(...), or pass "
            f"weights_only=True to load the model alone."
        )
    model_sd = _model_state(parts)
    optim_sd = {} if weights_only else _optim_state(parts)
    state = {"model": model_sd, "optim": optim_sd}
    reshaped = _stand_ins(state, metadata)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except dcp.api.CheckpointException as exc:
        raise CheckpointError(
            f"checkpoint step {step} at {str(path)!r} could not be read: {_cause(exc)}. Load another step (the "
            f"complete ones are the step-* directories with {_META}), or check it was saved for this model."
        ) from None
    for (group, key), target in reshaped.items():
        _copy_reshaped(target, state[group][key])
        state[group][key] = target
    for module, optimizer in zip(parts.modules, parts.optimizers):
        keys = set(get_model_state_dict(module).keys())
        set_model_state_dict(module, {k: v for k, v in state["model"].items() if k in keys})
        if optimizer is not None and not weights_only:
            own = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
            set_optimizer_state_dict(module, optimizer, {k: state["optim"][k] for k in own}, options=_OPTIONS)
    if meta["world_size"] == parts.world_size:
        rng_file = path / "rng" / f"rank-{parts.rank}.pt"
        if rng_file.exists():
            _set_rng_state(torch.load(rng_file, weights_only=False))
    return LoadedState(
        step=int(meta["step"]),
        data_position=position,
        path=str(path),
        loss_scale=meta.get("loss_scale"),
    )


def _check_model(meta: Mapping[str, Any], parts: CheckpointParts, path: Path) -> None:
    """Refuse a checkpoint saved from another model (its fingerprint, where both know
    one): DCP loads what this job's model names and drops the rest, so a model with
    fewer layers took its tensors and trained on without a word."""
    saved = meta.get("model_fingerprint") or ""
    if saved and parts.model_fingerprint and saved != parts.model_fingerprint:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was saved from {meta.get('model') or 'another model'} (fingerprint {saved}) "
            f"but this job trains {parts.model or 'a model'} (fingerprint {parts.model_fingerprint}): it would load "
            f"the tensors whose names match and drop the rest. Load it into the model it was saved from (any plan "
            f"of it), or read its tensors yourself with torch.distributed.checkpoint."
        )


def _first_failure(failure: str | None) -> str | None:
    """The first rank's failure of a write every rank made (None where all wrote),
    known to every rank: so that all raise together, none waiting at the next barrier."""
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failure)
    return next((f for f in gathered if f), None)


def _abandon_on(failure: str | None, parts: CheckpointParts, tmp: Path, step: int, root: Path) -> None:
    """:func:`_abandon` where a rank failed."""
    if failure is not None:
        _abandon(parts, tmp, step, root, failure)


def _abandon(parts: CheckpointParts, tmp: Path, step: int, root: Path, cause: str) -> NoReturn:
    """Remove the partial checkpoint (rank 0) and raise its CheckpointError on every rank:
    ``latest`` and the checkpoints before are untouched."""
    if parts.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointError(
        f"checkpoint step {step} could not be written under {str(root)!r}: {cause}; the previous "
        f"checkpoints are untouched. Free space or fix the path, then save again."
    ) from None


def _cause(exc: BaseException) -> str:
    """The first rank's own error inside DCP's ``CheckpointException`` (whose text lists
    only the ranks that failed), as one line."""
    failures = getattr(exc, "failures", None) or {}
    for rank, (inner, _) in sorted(failures.items()):
        return f"rank {rank}: {type(inner).__name__}: {_damaged(first_line(inner))}"
    return _damaged(first_line(exc))


def _damaged(text: str) -> str:
    """``text``, but where torch's unpickler failed on a shard's bytes its advice (load
    with ``weights_only=False``, trusting the file) is the wrong one for a damaged file."""
    if "weights only" not in text.lower().replace("_", " "):
        return text
    return "a shard's bytes do not unpickle: the file is damaged (its size matches the manifest)"


def _data_position(meta: Mapping[str, Any], global_batch_size: int | None, path: Path) -> int:
    """The saved run's data position in global batches of ``global_batch_size``: the
    samples it consumed (its position times its own batch size, where recorded) over
    this job's batch size, so that the same loader resumes at the same sample."""
    position, saved = int(meta["data_position"]), meta.get("global_batch_size")
    if global_batch_size is None or saved is None or saved == global_batch_size:
        return position
    samples = position * saved
    if samples % global_batch_size:
        raise CheckpointError(
            f"checkpoint {str(path)!r} consumed {samples} samples in global batches of {saved}; this plan's global "
            f"batch of {global_batch_size} does not divide that, so no batch of its loader starts where the run "
            f"stopped: resume with a global batch that divides {samples}, or from another step."
        )
    return samples // global_batch_size


def _manifest(directory: Path) -> dict[str, int]:
    """The size in bytes of every file under ``directory``, by relative path."""
    return {str(f.relative_to(directory)): f.stat().st_size for f in sorted(directory.rglob("*")) if f.is_file()}


def _check_files(path: Path, files: Mapping[str, int], step: int) -> None:
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(
                f"checkpoint step {step} at {str(path)!r} is damaged: {name} is missing. Load another step, "
                f"or copy the checkpoint again."
            )
        if f.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint step {step} at {str(path)!r} is damaged: {name} has {f.stat().st_size} bytes, "
                f"{size} were written. Load another step, or copy the checkpoint again."
            )


def _stand_ins(state: dict[str, dict[str, Any]], metadata: Any) -> dict[tuple[str, str], torch.Tensor]:
    """Replace each tensor saved in another shape of the same size (GPT-2's fused
    ``c_attn`` is ``(in, 3 x hidden)`` in one plan and ``(in, 3, hidden)`` when split by
    heads) by a full tensor of the saved shape; returns the targets to fill after loading."""
    saved = metadata.state_dict_metadata
    targets: dict[tuple[str, str], torch.Tensor] = {}
    for group, entries in state.items():
        for key, value in entries.items():
            meta = saved.get(f"{group}.{key}")
            if not isinstance(value, torch.Tensor) or meta is None or not hasattr(meta, "size"):
                continue
            if tuple(meta.size) != tuple(value.shape) and meta.size.numel() == value.numel():
                targets[(group, key)] = value
                entries[key] = torch.empty(tuple(meta.size), dtype=value.dtype, device=_local(value).device)
    return targets


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def _copy_reshaped(target: torch.Tensor, full: torch.Tensor) -> None:
    full = full.reshape(target.shape)
    if isinstance(target, DTensor):
        full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
    _local(target).copy_(full)


def _model_state(parts: CheckpointParts) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for module in parts.modules:
        merged.update(get_model_state_dict(module))
    return merged


def _optim_state(parts: CheckpointParts) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for module, optimizer in zip(parts.modules, parts.optimizers):
        if optimizer is not None:
            merged.update(get_optimizer_state_dict(module, optimizer, options=_OPTIONS))
    for names in parts.aliases:
        for key in list(merged):
            for name in names:
                suffix = _suffix(key, name)
                if suffix is None:
                    continue
                prefix = key[: len(key) - len(name) - len(suffix)]
                for other in names:
                    merged.setdefault(prefix + other + suffix, merged[key])
    return merged


def _suffix(key: str, name: str) -> str | None:
    for head in ("state.", "param_groups."):
        if key.startswith(head + name + "."):
            return key[len(head) + len(name) :]
    return None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
