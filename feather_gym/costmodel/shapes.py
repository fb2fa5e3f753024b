"""Transformer model shapes: the byte and FLOP counts a decode step is made of.

A :class:`ModelShape` is a dense decoder (Llama family: GQA attention, gated SiLU MLP,
RMSNorm). Presets give the published configurations of the models the project profiles:

============  ======  ======  =====  ========  ========  ============  ========
preset        layers  hidden  heads  kv_heads  head_dim  intermediate  vocab
============  ======  ======  =====  ========  ========  ============  ========
smollm2-135m  30      576     9      3         64        1536          49152
llama3-8b     32      4096    32     8         128       14336         128256
qwen3-4b      36      2560    32     8         128       9728          151936
============  ======  ======  =====  ========  ========  ============  ========

(``qwen3-4b`` is "Qwen3-4B-like": its q/k norms are omitted, they add no bytes worth counting.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Shape of a dense decoder; ``dtype`` is the storage type of weights and KV cache."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise ValueError(f"model shape {self.name!r}: {field} must be a positive integer")
        if self.heads % self.kv_heads:
            raise ValueError(f"model shape {self.name!r}: heads ({self.heads}) "
                             f"must be a multiple of kv_heads ({self.kv_heads})")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model shape {self.name!r}: "
                             f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def layer_params(self) -> int:
        """Weights of one layer: q, k, v, o projections, gate/up/down MLP, two norms."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def decode_params(self) -> int:
        """Weights read by one decode step: all layers plus the LM head (embedding lookup is negligible)."""
        return self.layers * self.layer_params + self.hidden * self.vocab

    @property
    def weight_bytes(self) -> int:
        return self.decode_params * self.dtype_bytes

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return self.layers * self.kv_bytes_per_token_layer

    @property
    def attention_flops_per_kv_token(self) -> int:
        """FLOPs for one query token attending to one KV token over all layers (QK^T and PV)."""
        return 4 * self.heads * self.head_dim * self.layers

    def with_dtype(self, dtype: str) -> ModelShape:
        return replace(self, dtype=dtype)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelShape:
        return cls(**data)


MODEL_PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("smollm2-135m", layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64,
                   intermediate=1536, vocab=49152),
        ModelShape("llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                   intermediate=14336, vocab=128256),
        ModelShape("qwen3-4b", layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128,
                   intermediate=9728, vocab=151936),
        # the trained hybrid (feather_gym.hybrid.model) as the cost model sees it: its 2 attention
        # layers, the only ones holding KV; its 6 Gated DeltaNet layers cost a fixed amount per
        # token, which the fitted per-token terms absorb. intermediate: 2 active experts + the shared one.
        ModelShape("qwen3next-hybrid-8l", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64,
                   intermediate=768, vocab=49152),
    )
}


def model_preset(name: str) -> ModelShape:
    """The preset called ``name``; ``ValueError`` listing the valid names otherwise."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(MODEL_PRESETS)}") from None
