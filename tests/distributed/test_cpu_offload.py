"""FSDP2 CPU offload (training.enable_cpu_offload): the option reaches every FSDP unit, and a step
with offloaded parameters, gradients and optimizer state runs the trainer's own clipping and
scaling and gives the step without offload. On a CPU-only machine the host copies are no-ops, so
what this shows is the code path; the 2-rank parity through train.py is in
tests/distributed/test_precision_memory.py.

The check runs in a child process of one rank (a process group of its own)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_offload_policy_reaches_every_fsdp_unit_and_the_step_matches():
    from titanlike.config import load_job_config
    from titanlike.train.plan import plan_job

    assert plan_job(load_job_config(["--training.enable_cpu_offload"]), 2).parallelize.cpu_offload
    assert not plan_job(load_job_config([]), 2).parallelize.cpu_offload

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OFFLOAD_OK" in proc.stdout, proc.stdout


def _step(offload: bool):
    import dataclasses

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from titanlike.models.llama3 import Transformer, llama3_flavors
    from titanlike.parallel.fsdp import apply_fsdp
    from titanlike.parallel.utils import clip_grad_norm_, scale_gradients

    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=2, vocab_size=256, max_seq_len=16)
    with torch.device("meta"):
        model = Transformer(args)
    apply_fsdp(model, init_device_mesh("cpu", (1,)), param_dtype="float32", reduce_dtype="float32",
               reshard_after_forward="default", cpu_offload=offload)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # torch keeps the policy per parameter (FSDPParam.offload_to_cpu); there is no public getter.
    flags = {p.offload_to_cpu for m in units for p in m._get_fsdp_state()._fsdp_param_group.fsdp_params}
    assert len(units) == 3 and flags == {offload}, (len(units), flags)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten(), reduction="sum")
    loss.backward()
    params = list(model.parameters())
    scale_gradients(params, 1.0 / torch.tensor(32.0))
    norm = clip_grad_norm_(params, 0.5)
    optimizer.step()
    state = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    return norm.total.item(), state, {s["exp_avg"].device.type for s in optimizer.state.values()}


def _check() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    norm, state, devices = _step(offload=True)
    plain_norm, plain, _ = _step(offload=False)
    assert devices == {"cpu"}
    assert norm == plain_norm and all(torch.equal(state[k], plain[k]) for k in plain)
    print("OFFLOAD_OK", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    _check()
