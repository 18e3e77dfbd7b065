"""Turn a :class:`ParallelConfig` into ONE ``torch.distributed`` DeviceMesh with named axes.

Only axes of degree > 1 become mesh dimensions: a degree-1 axis creates no process group.
``ParallelMesh`` is the runtime object (ranks, groups); nothing here is module-global.

Cross-rank rule: every rank must build the mesh with the same config, in the same order
(``init_device_mesh`` is a collective call over the default group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import AXIS_ORDER, ParallelConfig
from .timeline import phase


def default_device() -> torch.device:
    """The device this rank should use: ``cuda:LOCAL_RANK`` when CUDA is present, else CPU."""
    if torch.cuda.is_available():
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass
class ParallelMesh:
    """The runtime side of a config: the DeviceMesh (None when nothing is parallel) and this rank's place."""

    config: ParallelConfig
    device: torch.device
    device_mesh: object | None = None
    _groups: dict = field(default_factory=dict)

    @classmethod
    def build(cls, config: ParallelConfig, device: torch.device | None = None) -> "ParallelMesh":
        """Build the mesh for ``config`` over the initialized default process group."""
        device = device or default_device()
        world = dist.get_world_size() if dist.is_initialized() else 1
        config.check_world_size(world)
        active = config.active_axes()
        if not active:
            return cls(config=config, device=device)
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(getattr(config, a) for a in active)
        with phase("communicators"):  # the sub-groups of every axis (a collective of the default group)
            mesh = init_device_mesh(device.type, shape, mesh_dim_names=tuple(active))
        return cls(config=config, device=device, device_mesh=mesh)

    def size(self, axis: str) -> int:
        """Degree of ``axis`` (1 for axes that are off)."""
        return getattr(self.config, axis)

    def group(self, axis: str):
        """Process group of ``axis``; None when the axis has degree 1."""
        if self.size(axis) == 1:
            return None
        if axis not in self._groups:
            self._groups[axis] = self.device_mesh[axis].get_group()
        return self._groups[axis]

    def rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (0 for axes that are off)."""
        if self.size(axis) == 1:
            return 0
        return self.device_mesh[axis].get_local_rank()

    def coords(self) -> dict[str, int]:
        """This rank's coordinate on every axis, in mesh order."""
        return {axis: self.rank(axis) for axis in AXIS_ORDER}

    def flat_rank(self, *axes: str) -> int:
        """This rank's index in the combined axes, row-major in mesh order (the outer axis varies slowest).

        E.g. ``flat_rank("ring", "ulysses") == ring_rank * ulysses + ulysses_rank``, the rank order of
        :meth:`group_of` for the same axes.
        """
        index = 0
        for axis in (a for a in AXIS_ORDER if a in axes):
            index = index * self.size(axis) + self.rank(axis)
        return index

    def neighbour_groups(self, axis: str) -> tuple:
        """(group with the previous rank, group with the next rank) along ``axis``: a two-rank process group for
        each pair of neighbours of every line of ``axis`` (None at the ends, or when the axis is off), created
        once (a collective: every rank must call it, in order).

        Point-to-point messages between pipeline stages go on these, not on the axis's own group: with NCCL
        initialized eagerly (``init_process_group(device_id=...)``), a group runs all its operations, sends and
        receives included, one after another on one stream, so a stage's send to the next stage would wait behind
        the receive it has posted from the previous one."""
        if self.size(axis) == 1:
            return None, None
        key = ("neighbours", axis)
        if key not in self._groups:
            lines = self.device_mesh.mesh.movedim(self.device_mesh.mesh_dim_names.index(axis), -1)
            mine = {}
            for line in lines.reshape(-1, self.size(axis)).tolist():
                for k in range(len(line) - 1):
                    group = dist.new_group(line[k:k + 2])
                    if dist.get_rank() in line[k:k + 2]:
                        mine[line.index(dist.get_rank()) - k] = group  # 0: with the next rank, 1: with the previous
            self._groups[key] = (mine.get(1), mine.get(0))
        return self._groups[key]

    def group_of(self, *axes: str):
        """One process group spanning several axes (ranks ordered as :meth:`flat_rank`).

        None when every axis has degree 1; the axis's own group when only one is active; otherwise the
        DeviceMesh's flattened sub-mesh, created once (a collective: every rank must call it, in order).
        """
        active = tuple(a for a in AXIS_ORDER if a in axes and self.size(a) > 1)
        if not active:
            return None
        if len(active) == 1:
            return self.group(active[0])
        if active not in self._groups:
            self._groups[active] = self.device_mesh[active]._flatten().get_group()
        return self._groups[active]
