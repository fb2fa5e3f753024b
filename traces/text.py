"""Real text for token workloads: the shared corpus, and synthetic traces rewritten into it.

:func:`corpus_path` finds the text (``<shared>/corpora/war_and_peace.txt``, read in place, else a
public-domain text shipped inside an installed package). :func:`texturize` gives a generated
trace real text without changing its prefix sharing: a document, a system prompt or a
conversation history becomes a passage of the corpus, shared exactly where the synthetic
prompts shared a prefix.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from traces.request import Request, Trace
from traces.workload import shared_traces_dir

SHARED_CORPUS = "war_and_peace.txt"
#: (package, path inside it) of the fallback text when the shared corpus is absent.
PACKAGED_CORPUS = ("tvm_ffi", "3rdparty/libbacktrace/Isaac.Newton-Opticks.txt")


def corpus_path() -> Path:
    """The corpus file: the shared War and Peace, else the packaged fallback; ``OSError`` if neither."""
    shared = shared_traces_dir().parent / "corpora" / SHARED_CORPUS
    if shared.is_file():
        return shared
    import importlib.util

    package, relative = PACKAGED_CORPUS
    spec = importlib.util.find_spec(package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / relative).is_file():
            return Path(location) / relative
    raise OSError(f"no text corpus: neither {shared} nor {package}/{relative} exists "
                  f"(set FEATHER_SHARED_DIR to the folder holding corpora/)")


def corpus_token_ids(tokenizer, path: str | os.PathLike | None = None) -> np.ndarray:
    """Token ids (int64) of the whole corpus under ``tokenizer``."""
    text = Path(path or corpus_path()).read_text(encoding="utf-8", errors="replace")
    return np.asarray(tokenizer(text)["input_ids"], dtype=np.int64)


def texturize(trace: Trace, corpus_ids: np.ndarray) -> Trace:
    """``trace`` with real text: each prompt keeps the text of the longest prefix it shares with
    an earlier prompt, and its new tokens take the next unused tokens of ``corpus_ids``.

    Prefix sharing, the structure a prefix cache sees, is kept exactly: two prompts share a
    prefix of ``n`` tokens after the rewrite if and only if they did before. New content is a
    contiguous passage of the corpus. Raises ``ValueError`` when the corpus runs out (wrapping
    around would make unrelated prompts share text) or a request carries block ids only.
    Cost: one trie step per prompt token (a dict lookup).
    """
    if any(r.token_ids is None for r in trace):
        raise ValueError(f"trace {trace.name!r} has block-id prompts; only token-id traces can be given text")
    root: dict = {}                 # token -> (its text token, the child node)
    cursor = 0
    requests = []
    for request in trace:
        node, text = root, []
        for token in request.token_ids.tolist():
            if token not in node:
                if cursor >= corpus_ids.size:
                    raise ValueError(f"trace {trace.name!r} needs more distinct tokens of text than the corpus's "
                                     f"{corpus_ids.size}")
                node[token] = (int(corpus_ids[cursor]), {})
                cursor += 1
            word, node = node[token]
            text.append(word)
        requests.append(Request(request.request_id, request.arrival_s, input_len=request.input_len,
                                output_len=request.output_len, token_ids=np.array(text, dtype=np.int64),
                                session=request.session, group=request.group))
    return Trace(name=trace.name, requests=requests, source=f"{trace.source} text", block_size=trace.block_size,
                 skipped_lines=trace.skipped_lines)
