"""DPO's reference log-probabilities computed in one pass and stored with the preference data, so
that a job whose model is too large to hold twice trains without a reference model.

    python scripts/precompute_reference.py OUT.jsonl -- --job.config_file train_configs/dpo_debug.toml \\
        --checkpoint.initial_load_path outputs/sft/checkpoint/step-60
    python train.py --job.config_file train_configs/dpo_debug.toml \\
        --checkpoint.initial_load_path outputs/sft/checkpoint/step-60 \\
        --training.dataset_path OUT.jsonl --dpo.reference precomputed

The options after `--` are the DPO job's. Its reference is the model it starts from
(checkpoint.initial_load_path, or model.hf_assets_path with checkpoint.initial_load_in_hf), loaded
whole on one device (--device; no gradients or optimizer state, so a model that trains sharded over
several devices may fit one for this pass). Every row of training.dataset_path (both parts of a
training.split) is written to OUT, a JSONL file, with `ref_chosen_logps` and `ref_rejected_logps`
and `ref_fingerprint` (a digest of the model and tokenizer, which the DPO job checks against its own):
the log-probability of each answer token of the side, rendered alone with the job's chat template
and not cut (a job of any training.seq_len keeps the first ones of a pair it shortens). A row the
job would refuse is refused here, in the same sentence.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    job = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage=f"{prog or 'precompute_reference.py'} OUT.jsonl [--device D] -- JOB OPTIONS")
    parser.add_argument("out", help="the JSONL file to write (the rows with their reference log-probabilities)")
    parser.add_argument("--device", default="cpu", help="where the reference model runs (default cpu)")
    args = parser.parse_args(own)
    try:
        written = precompute(job, args.out, device=args.device)
    except ValueError as e:  # ConfigError and DataError derive from it: one sentence
        print(f"{prog or 'precompute_reference.py'}: {e}", file=sys.stderr)
        return 2
    print(f"reference log-probabilities of {written} pairs written to {args.out}")
    return 0


def precompute(job: list[str], out: str, *, device: str = "cpu") -> int:
    """Write every preference row of the job's data, with its reference log-probabilities, to `out`;
    returns the number of rows. ValueError (one sentence) for a job that is not DPO or starts from
    no checkpoint."""
    import torch

    import titanlike
    from titanlike.checkpoint.manager import initial_load_path
    from titanlike.config import load_job_config
    from titanlike.data.chat_template import load_chat_template
    from titanlike.data.conversations import split_rows
    from titanlike.data.preferences import FINGERPRINT_KEY, REFERENCE_KEYS, render_pair
    from titanlike.models.outputs import IGNORE_INDEX, logits_of
    from titanlike.objectives.preference import DPO, reference_fingerprint, token_logps
    from titanlike.train.plan import plan_job

    cfg = load_job_config(job)
    plan = plan_job(cfg, world_size=1)
    objective = plan.objective
    if not isinstance(objective, DPO) or not objective.uses_reference:
        raise ValueError("the job after -- must train training.objective dpo with a reference (not dpo.loss_type "
                         "simpo), whose log-probabilities this precomputes")
    source = initial_load_path(cfg.checkpoint, cfg.model.hf_assets_path)
    if source is None:
        raise ValueError("the job starts from no checkpoint, so its reference would be its random initialization; "
                         "give checkpoint.initial_load_path (or model.hf_assets_path with checkpoint.initial_load_in_hf)")
    model = titanlike.load_model(source, device)
    fingerprint = reference_fingerprint(source, plan.tokenizer)
    template = load_chat_template(objective.options.chat_template, plan.tokenizer, option="dpo.chat_template")
    rows = split_rows(cfg.training.dataset_path, None, "train")
    with open(out, "w") as f, torch.no_grad():
        for where, row in rows:
            values = []
            for ids, mask in render_pair(row, where, template, plan.tokenizer, seq_len=cfg.training.seq_len):
                trained = torch.as_tensor(mask[1:])
                targets = torch.where(trained, torch.as_tensor(ids[1:]), IGNORE_INDEX)[None].to(device)
                logps = token_logps(logits_of(model(torch.as_tensor(ids[:-1])[None].to(device))), targets)
                values.append(logps[0][trained.to(device)].float().cpu().tolist())
            f.write(json.dumps({**row, **dict(zip(REFERENCE_KEYS, values)), FINGERPRINT_KEY: fingerprint}) + "\n")
    return len(rows)


__all__ = ["main", "precompute"]
