"""Analytic GPU profiles: cost-model coefficients derived from public specs, not measured.

For machines without a GPU the simulator still needs GPU-like step times. Each coefficient
is a spec figure divided by a documented efficiency (:data:`ASSUMPTIONS`):

* fixed = step overhead + weight bytes / (HBM bandwidth x weight efficiency)
* per sequence = per-request engine overhead + 2 x params / (tensor peak x GEMM efficiency)
* KV from DRAM at HBM bandwidth x paged-KV efficiency; KV cache hits at L2 bandwidth x hit
  efficiency; the locality term's cache is L2 x the share left to KV
* decode attention FLOPs at the CUDA-core FP32 rate (paged decode kernels do not use tensor
  cores); cascade's shared-prefix attention is a GEMM, at tensor peak x GEMM efficiency
* prefill: 2 x params per token and attention FLOPs at tensor peak x GEMM efficiency
* kv_cache_bytes = memory x vLLM's gpu_memory_utilization - weights - activation reserve

Spec figures are the vendors' datasheet numbers (dense BF16, no sparsity). L2 bandwidths are
approximate (A100: 5120 B/clk x 1.41 GHz from the A100 whitepaper; the others are assumed,
not published by NVIDIA as a single figure). These profiles are labelled ``kind:
"analytic"``; a measured CUDA profile replaces one when a GPU is at hand.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from .features import COLUMNS
from .profile_io import ENGINE_DEFAULTS, PROFILE_SCHEMA
from .shapes import model_preset


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    hbm_bytes_s: float        # DRAM bandwidth, datasheet
    l2_bytes: int
    l2_bytes_s: float         # L2 read bandwidth (approximate, see module docstring)
    tensor_flops_s: float     # dense BF16 tensor-core peak
    fp32_flops_s: float       # non-tensor FP32 peak


GB = 10**9
MiB = 2**20
GPU_SPECS: dict[str, GpuSpec] = {
    "h100": GpuSpec("NVIDIA H100 SXM5 80GB", 80 * GB, 3.35e12, 50 * MiB, 10e12, 989e12, 67e12),
    "h200": GpuSpec("NVIDIA H200 SXM 141GB", 141 * GB, 4.8e12, 50 * MiB, 10e12, 989e12, 67e12),
    "a100": GpuSpec("NVIDIA A100 SXM4 80GB", 80 * GB, 2.039e12, 40 * MiB, 7.2e12, 312e12, 19.5e12),
    "rtx6000-ada": GpuSpec("NVIDIA RTX 6000 Ada Generation", 48 * GB, 0.96e12, 96 * MiB, 5e12, 364e12, 91.1e12),
}

ASSUMPTIONS = {
    "step_overhead_s": 2e-3,          # scheduler + launch per step (vLLM V1 with CUDA graphs)
    "per_sequence_overhead_s": 20e-6, # sampling, bookkeeping per request
    "weight_bw_efficiency": 0.8,      # weight streaming reaches 80% of HBM peak
    "kv_bw_efficiency": 0.6,          # paged KV blocks: scattered reads reach 60%
    "l2_hit_efficiency": 0.5,         # re-reads that hit L2 reach half its bandwidth
    "l2_share_for_kv": 0.5,           # half of L2 holds shared-prefix KV; the rest weights/activations
    "gemm_efficiency": 0.6,           # tensor-core GEMMs reach 60% of peak
    "gpu_memory_utilization": 0.9,    # vLLM default
    "activation_reserve_bytes": 2 * GB,
    "dtype": "bfloat16",
}


def analytic_coefficients(spec: GpuSpec, shape, cascade: bool) -> dict[str, float]:
    """Seconds per unit of each :data:`COLUMNS` feature for ``shape`` on ``spec``."""
    a = ASSUMPTIONS
    gemm = spec.tensor_flops_s * a["gemm_efficiency"]
    values = {
        "fixed": a["step_overhead_s"] + shape.weight_bytes / (spec.hbm_bytes_s * a["weight_bw_efficiency"]),
        "tokens": a["per_sequence_overhead_s"] + 2 * shape.decode_params / gemm,
        "prefix_passes": 0.0,  # fused kernels: no per-pass setup worth counting
        "kv_dram_bytes": 1.0 / (spec.hbm_bytes_s * a["kv_bw_efficiency"]),
        "kv_hit_bytes": 1.0 / (spec.l2_bytes_s * a["l2_hit_efficiency"]),
        "attn_flops": 1.0 / (gemm if cascade else spec.fp32_flops_s),
        "prefill_tokens": 2 * shape.decode_params / gemm,
        "prefill_attn_flops": 1.0 / gemm,
    }
    return {column: values[column] for column in COLUMNS}


def analytic_profile(gpu: str, model: str = "llama3-8b") -> dict:
    """The analytic profile of ``model`` on ``gpu`` (a key of :data:`GPU_SPECS`)."""
    if gpu not in GPU_SPECS:
        raise ValueError(f"unknown GPU {gpu!r}; valid: {', '.join(GPU_SPECS)}")
    spec = GPU_SPECS[gpu]
    shape = model_preset(model).with_dtype(ASSUMPTIONS["dtype"])
    kv_cache_bytes = int(spec.memory_bytes * ASSUMPTIONS["gpu_memory_utilization"]
                         - shape.weight_bytes - ASSUMPTIONS["activation_reserve_bytes"])
    if kv_cache_bytes <= 0:
        raise ValueError(f"{model} does not fit on {spec.name}")
    return {
        "schema": PROFILE_SCHEMA, "kind": "analytic", "name": gpu,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "backend": "analytic",
        "hardware": {"device": "cuda", "name": spec.name, "cores": 0, "memory_bytes": spec.memory_bytes,
                     "cache_bytes": spec.l2_bytes},
        "software": {}, "model": shape.to_dict(),
        "settings": {"note": "ANALYTIC: derived from public specs and assumptions, not measured",
                     "spec": asdict(spec), "assumptions": ASSUMPTIONS},
        "kv_cache_bytes": kv_cache_bytes,
        **ENGINE_DEFAULTS["cuda"],
        "coefficients": {"per_request": analytic_coefficients(spec, shape, cascade=False),
                         "cascade": analytic_coefficients(spec, shape, cascade=True)},
        "cache_bytes_effective": spec.l2_bytes * ASSUMPTIONS["l2_share_for_kv"],
    }
