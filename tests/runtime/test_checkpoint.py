"""Checkpoints: saved under one plan, resumed under another (or one process) with the
next losses equal to an uninterrupted run; a save killed midway leaves the previous
checkpoint intact and loadable."""

import datetime
import io
import json
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from parity import (
    LOSS_ATOL,
    LR,
    PARAM_ATOL,
    all_params,
    batches,
    build,
    make_plan,
    megatron_styles,
    reference,
    resumable,
    run,
    token_loss,
)
from torch.distributed.checkpoint import FileSystemWriter

import autopar.runtime.checkpoint as ckpt_module
from autopar.runtime.api import parallelize
from autopar.runtime.checkpoint import latest_step
from autopar.runtime.errors import CheckpointError
from autopar.runtime.spmd import SPMDError

pytestmark = pytest.mark.multiprocess

MOMENTUM = 0.9  # optimizer state that must survive the move
STEPS, SAVE_AT = 6, 3


def _train(rank, world, plan, path, resume, steps, save_at):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    opt = job.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    losses, start = resumable(job, opt, "gpt", path, resume, steps, save_at)
    return losses, start, job.data_position


@pytest.mark.parametrize("resume_as", ["tp2-pp2", "single"])
def test_resume_under_another_plan(tmp_path, resume_as):
    """Saved by dp=2 x tp=2 (FSDP2 ZeRO-3 over Megatron TP with SP); resumed by tp=2 x
    pp=2 (ZeRO-1) or by one process: the resumed run continues the uninterrupted
    single-process run."""
    saver = make_plan(
        "gpt", dp=2, tp=2, zero_stage=3, sequence_parallel=True, styles=megatron_styles("gpt", sequence_parallel=True)
    )
    if resume_as == "single":
        loader = make_plan("gpt", num_microbatches=4)
    else:
        loader = make_plan("gpt", tp=2, pp=2, num_microbatches=4, zero_stage=1, styles=megatron_styles("gpt"))
    assert saver.config.global_batch_size == loader.config.global_batch_size
    ref = reference("gpt", saver, steps=STEPS, momentum=MOMENTUM)
    first = run(_train, 4, saver, str(tmp_path), False, STEPS, SAVE_AT, timeout_s=120)
    assert latest_step(tmp_path) == SAVE_AT
    second = run(_train, loader.config.world_size, loader, str(tmp_path), True, STEPS, None, timeout_s=120)
    for losses, start, position in second:
        assert start == SAVE_AT and position == STEPS
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[SAVE_AT:]), rtol=0, atol=LOSS_ATOL)
    for losses, _, _ in first:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[:SAVE_AT]), rtol=0, atol=LOSS_ATOL)


def test_an_hsdp_checkpoint_resumes_under_plain_fsdp(tmp_path):
    """Saved by HSDP (dp=4 as 2 replicate groups x 2 shards, ZeRO-3), whose shards repeat
    across replicate groups; resumed by plain FSDP over dp=2 (ZeRO-2): the resumed run
    continues the uninterrupted single-process run, momentum included."""
    saver = make_plan("gpt", dp=4, zero_stage=3, dp_shard=2)
    loader = make_plan("gpt", dp=2, zero_stage=2, num_microbatches=4)
    assert saver.config.global_batch_size == loader.config.global_batch_size
    ref = reference("gpt", saver, steps=STEPS, momentum=MOMENTUM)
    first = run(_train, 4, saver, str(tmp_path), False, STEPS, SAVE_AT, timeout_s=120)
    assert latest_step(tmp_path) == SAVE_AT
    second = run(_train, 2, loader, str(tmp_path), True, STEPS, None, timeout_s=120)
    for losses, start, position in second:
        assert start == SAVE_AT and position == STEPS
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[SAVE_AT:]), rtol=0, atol=LOSS_ATOL)
    for losses, _, _ in first:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[:SAVE_AT]), rtol=0, atol=LOSS_ATOL)


class _DieMidWrite(FileSystemWriter):
    """Writes half a shard file, then the process is SIGKILLed (as by the OOM killer)."""

    def write_data(self, plan, planner):
        Path(self.path, "__1_0.distcp").write_bytes(b"\0" * 1000)
        os.kill(os.getpid(), signal.SIGKILL)


def _save_twice_die_second(rank, world, plan, path):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    opt = job.optimizer(torch.optim.SGD, lr=LR)
    for step, batch in enumerate(job.shard(batches("gpt", 2, plan.config.global_batch_size))):
        job.step(batch)
        opt.step()
        opt.zero_grad()
        if step == 1 and rank == 1:
            real = dcp.save
            ckpt_module.dcp.save = lambda state, checkpoint_id: real(state, storage_writer=_DieMidWrite(checkpoint_id))
        job.save_checkpoint(path, step=step + 1)


def _load_params(rank, world, plan, path):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    job.optimizer(torch.optim.SGD, lr=LR)
    return job.load_checkpoint(path), all_params(job)


def test_killed_save_keeps_the_previous_checkpoint(tmp_path):
    plan = make_plan("gpt", dp=2, zero_stage=2)
    with pytest.raises(SPMDError, match="rank 1: died"):
        run(_save_twice_die_second, 2, plan, str(tmp_path))
    assert latest_step(tmp_path) == 1
    assert not (tmp_path / "step-00000002").exists()
    assert (tmp_path / ".step-00000002.tmp").exists()  # the half-written attempt, never renamed
    assert json.loads((tmp_path / "step-00000001" / "autopar.json").read_text())["step"] == 1
    ref = reference("gpt", plan, steps=1)
    for step, params in run(_load_params, 2, plan, str(tmp_path)):
        assert step == 1
        for name, value in params.items():
            torch.testing.assert_close(value, ref.params[name], rtol=0, atol=PARAM_ATOL)


def _save_one_step(rank, world, plan, path):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    opt = job.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    for batch in job.shard(batches("gpt", 1, plan.config.global_batch_size)):
        job.step(batch)
        opt.step()
        opt.zero_grad()
    job.save_checkpoint(path, step=1)


def _load_error(rank, world, plan, path, with_optimizer, weights_only):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    if with_optimizer:
        job.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    try:
        step = job.load_checkpoint(path, weights_only=weights_only)
    except CheckpointError as exc:
        return "CheckpointError", str(exc)
    except BaseException as exc:
        return type(exc).__name__, str(exc)
    return step, all_params(job)


def _shard(path: Path) -> Path:
    return sorted((path / "step-00000001").glob("*.distcp"))[-1]


@pytest.mark.parametrize("damage", ["truncated", "missing", "truncated, no manifest"])
def test_a_damaged_checkpoint_is_refused_naming_the_step_and_the_file(tmp_path, damage):
    """A shard cut short or gone is found from the manifest of file sizes in
    autopar.json before any tensor is read, on every rank; a checkpoint without the
    manifest (format 1) fails inside torch's reader, whose CheckpointException (a
    BaseException) becomes the same typed error."""
    plan = make_plan("gpt", dp=2)
    run(_save_one_step, 2, plan, str(tmp_path))
    shard = _shard(tmp_path)
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    if damage == "truncated, no manifest":
        meta_file = tmp_path / "step-00000001" / "autopar.json"
        meta = json.loads(meta_file.read_text())
        meta_file.write_text(json.dumps({k: v for k, v in meta.items() if k != "files"} | {"format": 1}))
    for kind, message in run(_load_error, 2, plan, str(tmp_path), True, False):
        assert kind == "CheckpointError", message
        assert "step 1" in message
        if damage != "truncated, no manifest":
            assert shard.name in message and ("missing" if damage == "missing" else "bytes") in message


def test_loading_before_the_optimizer_is_refused_unless_weights_only(tmp_path):
    """The checkpoint holds SGD's momentum: a job without an optimizer would drop it
    without a word (the resumed losses then differ), so the load is refused naming the
    order; weights_only=True loads the model alone, equal to the saved one."""
    plan = make_plan("gpt", dp=2)
    run(_save_one_step, 2, plan, str(tmp_path))
    for kind, message in run(_load_error, 2, plan, str(tmp_path), False, False):
        assert kind == "CheckpointError" and "job.optimizer(...) before job.load_checkpoint" in message
    saved = run(_load_error, 2, plan, str(tmp_path), True, False)
    for (step, params), (ref_step, ref_params) in zip(run(_load_error, 2, plan, str(tmp_path), False, True), saved):
        assert step == ref_step == 1
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=0, atol=0)


def _save_two_steps(rank, world, plan, path):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    opt = job.optimizer(torch.optim.SGD, lr=LR)
    for step, batch in enumerate(job.shard(batches("gpt", 2, plan.config.global_batch_size))):
        job.step(batch)
        opt.step()
        opt.zero_grad()
        job.save_checkpoint(path, step=step + 1)


def _load_latest(rank, world, plan, path):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    job.optimizer(torch.optim.SGD, lr=LR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = job.load_checkpoint(path)
    return step, [str(w.message) for w in caught if "autopar checkpoint" in str(w.message)]


def _resume_one_step(rank, world, plan, path):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    opt = job.optimizer(torch.optim.SGD, lr=LR)
    job.load_checkpoint(path)
    start = job.data_position
    labels = []
    for step, batch in enumerate(job.shard(batches("gpt", 3, plan.config.global_batch_size)), start=start):
        job.step(batch)
        opt.step()
        labels.append(step)
    return start, labels, [m.step for m in job.metrics]


def test_a_resumed_loop_and_the_metrics_count_on_from_the_batches_consumed(tmp_path):
    """Two steps saved, then a resumed job over the same three batches: the loop's index,
    started at ``data_position`` as docs/runtime.md writes it, and the job's metrics both
    number the one batch left 2 (the metrics restarted at 0; the documented loop started
    at the saved step's label, one behind, and saved over the checkpoint it resumed)."""
    plan = make_plan("gpt", dp=2)
    run(_save_two_steps, 2, plan, str(tmp_path))
    for start, labels, metric_steps in run(_resume_one_step, 2, plan, str(tmp_path)):
        assert (start, labels, metric_steps) == (2, [2], [2])


@pytest.mark.parametrize("stale", ["killed between the renames", "incomplete"])
def test_a_stale_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path, stale):
    """``latest`` names step 2, but step 2 is gone (a save of it killed after the old
    directory was moved aside and before the new one was renamed in) or lacks its
    autopar.json: loading without a step takes step 1, the newest complete one, and
    warns on every rank saying so."""
    plan = make_plan("gpt", dp=2)
    run(_save_two_steps, 2, plan, str(tmp_path))
    second = tmp_path / "step-00000002"
    if stale == "incomplete":
        (second / "autopar.json").unlink()
    else:
        second.rename(tmp_path / ".step-00000002.old")
    for step, notes in run(_load_latest, 2, plan, str(tmp_path)):
        assert step == 1
        assert len(notes) == 1 and "'latest' names step-00000002, which is incomplete or missing" in notes[0]
        assert "loading step-00000001" in notes[0]


def _load_position(rank, world, plan, path):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    job.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    try:
        job.load_checkpoint(path)
    except CheckpointError as exc:
        return "CheckpointError", str(exc)
    return "position", job.data_position


def test_a_plan_of_another_global_batch_resumes_at_the_same_sample(tmp_path):
    """Saved after one global batch of 8 samples (dp=2, 2 x 2 per rank): a plan of 4
    samples per batch resumes after batch 2 (sample 8), one of 16 cannot start at sample 8
    and is refused in one line, as is a manifest cut short."""
    saver = make_plan("gpt", dp=2)
    assert saver.config.global_batch_size == 8
    run(_save_one_step, 2, saver, str(tmp_path), timeout_s=120)
    smaller = make_plan("gpt", num_microbatches=2, micro_batch_size=2)
    larger = make_plan("gpt", num_microbatches=4, micro_batch_size=4)
    assert (smaller.config.global_batch_size, larger.config.global_batch_size) == (4, 16)
    assert run(_load_position, 1, smaller, str(tmp_path), timeout_s=120) == [("position", 2)]
    [(kind, message)] = run(_load_position, 1, larger, str(tmp_path), timeout_s=120)
    assert kind == "CheckpointError" and "consumed 8 samples in global batches of 8" in message
    assert "\n" not in message
    meta = tmp_path / "step-00000001" / "autopar.json"
    meta.write_text(meta.read_text()[:40])
    [(kind, message)] = run(_load_position, 1, smaller, str(tmp_path), timeout_s=120)
    assert kind == "CheckpointError" and "has a damaged autopar.json" in message


def _save_six_blocks(rank, world, plan, path):
    job = parallelize(build("gpt-6-blocks"), plan, loss_fn=token_loss)
    job.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    job.save_checkpoint(path, step=1)


def test_a_checkpoint_of_another_model_is_refused_naming_both(tmp_path):
    """Saved from a GPT of 6 blocks, loaded into one of 4 (every name it holds is in the
    checkpoint): DCP loaded the 4 blocks' tensors, dropped the other 2 and training went
    on. The load is refused on every rank, naming both fingerprints."""
    saver = make_plan("gpt-6-blocks", dp=2)
    run(_save_six_blocks, 2, saver, str(tmp_path), timeout_s=120)
    loader = make_plan("gpt", dp=2)
    assert loader.model.fingerprint != saver.model.fingerprint
    for kind, message in run(_load_position, 2, loader, str(tmp_path), timeout_s=120):
        assert kind == "CheckpointError" and "\n" not in message
        assert f"was saved from GPT (fingerprint {saver.model.fingerprint})" in message
        assert f"but this job trains GPT (fingerprint {loader.model.fingerprint})" in message


def _save_on_a_full_disk(rank, world, plan, path, where="dcp"):
    """Step 1 saved; step 2's writes fail as a full disk fails them: inside DCP's writer
    (``dcp``, every rank), or once the shards are written, under rank 1's random
    generators (``rng``) or rank 0's ``autopar.json`` (``meta``)."""
    import errno

    import torch.distributed.checkpoint.filesystem as fs

    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    job.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    job.save_checkpoint(path, step=1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "dcp":
        fs._write_item = full
    if where == "rng" and rank == 1:  # the checkpoint module's torch.save only: DCP's writer keeps its own

        class TorchSavingNothing:
            save = staticmethod(full)

            def __getattr__(self, name):
                return getattr(torch, name)

        ckpt_module.torch = TorchSavingNothing()
    if where == "meta" and rank == 0:
        ckpt_module._write_synced = full
    try:
        job.save_checkpoint(path, step=2)
    except CheckpointError as exc:
        return "CheckpointError", str(exc)
    return "saved", ""


def test_a_save_that_fails_is_one_typed_error_and_leaves_nothing_behind(tmp_path):
    """DCP raises its CheckpointException, a BaseException that ``except Exception`` and
    torchrun's error record miss, naming only the failed ranks: the save raises a
    CheckpointError with a rank's own cause (ENOSPC), removes its partial directory, and
    the previous checkpoint stays the latest."""
    plan = make_plan("gpt", dp=2)
    for kind, message in run(_save_on_a_full_disk, 2, plan, str(tmp_path), timeout_s=120):
        assert kind == "CheckpointError" and "checkpoint step 2 could not be written" in message
        assert "No space left on device" in message and "\n" not in message
    assert latest_step(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]


@pytest.mark.parametrize("where, failed", [("rng", "rank 1"), ("meta", "rank 0")])
def test_a_disk_that_fills_after_the_shards_is_one_typed_error_on_every_rank(tmp_path, where, failed):
    """The shards written, one rank's own files fail (its generators' state, or rank 0's
    autopar.json): that rank raised a bare OSError (or torch.save's RuntimeError) while
    the others went on, and the partial directory stayed on the full disk. Every rank
    raises the failed rank's CheckpointError, the partial directory is removed, and the
    previous checkpoint stays the latest."""
    plan = make_plan("gpt", dp=2)
    for kind, message in run(_save_on_a_full_disk, 2, plan, str(tmp_path), where, timeout_s=120):
        assert kind == "CheckpointError" and "checkpoint step 2 could not be written" in message
        assert f"{failed}: OSError: [Errno 28] No space left on device" in message and "\n" not in message
    assert latest_step(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]


def test_a_shard_that_does_not_unpickle_is_called_damaged():
    """torch's unpickler, failing on a damaged shard, advises loading it with
    weights_only=False (trusting the file): the error relayed says the file is damaged
    instead, and leaves any other cause as it was."""
    shard = io.BytesIO()
    torch.save(datetime.date(2026, 12, 7), shard)  # a global the weights-only unpickler refuses, as damage makes
    shard.seek(0)
    with pytest.raises(Exception, match="weights_only") as caught:  # what DCP's reader would wrap
        torch.load(shard, weights_only=True)
    unpickled = caught.value
    failure = dcp.api.CheckpointException("load failed", {1: (unpickled, None)})
    cause = ckpt_module._cause(failure)
    damaged = "a shard's bytes do not unpickle: the file is damaged (its size matches the manifest)"
    assert cause == f"rank 1: UnpicklingError: {damaged}"
    other = dcp.api.CheckpointException("load failed", {0: (FileNotFoundError("no such shard"), None)})
    assert ckpt_module._cause(other) == "rank 0: FileNotFoundError: no such shard"
