"""The cost model the simulator asks for step times, and how to load one.

``step_s = sum(coefficient x feature)`` over :data:`features.COLUMNS`: a fixed cost per
step (overhead + weight read), per-sequence work, per shared-prefix attention pass, KV bytes from DRAM, KV
bytes that hit the cache, attention FLOPs, prefill tokens and prefill attention FLOPs.
A measured profile is fitted when loaded (milliseconds); an analytic one carries its
coefficients.

``kv_capacity_tokens = kv_cache_bytes // model_shape.kv_bytes_per_token``: the profile's
KV-cache budget (see :mod:`analytic` for GPUs; a vllm-backend profile records the KV blocks
the engine allocated, the torch-backend ``cpu`` profile a KV space of 4 GiB) divided by the
KV bytes of one token over all layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

from .features import COLUMNS, PREFILL_COLUMNS, DecodeBatch, step_features
from .fit import attention_variants, fit_rows, measurement_rows
from .profile_io import load_profile, profile_engine
from .shapes import ModelShape

PROFILE_DIR = Path(__file__).parent / "profiles"
#: The default profile on a machine without a GPU: the vLLM CPU engine, measured by the vllm backend.
CPU_PROFILE = "vllm-cpu"
#: Analytic GPU profiles, picked by the visible GPU's name.
GPU_PROFILES = ("h100", "h200", "a100", "rtx6000-ada")
#: The vLLM CPU engine serving the trained hybrid model (``feather sim compare --model hybrid``'s default).
HYBRID_CPU_PROFILE = "vllm-cpu-hybrid"
#: Profiles shipped in ``profiles/``: "vllm-cpu", "cpu" (torch backend) and the hybrid's measured here,
#: the GPUs' analytic.
SHIPPED_PROFILES = (CPU_PROFILE, "cpu", HYBRID_CPU_PROFILE) + GPU_PROFILES
_EMPTY = DecodeBatch(0, 0, 0, 0)


def hardware_profile() -> str:
    """The shipped profile for this machine: the one named in the visible GPU's name, else
    :data:`CPU_PROFILE` (also on a GPU no profile names).

    ``"NVIDIA H200"`` -> ``"h200"``, ``"NVIDIA RTX 6000 Ada Generation"`` -> ``"rtx6000-ada"``
    (names are compared on their letters and digits only). torch is imported lazily.
    """
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    except ImportError:
        gpu = ""
    gpu = _alphanumeric(gpu)
    return next((name for name in GPU_PROFILES if gpu and _alphanumeric(name) in gpu), CPU_PROFILE)


def _alphanumeric(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum())


@dataclass(frozen=True)
class CostModel:
    """Step-time predictor for one model on one machine, with one attention variant.

    ``coefficients`` maps each of :data:`features.COLUMNS` to seconds per unit (>= 0).
    ``cache_bytes`` is the effective cache size of the locality term. ``block_size`` is the
    engine's KV block size in tokens (the simulator's block and CHT chunk size) and
    ``token_budget`` its ``max_num_batched_tokens``; ``device`` is the profile's (``"cpu"`` or ``"cuda"``).
    """

    name: str
    model_shape: ModelShape
    cascade: bool
    coefficients: Mapping[str, float]
    cache_bytes: float
    kv_cache_bytes: int
    block_size: int
    token_budget: int
    device: str
    kind: str = "measured"
    _vector: tuple[float, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        missing = set(COLUMNS) - set(self.coefficients)
        if missing:
            raise ValueError(f"cost model {self.name!r}: coefficients missing {sorted(missing)}")
        if min(self.block_size, self.token_budget) < 1:
            raise ValueError(f"cost model {self.name!r}: block_size and token_budget must be >= 1")
        if any(self.coefficients[c] < 0 for c in COLUMNS):
            raise ValueError(f"cost model {self.name!r}: coefficients must be non-negative")
        object.__setattr__(self, "coefficients", MappingProxyType(dict(self.coefficients)))
        object.__setattr__(self, "_vector", tuple(self.coefficients[c] for c in COLUMNS))

    def step_s(self, batch: DecodeBatch, prefill_new_tokens: int = 0, prefill_cached_tokens: int = 0) -> float:
        """Seconds of one engine step decoding ``batch`` and prefilling ``prefill_new_tokens``
        new tokens after ``prefill_cached_tokens`` prefix-cache hits. 0.0 for an empty step. O(1)."""
        row = step_features(batch, prefill_new_tokens, prefill_cached_tokens, self.model_shape,
                            self.cache_bytes, self.cascade)
        return sum(c * x for c, x in zip(self._vector, row))

    def decode_step_s(self, batch: DecodeBatch) -> float:
        return self.step_s(batch)

    def chunked_step_s(self, batch: DecodeBatch, chunks) -> float:
        """Seconds of a step decoding ``batch`` and prefilling ``chunks`` (``(new, cached)`` tokens
        per request): :meth:`step_s` of the batch with the first chunk, plus every further chunk's
        :meth:`prefill_s` less the per-step fixed cost. The prefill terms describe one request
        (attention over its own cached prefix), so chunks of different requests add up rather
        than pool. O(chunks); the simulator composes its steps with it."""
        if not chunks:
            return self.step_s(batch)
        (new, cached), *further = chunks
        seconds = self.step_s(batch, new, cached)
        fixed = self.coefficients["fixed"]
        for new, cached in further:
            seconds += self.prefill_s(new, cached) - fixed
        return seconds

    def scaled(self, factor: float, prefill_factor: float | None = None) -> CostModel:
        """This model with its coefficients scaled by ``factor``, those of
        :data:`~.features.PREFILL_COLUMNS` by ``prefill_factor`` when given (the composition
        effects kept): a clock calibration (:mod:`.clock`). One factor makes every step ``factor``
        times as long. Named ``NAME@xFACTOR`` (``NAME@xFACTOR/prefill xPREFILL_FACTOR``)."""
        prefill = factor if prefill_factor is None else prefill_factor
        if not (0 < factor < float("inf") and 0 < prefill < float("inf")):
            raise ValueError(f"clock factor must be a positive number, got {factor!r} (prefill {prefill!r})")
        name = f"{self.name}@x{factor:.4g}" + ("" if prefill_factor is None else f"/prefill x{prefill:.4g}")
        return replace(self, name=name, coefficients={c: v * (prefill if c in PREFILL_COLUMNS else factor)
                                                      for c, v in self.coefficients.items()})

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds of a prefill-only step of ``new_tokens`` after ``cached_tokens`` cached ones."""
        return self.step_s(_EMPTY, new_tokens, cached_tokens)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_cache_bytes // self.model_shape.kv_bytes_per_token

    def describe(self) -> dict:
        """Coefficients in physical units (bandwidths in bytes/s, FLOP rates in FLOP/s)."""
        c = self.coefficients

        def rate(column: str) -> float | None:
            return 1.0 / c[column] if c[column] > 0 else None

        return {
            "name": self.name, "kind": self.kind, "cascade": self.cascade, "model": self.model_shape.name,
            "fixed_ms": c["fixed"] * 1e3,
            # the fixed cost includes the weight read: weight bytes / fixed is a lower bound of its bandwidth
            "weight_bytes_s_lower_bound": self.model_shape.weight_bytes / c["fixed"] if c["fixed"] > 0 else None,
            "per_sequence_us": c["tokens"] * 1e6, "prefix_pass_us": c["prefix_passes"] * 1e6,
            "kv_dram_bytes_s": rate("kv_dram_bytes"), "kv_hit_bytes_s": rate("kv_hit_bytes"),
            "attn_flops_s": rate("attn_flops"), "prefill_token_us": c["prefill_tokens"] * 1e6,
            "prefill_attn_flops_s": rate("prefill_attn_flops"), "cache_bytes_effective": self.cache_bytes,
            "kv_capacity_tokens": self.kv_capacity_tokens, "block_size": self.block_size,
            "token_budget": self.token_budget, "device": self.device,
        }


def profile_path(name_or_path: str | Path) -> Path:
    """A shipped profile's file, or ``name_or_path`` itself if it is a file."""
    if str(name_or_path) in SHIPPED_PROFILES:
        return PROFILE_DIR / f"{name_or_path}.json"
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"no profile {str(name_or_path)!r}: not a file and not one of {', '.join(SHIPPED_PROFILES)}")
    return path


def cost_model_from_profile(profile: dict, *, cascade: bool = False) -> CostModel:
    """Fit (measured) or read (analytic) the cost model of a validated profile."""
    variant = "cascade" if cascade else "per_request"
    if variant not in attention_variants(profile):
        raise ValueError(f"profile {profile['name']!r} ({profile['backend']} backend) has no {variant} attention "
                         f"measurements, only {', '.join(attention_variants(profile)) or 'none'}: "
                         f"load it with cascade={not cascade}")
    shape = ModelShape.from_dict(profile["model"])
    if profile["kind"] == "analytic":
        coefficients = profile["coefficients"][variant]
        cache_bytes = profile["cache_bytes_effective"]
    else:
        coefficients, cache_bytes = fit_rows(measurement_rows(profile, cascade), shape,
                                             profile["hardware"]["cache_bytes"], cascade)
    engine = profile_engine(profile)
    return CostModel(profile["name"], shape, cascade, coefficients, cache_bytes, profile["kv_cache_bytes"],
                     engine["block_size"], engine["max_num_batched_tokens"], profile["hardware"]["device"],
                     profile["kind"])


def load_cost_model(name_or_path: str | Path, *, cascade: bool = False) -> CostModel:
    """The cost model of a shipped profile name (:data:`SHIPPED_PROFILES`) or a profile file.

    ``cascade`` picks the attention variant: False (default) is per-request paged attention
    (what vLLM runs for batches without one common prefix), True is cascade attention.
    """
    return cost_model_from_profile(load_profile(profile_path(name_or_path)), cascade=cascade)
