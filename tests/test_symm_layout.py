"""The copy-engine transport's layout (``ditmesh.symm``), checked on CPU by playing every rank in one process.

The transport itself needs CUDA GPUs (symmetric memory); ``tests/gpu/test_symm_gpu.py`` runs it against
the NCCL path there. What can go wrong on any machine is where each part lands: here every rank packs its
own part into its receive buffer and each peer's part at the offset the layout gives, exactly as the ops
do, and the result must equal what the all-to-all delivers: the full sequence of this rank's heads.
"""

from __future__ import annotations

import math

import pytest
import torch

from ditmesh import symm
from ditmesh.options import RunOptions
from ditmesh.attention.ulysses import head_groups
from ditmesh.comm import offsets, split_sizes
from ditmesh.config import ConfigError


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("world,seq,heads,chunks", [(2, 16, 4, 1), (2, 15, 3, 1), (4, 18, 6, 2), (4, 7, 6, 1), (3, 10, 7, 2)])
def test_qkv_and_output_parts_land_where_the_all_to_all_puts_them(world, seq, heads, chunks, batch):
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(batch, seq, heads, 4, generator=g) for _ in range(3)]  # Q, K, V over the whole sequence
    seq_sizes = split_sizes(seq, world)
    starts = offsets(seq_sizes)
    shards = [[t[:, starts[r]:starts[r] + seq_sizes[r]] for t in full] for r in range(world)]
    lead = batch
    for head_starts, head_sizes in head_groups(heads, world, chunks):
        # Q/K/V: rank r packs its own part into its buffer and part j into rank j's buffer at dst[j]
        recv = [torch.full((symm.seq_to_heads_layout(lead, 3, seq_sizes[r], 4, seq_sizes, head_sizes, r)[2],), math.nan)
                for r in range(world)]
        for r in range(world):
            send, dst, _ = symm.seq_to_heads_layout(lead, 3, seq_sizes[r], 4, seq_sizes, head_sizes, r)
            for j in range(world):
                symm.pack_heads_into(shards[r], head_starts, head_sizes, j, recv[j].narrow(0, dst[j], send[j]))
        for j in range(world):
            # the receive layout the Ulysses finish reads: [source][..., S_source, 3, h_j, D]
            parts = recv[j].split([lead * 3 * n * head_sizes[j] * 4 for n in seq_sizes])
            got = torch.cat([p.view(lead, n, 3, head_sizes[j], 4) for p, n in zip(parts, seq_sizes)], dim=1)
            for i in range(3):
                expected = full[i].narrow(2, head_starts[j], head_sizes[j])
                assert torch.equal(got.select(2, i), expected)
        # output: rank j holds the full sequence of its heads and sends rank s its rows; rank s joins the heads
        outs = [torch.randn(batch, seq, head_sizes[j], 4, generator=g) for j in range(world)]
        back = [torch.full((symm.heads_to_seq_layout(lead, 4, seq_sizes, head_sizes, s)[2],), math.nan)
                for s in range(world)]
        for j in range(world):
            send, dst, _ = symm.heads_to_seq_layout(lead, 4, seq_sizes, head_sizes, j)
            for s in range(world):
                if s != j:  # a rank's own rows stay in its attention output
                    symm.pack_seq_into(outs[j], starts[s], seq_sizes[s], back[s].narrow(0, dst[s], send[s]))
        for s in range(world):
            parts = back[s].split([lead * seq_sizes[s] * h * 4 for h in head_sizes])
            for j in range(world):
                rows = outs[j].narrow(1, starts[s], seq_sizes[s])
                if j == s:
                    assert torch.isnan(parts[j]).all()  # left unwritten: the receiver reads x's own rows
                else:
                    assert torch.equal(parts[j].view(lead, seq_sizes[s], head_sizes[j], 4), rows)


def test_symm_transport_is_refused_off_cuda_with_a_clear_error():
    with pytest.raises(ConfigError, match="transport=symm needs CUDA GPUs"):
        RunOptions.create(transport="symm").validate(device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="--transport 'shm' is not a transport; use one of nccl, symm"):
        RunOptions.create(transport="shm", cli=True)


def test_symm_transport_checks_the_mesh_it_would_run_on():
    from ditmesh.config import ParallelConfig

    cuda = torch.device("cuda")  # the check reads only the device type: nothing runs on it
    def check(transport, config, local_world):
        RunOptions.create(config, transport=transport).validate(device=cuda, local_world=local_world)

    check("symm", ParallelConfig(ulysses=4), 8)
    check("nccl", ParallelConfig(ring=2, ulysses=2), 1)
    with pytest.raises(ConfigError, match="transport=symm moves Ulysses all-to-alls only, and ring=2 is set"):
        check("symm", ParallelConfig(ring=2, ulysses=2), 4)
    with pytest.raises(ConfigError, match="needs each ulysses=4 group on one host, but a host runs 2 processes"):
        check("symm", ParallelConfig(ulysses=4), 2)
