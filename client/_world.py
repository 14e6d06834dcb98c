"""Which processes deal the data: the data-parallel group of a sampler, and the process of each rank that logs."""

from __future__ import annotations

from typing import Any


def _data_parallel_group(process_group: Any | None, device_mesh: Any | None, mesh_dim: str | int | None) -> Any | None:
    """The process group whose ranks deal the data: given, or the `mesh_dim` dimension of `device_mesh`."""
    if device_mesh is None:
        if mesh_dim is not None:
            raise ValueError(f"mesh_dim={mesh_dim!r} needs device_mesh=")
        return process_group
    if process_group is not None:
        raise ValueError("pass process_group= or device_mesh=, not both")
    if mesh_dim is None and device_mesh.ndim > 1:
        raise ValueError(f"device_mesh has {device_mesh.ndim} dimensions {device_mesh.mesh_dim_names}: name the "
                         "data-parallel one with mesh_dim=")
    return device_mesh.get_group(mesh_dim if mesh_dim is not None else 0)


def _first_of_its_rank(group: Any | None, rank: int) -> bool:
    """Whether this process is the lowest global rank among those that share its data-parallel rank.

    With a data-parallel group inside a larger mesh, several processes (a tensor-parallel group)
    receive the same batches; one of them writes the audit log. A collective over the whole job.
    """
    if group is None:
        return True
    import torch.distributed as dist

    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, rank)
    return ranks.index(rank) == dist.get_rank()
