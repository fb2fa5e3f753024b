"""A mimetic start for in-context recall in the attention layer: weights set so that, at
initialization, a query for token ``x`` already reads what followed earlier occurrences of ``x``
(the induction pattern behind copying, key-value retrieval and the passkey). Training refines the
circuit instead of having to find one; from a random start this small model's plateau outlasts
the whole budget.

The circuit lives in the first full-attention layer, whose keys and values the KV cache keeps
exactly, so a needle it retrieves does not depend on a GDN state SuffixReplay rebuilds:

* The first GDN layer becomes a previous-token layer (queries and keys at the current token,
  values at the one and two tokens before, a state forgotten at every token) writing into the
  half of the residual stream the token embeddings leave empty; the modules between it and the
  attention layer start quiet.
* The attention layer's position-free query dimensions read the current token; its keys are
  fitted (ridge least squares on a batch) to the query of the token before, and its output
  projection to the embedding of the token attended to.
* Every GDN layer's ``A_log`` is 0, so each head's memory is that of its time step (the range
  given to :func:`feather_gym.hybrid.training.init_gate_memory`).

Invariant: only weights change (the architecture is transformers' and vLLM's own), so a model
started here serves unchanged.
"""

from __future__ import annotations

import math

#: The embeddings' constant channel (index 0), which the previous-token layer's
#: output gates read so that they do not depend on the token.
CONSTANT_CHANNEL = 0.1
#: Scale of the previous-token layer's output projection (its output is then
#: about as large as a token's embedding).
PREVIOUS_TOKEN_SCALE = 0.03
#: Scale of the outputs of the modules between the previous-token layer and the
#: attention layer, so that the residual stream there holds the two parts the attention reads.
QUIET_SCALE = 0.1
#: The attention's query and key norm gain (a match's logit grows with its square).
MATCH_GAIN = 3.0
#: The final norm's gain, so the tied output projection's logits are sharp enough
#: for a fitted circuit's answer to cost little loss (a soft one is unlearned in a few steps).
LOGIT_GAIN = 10.0
#: Ridge of the least-squares fits, relative to the inputs' mean square.
RIDGE = 1e-3


def attention_recall_start(model, batch_ids) -> None:
    """Start ``model`` as the module docstring says, in place; ``batch_ids`` (``[batch, length]``
    token ids of the model's vocabulary, text with the tasks in it) is what the attention's keys
    and output are fitted on. ``ValueError`` unless layer 0 is GDN and a full-attention layer follows."""
    import torch

    from feather_gym.hybrid.suffix_replay import gdn_modules

    types = list(model.config.layer_types)
    if types[0] != "linear_attention" or "full_attention" not in types:
        raise ValueError(f"the attention recall start needs a GDN layer 0 and a full-attention layer after it: {types}")
    layers = model.model.layers
    attention_at = types.index("full_attention")
    with torch.no_grad():
        embedding = model.model.embed_tokens.weight
        half = embedding.shape[1] // 2
        embedding[:, half:] = 0
        embedding[:, 0] = CONSTANT_CHANNEL
        for module in gdn_modules(model).values():
            module.A_log.zero_()
        _previous_token_layer(layers[0].linear_attn, half)
        for index in range(attention_at):
            _scale_mlp_output(layers[index].mlp, QUIET_SCALE)
            if index > 0:
                layers[index].linear_attn.out_proj.weight.mul_(QUIET_SCALE)
        model.model.norm.weight.fill_(LOGIT_GAIN - 1)                          # Qwen3-Next norms scale by 1 + weight
        _fit_induction_attention(model, layers[attention_at].self_attn, batch_ids)


def _tie_keys_to_queries(module) -> None:
    dk = module.head_k_dim
    group = module.in_proj_qkvz.out_features // module.num_k_heads             # q, k, v, z rows of one key head
    weight = module.in_proj_qkvz.weight
    for head in range(module.num_k_heads):
        weight[head * group + dk:head * group + 2 * dk] = weight[head * group:head * group + dk]


def _previous_token_layer(module, half: int) -> None:
    """Queries and keys at this token (tied, so each reads back what it just wrote), value heads
    at the token before and the one before that, alternately; a state forgotten at every token;
    output gates reading the constant channel; output into the residual's second half."""
    import torch

    _tie_keys_to_queries(module)
    key_dim, kernel, dk, dv = module.key_dim, module.conv_kernel_size, module.head_k_dim, module.head_v_dim
    conv = torch.zeros_like(module.conv1d.weight)
    conv[:2 * key_dim, 0, kernel - 1] = 1.0
    for head in range(module.num_v_heads):
        conv[2 * key_dim + head * dv:2 * key_dim + (head + 1) * dv, 0, kernel - 2 - head % 2] = 1.0
    module.conv1d.weight.copy_(conv)
    module.A_log.fill_(math.log(10.0))                                         # decay exp(-10 softplus(2)) per token
    module.dt_bias.fill_(2.0)
    group = module.in_proj_qkvz.out_features // module.num_k_heads
    gates = module.num_v_heads // module.num_k_heads * dv                      # z rows of one key head
    for head in range(module.num_k_heads):
        z = head * group + 2 * dk + gates
        module.in_proj_qkvz.weight[z:z + gates] = 0
        module.in_proj_qkvz.weight[z:z + gates, 0] = 0.5
    module.out_proj.weight.mul_(PREVIOUS_TOKEN_SCALE)
    module.out_proj.weight[:half] = 0


def _scale_mlp_output(mlp, scale: float) -> None:
    import torch

    for module in mlp.modules():
        down = getattr(module, "down_proj", None)
        if isinstance(down, torch.nn.Parameter):                               # fused experts
            down.mul_(scale)
        elif isinstance(down, torch.nn.Linear):
            down.weight.mul_(scale)


def _ridge(inputs, targets):
    """``W`` minimising ``|inputs @ W.T - targets|^2 + ridge |W|^2`` (float64)."""
    import torch

    gram = inputs.T @ inputs
    penalty = RIDGE * inputs.pow(2).mean() * inputs.shape[0]
    return torch.linalg.solve(gram + penalty * torch.eye(gram.shape[0], dtype=gram.dtype), inputs.T @ targets).T


def _fit_induction_attention(model, attention, batch_ids) -> None:
    """Every query head the same, reading the current token in its position-free dimensions
    (output gates at zero: one half); keys fitted to the query of the token before; the output
    projection fitted to the embedding of the attended token."""
    captured = {}

    def capture(module, args, kwargs):
        captured["inputs"] = kwargs["hidden_states"]

    hook = attention.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        model.model(input_ids=batch_ids)
    finally:
        hook.remove()
    inputs = captured["inputs"].double()                                       # [batch, length, hidden]
    config = model.config
    head_dim, heads, kv_heads = attention.head_dim, config.num_attention_heads, config.num_key_value_heads
    rotary = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
    query = attention.q_proj.weight.view(heads, 2 * head_dim, -1)            # per head: query rows, then gate rows
    query[:, head_dim:] = 0
    query[:, :rotary] = 0
    query[1:, :head_dim] = query[0, :head_dim]
    queries = inputs @ query[0, :head_dim].double().T
    flat = inputs[:, 1:].reshape(-1, inputs.shape[-1])
    key = _ridge(flat, queries[:, :-1].reshape(-1, head_dim))
    key[:rotary] = 0
    attention.k_proj.weight.copy_(key.float().repeat(kv_heads, 1))
    attention.q_norm.weight.fill_(MATCH_GAIN - 1)
    attention.k_norm.weight.fill_(MATCH_GAIN - 1)
    flat = inputs.reshape(-1, inputs.shape[-1])
    values = 0.5 * (flat @ attention.v_proj.weight[:head_dim].double().T).repeat(1, heads)
    embedding = model.model.embed_tokens.weight.double()[batch_ids.reshape(-1)]
    scale = flat.norm(dim=1).median() / embedding.norm(dim=1).median()
    attention.o_proj.weight.copy_(_ridge(values, scale * embedding).float())
