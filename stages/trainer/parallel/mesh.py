"""The named DeviceMesh of one replica group, laid out as torchtitan lays it out.

torchtitan's ``ParallelDims.build_mesh`` orders the dimensions
``[pp, dp_replicate, dp_shard, cp, tp]``, outermost first, so that TP (the most
talkative) takes neighbouring ranks (one NVLink island) and PP (the least) strides
widest. Here ``dp_replicate`` is torchft's: it lives *across* replica groups (their
own process groups, healed and re-formed live), so the mesh of one group is
``[pp, dp_shard, cp, tp]``, and FSDP shards over the flattened ``dp_shard x cp``
(torchtitan's ``dp_shard_cp``: CP ranks hold different tokens of the same sequences,
so their gradients are reduced like data parallel ones).

Every dimension is kept, size 1 included, so the layout a trainer built can be read
back from the mesh itself (``mesh_layout``), not copied from the plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stages.trainer.parallel.layout import MESH_DIMS, ParallelLayout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

FSDP_DIM = "dp_shard_cp"


def build_mesh(layout: ParallelLayout, device_type: str) -> DeviceMesh:
    """The group's 4-D mesh over the default process group (world = the group's
    ranks), plus the flattened FSDP dimension."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(layout.degrees()[name] for name in MESH_DIMS)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    mesh["dp_shard", "cp"]._flatten(FSDP_DIM)
    return mesh


def mesh_layout(mesh: DeviceMesh) -> dict[str, int]:
    """Degrees read back from a built mesh: what really runs."""
    names = tuple(mesh.mesh_dim_names or ())
    return {name: int(mesh[name].size()) if name in names else 1 for name in MESH_DIMS}


def mesh_coords(mesh: DeviceMesh) -> dict[str, int]:
    """This rank's coordinate on each dimension of the mesh."""
    names = tuple(mesh.mesh_dim_names or ())
    return {name: int(mesh[name].get_local_rank()) if name in names else 0 for name in MESH_DIMS}
