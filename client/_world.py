"""Which processes deal the data: a sampler's data-parallel world and group, and the process of each rank that logs."""

from __future__ import annotations

from typing import Any

from croupier.client._resolve import dist_ready, resolve_world
from croupier.core.api import MAX_WORLD
from croupier.core.checks import check_int


def data_parallel_group(process_group: Any | None, device_mesh: Any | None, mesh_dim: str | int | None) -> Any | None:
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


def first_of_its_rank(group: Any | None, rank: int) -> bool:
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


class World:
    """A sampler's data-parallel world: `num_replicas` and `rank` as given, resolved the first time
    anything needs them (not at construction, so a sampler may be built before ``init_process_group``).

    Args:
        num_replicas: The world size given, or None (torch.distributed's, else the launcher's).
        rank: The rank given, or None.
        group: The data-parallel process group, or None (the default group).

    Raises:
        ValueError: a world size or rank out of range.
    """

    def __init__(self, num_replicas: int | None, rank: int | None, group: Any | None) -> None:
        for name, v in (("num_replicas", num_replicas), ("rank", rank)):
            if v is not None:
                check_int(name, v, 0 if name == "rank" else 1, MAX_WORLD + 1, ValueError)
        self.group = group
        self._given = (num_replicas, rank)
        self._resolved: tuple[int, int] | None = None  # (num_replicas, rank) once resolved
        self._from_dist = False
        if num_replicas is not None and rank is not None:
            self.resolve()

    def resolve(self) -> tuple[int, int]:
        """``(num_replicas, rank)``: given, else from the group or torch.distributed, else the launcher's."""
        if self._resolved is None:
            self._from_dist = dist_ready()
            self._resolved = resolve_world(self._given[0], self._given[1], self.group)
        return self._resolved

    def set(self, num_replicas: int | None, rank: int | None) -> None:
        """Assigns `num_replicas` or `rank` (None: unchanged), resolved again when next needed."""
        w, r = self._given
        self._given = (num_replicas if num_replicas is not None else w, rank if rank is not None else r)
        self._resolved = None

    def check_still(self) -> None:
        """A world resolved before torch.distributed was initialised must match the one it has now.

        Raises:
            RuntimeError: it does not (the message shows both).
        """
        if self._from_dist or self._given[0] is not None and self._given[1] is not None or not dist_ready():
            return
        now = resolve_world(self._given[0], self._given[1], self.group)
        if now != self._resolved:
            was = self._resolved or (None, None)
            raise RuntimeError(
                f"this sampler took num_replicas={was[0]}, rank={was[1]} before torch.distributed was initialised, "
                f"but torch.distributed now says num_replicas={now[0]}, rank={now[1]}: build the sampler (or call "
                "len() on it) after init_process_group, or pass num_replicas= and rank="
            )

    def for_copy(self) -> World:
        """This world for a copy of the sampler (pickle, deepcopy): resolved, without its process group."""
        if self.group is not None:
            self.resolve()
        copy = World.__new__(World)
        copy.__dict__.update(self.__dict__, group=None)
        return copy
