"""Compiled blocks that hold a module which must stay eager (an MoE layer under expert parallelism,
parallel/parallelize.py _compile): every other child is compiled, torch.nn's own norms included, and
inside a checkpointed block too. Parity under EP: tests/distributed/test_moe_parity.py."""

import torch
import torch.nn as nn

from titanlike.models import protocol
from titanlike.parallel.parallel_dims import ParallelDims
from titanlike.parallel.parallelize import ParallelizeOptions, parallelize_model


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.moe = nn.Linear(dim, dim)
        protocol.set_skip_compile(self.moe)

    def forward(self, x):
        return x + self.moe(self.mix(self.norm(x)))


class Model(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.layers = nn.ModuleDict({"0": Block(dim), "1": Block(dim)})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x


def compiled(module: nn.Module) -> bool:
    return hasattr(module.forward, "_torchdynamo_orig_callable")


def test_the_children_beside_an_eager_module_compile_also_under_checkpointing():
    x = torch.randn(2, 3, 8)
    torch.manual_seed(0)
    want = Model()(x)
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = Model()
        parallelize_model(model, None, ParallelDims.resolve(world_size=1),
                          ParallelizeOptions(activation_checkpoint_mode=mode, compile_blocks=True, compile_backend="eager"))
        # torch 2.13's Module.compile of the nn.RMSNorm compiled nothing: fullgraph failed here.
        torch.testing.assert_close(model(x), want)
        for block in model.layers.values():
            inner = block._checkpoint_wrapped_module if mode == "full" else block
            assert compiled(inner.norm) and compiled(inner.mix) and not compiled(inner.moe), mode
