"""The trainer: assemble a job from a validated JobConfig, then run the training loop.

Assembly follows README.md's "How a job runs": ParallelDims -> model on meta -> parallelize ->
materialize and initialize on the sharded tensors -> optimizer and schedule ->
data -> loop. The training step is `TrainStep` (titanlike/train/step.py): all microbatches of
one global batch, one clip, one optimizer step, device tensors out; the loop decides when the
host reads them (`train`).

Faults (titanlike/train/faults.py, titanlike/observe/run_lock.py): rank 0 locks the dump
folder for the job's life; a step whose loss or gradient norm is non-finite is skipped on the
device and then stops the job (or is counted, training.skip_nonfinite_steps); SIGTERM / SIGUSR1 on
any rank make all ranks save the step they finish and return from `train`. Under float16 loss
scaling (titanlike/train/loss_scaling.py) a non-finite gradient norm with a finite loss is an
overflow instead: every rank skips the step, the learning rate is held and the scale backs off.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
import shutil
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from titanlike.checkpoint import CheckpointManager
from titanlike.config.loader import config_to_dict
from titanlike.config.schema import JobConfig
from titanlike.data import build_dataloader
from titanlike.models import protocol
from titanlike.models.common.attention import describe_sdpa_kernel, resolve_attention_backend
from titanlike.models.converters import build_model_converters
from titanlike.models.load_hooks import model_hooks
from titanlike.observe.memory import MemorySnapshot, tensor_footprint
from titanlike.observe.metrics import MetricsLogger, tensorboard_run_folder
from titanlike.observe.profiler import Profiler
from titanlike.observe.run_lock import FolderLock, FolderRefused, lock_folders, output_folders
from titanlike.observe.stragglers import StragglerDetector, format_stragglers
from titanlike.observe.summary import RunSummary
from titanlike.objectives.base import BatchContext, Microbatch
from titanlike.objectives.registry import job_chat_template
from titanlike.parallel.context import load_balanced_positions
from titanlike.parallel.pipeline import TiedWeightSync, build_schedule
from titanlike.parallel.timeouts import CollectiveGuard, set_train_timeout
from titanlike.parallel.utils import sum_over_world
from titanlike.train.evaluate import Evaluator, Samples, build_validation_data
from titanlike.train.expert_balance import ExpertBalance
from titanlike.train.faults import StopRequest, name_nonfinite_grad, under_torchrun
from titanlike.train.gc_schedule import PeriodicGC
from titanlike.train.loss_scaling import build_loss_scaler
from titanlike.train.step import StepLoss, StepOutput, TrainStep
from titanlike.train.companions import Companions, ForwardOnly, InFlight, build_companions
from titanlike.train.model_parts import build_model_parts
from titanlike.train.plan import JobPlan
from titanlike.train.optimizer import build_lr_scheduler, build_optimizer
from titanlike.train.qk_clip import QKClip

logger = logging.getLogger("titanlike")


class HostCopy:
    """A few device values on their way to the host, read later without draining the device queue: on
    CUDA a non-blocking copy into pinned memory and an event recorded after it, so that reading waits
    for that point of the stream only; elsewhere the values themselves (nothing to wait for)."""

    def __init__(self, values: torch.Tensor):
        self._ready = None
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = values

    def read(self) -> list[float]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.numpy().tolist()  # host memory by now: numpy's list, no device read


@dataclasses.dataclass
class StepRecord:
    """A finished step as the loop keeps it until the host reads it: its learning rate and batch, its
    device results, and its flags (finite, then the summed side values: stop signals) on their way."""

    step: int
    lr: float
    batch: int
    out: StepOutput
    flags: HostCopy = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.flags = HostCopy(torch.cat([self.out.finite.reshape(1).float(), self.out.side]))


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message is for the user."""


def _millions(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def _cannot_write(what: str, e: OSError) -> str:
    """The sentence refusing a job whose outputs cannot be written before training starts."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"no space left on device to write {what}; nothing was trained or saved: free some space and "
                "relaunch (the checkpoints already saved are kept)")
    return f"cannot write {what} ({os.strerror(e.errno) if e.errno else e}); nothing was trained or saved"


def init_distributed(cfg: JobConfig, world_size: int) -> tuple[torch.device, bool]:
    """Pick the device and, under torchrun, create the default process group. Returns the device and
    whether this call created the group (a caller that brought its own group keeps it after the job)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if world_size > 1 and not dist.is_initialized():
        from titanlike.parallel.timeouts import configure_flight_recorder

        # Read when NCCL creates its communicators, so before the process group exists.
        configure_flight_recorder(cfg.comm.trace_buf_size, dump_folder=(
            os.path.join(cfg.job.dump_folder, "comm_traces") if torch.cuda.is_available() else None))
        # Create the default group ourselves: if the DeviceMesh creates it, the backend reads "undefined".
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.comm.init_timeout_seconds))
        return device, True
    return device, False


class Trainer:
    """Builds a planned job (titanlike/train/plan.py) on this process's ranks and trains it."""

    def __init__(self, plan: JobPlan, *, stop: StopRequest | None = None):
        """stop: the stop-signal handling of the process, installed by its caller (train.py, from
        its first line, so that setup is covered too); None: train() installs its own and close()
        restores the previous handlers."""
        cfg, dims = plan.cfg, plan.dims
        self.plan, self.cfg, self.dims = plan, cfg, dims
        self.device, self.owns_process_group = init_distributed(cfg, dims.world_size)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # One job per output folder: rank 0 locks it before anything is written (every rank learns the verdict).
        self.folder_locks = self._lock_output_folders()
        self.stop = stop  # SIGTERM / SIGUSR1 handling (train() installs one if none was given)
        self._owns_stop = stop is None
        self.skipped_steps = 0  # steps skipped for a non-finite loss or gradient norm (training.skip_nonfinite_steps)
        if cfg.debug.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=cfg.debug.deterministic_warn_only)
        torch.manual_seed(cfg.debug.seed)
        self.spec, self.objective, self.model_args = plan.spec, plan.objective, plan.model_args
        self.tokenizer, self.batches = plan.tokenizer, plan.batch
        # The template the objective renders conversations with: logged, and recorded by checkpoints so
        # that their Hugging Face exports chat as training rendered (checkpoint/hf.py write_hf).
        self.chat_template, self._template_warning = job_chat_template(cfg, self.tokenizer)
        dims.build_mesh(self.device.type, experts=self.model_args.moe_args() is not None)
        self._agree(self._log_job() if self.rank == 0 else None)
        self._build_data()
        self._build_model()
        self._build_step()
        # A generating companion's generations not yet trained (RL), saved with the rank's loader position.
        generates = any(c.rollout is not None for c in self.objective.companions)
        self.in_flight = InFlight(dims.dp_degree) if generates else None
        self.checkpointer = CheckpointManager(
            cfg, dims=dims, model_parts=self.model_parts, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader, model_args=self.model_args, tokenizer=self.tokenizer,
            loss_scaler=self.loss_scaler, hooks=[*self.converters.load_hooks(), *model_hooks(self.model_args)],
            context_len=plan.context_len, chat_template=self.chat_template,
            flavor=plan.flavor, rollouts=self.in_flight)
        self._build_observers()
        self.step = 0
        self.pending: StepRecord | None = None  # the last step, until the host reads it (see train)
        self.collectives: CollectiveGuard | None = None  # set by train(); tells close() a collective failed
        self.summary: RunSummary | None = None  # set when train() ends normally; printed by close()

    def _log_job(self) -> str | None:
        """Rank 0's first lines; the sentence refusing the job when job.save_config_file cannot be
        written (a full disk), else None."""
        cfg, dims, args = self.cfg, self.dims, self.model_args
        # What runs, from the plan: a preset's job.description may describe another model or data.
        logger.info(f"run: {self._describe_run()}"
                    + (f"; job.description: {cfg.job.description}" if cfg.job.description else ""))
        if self.chat_template is not None:
            logger.info(f"chat template: {self.chat_template.origin}")
        if self._template_warning:
            logger.warning(self._template_warning)
        if cfg.job.print_config:
            logger.info(f"config: {config_to_dict(cfg)}")
        if cfg.job.save_config_file:
            path = os.path.join(cfg.job.dump_folder, cfg.job.save_config_file)
            try:
                self._save_config(path)
            except OSError as e:
                return _cannot_write(f"job.save_config_file {path}", e)
        logger.info(f"world size {dims.world_size} on {self.device.type}: {dims}")
        total, active = args.num_params(), args.num_params(active=True)
        logger.info(f"model {self.plan.model_name}: {total:,} parameters"
                    + (f" ({active:,} active per token)" if active != total else "")
                    + f", {args.flops_per_token(cfg.training.seq_len):,.0f} training FLOPs per token")
        return None

    def _describe_run(self) -> str:
        """The model (family and flavor, or where its sizes came from), its size, the objective and the
        data, e.g. "llama3 debugmodel (6.1M parameters), objective sft, data text ./conversations.jsonl"."""
        t, plan = self.cfg.training, self.plan
        data = f"{t.dataset} {t.dataset_path}" if t.dataset_path else t.dataset
        if t.dataset == "default" and not t.dataset_path:
            data = "default (the embedded corpus)"
        return (f"{plan.model_name} ({_millions(self.model_args.num_params())} parameters), "
                f"objective {self.objective.name}, data {data}")

    def _agree(self, error: str | None, *, elsewhere: str = "rank 0 could not start the job (it says why)") -> None:
        """Raise TrainingError on every rank when any rank has an error (one all-reduce on the CPU
        group); a rank without its own says `elsewhere`."""
        if dist.is_initialized():
            refused = torch.tensor([int(error is not None)], dtype=torch.int32)  # CPU: gloo
            dist.all_reduce(refused, op=dist.ReduceOp.MAX)
            if refused.item() and error is None:
                error = elsewhere
        if error is not None:
            raise TrainingError(error)

    def _build_data(self) -> None:
        """The training loader (every step's samples of this data-parallel rank) and the validation data."""
        cfg, dims, t = self.cfg, self.dims, self.cfg.training
        self.dataloader = build_dataloader(
            dataset=t.dataset, dataset_path=t.dataset_path, tokenizer=self.tokenizer, seq_len=t.seq_len,
            local_batch_size=t.local_batch_size, global_batch_size=self.batches.global_batch_size,
            dp_rank=dims.dp_rank(), dp_degree=dims.dp_degree, seed=cfg.debug.seed,
            num_samples=self.batches.schedule.samples_before(t.steps),
            split=t.split,  # validation reads the 'valid' part of the same split
            rampup=t.rampup_batch_size, objective=self.objective)
        self.validation = build_validation_data(
            cfg, self.tokenizer, dp_rank=dims.dp_rank(), dp_degree=dims.dp_degree, seed=cfg.debug.seed,
            objective=self.objective,
        ) if cfg.validation.enable else None

    def _build_model(self) -> None:
        """This rank's model parts: built on meta, converted, parallelized, then materialized shard by
        shard and initialized; and what the objective's batches need on this rank."""
        cfg, dims, t = self.cfg, self.dims, self.cfg.training
        self.converters = build_model_converters(cfg.model.converters, cfg)
        parts = build_model_parts(self.plan, self.converters)
        if cfg.model.print_after_conversion and self.rank == 0:
            for part in parts:
                logger.info(f"model after conversion and parallelization:\n{part}")
        # CPU offload: FSDP keeps the parameter shards in host memory; buffers (RoPE) stay on the device.
        offload = t.enable_cpu_offload
        for part in parts:
            part.to_empty(device="cpu" if offload else self.device)
            part.init_weights(seed=cfg.debug.seed, buffer_device=self.device if offload else None)
            self.converters.init_weights(part, cfg.debug.seed)
            part.train()
        self.model_parts = parts
        # Context parallel: the global positions of the tokens this rank keeps of every sequence.
        self.cp_positions = (
            load_balanced_positions(t.seq_len, dims.cp, dims.mesh("cp").get_local_rank(), self.device)
            if dims.cp_enabled else None
        )
        # Document masking: a DocumentMask per microbatch, for the kernel that will use it
        # (none under CP, whose attention builds its own masks from the document ids).
        self.mask_kernel = None if dims.cp_enabled else resolve_attention_backend(
            cfg.model.attention_backend, self.device.type)
        self.batch_context = BatchContext(self.device, cp_positions=self.cp_positions, mask_kernel=self.mask_kernel,
                                          eos_id=self.tokenizer.eos_id,
                                          lookahead_tokens=self.model_args.lookahead_tokens,
                                          cp_mesh=dims.mesh("cp") if dims.cp_enabled else None,
                                          select_logits=not (dims.tp_enabled or dims.cp_enabled or dims.pp_enabled)
                                          and protocol.selects_logits(parts[0]))
        if self.rank == 0:
            self._log_attention()

    def _build_step(self) -> None:
        """The pipeline schedule, the optimizer and LR schedule, the training step and the evaluator."""
        cfg, dims, t, p = self.cfg, self.dims, self.cfg.training, self.cfg.parallelism
        # float16: the loss is scaled before backward and steps whose gradients overflow are skipped.
        self.loss_scaler = build_loss_scaler(cfg.loss_scaling, self.plan.precision.loss_scaling)
        # The objective's weight for backward: a device tensor the step rewrites (loss scaling), or 1.
        self.step_loss = StepLoss(self.objective, self.batch_context, torch.ones((), device=self.device)
                                  if self.loss_scaler is not None else None)
        pipeline = tied = None
        if self.plan.pipeline is not None:
            layout = self.plan.pipeline
            # Tied weights cut apart by the pipeline split: their copies' gradients are summed after backward.
            tied = TiedWeightSync(self.model_parts, layout, dims.mesh("pp"), dims.mesh("world"))
            tied = tied if tied.active else None
            n = self.batches.pipeline_microbatches
            pipeline = build_schedule(self.model_parts, layout, dims.mesh("pp"), self.device,
                                      schedule=p.pipeline_parallel_schedule, n_microbatches=n, loss_fn=self.step_loss,
                                      inference_loss_fn=self.step_loss.unrecorded)
            if self.rank == 0:
                logger.info(f"pipeline {p.pipeline_parallel_schedule}: {layout.describe()}; "
                            f"{n} microbatches of {p.pipeline_parallel_microbatch_size} per local batch")
        # Mixture of experts: per-step token counts -> expert bias update and load-balance metrics.
        moe = self.model_args.moe_args()
        self.expert_balance = None if moe is None else ExpertBalance(
            self.model_parts, moe, self.model_args.total_layers, self.device,
            dist.group.WORLD if dist.is_initialized() else None)
        self.optimizer = build_optimizer(self.model_parts, cfg.optimizer, seed=cfg.debug.seed)
        # lr_scheduler.total_steps lets a short run follow a longer run's curve.
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.lr_scheduler.total_steps or t.steps,
                                               self.batches.schedule)
        tau = cfg.optimizer.qk_clip_threshold
        self.qk_clip = QKClip(self.model_parts, tau, data_mesh=dims.mesh("loss"), tp_mesh=dims.mesh("tp")) \
            if tau else None
        self.train_step = TrainStep.for_plan(
            self.plan, dims, model_parts=self.model_parts, step_loss=self.step_loss, optimizer=self.optimizer,
            device=self.device, pipeline=pipeline, tied=tied, converters=self.converters,
            expert_balance=self.expert_balance, loss_scaler=self.loss_scaler, qk_clip=self.qk_clip)
        self.evaluator = Evaluator(self.train_step, self.validation, self.prepare) if self.validation is not None else None
        self.companions = Companions((), [], ForwardOnly(self.train_step, self.plan, dims.mesh("pp"), self.device),
                                     self.converters.disabled)  # built by _start
        v = cfg.validation
        # Greedy samples of fixed prompts (plan_job allowed them: every rank holds whole layers, model_parts[0]).
        self.samples = Samples(self.model_parts[0], self.tokenizer, v.sample_prompts, v.sample_max_tokens) \
            if v.sample_prompts else None

    def _build_observers(self) -> None:
        """Metrics (console, TensorBoard, JSONL, W&B) and the straggler detector."""
        cfg, t, m = self.cfg, self.cfg.training, self.cfg.metrics
        dump = cfg.job.dump_folder
        wandb_run = None
        if m.enable_wandb and self.rank == 0:
            from titanlike.observe.wandb_run import start_wandb

            wandb_run = start_wandb(mode=m.wandb_mode, folder=dump, config=config_to_dict(cfg))
        self.wandb_folder = os.path.dirname(wandb_run.dir) if wandb_run is not None else None  # the run's own
        # torchtitan's layout: <dump_folder>/<save_tb_folder>/<YYYYmmdd-HHMM>, one run per launch (rank 0 writes).
        self.tb_folder = (tensorboard_run_folder(os.path.join(dump, m.save_tb_folder))
                          if m.enable_tensorboard and self.rank == 0 else None)
        self.trained = False  # whether the loop started: a launch that trains nothing leaves no TensorBoard run
        error = None
        try:  # rank 0 opens the files; a full disk refuses the job here, on every rank, before training
            self.metrics = MetricsLogger(
                device=self.device, flops_per_token=self.model_args.flops_per_token(t.seq_len),
                tokens_per_step_per_device=self.batches.global_batch_size * t.seq_len / self.dims.world_size,
                log_freq=m.log_freq, is_writer=self.rank == 0,
                tb_folder=self.tb_folder,
                jsonl_path=os.path.join(dump, "metrics.jsonl") if m.enable_jsonl else None,
                total_steps=t.steps, wandb_run=wandb_run)
        except OSError as e:
            error = _cannot_write(f"the metrics (TensorBoard, metrics.jsonl) in job.dump_folder {dump}", e)
        self._agree(error)
        # Per-rank data and optimizer times, compared over ranks at every log (observe/stragglers.py).
        self.stragglers = StragglerDetector(factor=m.straggler_factor, device=self.device)
        self.stragglers.watch(self.optimizer)

    @property
    def global_batch_size(self) -> int:
        return self.batches.global_batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.batches.grad_accum_steps

    def _save_config(self, path: str) -> None:
        """job.save_config_file: the resolved configuration as JSON (rank 0)."""
        import json

        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(config_to_dict(self.cfg), f, indent=2)
        logger.info(f"config saved to {path}")

    def _lock_output_folders(self) -> list[FolderLock]:
        """Rank 0 locks every folder the job writes into (observe/run_lock.py output_folders: the
        dump folder, the checkpoint folder, ... wherever each lies); every rank raises TrainingError
        if one cannot be created or another live job holds it."""
        locks, error = [], None
        if self.rank == 0:
            try:
                locks = lock_folders(output_folders(self.cfg), description=self.cfg.job.description)
            except FolderRefused as e:
                error = str(e)
        self._agree(error, elsewhere="another titanlike job holds this job's output folder, or it cannot be created "
                                     "(rank 0 names it)")
        return locks

    def _log_attention(self) -> None:
        a, t = self.model_args.attention_shape(), self.cfg.training
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(t.mixed_precision_param, torch.float32)
        if a is None:
            return
        what = self.objective.attention_mask  # a document mask, a padding mask, or none
        masked = what is not None
        direction = "causal" if a.causal else "bidirectional"
        if self.dims.cp_enabled:
            how = f"context parallel ({self.cfg.parallelism.context_parallel_rotate_method}), {direction}"
        elif masked and self.mask_kernel == "flex":
            how = f"FlexAttention, {direction}, with {what} as a block mask"
        else:
            # Eager on CPU, masked attention goes one document at a time (models/common/attention.py).
            by_documents = masked and self.device.type == "cpu" and not self.plan.parallelize.compile_blocks
            kernel = describe_sdpa_kernel(a, seq_len=t.seq_len, dtype=dtype, device=self.device,
                                          dense_mask=masked and not by_documents)
            if by_documents:
                how = (f"SDPA {direction} on each document of {what}, {kernel} kernel (a dense mask for "
                       f"sliding windows, sinks and rows of many short documents)")
            else:
                how = f"SDPA {direction}{f' with {what} (dense)' if masked else ''}, {kernel} kernel"
        logger.info(f"attention: {how}" + (" (positions restart per document)" if t.document_masking else ""))

    def _load_converter_state(self, parts: list[nn.Module] | None = None) -> None:
        """A fresh run: what the converters bring (LoRA's lora.adapter_path), after the model's initial
        load. Every rank reads it for its own model parts and keeps its shards (no communication); a
        refusal on any rank stops every rank with one sentence."""
        from titanlike.models.common.init import copy_full_

        parts = self.model_parts if parts is None else parts  # or a frozen copy's (companions)
        error, states = None, []
        try:
            states = [self.converters.initial_state(part) for part in parts]
        except ValueError as e:
            error = str(e)
        self._agree(error, elsewhere="another rank could not load the converters' initial state (it says why)")
        for part, state in zip(parts, states):
            params = dict(part.named_parameters())
            for name, full in state.items():
                copy_full_(params[name], full)
            if state and self.rank == 0:
                logger.info(f"converters: {len(state)} tensors loaded into the model")

    def _build_companions(self, *, resumed: bool) -> None:
        """The models the objective runs beside this one (train/companions.py), once the model is loaded."""
        def load_start(parts: list[nn.Module]) -> None:
            self.checkpointer.load_initial_model(parts)
            self._load_converter_state(parts)

        self.companions = build_companions(
            self.objective.companions, self.plan, self.model_parts, forward=self.companions.forward,
            device=self.device, resumed=resumed, load_start=load_start, converters=self.converters,
            build_converters=lambda: build_model_converters(self.cfg.model.converters, self.cfg),
            log=self.rank == 0, in_flight=self.in_flight)

    def prepare(self, batch: dict[str, torch.Tensor]) -> Microbatch:
        """A loader microbatch (a dict of named tensors) as the model sees it: on the device, masked,
        and cut to this cp rank, by the objective; with what its companions add to the targets."""
        return self.companions.fill(self.objective.prepare(batch, self.batch_context))

    def train(self) -> list[float]:
        """Run to training.steps; returns the loss of every step the host read (log, save and
        validation steps, and any step that was skipped).

        Stops early, after saving a full checkpoint of the last finished step, when any rank got
        SIGTERM or SIGUSR1 (see titanlike/train/faults.py); then returns normally.

        The host reads a step's results only where it needs them: on log, save and validation
        steps and the last one (one all-reduce for the logged values, then one read), and under
        float16 loss scaling on every step (a skipped step holds the learning rate, so the schedule
        must know). Any other step is settled one step late: its small flags (finite, stop signals)
        travel to the host while the next step is queued, and reading them waits for that step
        only, never for the device queue behind it.
        """
        steps = self.cfg.training.steps
        self.losses: list[float] = []
        start = self._start()
        if start is None:
            return self.losses
        self.step, self.trained = start, True
        begin = time.monotonic()
        # The loader's batches, or (a companion that generates: RL) batches of rollouts made from them.
        data = self.companions.batches(self.stragglers.timed(iter(self.dataloader)), step=lambda: self.step,
                                       microbatches=self.batches.microbatches,
                                       prepare=lambda batch: self.objective.prepare(batch, self.batch_context))
        p = self.cfg.profiling
        profiler = Profiler(enabled=p.enable_profiling, freq=p.profile_freq, rank=self.rank, start_step=start,
                            folder=os.path.join(self.cfg.job.dump_folder, p.save_traces_folder))
        snapshots = MemorySnapshot(
            enabled=p.enable_memory_snapshot, freq=p.profile_freq, rank=self.rank, device=self.device,
            folder=os.path.join(self.cfg.job.dump_folder, p.save_memory_snapshot_folder),
            footprint=lambda: tensor_footprint(self.model_parts, self.optimizer))
        # A collective that times out (comm.train_timeout_seconds) or loses its peer: an error naming the step.
        self.collectives = CollectiveGuard(lambda: self.step, rank=self.rank,
                                           timeout_seconds=self.cfg.comm.train_timeout_seconds,
                                           dump_folder=os.path.join(self.cfg.job.dump_folder, "comm_traces"))
        gc_schedule = PeriodicGC(self.cfg.training.gc_freq, debug=self.cfg.training.gc_debug)
        with self.collectives, profiler, snapshots, gc_schedule:
            while self.step < steps:
                self.step += 1
                record = self._run_step(data)
                # The previous step, now that this one is queued; this one too if its results are needed now.
                stop = self._settle(self.pending) if self.pending is not None else 0
                self.pending = None
                if self._reads_at(self.step):
                    stop = self._settle(record, now=True) or stop
                else:
                    self.pending = record
                if self._validates_at(self.step):
                    self.metrics.log_validation(self.step, *self.evaluator.run())
                if self._samples_at(self.step):
                    self.metrics.log_samples(self.step, self.samples.run())
                if completions := self.companions.samples(self.step):  # RL: a few rollouts with their rewards
                    self.metrics.log_samples(self.step, completions)
                if self.step < steps and stop:
                    self._save_and_stop(stop)
                    break
                self.checkpointer.save(self.step)
                if self.step == start + 1 and dist.is_initialized():
                    # The first step (compilation, lazy init) is done: a hung collective now fails in
                    # comm.train_timeout_seconds. The checkpoint's group keeps its long timeout.
                    set_train_timeout(self.cfg.comm.train_timeout_seconds, keep=[self.checkpointer.process_group])
                profiler.step()
                snapshots.step(self.step)
                gc_schedule.step_done(self.step)
        if self.skipped_steps and self.rank == 0:
            logger.warning(f"{self.skipped_steps} step(s) with a non-finite loss or gradient norm were skipped "
                           f"(training.skip_nonfinite_steps {self.cfg.training.skip_nonfinite_steps})")
        self.summary = self._summary(start, time.monotonic() - begin, profiler, snapshots)
        return self.losses

    def _start(self) -> int | None:
        """Install the stop-signal handlers and load the checkpoint to resume from; the step to train
        after, or None when there is nothing to train (a finished run relaunched, a seed checkpoint
        written, a stop signal before the first step), said in one line."""
        if self.stop is None:
            self.stop = StopRequest(watch_parent=under_torchrun())
        self.stop.install()  # (again: idempotent)
        finished = self.checkpointer.resume_verdict()
        if finished is not None:  # a finished run relaunched: say so instead of exiting silently
            if self.rank == 0:
                logger.warning(finished)
            return None
        # Before iter(): the loader applies a loaded position when its iterator is created.
        start = self.checkpointer.load()
        if start is None:  # checkpoint.create_seed_checkpoint: the seed is written, nothing to train
            return None
        if start == 0:
            self._load_converter_state()
        self._build_companions(resumed=start > 0)
        if self.stop.agreed():
            if self.rank == 0:
                logger.info(f"received {StopRequest.describe(self.stop.agreed_code)} before the first step: "
                            f"nothing new to save (the run is at step {start}); exiting")
            return None
        if self.rank == 0:
            logger.info(
                f"training {self.cfg.training.steps} steps: {self.batches.schedule.describe()} x seq "
                f"{self.cfg.training.seq_len}, {self.grad_accum_steps} microbatch(es) per rank"
                + (" at the full batch" if self.batches.schedule.ramps else "")
                + (f"; {self.loss_scaler.describe()}" if self.loss_scaler is not None else "")
            )
        return start

    def _run_step(self, data) -> StepRecord:
        """One training step on the device (nothing read back); the learning rate moves with it,
        except under loss scaling, where it waits for the step's verdict (_settle)."""
        lr = self.lr_scheduler.get_last_lr()[0]
        batch = self.batches.batch_size(self.step)  # a ramp-up's, else global_batch_size
        microbatches = [self.prepare(next(data)) for _ in range(self.batches.microbatches(self.step))]
        out = self.train_step(microbatches, side=self.stop.flags())
        if self.loss_scaler is None:
            self.lr_scheduler.step()  # a skipped step too: step N keeps its learning rate in a run without skips
        # The positions this rank's microbatches hold (whole sequences: a cp rank holds 1/cp of each),
        # as every data-parallel rank's, per device: batch x seq_len / world, unless the objective cut
        # its microbatches shorter (sft.padding longest), where this rank's count stands for all.
        positions = sum(mb.inputs.numel() for mb in microbatches) * self.dims.cp
        self.metrics.step_done(positions * self.dims.dp_degree / self.dims.world_size)
        return StepRecord(self.step, lr, batch, out)

    def _reads_at(self, step: int) -> bool:
        """Whether the host reads this step's results as soon as it is queued."""
        return (self.loss_scaler is not None or step == self.cfg.training.steps
                or self.metrics.should_log(step, self.cfg.training.steps) or self.checkpointer.saves_at(step)
                or self._validates_at(step))

    def _samples_at(self, step: int) -> bool:
        v = self.cfg.validation
        return self.samples is not None and (step % (v.sample_freq or v.freq) == 0 or step == self.cfg.training.steps)

    def _validates_at(self, step: int) -> bool:
        return self.evaluator is not None and (step % self.cfg.validation.freq == 0 or step == self.cfg.training.steps)

    def _settle(self, record: StepRecord, *, now: bool = False) -> int:
        """Read a step's verdict: count or refuse a skipped step, update the loss scale, log it if it is
        a log step (now) or was skipped. Returns the stop signal every rank agreed on (0: none)."""
        finite, *side = record.flags.read()
        stop = self.stop.agree(side)
        if finite and not now:
            return stop
        loss, norm, tokens, *reported = self._read_values(record.out)
        skipped = not (finite and math.isfinite(loss))
        overflow = self.loss_scaler is not None and skipped and math.isfinite(loss)
        if overflow:
            self._skip_overflow(record.step, norm)
        elif skipped:
            self._skip_or_stop(record, loss, norm, late=not now)
        if self.loss_scaler is not None:
            if not skipped:
                self.loss_scaler.update(overflow=False)
            if not overflow:
                self.lr_scheduler.step()
        self.losses.append(loss)
        if skipped or self.metrics.should_log(record.step, self.cfg.training.steps):
            self._log(record, loss, norm, tokens, reported)
        return stop

    def _read_values(self, out: StepOutput) -> list[float]:
        """The step's global loss per target token, grad norm, target tokens and reported loss terms:
        one sum over all ranks, one read."""
        local = out.loss_sum.reshape(1) if out.reported is None else torch.cat([out.loss_sum.reshape(1), out.reported])
        summed = sum_over_world(local) / out.tokens
        return torch.cat([summed[:1], out.grad_norm.reshape(1), out.tokens.reshape(1), summed[1:]]).tolist()

    def _log(self, record: StepRecord, loss: float, norm: float, tokens: float, reported: list[float]) -> None:
        extra = {"skipped_steps": self.skipped_steps} if self.skipped_steps else {}
        extra.update(self._precision_and_batch_metrics(record.batch))
        extra.update(zip(self.model_args.reported_losses() + self.objective.reported_terms, reported))
        extra.update(self.companions.metrics())  # a generating companion's (rewards, lengths, speed)
        expert_counts = None
        if self.expert_balance is not None:
            table = record.out.expert_table
            extra.update(self.expert_balance.summary(table, tokens))
            # Routes per expert of each MoE layer: the table's first num_experts columns.
            moe = self.expert_balance.args
            expert_counts = {i: table[i, :moe.num_experts]
                             for i in range(self.model_args.total_layers) if moe.is_moe_layer(i)}
        if self.qk_clip is not None:
            extra.update(self.qk_clip.summary(record.out.max_logits, self.model_args.total_layers))
        self.metrics.log(record.step, loss=loss, grad_norm=norm, lr=record.lr, extra=extra or None,
                         expert_counts=expert_counts, console=self.objective.reported_terms)
        slow = self.stragglers.report(record.step)  # a collective: every rank
        if slow and self.rank == 0:
            logger.warning(format_stragglers(record.step, slow, self.stragglers.factor))

    def _skip_overflow(self, step: int, norm: float) -> None:
        """Scaled float16 gradients overflowed: every rank dropped the step (the norm is global), with no
        update and, as in Megatron, no learning-rate step; the scaler backs off (train/loss_scaling.py)."""
        scale = self.loss_scaler.scale
        self.loss_scaler.update(overflow=True)
        if self.rank == 0:
            logger.info(f"skipped step {step}: gradients overflowed at loss scale {scale:g} (norm {norm}); no "
                        f"update, learning rate held; loss scale now {self.loss_scaler.scale:g} "
                        f"({self.loss_scaler.skipped_steps} step(s) skipped for overflow so far)")

    def _skip_or_stop(self, record: StepRecord, loss: float, norm: float, *, late: bool) -> None:
        """A step with a non-finite loss or gradient norm, which the device did not apply: count it
        (training.skip_nonfinite_steps) or raise TrainingError. late: read one step after it ran
        (the step after it was applied, but nothing was saved since)."""
        step = record.step
        if math.isfinite(loss):
            # A collective on every rank (they all saw the same norm).
            what = f"the gradient norm is {norm} at step {step} (first non-finite gradient: " \
                   f"{name_nonfinite_grad(record.out.nonfinite_param())})"
        else:
            what = f"the loss is {loss} at step {step}"
        budget = self.cfg.training.skip_nonfinite_steps
        if self.skipped_steps >= budget:
            after = (f" (the {budget} step(s) training.skip_nonfinite_steps allows were already skipped)"
                     if budget else "")
            stopped = (f"its update was skipped and training stopped after step {self.step}, nothing was saved "
                       "after it" if late else "stopped before the optimizer step, nothing was updated or saved")
            raise TrainingError(f"{what}; {stopped}{after}")
        self.skipped_steps += 1
        if self.rank == 0:
            logger.warning(f"skipped step {step}: {what}; no parameter was updated ({self.skipped_steps} of "
                           f"training.skip_nonfinite_steps {budget} used)")

    def _summary(self, start: int, seconds: float, profiler: Profiler, snapshots: MemorySnapshot) -> RunSummary:
        cfg, dump = self.cfg, self.cfg.job.dump_folder
        m, p = cfg.metrics, cfg.profiling
        return RunSummary(
            first_step=start + 1, last_step=self.step, seconds=seconds, final_loss=self.metrics.last_loss,
            validations=self.metrics.validations, skipped_steps=self.skipped_steps,
            checkpoints=self.checkpointer.folder if self.checkpointer.enabled else None,
            tensorboard=os.path.join(dump, m.save_tb_folder) if m.enable_tensorboard else None,
            tensorboard_run=self.tb_folder,
            metrics_jsonl=os.path.join(dump, "metrics.jsonl") if m.enable_jsonl else None,
            profile_traces=os.path.join(dump, p.save_traces_folder) if profiler.traces else None,
            memory_snapshots=os.path.join(dump, p.save_memory_snapshot_folder) if snapshots.written else None,
            wandb=self.wandb_folder, generates=self.plan.generates, chat=self.plan.objective.generation == "chat",
        )

    def _precision_and_batch_metrics(self, batch: int) -> dict:
        """The loss scale and the steps skipped for overflow (float16), the step's batch (ramp-up)."""
        out = {}
        if self.loss_scaler is not None:
            out.update(loss_scale=self.loss_scaler.scale, overflow_skipped_steps=self.loss_scaler.skipped_steps)
        if self.batches.schedule.ramps:
            out["global_batch_size"] = batch
        return out

    def _save_and_stop(self, code: int) -> None:
        """A stop signal reached some rank: save a full checkpoint of this step on every rank, say so."""
        name = StopRequest.describe(code)
        if not self.checkpointer.saves:
            if self.rank == 0:
                why = "checkpoint.load_only is set" if self.checkpointer.enabled else "checkpoint.enable is off"
                logger.warning(f"received {name}: {why}, so step {self.step} was not saved; exiting")
            return
        if self.rank == 0:
            logger.info(f"received {name}: saving step {self.step} before exiting")
        begin = time.monotonic()
        self.checkpointer.save(self.step, force=True)
        if self.rank == 0:
            logger.info(f"received {name}: saved step {self.step} to {self.checkpointer.path(self.step)} in "
                        f"{time.monotonic() - begin:.1f} s; exiting")

    def close(self) -> None:
        try:
            self.checkpointer.close()
            self.metrics.close()
            if self.tb_folder is not None and not self.trained:  # refused or finished: no empty run to show
                shutil.rmtree(self.tb_folder, ignore_errors=True)
            if self.summary is not None and self.rank == 0:
                # After the checkpointer's close: an asynchronous last save is published by now.
                from titanlike.checkpoint.format import CheckpointError, published_steps, read_sidecar

                if self.summary.checkpoints:
                    steps = published_steps(self.summary.checkpoints)
                    if steps:
                        latest = self.checkpointer.path(steps[-1])
                        self.summary.latest_checkpoint = os.path.basename(latest)
                        try:
                            self.summary.latest_contents = (read_sidecar(latest) or {}).get("contents")
                        except CheckpointError:
                            pass  # the summary then names the step alone; a load says what is wrong
                logger.info("\n".join(self.summary.lines()))
            # After a collective timed out or lost its peer the other ranks may be gone or hung: a
            # barrier or destroy_process_group would wait on them, so the process exit frees the group.
            failed = self.collectives is not None and self.collectives.failed
            if dist.is_initialized() and not failed:
                # Without a barrier a fast rank can tear gloo down under a slower one
                # ("terminate called without an active exception").
                dist.barrier()
                if self.owns_process_group:
                    dist.destroy_process_group()
        finally:
            for lock in self.folder_locks:
                lock.release()
            if self.stop is not None and self._owns_stop:
                # Last: a signal during the final saves and the barrier above must not kill the process.
                self.stop.restore()
