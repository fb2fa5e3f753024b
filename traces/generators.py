"""Seeded synthetic workloads with known prefix structure.

=================== ============================================= =========================
kind                shape (published statistics followed)         labels
=================== ============================================= =========================
prefix-groups       Feather paper: G groups, 1K-10K-token shared   ``group``
                    prefixes, unique suffixes, decode 1-200
long-doc-qa         LooGLE / QuALITY: 5K-40K-token documents,      ``group`` = document
                    8-20 questions each
tool-agent          ToolBench: ~430-token system prompt, ~1.2K     ``session`` = task
                    tokens of Zipf-popular tools, 3-5 calls/task
multi-turn-chat     ShareGPT: 3-7 turns, user ~96 / assistant      ``session`` = conversation
                    ~323 tokens, prompt = whole history
no-sharing          Azure LLM trace 2023 (conv) lengths; control   none
=================== ============================================= =========================

Each generator is a frozen dataclass whose fields are its parameters (every size is one);
``generate(seed)`` is deterministic in (parameters, seed). A parameter's range is declared once,
in the class's :attr:`~WorkloadGenerator.RANGES` (every other number is >= 0), with
``X_min <= X_max`` for every pair of fields so named; building a generator checks them all, and
:func:`parameters` lists them (``feather trace kinds``). Prompts are ``token_ids`` (int64)
drawn uniformly from the synthetic token range of :mod:`traces.request`, so unrelated
contents never share a block of 4 or more tokens (collision odds < 1e-17 per block pair).
Shared contents are built once and concatenated (or sliced: a turn's prompt is a view of
its conversation), so generation is vectorised and costs O(total prompt tokens).
Every generator makes exactly ``num_requests`` requests; where requests come in units
(documents, tasks, conversations) the last unit is cut short to make the count exact.
Request ids are ``"<i>"`` in arrival order; the trace ``source`` is a workload spec
(``kind:key=value,...``) that regenerates it with the same seed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np

from traces.request import SYNTH_TOKEN_LOW, SYNTH_TOKEN_RANGE, Request, Trace


def random_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` uniform token ids from the synthetic range (fresh content)."""
    return rng.integers(SYNTH_TOKEN_LOW, SYNTH_TOKEN_LOW + SYNTH_TOKEN_RANGE, size=n, dtype=np.int64)


def random_pieces(rng: np.random.Generator, lengths: np.ndarray) -> list[np.ndarray]:
    """Fresh contents of the given lengths: one draw, split into views."""
    return np.split(random_tokens(rng, int(np.sum(lengths))), np.cumsum(lengths)[:-1])


def poisson_arrivals(rng: np.random.Generator, n: int, mean_gap_s: float) -> np.ndarray:
    """``n`` arrival times (s), the first at 0, then exponential gaps of mean ``mean_gap_s``
    (a Poisson process of rate 1 / mean_gap_s; all at 0 when the mean gap is 0)."""
    return np.concatenate(([0.0], np.cumsum(rng.exponential(mean_gap_s, size=max(n - 1, 0)))))[:n]


def uniform_ints(rng: np.random.Generator, low: int, high: int, n: int) -> np.ndarray:
    """``n`` integers uniform on [low, high] (inclusive)."""
    return rng.integers(low, high + 1, size=n, dtype=np.int64)


def unit_sizes(rng: np.random.Generator, total: int, low: int, high: int) -> np.ndarray:
    """Sizes uniform on [low, high] summing to exactly ``total``; the last one is cut short."""
    sizes = uniform_ints(rng, low, high, -(-total // low))
    count = int(np.searchsorted(np.cumsum(sizes), total)) + 1
    sizes = sizes[:count]
    sizes[-1] -= int(sizes.sum()) - total
    return sizes


def lognormal_ints(rng: np.random.Generator, log_mean: float, log_sd: float, n: int, high: int) -> np.ndarray:
    """``n`` rounded lognormal integers (parameters of the underlying normal), clipped to [1, high]."""
    return np.clip(np.rint(rng.lognormal(log_mean, log_sd, size=n)), 1, high).astype(np.int64)


def log_mean_for(mean: float, log_sd: float) -> float:
    """The log-mean that gives a lognormal of log-sd ``log_sd`` the given ``mean``."""
    return float(np.log(mean) - log_sd ** 2 / 2)


@dataclass(frozen=True)
class Range:
    """The values ``low <= x <= high`` (``above``: ``low < x``; ``high`` None: no upper bound)."""

    low: float = 0
    high: float | None = None
    above: bool = False

    def __contains__(self, value) -> bool:
        return (value > self.low if self.above else value >= self.low) and (self.high is None or value <= self.high)

    def __str__(self) -> str:
        if self.high is not None:
            return f"in {'(' if self.above else '['}{self.low:g}, {self.high:g}]"
        return f"{'>' if self.above else '>='} {self.low:g}"


AT_LEAST_1, POSITIVE, SHARE = Range(1), Range(0, above=True), Range(0, 1)


@dataclass(frozen=True)
class WorkloadGenerator(ABC):
    """A synthetic workload: dataclass fields are its parameters; :meth:`generate` builds it.

    Invariant (checked when built): every number is in its :attr:`RANGES` entry (default
    ``>= 0``), ``X_min <= X_max`` for every pair of parameters so named, and :meth:`validate`
    holds; a parameter that may be None is unchecked when None.
    """

    kind: ClassVar[str]
    #: Parameter -> its range, where it is not ``>= 0``.
    RANGES: ClassVar[dict[str, Range]] = {}

    def __post_init__(self) -> None:
        names = {f.name for f in fields(self)}
        for name in names:
            value = getattr(self, name)
            if value is not None and value not in self.RANGES.get(name, Range()):
                raise ValueError(f"{self.kind}: {name} must be {self.RANGES.get(name, Range())}, got {value}")
        for low in sorted(names):
            high = low.removesuffix("_min") + "_max"
            if low.endswith("_min") and high in names:
                self.require(getattr(self, low) <= getattr(self, high),
                             f"need {low} <= {high}, got {getattr(self, low)} and {getattr(self, high)}")
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` for parameters inconsistent beyond their ranges and ``_min``/``_max`` pairs."""

    def require(self, condition: bool, message: str) -> None:
        if not condition:
            raise ValueError(f"{self.kind}: {message}")

    @abstractmethod
    def build(self, rng: np.random.Generator) -> list[tuple[float, dict]]:
        """(arrival_s, Request keyword arguments) pairs, in any order."""

    def spec(self) -> str:
        """The workload spec that regenerates this generator."""
        return self.kind + ":" + ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    def generate(self, seed: int = 0) -> Trace:
        """The workload for ``seed``: requests sorted by arrival (stable), ids "0", "1", ..."""
        built = self.build(np.random.default_rng(seed))
        order = np.argsort(np.array([arrival for arrival, _ in built], dtype=np.float64), kind="stable")
        requests = []
        for i, k in enumerate(order):
            arrival, kwargs = built[k]
            requests.append(Request(str(i), float(arrival), input_len=len(kwargs["token_ids"]), **kwargs))
        return Trace(name=self.kind, requests=requests, source=f"{self.spec()} seed={seed}")


@dataclass(frozen=True)
class PrefixGroups(WorkloadGenerator):
    """The Feather paper's synthetic prefix-group workload (Rathi et al., "Requests of a Feather
    Must Flock Together", 2026): ``groups`` groups, each with a shared prefix of 1K-10K tokens
    (``prefix_tokens`` fixes it for all groups), a unique suffix per request, decode lengths
    uniform on 1-200 and Poisson arrivals at ``rate`` requests/s.

    ``homogeneity`` h in [0, 1] sets how clustered the arrival stream is: each request
    repeats the previous request's group with probability h, else draws a group uniformly.
    Groups stay equally popular at every h; consecutive requests share a group with
    probability h + (1 - h) / groups (h=0: fully interleaved, h=1: one group only).
    """

    kind: ClassVar[str] = "prefix-groups"
    num_requests: int = 1000
    groups: int = 8
    prefix_tokens: int | None = None
    prefix_tokens_min: int = 1000
    prefix_tokens_max: int = 10000
    suffix_tokens_min: int = 32
    suffix_tokens_max: int = 512
    output_tokens_min: int = 1
    output_tokens_max: int = 200
    rate: float = 20.0
    homogeneity: float = 0.0

    RANGES: ClassVar[dict[str, Range]] = {
        **dict.fromkeys(("num_requests", "groups", "prefix_tokens", "prefix_tokens_min", "suffix_tokens_min",
                         "output_tokens_min"), AT_LEAST_1), "rate": POSITIVE, "homogeneity": SHARE}

    def group_sequence(self, rng: np.random.Generator) -> np.ndarray:
        """Group of each request: a sticky chain (see class docstring), vectorised."""
        n = self.num_requests
        fresh = uniform_ints(rng, 0, self.groups - 1, n)
        redraw = rng.random(n) >= self.homogeneity
        redraw[0] = True
        last_redraw = np.maximum.accumulate(np.where(redraw, np.arange(n), 0))
        return fresh[last_redraw]

    def build(self, rng):
        n = self.num_requests
        prefix_lens = (np.full(self.groups, self.prefix_tokens) if self.prefix_tokens is not None else
                       uniform_ints(rng, self.prefix_tokens_min, self.prefix_tokens_max, self.groups))
        prefixes = random_pieces(rng, prefix_lens)
        group = self.group_sequence(rng)
        suffixes = random_pieces(rng, uniform_ints(rng, self.suffix_tokens_min, self.suffix_tokens_max, n))
        outputs = uniform_ints(rng, self.output_tokens_min, self.output_tokens_max, n)
        arrivals = poisson_arrivals(rng, n, 1.0 / self.rate)
        return [(arrivals[i], {"token_ids": np.concatenate((prefixes[group[i]], suffixes[i])),
                               "output_len": int(outputs[i]), "group": f"group{group[i]}"}) for i in range(n)]


@dataclass(frozen=True)
class LongDocQA(WorkloadGenerator):
    """Question answering over long documents, in the shape of LooGLE (Li et al., 2023; long
    documents of ~20K+ tokens) and QuALITY (Pang et al., 2022; ~5K-token articles, several
    questions each): documents of uniform 5K-40K tokens, each asked 8-20 questions
    (uniform) of 16-128 tokens appended after the document, answers of 4-64 tokens.
    Questions of all documents arrive interleaved in random order, Poisson at ``rate``/s.
    """

    kind: ClassVar[str] = "long-doc-qa"
    num_requests: int = 224
    doc_tokens_min: int = 5000
    doc_tokens_max: int = 40000
    questions_min: int = 8
    questions_max: int = 20
    question_tokens_min: int = 16
    question_tokens_max: int = 128
    output_tokens_min: int = 4
    output_tokens_max: int = 64
    rate: float = 2.0

    RANGES: ClassVar[dict[str, Range]] = {
        **dict.fromkeys(("num_requests", "doc_tokens_min", "questions_min", "question_tokens_min",
                         "output_tokens_min"), AT_LEAST_1), "rate": POSITIVE}

    def build(self, rng):
        n = self.num_requests
        questions_per_doc = unit_sizes(rng, n, self.questions_min, self.questions_max)
        docs = len(questions_per_doc)
        documents = random_pieces(rng, uniform_ints(rng, self.doc_tokens_min, self.doc_tokens_max, docs))
        doc_of = np.repeat(np.arange(docs), questions_per_doc)
        rng.shuffle(doc_of)
        questions = random_pieces(rng, uniform_ints(rng, self.question_tokens_min, self.question_tokens_max, n))
        outputs = uniform_ints(rng, self.output_tokens_min, self.output_tokens_max, n)
        arrivals = poisson_arrivals(rng, n, 1.0 / self.rate)
        return [(arrivals[i], {"token_ids": np.concatenate((documents[doc_of[i]], questions[i])),
                               "output_len": int(outputs[i]), "group": f"doc{doc_of[i]}"}) for i in range(n)]


@dataclass(frozen=True)
class ToolAgent(WorkloadGenerator):
    """Tool-using agent tasks in the shape of ToolBench (Qin et al., ToolLLM, 2023): a shared
    ~430-token system prompt, then the definitions of ``tools_per_task`` tools (100-300 tokens
    each, ~1.2K in all) drawn without replacement from a pool of ``tool_pool`` tools with
    Zipf(``zipf_exponent``) popularity and listed most popular first, then the user query.
    Each task makes 3-5 calls; call k+1's prompt is call k's prompt + its output (the tool
    call, 16-128 tokens) + the tool's observation (64-512 tokens): a growing context.
    Tasks start Poisson at ``task_rate``/s; calls follow at exponential gaps of mean
    ``call_gap_s`` s.
    """

    kind: ClassVar[str] = "tool-agent"
    num_requests: int = 400
    calls_min: int = 3
    calls_max: int = 5
    system_tokens: int = 430
    tool_pool: int = 64
    tools_per_task: int = 6
    tool_tokens_min: int = 100
    tool_tokens_max: int = 300
    zipf_exponent: float = 1.1
    query_tokens_min: int = 32
    query_tokens_max: int = 160
    call_output_tokens_min: int = 16
    call_output_tokens_max: int = 128
    observation_tokens_min: int = 64
    observation_tokens_max: int = 512
    task_rate: float = 1.0
    call_gap_s: float = 2.0

    RANGES: ClassVar[dict[str, Range]] = {
        **dict.fromkeys(("num_requests", "system_tokens", "calls_min", "tool_pool", "tools_per_task", "tool_tokens_min",
                         "query_tokens_min", "call_output_tokens_min", "observation_tokens_min"), AT_LEAST_1),
        "task_rate": POSITIVE}

    def validate(self) -> None:
        """``tools_per_task <= tool_pool``: a task's tools are drawn without replacement."""
        self.require(self.tools_per_task <= self.tool_pool, "need tools_per_task <= tool_pool")

    def build(self, rng):
        system = random_tokens(rng, self.system_tokens)
        tools = random_pieces(rng, uniform_ints(rng, self.tool_tokens_min, self.tool_tokens_max, self.tool_pool))
        popularity = 1.0 / np.arange(1, self.tool_pool + 1) ** self.zipf_exponent
        popularity /= popularity.sum()
        calls_per_task = unit_sizes(rng, self.num_requests, self.calls_min, self.calls_max)
        starts = poisson_arrivals(rng, len(calls_per_task), 1.0 / self.task_rate)
        built = []
        for task, calls in enumerate(calls_per_task.tolist()):
            chosen = np.sort(rng.choice(self.tool_pool, size=self.tools_per_task, replace=False, p=popularity))
            outputs = uniform_ints(rng, self.call_output_tokens_min, self.call_output_tokens_max, calls)
            observations = uniform_ints(rng, self.observation_tokens_min, self.observation_tokens_max, calls - 1)
            query = random_tokens(rng, int(uniform_ints(rng, self.query_tokens_min, self.query_tokens_max, 1)[0]))
            first_prompt = np.concatenate([system, *(tools[t] for t in chosen), query])
            steps = np.column_stack((outputs[:-1], observations)).reshape(-1)    # out1 obs1 out2 obs2 ...
            context = np.concatenate((first_prompt, random_tokens(rng, int(steps.sum()))))
            prompt_lens = len(first_prompt) + np.concatenate(([0], np.cumsum(steps)[1::2]))
            arrivals = starts[task] + poisson_arrivals(rng, calls, self.call_gap_s)
            built += [(arrivals[k], {"token_ids": context[:prompt_lens[k]], "output_len": int(outputs[k]),
                                     "session": f"task{task}"}) for k in range(calls)]
        return built


@dataclass(frozen=True)
class MultiTurnChat(WorkloadGenerator):
    """Multi-turn chat in the shape of ShareGPT: 3-7 turns per conversation (uniform), user
    turns of mean ~96 tokens and assistant turns of mean ~323 (lognormal, log-sd
    ``length_sigma``, clipped to [1, 8192]); turn k's prompt is the whole history
    u1 a1 ... u(k-1) a(k-1) uk and its output is ak. Conversations start Poisson at ``rate``/s;
    turn k+1 arrives an exponential time of mean ``think_time_s`` s after turn k (a trace
    replays arrivals; it does not wait for turn k's answer).
    """

    kind: ClassVar[str] = "multi-turn-chat"
    num_requests: int = 500
    turns_min: int = 3
    turns_max: int = 7
    user_tokens_mean: float = 96.0
    assistant_tokens_mean: float = 323.0
    length_sigma: float = 1.0
    rate: float = 1.0
    think_time_s: float = 10.0

    MAX_TURN_TOKENS: ClassVar[int] = 8192
    RANGES: ClassVar[dict[str, Range]] = {
        **dict.fromkeys(("num_requests", "turns_min", "user_tokens_mean", "assistant_tokens_mean"), AT_LEAST_1),
        "rate": POSITIVE}

    def build(self, rng):
        turns_per_conversation = unit_sizes(rng, self.num_requests, self.turns_min, self.turns_max)
        starts = poisson_arrivals(rng, len(turns_per_conversation), 1.0 / self.rate)
        built = []
        for conv, turns in enumerate(turns_per_conversation.tolist()):
            user = lognormal_ints(rng, log_mean_for(self.user_tokens_mean, self.length_sigma), self.length_sigma,
                                  turns, self.MAX_TURN_TOKENS)
            assistant = lognormal_ints(rng, log_mean_for(self.assistant_tokens_mean, self.length_sigma),
                                       self.length_sigma, turns, self.MAX_TURN_TOKENS)
            history = random_tokens(rng, int(user.sum() + assistant.sum()))
            prompt_ends = np.cumsum(user) + np.concatenate(([0], np.cumsum(assistant)[:-1]))
            arrivals = starts[conv] + poisson_arrivals(rng, turns, self.think_time_s)
            built += [(arrivals[k], {"token_ids": history[:prompt_ends[k]], "output_len": int(assistant[k]),
                                     "session": f"conv{conv}"}) for k in range(turns)]
        return built


@dataclass(frozen=True)
class NoSharing(WorkloadGenerator):
    """The no-sharing control: unique prompts with the lengths of the Azure LLM inference
    trace 2023, conversation part (Patel et al., Splitwise, ISCA'24). Lengths are lognormal,
    fitted here to that trace's median and p90 (19,366 requests): input median 1,020, p90
    2,735 tokens (log-mean 6.93, log-sd 0.77, clipped to [1, 14,050]); output median 129,
    p90 424 (log-mean 4.86, log-sd 0.93, clipped to [1, 1,000]). Means come out near 1,375
    and 193 (the trace's: 1,155 and 211; its input has a heavier short tail). Poisson
    arrivals at ``rate``/s (the trace's own rate is 5.5/s).
    """

    kind: ClassVar[str] = "no-sharing"
    num_requests: int = 1000
    input_log_mean: float = 6.93
    input_log_sd: float = 0.77
    input_tokens_max: int = 14050
    output_log_mean: float = 4.86
    output_log_sd: float = 0.93
    output_tokens_max: int = 1000
    rate: float = 5.5

    RANGES: ClassVar[dict[str, Range]] = {
        **dict.fromkeys(("num_requests", "input_tokens_max", "output_tokens_max"), AT_LEAST_1), "rate": POSITIVE}

    def build(self, rng):
        n = self.num_requests
        inputs = lognormal_ints(rng, self.input_log_mean, self.input_log_sd, n, self.input_tokens_max)
        outputs = lognormal_ints(rng, self.output_log_mean, self.output_log_sd, n, self.output_tokens_max)
        prompts = random_pieces(rng, inputs)
        arrivals = poisson_arrivals(rng, n, 1.0 / self.rate)
        return [(arrivals[i], {"token_ids": prompts[i], "output_len": int(outputs[i])}) for i in range(n)]


GENERATORS: dict[str, type[WorkloadGenerator]] = {
    g.kind: g for g in (PrefixGroups, LongDocQA, ToolAgent, MultiTurnChat, NoSharing)}
GENERATOR_KINDS: tuple[str, ...] = tuple(GENERATORS)


def generator_class(kind: str) -> type[WorkloadGenerator]:
    if kind not in GENERATORS:
        raise ValueError(f"unknown workload kind {kind!r}; valid kinds: {', '.join(GENERATOR_KINDS)}")
    return GENERATORS[kind]


def parameters(kind: str) -> list[dict]:
    """The parameters of generator ``kind``, in order: ``name``, ``type`` (as ``key=value`` takes
    it), ``default`` and ``range`` (its :attr:`~WorkloadGenerator.RANGES` entry, plus
    ``<= X_max`` for an ``X_min``); the class's own cross-checks are in its ``validate``."""
    import typing

    cls = generator_class(kind)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    rows = []
    for f in fields(cls):
        kinds = [t.__name__ for t in typing.get_args(hints[f.name]) or (hints[f.name],)]
        text = str(cls.RANGES.get(f.name, Range()))
        low, high = f.name.removesuffix("_max") + "_min", f.name.removesuffix("_min") + "_max"
        if f.name.endswith("_min") and high in names:
            text += f", <= {high}"
        elif f.name.endswith("_max") and low in names:
            text = f">= {low}"
        rows.append({"name": f.name, "type": " or ".join(k.replace("NoneType", "None") for k in kinds),
                     "default": f.default, "range": text})
    return rows


def make_generator(kind: str, **params) -> WorkloadGenerator:
    """The generator of ``kind`` with ``params``; unknown keys raise ``ValueError`` listing valid ones."""
    cls = generator_class(kind)
    valid = [f.name for f in fields(cls)]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(f"{kind}: unknown parameter(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return cls(**params)


def generate(kind: str, *, seed: int = 0, **params) -> Trace:
    """The seeded workload of ``kind`` (one of :data:`GENERATOR_KINDS`) with ``params``."""
    return make_generator(kind, **params).generate(seed)
