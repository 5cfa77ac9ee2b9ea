"""Saving: checkpoints written every `checkpoint.interval` steps and at the end, synchronously or
asynchronously, published atomically, the oldest purged.

Publishing is atomic: everything is written to ``step-N.tmp`` and renamed to ``step-N`` by rank 0
only once DCP reports the save complete on every rank (DCP's final all-reduce, i.e. a barrier, or
the async future). Readers only ever consider ``step-N`` folders, so a crash mid-save leaves the
previous checkpoint as the latest. ``keep_latest_k`` counts published checkpoints only, so the one
being written never counts against it. A save that fails (a full disk, ...) removes its
``step-N.tmp``; a step whose parameters are not all finite is not saved. Leftover
``.tmp``/``.purge`` folders of a killed job are removed when the manager is built, before anything
else of the job writes.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from titanlike.checkpoint import format as fmt
from titanlike.checkpoint import hf
from titanlike.checkpoint.format import PURGE_SUFFIX, STEP_RE, TMP_SUFFIX, CheckpointError, Json, published_steps, summarize
from titanlike.models.load_hooks import LoadHook
from titanlike.checkpoint.states import MODEL, TRAIN_STATE, JobModel

logger = logging.getLogger("titanlike")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Pending:
    """An async save in flight, published once its future completes."""
    step: int
    future: Future
    started: float
    finished: float | None = None  # set by the future's callback: publishing waits for the next poll


class Saver:
    """CheckpointManager's saving half (manager.py): writes `states` into `folder`'s step-N folders."""

    def __init__(self, c, folder: str, states: dict[str, Stateful], *, total_steps: int, job: JobModel | None,
                 tokenizer: dict[str, Any], hooks: Sequence[LoadHook], optimizer, rank: int, distributed: bool, pg,
                 base_model: str | None = None):
        """base_model: the Hugging Face folder the job's model started from (None: a DCP checkpoint or
        its initialization), which a hook's export names as its base (a PEFT adapter's)."""
        self.cfg, self.folder, self.states, self.total_steps = c, folder, states, total_steps
        self.base_model = base_model
        self.job, self._tokenizer, self.hooks = job, tokenizer, tuple(hooks)
        self.rank, self.distributed, self._pg = rank, distributed, pg
        self.blocked_s = 0.0  # time the training loop spent inside save() and staging waits
        self.save_seconds: list[tuple[int, float]] = []  # (step, start of save -> published), rank 0
        self._pending: _Pending | None = None
        self._staging: Future | None = None
        self._stager = None
        self._purger: _Purger | None = _Purger() if c.keep_latest_k > 0 and rank == 0 else None
        self._leftovers_removed = False
        self.async_mode = c.async_mode
        if self.async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            if not cuda and self.rank == 0:
                logger.info("checkpoint: pinned memory needs CUDA, which is not available; "
                            "async_with_pinned_mem stages into shared (pageable) CPU memory instead")
            if not self.distributed:
                logger.info("checkpoint: a single-process job has no process group for a checkpoint "
                            "process; async_with_pinned_mem writes from a background thread instead")
            # Staging runs in a thread, overlapping the next forward/backward; the checkpoint
            # is written by a separate process (reading the staged copy from shared memory), so
            # file writing never holds this GIL.
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=self.distributed, use_async_staging=True,
                use_non_blocking_copy=cuda))
            # Staging reads the parameters and optimizer state the next optimizer step
            # overwrites in place: that step waits for it.
            optimizer.register_step_pre_hook(lambda *_: self.wait_for_staging())

    def path(self, step: int) -> str:
        return fmt.step_folder(self.folder, step)

    @torch.no_grad()
    def saves_at(self, step: int) -> bool:
        """Whether save(step) writes a checkpoint (the interval, the last step, the first step with
        checkpoint.enable_first_step_checkpoint); the loop reads the step's results before those."""
        return not self.cfg.load_only and (step >= self.total_steps or step % self.cfg.interval == 0
                               or (step == 1 and self.cfg.enable_first_step_checkpoint))

    def save(self, step: int, *, force: bool = False) -> None:
        """Call after every training step; saves at the interval, at the last step and, with
        checkpoint.enable_first_step_checkpoint, after step 1. force saves a full, synchronous
        (resumable) checkpoint now, e.g. before a job is preempted. Nothing with checkpoint.load_only."""
        if self.cfg.load_only:
            return
        begin = time.monotonic()
        self._poll_pending()
        last = step >= self.total_steps
        if force and not last:
            self._wait_pending()
            self._check_finite(step)
            self.states[TRAIN_STATE].step = step
            self._save_full_sync(step)
        elif self.saves_at(step):
            self._wait_pending()  # one save in flight at a time
            self._check_finite(step)
            self.states[TRAIN_STATE].step = step
            if last and self.cfg.last_save_model_only:
                self._save_model_only(step, DTYPES[self.cfg.export_dtype], in_hf=self.cfg.last_save_in_hf)
            elif last or self.async_mode == "disabled":
                self._save_full_sync(step)
            else:
                self._save_full_async(step)
        self.blocked_s += time.monotonic() - begin

    def save_seed(self) -> None:
        """checkpoint.create_seed_checkpoint: the initialized model as step 0, in float32."""
        if published_steps(self.folder):
            raise CheckpointError(
                f"{self.folder} already holds checkpoints (steps {published_steps(self.folder)}); "
                "a seed checkpoint goes into an empty checkpoint folder"
            )
        self._check_finite(0)
        self._save_model_only(0, torch.float32, in_hf=False)

    def _check_finite(self, step: int) -> None:
        """Refuse to save a model with a NaN or infinite parameter: all ranks agree (one all-reduce
        over the checkpoint's group), so all raise the same error and the previous checkpoint
        stays the latest. One isfinite().all() per local shard and one device sync."""
        names, flags = [], []
        for name, t in self.states[MODEL].state_dict().items():
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.is_floating_point() and local.numel():
                names.append(name)
                flags.append(torch.isfinite(local).all())
        bad = (~torch.stack(flags)).nonzero().flatten().tolist() if flags else []
        first = names[bad[0]] if bad else None
        if self.distributed:
            flag = torch.tensor([0 if first is None else 1], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._pg)
            if flag.item():
                found: list = [None] * dist.get_world_size(self._pg)
                dist.all_gather_object(found, first, group=self._pg)
                first = next(n for n in found if n is not None)
        if first is not None:
            raise CheckpointError(f"step {step} has non-finite parameters (first: {first}); not saving it")

    def _tmp(self, step: int) -> str:
        return self.path(step) + TMP_SUFFIX

    def _dcp_state(self, states: dict[str, Stateful]) -> dict[str, torch.Tensor]:
        """The states as DCP saves them: one flat dict of tensors, JSON entries encoded."""
        flat, _ = flatten_state_dict({name: state.state_dict() for name, state in states.items()})
        out = {}
        for key, value in flat.items():
            if isinstance(value, Json):
                value = fmt.encode_json(value.value, key)
            elif not isinstance(value, torch.Tensor):
                raise CheckpointError(f"checkpoint entry {key!r} holds a {type(value).__name__}, not a tensor; "
                                      "titanlike stores non-tensor state as JSON only (format.Json)")
            out[key] = value
        return out

    def _save_full_sync(self, step: int) -> None:
        begin = time.monotonic()
        self._dcp_save(self._dcp_state(self.states), step)
        self._publish_agreed(step, "full", begin)

    def _save_full_async(self, step: int) -> None:
        kwargs = {}
        if self.async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            # DCP's checkpoint process joins a process group of its own, set up through the job's;
            # a single-process job has none, so there the writing stays in a thread.
            kind = AsyncCheckpointerType.PROCESS if self.distributed else AsyncCheckpointerType.THREAD
            kwargs = dict(async_checkpointer_type=kind, async_stager=self._stager)
        state = self._dcp_state(self.states)
        if not self.distributed:
            fmt.ignore_single_process_warning()
        try:
            response = dcp.async_save(state, storage_writer=fmt.ChecksumWriter(self._tmp(step)),
                                      process_group=self._pg, no_dist=not self.distributed, **kwargs)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise self._save_failed(step, e, f"starting the save of {self._tmp(step)} failed: {summarize(e)}") from None
        if hasattr(response, "upload_completion"):  # staging in the background
            self._staging, future = response.staging_completion, response.upload_completion
        else:
            future = response
        pending = self._pending = _Pending(step, future, time.monotonic())
        future.add_done_callback(lambda _: setattr(pending, "finished", time.monotonic()))

    def _save_model_only(self, step: int, dtype: torch.dtype, *, in_hf: bool) -> None:
        begin = time.monotonic()
        state = self.states[MODEL].state_dict()
        if dtype != torch.float32 and not in_hf:
            state = {k: v.to(dtype) for k, v in state.items()}
        tmp = self._tmp(step)
        if not in_hf:
            self._dcp_save(state, step)
            self._publish_agreed(step, "model_only", begin)
            return
        # Every rank writes its shards as DCP (any layout, pipeline stages included); rank 0 then
        # converts the whole model, which needs full tensors for the q/k permutation.
        staging = os.path.join(tmp, "dcp")
        self._dcp_save(state, step, path=staging)

        job = self.job

        def convert() -> None:
            state_dict = fmt.read_dcp_model(staging, verify=False)  # written just now, by this job
            for hook in self.hooks:
                state_dict = hook.hf_export(state_dict, job.spec, job.args, tmp, base_model=self.base_model)
            tok = self._tokenizer
            export = hf.write_hf(state_dict, job.spec, job.args, tmp, dtype=dtype,
                                 context_len=job.context_len, bos_id=tok.get("bos_id"), eos_id=tok.get("eos_id"),
                                 pad_id=tok.get("pad_id"), tokenizer_path=tok.get("path"),
                                 tokenizer_fingerprint=tok.get("fingerprint"), chat_template=tok.get("chat_template"),
                                 end_of_turn_ids=tok.get("end_of_turn_ids"))
            (logger.info if export.converted else logger.warning)(f"checkpoint: {export.message}")
            shutil.rmtree(staging)

        # The other ranks wait for rank 0's conversion in _publish_agreed, on the checkpoint's group
        # with its long timeout, rather than in their next collective on a group with the (short)
        # comm.train_timeout_seconds.
        self._publish_agreed(step, "hf", begin, prepare=convert)

    def _dcp_save(self, state: dict, step: int, *, path: str | None = None) -> None:
        path = path or self._tmp(step)
        try:
            fmt.dcp_save(state, path, process_group=self._pg, no_dist=not self.distributed)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise self._save_failed(step, e, f"saving checkpoint {path} failed: {summarize(e)}") from None

    def _save_failed(self, step: int, e: BaseException, message: str) -> CheckpointError:
        """The error of a save that failed: rank 0 removes the partial step-N.tmp (a full disk
        stays full otherwise), and the message says what stays the latest checkpoint."""
        if self.rank == 0:
            shutil.rmtree(self._tmp(step), ignore_errors=True)
        steps = published_steps(self.folder)
        kept = f"{self.path(steps[-1])} stays the latest checkpoint" if steps else "there is no earlier checkpoint"
        if fmt.is_no_space(e):
            message = f"no space left on device while saving step {step} to {self.path(step)}"
        return CheckpointError(f"{message}; removed the partial save, {kept}")

    def _publish_agreed(self, step: int, contents: str, begin: float, prepare=None) -> None:
        """Publish a synchronous save (after prepare(), on rank 0) and share rank 0's verdict, so
        that if rank 0 cannot publish (no space for the sidecar, ...) every rank stops with it."""
        error = None
        if self.rank == 0:
            try:
                if prepare is not None:
                    prepare()
                self._publish(step, contents, time.monotonic() - begin)
            except Exception as e:  # whatever rank 0 meets, the other ranks must hear it, not wait
                detail = str(e) if isinstance(e, (CheckpointError, OSError)) else f"{type(e).__name__}: {e}"
                error = str(self._save_failed(step, e, f"publishing checkpoint {self._tmp(step)} failed: {detail}"))
        fmt.raise_rank0_verdict(error, distributed=self.distributed, group=self._pg)

    def _publish(self, step: int, contents: str, seconds: float) -> None:
        """Rank 0 renames step-N.tmp to step-N; every rank's data is on disk by now.

        DCP's save ends with an all-reduce in which the coordinator (rank 0) writes the index
        after gathering every rank's write results, so its completion is the barrier. The
        sidecar, written last, records the checksum of every file (format.collect_checksums).
        """
        if self.rank != 0:
            return
        tmp, final = self._tmp(step), self.path(step)
        # The tokenizer's files go into the checkpoint (write_sidecar), except into a Hugging Face
        # export, which already holds them as transformers reads them.
        tokenizer = self._tokenizer if contents != "hf" else {k: v for k, v in self._tokenizer.items() if k != "path"}
        info = {"contents": contents, "step": step, "tokenizer": tokenizer}
        if self.job is not None:
            info["model"] = self.job.description
        fmt.write_sidecar(tmp, info)
        if os.path.exists(final):
            # Re-saving a step (after load_step went back): drop the old one first.
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.folder)
        self.save_seconds.append((step, seconds))
        logger.info(f"checkpoint: saved {contents.replace('_', ' ')} {final} in {seconds:.2f} s")
        self._purge()

    def _purge(self) -> None:
        k = self.cfg.keep_latest_k
        if self._purger is None or k <= 0:
            return
        for old in published_steps(self.folder)[:-k]:
            doomed = self.path(old) + PURGE_SUFFIX
            # Renamed first, so a half-deleted folder is never mistaken for a checkpoint.
            os.rename(self.path(old), doomed)
            self._purger.submit(doomed)

    def remove_leftovers(self) -> None:
        """Delete step-N.tmp (a save that never finished) and step-N.purge folders. Runs when
        the manager is built, before the job's metrics or TensorBoard files are written: a save
        that filled the disk must not stop the relaunch before it is removed. Once per manager."""
        if self._leftovers_removed:
            return
        self._leftovers_removed = True
        if self.rank == 0 and os.path.isdir(self.folder):
            for name in os.listdir(self.folder):
                if name.endswith((TMP_SUFFIX, PURGE_SUFFIX)) and STEP_RE.match(name):
                    logger.warning(f"checkpoint: removing {os.path.join(self.folder, name)} "
                                   "(left by a save or purge that did not finish)")
                    shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        if self.distributed:
            # No rank may start writing a step-N.tmp that rank 0 is still deleting.
            dist.barrier(group=self._pg)

    # Async bookkeeping ----------------------------------------------------------------------

    def wait_for_staging(self) -> None:
        if self._staging is not None:
            begin = time.monotonic()
            staging, self._staging = self._staging, None
            try:
                staging.result()
            except BaseException as e:
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                raise CheckpointError(f"staging the checkpoint failed: {summarize(e)}") from None
            self.blocked_s += time.monotonic() - begin

    def _poll_pending(self) -> None:
        if self._pending is not None and self._pending.future.done():
            self._wait_pending()

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self.wait_for_staging()
        try:
            pending.future.result()
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise self._save_failed(
                pending.step, e, f"saving checkpoint {self._tmp(pending.step)} failed: {summarize(e)}") from None
        # Rank 0 alone publishes an async save, when its future is done (the ranks poll at
        # different times, so no collective here).
        try:
            self._publish(pending.step, "full", (pending.finished or time.monotonic()) - pending.started)
        except (CheckpointError, OSError) as e:
            raise self._save_failed(
                pending.step, e, f"publishing checkpoint {self._tmp(pending.step)} failed: {e}") from None

    def close(self) -> None:
        """Finish the save in flight, then stop the purge thread and the checkpoint process."""
        try:
            self._wait_pending()
        except CheckpointError as e:
            # Only reachable after the loop failed (the last step's save is synchronous), so
            # that error is the one being reported; this one is logged next to it.
            logger.error(f"checkpoint: {e}")
        finally:
            if self._purger is not None:
                self._purger.close()
                self._purger = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None
                # The checkpoint process is torch's module-level singleton; dropping the last
                # reference asks it to exit (private API: keep in step with torch).
                from torch.distributed.checkpoint import _async_process_executor as ape

                if getattr(ape, "_CHECKPOINT_PROCESS", None) is not None:
                    ape._CHECKPOINT_PROCESS = None


class _Purger:
    """Deletes old checkpoints in a background thread (rmtree of GBs takes seconds)."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="checkpoint-purge", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (path := self.queue.get()) is not None:
            shutil.rmtree(path, ignore_errors=True)

    def submit(self, path: str) -> None:
        self.queue.put(path)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

