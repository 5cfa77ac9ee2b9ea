"""The end-of-run summary rank 0 prints: what the run did and where everything it wrote went.

    run summary: 200 step(s) (1 -> 200) in 0:03:12; final loss 4.1210
      validation loss: final 4.3003 (step 200), best 4.2871 (step 150)
      checkpoints:     outputs/checkpoint (latest: step-200, the model only; sample: python scripts/generate.py outputs/checkpoint)
      tensorboard:     tensorboard --logdir outputs/tb (this run: outputs/tb/20260101-1200)
      metrics:         outputs/metrics.jsonl (plot: python scripts/plot_metrics.py outputs/metrics.jsonl)
      ...

Only what the run wrote is listed. Built by the trainer from plain values, printed by rank 0 once
the checkpointer has closed (so an asynchronous last save is already published).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlike.observe.metrics import format_eta


@dataclass
class RunSummary:
    first_step: int  # the first step this launch trained
    last_step: int  # the last step it finished (first_step - 1: none)
    seconds: float
    final_loss: float | None = None
    validations: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    skipped_steps: int = 0
    # Where things went; None: not written (e.g. TensorBoard off).
    checkpoints: str | None = None
    latest_checkpoint: str | None = None
    latest_contents: str | None = None  # the latest checkpoint's sidecar "contents": full, model_only, hf
    tensorboard: str | None = None  # the --logdir: every launch's run below it
    tensorboard_run: str | None = None  # this launch's events (torchtitan's timestamped subfolder)
    metrics_jsonl: str | None = None
    profile_traces: str | None = None
    memory_snapshots: str | None = None
    wandb: str | None = None
    # Whether the model continues text (JobPlan.generates): only then is generate.py suggested.
    generates: bool = True
    # Whether it was trained on chat-rendered conversations (Objective.generation "chat"): sample with --chat.
    chat: bool = False

    def lines(self) -> list[str]:
        steps = self.last_step - self.first_step + 1
        head = (f"run summary: {steps} step(s) ({self.first_step} -> {self.last_step}) in {format_eta(self.seconds)}"
                if steps > 0 else f"run summary: no step trained in {format_eta(self.seconds)}")
        if self.final_loss is not None:
            head += f"; final loss {self.final_loss:.4f}"
        if self.skipped_steps:
            head += f"; {self.skipped_steps} non-finite step(s) skipped"
        out = [head]
        if self.validations:
            final_step, final = self.validations[-1]
            best_step, best = min(self.validations, key=lambda v: v[1])
            out.append(f"  validation loss: final {final:.4f} (step {final_step}), best {best:.4f} (step {best_step})")
        if self.checkpoints:
            out.append(f"  checkpoints:     {self.checkpoints}{self._latest()}")
        if self.tensorboard:
            run = f" (this run: {self.tensorboard_run})" if self.tensorboard_run else ""
            out.append(f"  tensorboard:     tensorboard --logdir {self.tensorboard}{run}")
        if self.metrics_jsonl:
            out.append(f"  metrics:         {self.metrics_jsonl} "
                       f"(plot: python scripts/plot_metrics.py {self.metrics_jsonl})")
        if self.wandb:
            out.append(f"  wandb:           {self.wandb}")
        if self.profile_traces:
            out.append(f"  profiler traces: {self.profile_traces}")
        if self.memory_snapshots:
            out.append(f"  memory snapshots: {self.memory_snapshots}")
        return out

    def _latest(self) -> str:
        """What the latest checkpoint holds, and the command that samples from it."""
        if not self.latest_checkpoint:
            return " (none published)"
        what = _CONTENTS.get(self.latest_contents or "")
        if what is None:
            return f" (latest: {self.latest_checkpoint})"
        if not self.generates:
            return f" (latest: {self.latest_checkpoint}, {what})"
        # generate.py takes a checkpoint folder (its latest DCP step) or a Hugging Face folder itself.
        target = self.checkpoints if self.latest_contents != "hf" else f"{self.checkpoints}/{self.latest_checkpoint}"
        chat = " --chat" if self.chat else ""
        return f" (latest: {self.latest_checkpoint}, {what}; sample: python scripts/generate.py {target}{chat})"


_CONTENTS = {"full": "the full training state", "model_only": "the model only",
             "hf": "the model in Hugging Face format"}


__all__ = ["RunSummary"]
