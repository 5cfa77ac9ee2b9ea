"""Named targets keep their dtypes through every layout (issue 41): token ids and document indices
above 2**24 (where float32 stops being exact) reach the loss intact through a two-stage pipeline
(the schedule's target is the microbatch index, the loss reads its rows by name:
parallel/pipeline.py _NamedTargets) and through the context-parallel cut (objectives' prepare)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from family_checks import run_on_gloo_ranks
from titanlike.models.outputs import IGNORE_INDEX
from titanlike.objectives import BatchContext, CausalLM
from titanlike.objectives.base import Microbatch, cut_sequence

BIG = 2**24 + 1  # float32(2**24 + 1) == 2**24: a float channel would lose it
BATCH, SEQ = 4, 8


def _targets() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = BIG + torch.randint(0, 1000, (BATCH, SEQ), generator=g)
    labels[0, :2] = IGNORE_INDEX
    documents = BIG + torch.arange(BATCH * SEQ).view(BATCH, SEQ) // 3
    return {"labels": labels, "document_index": documents, "weights": torch.rand(BATCH, SEQ, generator=g)}


class _Stage(nn.Module):
    def __init__(self, first: bool):
        super().__init__()
        self.embed = nn.Embedding(16, 4) if first else None
        self.proj = nn.Linear(4, 4)

    def forward(self, h, **_):
        if self.embed is not None:
            h = self.embed(h)
        return self.proj(h)


def _pipeline_check(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titanlike.parallel.pipeline import PipelineLayout, build_schedule

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    seen: list[dict[str, torch.Tensor]] = []

    def loss(output, targets):
        seen.append(targets)
        return output.float().sum() * 0 + targets["weights"].sum()

    layout = PipelineLayout(pp=2, layers=(1, 1), v_shaped=False)
    for schedule in ("1F1B", "GPipe"):
        runner = build_schedule([_Stage(first=rank == 0)], layout, mesh["pp"], torch.device("cpu"),
                                schedule=schedule, n_microbatches=BATCH // 2, loss_fn=loss)
        targets = _targets()
        mb = Microbatch(torch.randint(0, 16, (BATCH, SEQ)), targets, torch.tensor(0))
        seen.clear()
        losses = runner.step(mb, 2, backward=True)
        if rank == 1:  # the last stage: every microbatch's rows, by name, dtypes and values intact
            assert len(losses) == 2 and len(seen) >= 2
            got = seen[-2:]
            for name, value in targets.items():
                whole = torch.cat([rows[name] for rows in got])
                assert whole.dtype == value.dtype and torch.equal(whole, value), (schedule, name)
            assert int(got[1]["labels"].max()) > 2**24 and int(got[1]["document_index"].min()) > 2**24
        else:
            assert losses == [] and not seen
    dist.barrier()


def test_ids_above_2_to_the_24_survive_pp2():
    run_on_gloo_ranks(_pipeline_check, world=2, timeout_s=240, what="named targets through a 2-stage pipeline")


def test_ids_above_2_to_the_24_survive_cp2_cuts():
    """Each cp rank's cut of the targets holds the original values at its positions; the two cuts
    are the whole (the objective's prepare: CausalLM; any target cut like it: cut_sequence)."""
    from titanlike.parallel.context import load_balanced_positions

    targets = _targets()
    inputs = torch.randint(0, 16, (BATCH, SEQ))
    cuts = []
    for rank in range(2):
        positions = load_balanced_positions(SEQ, 2, rank, "cpu")
        ctx = BatchContext(torch.device("cpu"), cp_positions=positions)
        mb = CausalLM().prepare({"inputs": inputs, "labels": targets["labels"]}, ctx)
        index = cut_sequence(targets["document_index"], ctx)
        assert mb.targets["labels"].dtype == index.dtype == torch.int64
        assert torch.equal(mb.targets["labels"], targets["labels"][:, positions])
        assert torch.equal(index, targets["document_index"][:, positions])
        assert int(mb.units) == int((targets["labels"][:, positions] != IGNORE_INDEX).sum())
        cuts.append((positions, mb.targets["labels"], index))
    whole = torch.empty_like(targets["labels"])
    for positions, labels, _ in cuts:
        whole[:, positions] = labels
    assert torch.equal(whole, targets["labels"])
