"""ParallelDims: the parallel degrees of a job and the one DeviceMesh built from them.

The world mesh has the dimensions (pp, dp_replicate, dp_shard, cp, tp), keeping
only those with degree > 1, outermost first: tp innermost so its heavy
collectives stay inside a node, pp outermost because it only sends activations.
Every other mesh the job needs is a named view of that one mesh:

  dp           (dp_replicate, dp_shard)       data loading: ranks that read different samples
  fsdp         (dp_replicate?, dp_shard x cp) parameter sharding (cp ranks also shard params)
  loss         (dp_replicate, dp_shard, cp)   ranks whose losses/token counts are summed
  tp, cp, pp   single dimensions

Mixture-of-experts models (build_mesh(..., experts=True)) view the same ranks differently. Under
sequence parallelism every rank of dp_shard x cp x tp holds different tokens at a block's MLP, so
an MoE layer is data-parallel over all of them, and the ranks of dp_shard x cp x tp are re-cut into
(efsdp, ep, etp): the expert meshes are [pp, dp_replicate, efsdp, ep, etp] over the dense mesh's
ranks (Megatron's MoE parallel folding; torchtitan's with etp 1):

  token_fsdp   (dp_replicate?, dp_shard x cp x tp): the router and shared experts (whole on every
               rank, fed different tokens) are sharded over it, so their gradients sum over all
  sequence     (cp x tp): ranks holding slices of the same sequences at an MLP's input
  ep           ranks that hold different experts and exchange tokens (all-to-all)
  etp          ranks that hold different slices of the same experts' hidden units (expert tensor
               parallelism), innermost: with etp = tp the slices stay inside a tensor-parallel group
  experts      (ep, etp): the mesh the expert weights are DTensors on
  efsdp        ranks that FSDP-shard one set of expert slices (dp_shard x cp x tp / (ep x etp))
  expert_fsdp  (dp_replicate?, efsdp): the mesh expert weights are fully_shard-ed over
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    etp: int = 1
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False, init=False)

    @classmethod
    def resolve(
        cls,
        *,
        world_size: int,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        etp: int = 1,
    ) -> "ParallelDims":
        """Fill in dp_shard = -1 and check the degrees multiply to world_size.

        Pure arithmetic (no process group), so the config can be validated before
        anything distributed exists. Raises ValueError with a one-sentence message.
        """
        named = {"data_parallel_replicate_degree": dp_replicate, "context_parallel_degree": cp,
                 "tensor_parallel_degree": tp, "pipeline_parallel_degree": pp,
                 "expert_parallel_degree": ep, "expert_tensor_parallel_degree": etp}
        for name, degree in named.items():
            if degree < 1:
                raise ValueError(f"parallelism.{name} must be at least 1, got {degree}")
        if dp_shard == 0 or dp_shard < -1:
            raise ValueError(
                f"parallelism.data_parallel_shard_degree must be -1 (the rest) or at least 1, got {dp_shard}"
            )
        others = dp_replicate * cp * tp * pp
        if dp_shard == -1:
            if world_size % others:
                raise ValueError(
                    f"the world size {world_size} is not divisible by replicate {dp_replicate} x "
                    f"cp {cp} x tp {tp} x pp {pp} = {others}, so data_parallel_shard_degree=-1 has no value"
                )
            dp_shard = world_size // others
        if dp_replicate * dp_shard * cp * tp * pp != world_size:
            raise ValueError(
                f"parallel degrees replicate {dp_replicate} x shard {dp_shard} x cp {cp} x tp {tp} x pp {pp} "
                f"= {dp_replicate * dp_shard * cp * tp * pp} must equal the world size {world_size}"
            )
        if (dp_shard * cp * tp) % (ep * etp):
            what = (f"expert_parallel_degree {ep} x expert_tensor_parallel_degree {etp} = {ep * etp}" if etp > 1
                    else f"expert_parallel_degree {ep}")
            raise ValueError(
                f"parallelism.{what} must divide data_parallel_shard_degree {dp_shard} x "
                f"context_parallel_degree {cp} x tensor_parallel_degree {tp} = {dp_shard * cp * tp}, the ranks "
                "experts are spread over")
        return cls(dp_replicate, dp_shard, cp, tp, pp, ep, world_size, etp)

    @staticmethod
    def smallest_world(p) -> int:
        """The smallest world size the [parallelism] section p allows: its degrees multiplied, where
        data_parallel_shard_degree -1 takes the fewest shards that let expert_parallel_degree x
        expert_tensor_parallel_degree divide dp_shard x cp x tp (resolve's rule)."""
        cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
        ep = p.expert_parallel_degree * p.expert_tensor_parallel_degree
        shard = p.data_parallel_shard_degree
        if shard == -1:
            shard = ep // math.gcd(ep, cp * tp)
        return p.data_parallel_replicate_degree * max(shard, 1) * cp * tp * p.pipeline_parallel_degree

    @classmethod
    def from_config(cls, p, world_size: int) -> "ParallelDims":
        """resolve() from the [parallelism] section p."""
        return cls.resolve(world_size=world_size, dp_replicate=p.data_parallel_replicate_degree,
                           dp_shard=p.data_parallel_shard_degree, cp=p.context_parallel_degree,
                           tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
                           etp=p.expert_tensor_parallel_degree)

    # Degrees and switches ------------------------------------------------------------

    @property
    def dp_degree(self) -> int:
        """Ranks that read different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters go through fully_shard (also under pure replication, as HSDP)."""
        return self.dp_shard * self.cp * self.dp_replicate > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    @property
    def efsdp(self) -> int:
        """Ranks that FSDP-shard one set of expert slices: dp_shard x cp x tp / (ep x etp)."""
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that jointly process one data-parallel sample (cp x tp x pp)."""
        return self.cp * self.tp * self.pp

    # Meshes --------------------------------------------------------------------------

    def build_mesh(self, device_type: str, *, experts: bool = False) -> DeviceMesh | None:
        """Create the world mesh and its named views; None in a single process. experts: the
        model has mixture-of-experts layers (builds their views, also at ep 1)."""
        degrees = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
                   "cp": self.cp, "tp": self.tp}
        # dp_shard stays in the mesh (possibly of size 1) under replication, so pure data
        # parallelism is HSDP with a shard group of one and needs no separate DDP code path.
        keep = {n for n in _DIM_ORDER if degrees[n] > 1}
        if "dp_replicate" in keep:
            keep.add("dp_shard")
        names = tuple(n for n in _DIM_ORDER if n in keep)
        if self.world_size == 1 or not names:
            return None
        world = init_device_mesh(device_type, tuple(degrees[n] for n in names), mesh_dim_names=names)
        self._meshes = {n: world[n] for n in names}
        self._meshes["world"] = world
        self._view(world, "dp", ("dp_replicate", "dp_shard"))
        self._view(world, "dp_shard_cp", ("dp_shard", "cp"))
        self._view(world, "loss", ("dp_replicate", "dp_shard", "cp"))
        if "dp_replicate" in self._meshes:
            # HSDP: FSDP runs on a 2-D (replicate, shard) mesh; with cp the shard dim is the
            # flattened dp_shard x cp, otherwise dp_shard itself.
            self._meshes["fsdp"] = world["dp_replicate", "dp_shard_cp" if self.cp > 1 else "dp_shard"]
        elif "dp_shard_cp" in self._meshes:
            self._meshes["fsdp"] = self._meshes["dp_shard_cp"]
        if experts or self.ep * self.etp > 1:
            self._expert_views(world)
        return world

    def _expert_views(self, world: DeviceMesh) -> None:
        """token_fsdp, sequence, and ep, etp, experts, efsdp, expert_fsdp: the ranks of dp_replicate x
        dp_shard x cp x tp re-cut into (replicate, efsdp, ep, etp), etp and ep innermost so that an
        expert group stays inside a node when tp and cp do."""
        self._view(world, "sequence", ("cp", "tp"))
        if self.tp == 1:
            token = self._meshes.get("fsdp")
        else:
            self._view(world, "dp_shard_cp_tp", ("dp_shard", "cp", "tp"))
            token = (world["dp_replicate", "dp_shard_cp_tp"] if "dp_replicate" in self._meshes
                     else self._meshes["dp_shard_cp_tp"])
        if token is not None:
            self._meshes["token_fsdp"] = token
        if self.ep * self.etp == 1:
            # Neither expert nor expert tensor parallelism: experts are sharded like the router.
            if token is not None:
                self._meshes["expert_fsdp"] = token
            return
        span = tuple(d for d in ("dp_replicate", "dp_shard", "cp", "tp") if d in self._meshes)
        spanned = world[span]._flatten("ep_span") if len(span) > 1 else world[span[0]]
        experts = spanned._unflatten(0, (self.dp_replicate, self.efsdp, self.ep, self.etp),
                                     ("ep_replicate", "efsdp", "ep", "etp"))
        split = tuple(d for d, n in (("ep", self.ep), ("etp", self.etp)) if n > 1)
        for name in split:
            self._meshes[name] = experts[name]
        self._meshes["experts"] = experts[split] if len(split) > 1 else experts[split[0]]
        if self.efsdp > 1:
            self._meshes["efsdp"] = experts["efsdp"]
        if self.dp_replicate > 1:
            # HSDP of experts: replicated over dp_replicate, sharded over efsdp (possibly of size 1).
            self._meshes["expert_fsdp"] = experts["ep_replicate", "efsdp"]
        elif self.efsdp > 1:
            self._meshes["expert_fsdp"] = experts["efsdp"]

    def _view(self, world: DeviceMesh, name: str, dims: tuple[str, ...]) -> None:
        present = tuple(d for d in dims if d in self._meshes)
        if not present:
            return
        if len(present) == 1:
            self._meshes[name] = self._meshes[present[0]]
        else:
            # Keep the mesh _flatten returns: slicing a flattened name back out of the root is deprecated.
            self._meshes[name] = world[present]._flatten(name)

    def mesh(self, name: str) -> DeviceMesh | None:
        """A named mesh (world, dp, fsdp, dp_shard_cp, loss, pp, dp_replicate, dp_shard, cp, tp, and for
        experts token_fsdp, sequence, ep, etp, experts, efsdp, expert_fsdp), or None when that dimension
        has degree 1."""
        return self._meshes.get(name)

    def dp_rank(self) -> int:
        mesh = self.mesh("dp")
        return 0 if mesh is None else mesh.get_local_rank()

