"""Resume decisions: whether a relaunched job has anything left to train, and what to pass when it
cannot continue from its latest checkpoint (a model-only final export).

Read by rank 0 from the checkpoint folder before anything loads; every rank gets the verdict
(CheckpointManager.resume_verdict).
"""

from __future__ import annotations

from titanlike.checkpoint import format as fmt


def resume_verdict(folder: str, load_step: int, steps: int, other_model=None) -> tuple[str, str] | None:
    """("done", sentence) when the checkpoint a job would resume from is at or past training.steps;
    ("error", sentence) when it is a model-only final export below training.steps, or when
    other_model(step folder) says it holds another model than the job's (a sentence, else None: a
    finished run of another model is not this job's run to declare done); else None (the checkpoint
    manager loads normally, or reports what is wrong)."""
    published = fmt.published_steps(folder)
    step = load_step if load_step >= 0 else (published[-1] if published else None)
    if step is None or step not in published:
        return None
    other = other_model(fmt.step_folder(folder, step)) if other_model is not None else None
    if other is not None:
        return "error", other
    full = _is_full_checkpoint(fmt.step_folder(folder, step))
    if step >= steps:
        head = f"the checkpoint in {folder} is at step {step} >= training.steps {steps}: nothing to train"
        if full:
            return "done", f"{head}; raise --training.steps to continue"
        return "done", f"{head}; step {step} is a model-only final export (checkpoint.last_save_model_only): " \
                       + _how_to_extend(folder, published, step, steps_flag=f"--training.steps > {step} ")
    if full or load_step >= 0:
        return None  # resumes; an explicit load_step of a model-only export is the manager's to refuse
    return "error", f"the latest checkpoint in {folder}, step {step}, is a model-only final export " \
                    f"(checkpoint.last_save_model_only) that training cannot resume from; " \
                    + _how_to_extend(folder, published, step, steps_flag="")


def _how_to_extend(folder: str, published: list[int], step: int, *, steps_flag: str) -> str:
    full = [s for s in published if s < step and _is_full_checkpoint(fmt.step_folder(folder, s))]
    if full:
        again = f"step {step} is" if full[-1] + 1 == step else f"steps {full[-1] + 1}..{step} are"
        return (f"to extend the run, relaunch with {steps_flag}--checkpoint.load_step {full[-1]} "
                f"(its last full checkpoint; {again} trained again)")
    path = fmt.step_folder(folder, step)
    hf = fmt.is_hf_folder(path) and not fmt.is_dcp_folder(path)
    return (f"no full checkpoint is left to extend the run from; start a new run from it with "
            f"--checkpoint.initial_load_path {path}" + (" --checkpoint.initial_load_in_hf" if hf else "")
            + " (checkpoint.no_last_save_model_only keeps the last save resumable)")


def _is_full_checkpoint(path: str) -> bool:
    """Whether a published checkpoint holds the whole training state (not a model-only export)."""
    info = fmt.read_sidecar(path)
    if info is not None and "contents" in info:
        return info["contents"] == "full"
    if not fmt.is_dcp_folder(path):
        return False
    return fmt.dcp_model_keys(fmt.read_dcp_metadata(path))[1]
