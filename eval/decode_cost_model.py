"""The decode-cost model of eval/bench_decode_cost.py (issue 49): GPU profiles, the host side, step times.

Everything is per GPU (one TP rank: its expert shards, its own x16 host link) and per decode step of T
tokens. Constants and their sources:

GPU profiles (PROFILES):
- `h200`: host link 55 GB/s, the whole-region copy measured on the one GPU run (docs/gpu.md, "First run on
  a GPU", section `overlap`, H200, pinned host copy). Resident MoE compute 0.29 / 0.90 / 2.30 ms per step at
  decode batch 1 / 16 / 64, same section: a step there is 4 MoE layers of Qwen3-Next's shape at TP 1
  (512 experts, hidden 2048, expert intermediate 512, bf16, top-10), each reading its expected routed experts
  E(1-(1-k/E)^T) (the section's own count). HBM 4.8 TB/s (NVIDIA H200 datasheet, HBM3e).
- `h100-pcie`: the paper's testbed, 2x "H100 PCIe" with 94 GiB of HBM each (paper Table I): the H100 NVL
  PCIe card, HBM3 3.9 TB/s (NVIDIA H100 NVL datasheet). Host link PCIe Gen5 x16: 64 GB/s per direction raw
  (NVIDIA H100 product brief: "PCIe Gen5 128 GB/s", both directions); pinned host-to-device copies reach 55
  GB/s on the same generation of link in the H200 run above (86 % of raw), taken here as the effective rate.
  The paper notes its PCIe copies share the bus with TP traffic (section VII); that contention is not modelled.

Resident MoE time of one layer: t(bytes) = a + bytes / bw_eff, a least-squares line through the three
`h200` points over the expert bytes each point read (a: fixed launch cost per layer; bw_eff: achieved HBM
rate); `h100-pcie` keeps a and scales bw_eff by its HBM bandwidth (3.9 / 4.8). The no-offload step time at
batch T is the HBM roofline of what a step reads on one rank: every MoE layer's distinct routed experts (by
the same line) plus the rank's other weights (capacity planner, `dense_weight_bytes`) at bw_eff. It leaves out
attention's KV reads, TP all-reduces, sampling and scheduling, so it is a floor: the modelled TPOT overheads
are upper bounds (real steps are longer, so the same staging is a smaller fraction of them).

Host side (HOST): per-core expert throughput measured on this machine by eval/bench_host_experts.py (an AMD
EPYC Zen 4 core, AVX-512 BF16, no AMX; OMP_NUM_THREADS=1, median of repeated rounds on a shared machine),
scaled to one socket of a named server CPU per GPU (TP 2 on a two-socket server): AMD EPYC 9654, 96 Zen 4
cores, 12 channels DDR5-4800 = 460.8 GB/s (AMD's published per-socket bandwidth). A step's host time per
layer is max(core-seconds / cores, weight bytes read / socket bandwidth), experts split over cores; plus the
activations' round trip: T x hidden x 2 bytes each way over the link and an assumed 10 us latency per direction
(not measured: the gpu_check host-experts section of issue 49 is to measure it). The host half overlaps the
device's resident experts of the same layer, so only what outlasts them is paid.

Modes (per eligible layer; every MoE layer but the first, paper V-B):
- whole: the layer's whole offloaded region, copied one layer ahead, so the copy hides behind one layer's
  time: paid max(0, bytes / link - step_ms / layers) (paper IV-D, V-B; `StagingChooser.whole_s`).
- routed / routed+order: the routed offloaded rows after the router, not overlapped: rows x row bytes / link
  (`StagingChooser.routed_s`); no fixed per-layer latency (the GPU run did not time routed staging).
- host: the cold pairs on the host, as above.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vamp_sglang.memory.routed import expected_routed_fraction

GB = 1e9
H200_HBM_GBPS = 4800.0
H200_MOE_STEP_MS = {1: 0.29, 16: 0.90, 64: 2.30}  # docs/gpu.md `overlap`: 4 MoE layers per step
H200_SECTION = {"experts": 512, "top_k": 10, "hidden": 2048, "inter": 512, "dtype_bytes": 2, "layers": 4}
LINK_LATENCY_S = 10e-6  # assumed, per direction (see the module docstring)


def _fit_moe_line() -> tuple[float, float]:
    """(a seconds, bw_eff bytes/s) of the `h200` resident MoE points (least squares over expert bytes)."""
    s = H200_SECTION
    row = 3 * s["hidden"] * s["inter"] * s["dtype_bytes"]
    xs, ys = [], []
    for batch, step_ms in H200_MOE_STEP_MS.items():
        used = max(1, round(s["experts"] * expected_routed_fraction(s["top_k"], s["experts"], batch)))
        xs.append(used * row)
        ys.append(step_ms / 1e3 / s["layers"])
    slope, intercept = np.polyfit(xs, ys, 1)
    return float(intercept), float(1.0 / slope)


MOE_FIXED_S, H200_BW_EFF = _fit_moe_line()


@dataclass(frozen=True)
class Profile:
    name: str
    link_bytes_per_s: float  # host-to-device, pinned
    hbm_bytes_per_s: float  # achieved (the h200 fit's rate scaled by the datasheet ratio)
    source: str

    def moe_s(self, expert_bytes: float) -> float:
        """Resident MoE compute of one layer reading `expert_bytes` of experts."""
        return MOE_FIXED_S + expert_bytes / self.hbm_bytes_per_s


PROFILES = {
    "h200": Profile("h200", 55 * GB, H200_BW_EFF, "docs/gpu.md overlap section (H200): 55 GB/s, MoE points"),
    "h100-pcie": Profile("h100-pcie", 55 * GB, H200_BW_EFF * 3900 / H200_HBM_GBPS,
                         "H100 NVL PCIe (paper Table I, 94 GiB): PCIe Gen5 x16 64 GB/s raw, 55 GB/s effective; "
                         "HBM3 3.9 TB/s"),
}


@dataclass(frozen=True)
class HostCpu:
    """Per-core expert time (measured here) on a named server socket."""

    name: str
    cores: int
    mem_bytes_per_s: float
    tokens: np.ndarray  # measured tokens per expert call
    core_s: np.ndarray  # median seconds per call at the measured shape
    measured_expert_bytes: int  # that shape's weight bytes (bf16)
    source: str
    link_latency_s: float = LINK_LATENCY_S

    def layer_s(self, tokens_per_expert: np.ndarray, expert_bytes: int) -> float:
        """Host seconds for one layer's cold experts, `tokens_per_expert` > 0 each, `expert_bytes` of
        weights each (one rank's shard): core time scaled by weight bytes, split over cores, or the socket's
        memory bandwidth, whichever binds."""
        if tokens_per_expert.size == 0:
            return 0.0
        per_call = np.interp(tokens_per_expert, self.tokens, self.core_s) * (expert_bytes / self.measured_expert_bytes)
        return max(float(per_call.sum()) / self.cores, tokens_per_expert.size * expert_bytes / self.mem_bytes_per_s)

    def round_trip_s(self, tokens: int, hidden: int, link_bytes_per_s: float) -> float:
        """Activations down and results up (bf16), each with the assumed link latency."""
        return 2 * (self.link_latency_s + tokens * hidden * 2 / link_bytes_per_s)


def load_host(path: Path, link_latency_s: float = LINK_LATENCY_S) -> HostCpu:
    """The server socket with this machine's measured per-core bf16 expert times (bench_host_experts.py)."""
    try:
        data = json.loads(path.read_text())
        bf16 = data["dtypes"]["bfloat16"]
        points = sorted(bf16["points"], key=lambda p: p["tokens"])
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"--host-json {path}: not a bench_host_experts.py result ({exc}); "
                         "run `make bench-host-experts` first") from None
    return HostCpu("AMD EPYC 9654 (one socket per GPU)", 96, 460.8 * GB,
                   np.array([p["tokens"] for p in points], dtype=float),
                   np.array([p["median_ms"] / 1e3 for p in points]), int(bf16["expert_bytes"]),
                   f"per-core bf16 expert times measured on {data.get('cpu', 'this CPU')} ({path.name}); "
                   "96 cores, 460.8 GB/s (AMD EPYC 9654 spec)", link_latency_s)
