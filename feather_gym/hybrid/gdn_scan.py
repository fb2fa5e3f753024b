"""A faster backward for transformers' pure-torch chunked gated delta rule, for training on CPU.

Without flash-linear-attention, transformers' Qwen3-Next computes every Gated DeltaNet layer
with ``torch_chunk_gated_delta_rule``: the intra-chunk work is batched, then a Python loop over
the chunks writes each chunk's output by index assignment. Autograd then keeps one select per
chunk and tensor, whose backward allocates and fills a zero tensor of the whole sequence:
the backward's cost grows with the square of the number of chunks (64 chunks at 4,096 tokens).

:func:`chunk_gated_delta_rule` is the same computation (the same operations in the same
order, float32 throughout) with the loop over ``unbind`` views and the outputs joined by one
``stack``, so each backward step touches one chunk. :func:`faster_gdn_backward` swaps it in
for the duration of a ``with`` block (training); the saved model and every other user of
transformers run transformers' own function. Invariant (``tests/test_long_tasks.py``): outputs,
final states and gradients equal transformers' to float32 rounding.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, **kwargs):
    """transformers' ``torch_chunk_gated_delta_rule`` (same arguments, same results), see the module docstring."""
    from transformers.models.qwen3_next.modeling_qwen3_next import l2norm

    dtype = query.dtype
    batch, length, _, k_dim = key.shape
    query, key, value, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                  for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query, dim=-1, eps=1e-6), l2norm(key, dim=-1, eps=1e-6)
    query = query * k_dim ** -0.5
    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    heads, v_dim = value.shape[1], value.shape[-1]
    chunks = (length + pad) // chunk_size
    v_beta, k_beta = value * beta.unsqueeze(-1), key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (x.reshape(batch, heads, chunks, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta))
    cum = g.reshape(batch, heads, chunks, chunk_size).cumsum(dim=3)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)
    state = (torch.zeros(batch, heads, k_dim, v_dim, dtype=new_values.dtype, device=new_values.device)
             if initial_state is None else initial_state.to(new_values))
    query = query * cum.exp().unsqueeze(-1)
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outputs = []
    for q, k, a, u, w, d in zip(query.unbind(2), key.unbind(2), intra.unbind(2), new_values.unbind(2),
                                k_cumdecay.unbind(2), chunk_decay.unbind(2)):
        v_new = u - w @ state
        outputs.append(q @ state + a @ v_new)
        state = state * d + k.transpose(-1, -2) @ v_new
    out = torch.stack(outputs, dim=2).reshape(batch, heads, -1, v_dim)[:, :, :length]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), (state if output_final_state else None)


@contextmanager
def faster_gdn_backward():
    """Within the block, transformers' Qwen3-Next computes chunked GDN with :func:`chunk_gated_delta_rule`."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    original = modeling_qwen3_next.torch_chunk_gated_delta_rule
    modeling_qwen3_next.torch_chunk_gated_delta_rule = chunk_gated_delta_rule
    try:
        yield
    finally:
        modeling_qwen3_next.torch_chunk_gated_delta_rule = original
