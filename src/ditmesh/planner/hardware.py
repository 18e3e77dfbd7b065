"""Hardware presets: GPUs (matrix throughput, memory) and links (bandwidth, latency per collective).

Numbers are public spec sheets, derated to what collectives and GEMMs reach in practice; a measured
value (``ditmesh bench``) should replace a preset when one is available: every field can be overridden
from the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Device:
    """One accelerator. ``matmul_tflops`` is the dense bf16 rate GEMMs actually reach (not the spec peak)."""

    name: str
    peak_tflops: float  # dense bf16 spec
    matmul_tflops: float  # reached by large bf16 GEMMs (measured where known)
    hbm_gbps: float  # memory bandwidth, GB/s
    memory_gib: float  # usable device memory
    host_gbps: float  # host link (weight offload / streaming), GB/s per direction
    default_link: str
    description: str = ""


@dataclass(frozen=True)
class Link:
    """One link level. ``gbps`` is the bandwidth one GPU sustains in a collective, per direction."""

    name: str
    gbps: float
    latency_us: float  # fixed cost of one collective call (launch + synchronisation)
    description: str = ""


def _table(cls, text: str) -> dict:
    """Presets from a whitespace table: numeric columns, then the name-like columns, the description last."""
    out = {}
    for line in text.strip().splitlines():
        *cells, description = line.split("|")
        values = [float(c) if c.replace(".", "").isdigit() else c for c in cells[0].split()]
        preset = cls(*values, description.strip())
        out[preset.name] = preset
    return out


# name        peak  matmul  hbm   GiB    host  default link  | description
DEVICES: dict[str, Device] = _table(Device, """
h100          989   790     3350  79.1   50    nvlink-h100   | NVIDIA H100 SXM 80GB
h200          989   790     4800  139.8  50    nvlink-h200   | NVIDIA H200 SXM 141GB (790 TFLOP/s measured, ANCHORS.md)
a100          312   250     2039  79.1   25    nvlink-a100   | NVIDIA A100 SXM 80GB
l40s          362   250     864   44.4   25    pcie4         | NVIDIA L40S 48GB (PCIe)
rtx4090       165   130     1008  23.6   25    pcie4         | NVIDIA GeForce RTX 4090 24GB
mi300x        1307  750     5300  191.5  50    xgmi-mi300x   | AMD Instinct MI300X 192GB
rx7800xt      74.6  34      624   15.9   25    pcie4         | AMD Radeon RX 7800 XT 16GB (consumer, PCIe)
b200          2250  1700    8000  178.0  50    nvlink-b200   | NVIDIA B200 180GB
""")

# name           GB/s  latency us | description
LINKS: dict[str, Link] = _table(Link, """
nvlink-h100      360   15  | NVLink 4 (450 GB/s per direction) through NVSwitch
nvlink-h200      360   15  | NVLink 4 (450 GB/s per direction) through NVSwitch
nvlink-a100      230   15  | NVLink 3 (300 GB/s per direction)
nvlink-b200      720   15  | NVLink 5 (900 GB/s per direction)
xgmi-mi300x      300   20  | AMD Infinity Fabric, 7 peers x 64 GB/s
pcie4            10    40  | PCIe 4.0 x16 consumer board, no peer-to-peer: collectives staged through host memory
pcie5            20    30  | PCIe 5.0 x16, no peer-to-peer
pcie4-p2p        22    25  | PCIe 4.0 x16 with peer-to-peer
pcie5-p2p        45    20  | PCIe 5.0 x16 with peer-to-peer
ethernet-100g    11    60  | 100 Gb/s Ethernet (RoCE) per GPU
ethernet-400g    45    40  | 400 Gb/s Ethernet (RoCE) per GPU
infiniband-ndr   45    10  | InfiniBand NDR 400 Gb/s per GPU
""")


def _unknown(kind: str, name: str, known) -> ValueError:
    return ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(known))}")


def get_device(name: str, **overrides) -> Device:
    """The preset called ``name`` with any non-None field in ``overrides`` replaced."""
    if name not in DEVICES:
        raise _unknown("device", name, DEVICES)
    return replace(DEVICES[name], **{k: v for k, v in overrides.items() if v is not None})


def get_link(name: str, gbps: float | None = None, latency_us: float | None = None) -> Link:
    """The link preset called ``name`` (or ``custom`` with both numbers given), with overrides applied."""
    if name == "custom":
        if gbps is None or latency_us is None:
            raise ValueError("link 'custom' needs both a bandwidth (GB/s) and a latency (us)")
        return Link("custom", gbps, latency_us, "user-supplied")
    if name not in LINKS:
        raise _unknown("link", name, list(LINKS) + ["custom"])
    return replace(LINKS[name], **{k: v for k, v in (("gbps", gbps), ("latency_us", latency_us)) if v is not None})
