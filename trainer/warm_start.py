"""Warm start: distil a heuristic into the fresh PPO module before reinforcement learning.

Why: the Feather gain needs *consistent* STOPs (a group kept out for a batch's whole life). From
a random or always-ADD start, PPO explores single STOPs, each of which only delays one request,
so the gradient points back to always-ADD and training settles there. Starting PPO from the
Feather rule puts it where consistent STOPs happen, so what PPO learns starts from the rule.

What is cloned must be a function of the observation. The Feather rule's one piece of history,
its floor (it grows by one every few steps in which the rule refused, up to ``max_floor``), is not
observable, and a clone of the rule with its floor still growing mixes contradicting labels (ADD
and STOP for the same features) and errs in closed loop. So the rule is recorded in its steady
state, floor at ``max_floor`` from the start: stateless, and otherwise the rule.

How: run the heuristic in the training env (same workloads, profile and episode settings as
PPO), record observations, the heuristic's actions and the undiscounted return-to-go of every
decision, then fit the module's policy head by cross-entropy (behaviour cloning) and its value
head by mean squared error to those returns, so PPO's first advantages are already meaningful.

With a minimum gain ``g`` (``TrainConfig.improve_warm_start``) the labels are one step of policy
iteration on the heuristic towards STOP, computed in the simulator: at each decision where the
heuristic admits, STOP and the heuristic's own action are tried on forks of the env
(:meth:`~feather_gym.envs.batch_formation.BatchFormationEnv.fork`), each followed by the heuristic
to the episode's end (:func:`playout_return`), and the decision is labelled STOP where STOP's mean
return beats the heuristic's action's by more than ``g`` (:func:`improved_action`); a decision
where the heuristic stops keeps its label unplayed. The mean is over
:data:`~feather_gym.policies.DEFAULT_PLAYOUT_SAMPLES` futures whose output lengths are drawn from
the trace's distribution given what each request has emitted, not the true ones, which the
observation cannot tell (labels played out on them would be clairvoyant). The threshold keeps the
labels the network can learn from its observation. The episodes follow the heuristic, so the
states are the heuristic's; the improved labels need more demonstrations and epochs
(:data:`IMPROVED`) than the heuristic's own. The episodes are independent, so they are recorded
in one spawned process per core.

Playouts are the warm start's cost: each decision plays the rest of its episode out
``2 x DEFAULT_PLAYOUT_SAMPLES`` times. They run only on the generated workloads at their own
arrival rate (:func:`plays_out`: the bursts of the built-in mixes, where the STOPs that pay were
found); a workload at a load factor of its capacity (``SPEC@load=X``) or a trace file is
demonstrated with the heuristic's own labels (:data:`PLAIN`). At a load factor requests trickle
in, so the rest of an episode is several times the engine steps of a burst's, and a trace file's
episode is hundreds of decisions: playing those out would spend most of ``feather-train``'s
budget before PPO starts. A trace file is recorded once (its seed changes nothing but the window).
A generator at a load factor is demonstrated on a longer trace of its shape than the mix gives it
(:func:`demonstrated`): at a load, the states a served queue reaches (several prefix groups
waiting, a deeper-resident candidate behind the first) build up over hundreds of arrivals, and the
short traces of the CPU mix end before they do, so a clone fitted on them alone mostly admits the
first candidate where its demonstrator would choose another. Only the demonstrations are longer;
PPO and validation run the mix as given.
A run on a time budget also stops playing out at a deadline, :data:`PLAYOUT_SHARE` of its budget
after the warm start began: the played-out episodes go seed by seed, and the decisions after the
deadline keep the heuristic's labels, so on a slower or busier machine fewer labels are improved
and PPO keeps its time; a run of a fixed number of iterations plays every decision out, the same
on any machine.

The cross-entropy is label-smoothed (``TrainConfig.clone_smoothing``, 0.1 by default): a clone
fitted to one-hot labels puts all probability on the demonstrator's action, the rule admits only
slot 0, and PPO then never samples another slot or a STOP, so it has nothing to compare and keeps
the clone. Smoothed, the other actions keep a little probability each.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass

import numpy as np

from feather_gym.observation import STOP
from feather_gym.policies import DEFAULT_PLAYOUT_SAMPLES, playout_futures

#: Demonstrations: workload seeds recorded per generated workload (from ``DEMO_SEED_BASE``,
#: disjoint from every other seed set) and cloning epochs. The rule's labels fit exactly at
#: (4, 30); playout-improved ones underfit there, hence :data:`IMPROVED`'s epochs for the whole
#: set when any label is improved.
DEMO_SEED_BASE = 50_000
PLAIN = (4, 30)
IMPROVED = (8, 300)
#: Share of a time budget after which the warm start plays nothing more out (see above).
PLAYOUT_SHARE = 0.2
#: Requests at least in a generated workload demonstrated at a load factor (:func:`demonstrated`).
DEMO_LOAD_REQUESTS = 256


def demonstration_seeds(improve: bool) -> range:
    """The workload seeds the warm start records (``improve``: playout-improved labels)."""
    seeds = max(IMPROVED[0], PLAIN[0]) if improve else PLAIN[0]
    return range(DEMO_SEED_BASE, DEMO_SEED_BASE + seeds)


def plays_out(workload: str) -> bool:
    """Whether the improved warm start plays ``workload``'s decisions out: a generator at its own
    arrival rate (neither a trace file nor at a load factor; see the module docstring)."""
    from feather_gym.load import split_load
    from traces.workload import is_generated

    return is_generated(workload) and split_load(workload)[1] is None


def demonstrated(workload: str) -> str:
    """The spec the warm start records for mix workload ``workload``: a generator at a load factor
    (``SPEC@load=X``) with at least :data:`DEMO_LOAD_REQUESTS` requests; anything else as it is,
    a time window of a generator too."""
    from feather_gym.load import split_load
    from traces.generators import generator_class
    from traces.workload import is_generated, parse_params, with_params

    base, load = split_load(workload)
    if load is None or not is_generated(base) or "@" in base:
        return workload
    kind, _, text = base.partition(":")
    requests = parse_params(kind, text).get("num_requests", generator_class(kind).num_requests)
    if requests >= DEMO_LOAD_REQUESTS:
        return workload
    return with_params(base, num_requests=DEMO_LOAD_REQUESTS) + workload[len(base):]


@dataclass(frozen=True)
class Demonstrations:
    """``obs [N, F]`` float32, ``actions [N]`` int64 (the labels), ``returns [N]`` float32 (the
    demonstrator's return-to-go), ``relabelled``: labels that are not the demonstrator's action,
    ``played``: decisions labelled by playouts."""

    obs: np.ndarray
    actions: np.ndarray
    returns: np.ndarray
    relabelled: int = 0
    played: int = 0

    @property
    def add_fraction(self) -> float:
        """Share of the decisions that admit a candidate (any slot)."""
        return float((self.actions != 0).mean()) if len(self.actions) else 0.0

    @classmethod
    def concatenate(cls, parts) -> Demonstrations:
        """The demonstrations of ``parts`` one after another."""
        parts = list(parts)
        return cls(np.concatenate([part.obs for part in parts]), np.concatenate([part.actions for part in parts]),
                   np.concatenate([part.returns for part in parts]), sum(part.relabelled for part in parts),
                   sum(part.played for part in parts))


def demonstrator(policy_name: str):
    """The policy recorded for ``policy_name`` (a baseline of :data:`feather_gym.policies.BASELINES`):
    the baseline itself, except the Feather rule (``feather-rule``, ``feather-hold``,
    ``feather-resident``), which is recorded in its steady state (see above)."""
    from feather_gym.policies import FeatherRule, make_policy

    policy = make_policy(policy_name)
    return policy.in_steady_state() if isinstance(policy, FeatherRule) else policy


def playout_return(env, policy, action: int, output_len: np.ndarray | None = None) -> float:
    """The return from ``env``'s pending decision on when ``action`` is taken there and ``policy``
    decides every later one, played out on a fork (``env`` and ``policy`` are left as they were;
    ``output_len``: the fork's, see :meth:`~feather_gym.envs.batch_formation.BatchFormationEnv.fork`)."""
    env, policy = env.fork(output_len), copy.deepcopy(policy)
    total, done = 0.0, False
    while not done:
        _, reward, terminated, truncated, _ = env.step(action)
        total += reward
        done = terminated or truncated
        if not done:
            action = policy.decide(env.admission_point)
    return total


def improved_action(env, policy, action: int, min_gain: float, *,
                    samples: int | None = DEFAULT_PLAYOUT_SAMPLES) -> int:
    """STOP where its mean :func:`playout_return` at ``env``'s pending decision beats ``action``'s
    (the policy's own) by more than ``min_gain``, else ``action``. The mean is over ``samples``
    output-length futures (:func:`~feather_gym.policies.playout_futures`, the same for both
    actions); ``samples=None`` plays the true output lengths out once (clairvoyant)."""
    if action == STOP:
        return action
    futures = playout_futures(env.admission_point.sim, samples)
    stop, own = (np.mean([playout_return(env, policy, a, future) for future in futures]) for a in (STOP, action))
    return STOP if stop > own + min_gain else action


def record_episode(policy_name: str, env_config: dict, workload: str, seed: int,
                   min_gain: float | None = None, playout_until: float | None = None) -> Demonstrations:
    """One episode of :func:`demonstrator` of ``policy_name`` on ``workload`` at workload seed
    ``seed`` in the env of ``env_config``; with ``min_gain``, each decision labelled with
    :func:`improved_action` instead of the demonstrator's action, until ``time.time()`` reaches
    ``playout_until`` (None: to the end). Deterministic without a ``playout_until``."""
    import gymnasium as gym

    from feather_gym.envs import ENV_ID

    policy = demonstrator(policy_name)
    env = gym.make(ENV_ID, **{**env_config, "workloads": [workload], "seed": seed, "workload_instances": 1})
    obs, _ = env.reset()
    policy.reset()
    obs_rows, labels, rewards = [], [], []
    relabelled = played = 0
    done = False
    while not done:
        action = policy.decide(env.unwrapped.admission_point)
        play = min_gain is not None and action != STOP and (playout_until is None or time.time() < playout_until)
        label = improved_action(env.unwrapped, policy, action, min_gain) if play else action
        relabelled += label != action
        played += play
        obs_rows.append(obs)
        labels.append(label)
        obs, reward, terminated, truncated, _ = env.step(action)
        rewards.append(reward)
        done = terminated or truncated
    env.close()
    return Demonstrations(np.asarray(obs_rows, dtype=np.float32), np.asarray(labels, dtype=np.int64),
                          np.cumsum(rewards[::-1])[::-1].astype(np.float32), relabelled, played)


def record_demonstrations(policy_name: str, env_config: dict, *, seeds: range, min_gain: float | None = None,
                          workers: int = 1, playout_until: float | None = None) -> Demonstrations:
    """:func:`record_episode` for every workload of ``env_config`` at each workload seed of
    ``seeds`` (a trace file at the first only), concatenated in that order (seed-major, so a
    ``playout_until`` cuts the last seeds). ``workers > 1`` records the episodes in that many
    spawned processes (playouts are the costly part of an improved warm start); without a
    ``playout_until`` the result is the same for any ``workers``."""
    from traces.workload import is_generated

    tasks = [(policy_name, env_config, workload, seed, min_gain, playout_until) for seed in seeds
             for workload in env_config["workloads"] if is_generated(workload) or seed == seeds[0]]
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn, not fork: the driver may hold Ray's threads.
        with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as pool:
            episodes = list(pool.map(record_episode, *zip(*tasks)))
    else:
        episodes = [record_episode(*task) for task in tasks]
    return Demonstrations.concatenate(episodes)


def clone_into(module, demos: Demonstrations, *, epochs: int = 30, batch_size: int = 512, lr: float = 3e-3,
               smoothing: float = 0.0, seed: int = 0) -> dict:
    """Fit ``module`` (RLlib's default PPO torch module) to ``demos``: policy logits by
    cross-entropy to the actions, value by MSE to the returns. Returns the final accuracy and
    value error on the demonstrations."""
    import torch
    from ray.rllib.core.columns import Columns

    generator = torch.Generator().manual_seed(seed)
    obs = torch.from_numpy(demos.obs)
    actions = torch.from_numpy(demos.actions)
    returns = torch.from_numpy(demos.returns)
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    module.train()
    for _ in range(epochs):
        for rows in torch.randperm(len(obs), generator=generator).split(batch_size):
            out = module.forward_train({Columns.OBS: obs[rows]})
            policy_loss = torch.nn.functional.cross_entropy(out[Columns.ACTION_DIST_INPUTS], actions[rows],
                                                                  label_smoothing=smoothing)
            value_loss = torch.nn.functional.mse_loss(module.compute_values({Columns.OBS: obs[rows]}), returns[rows])
            optimizer.zero_grad()
            (policy_loss + value_loss).backward()   # separate encoders (vf_share_layers=False): no interference
            optimizer.step()
    with torch.no_grad():
        logits = module.forward_train({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]
        values = module.compute_values({Columns.OBS: obs})
    return {"accuracy": float((logits.argmax(-1) == actions).float().mean()),
            "value_rmse": float(torch.sqrt(torch.mean((values - returns) ** 2)))}


def warm_start(algo, policy_name: str, env_config: dict, *, smoothing: float = 0.0,
               min_gain: float | None = None, playout_s: float | None = None) -> dict:
    """Record ``policy_name`` in the env (with ``min_gain``, its playout-improved labels, played out
    for at most ``playout_s`` seconds, None: all), clone it into every learner's module, and push
    the weights to the env runners. Returns a report for the run summary."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    start = time.monotonic()
    played = [workload for workload in env_config["workloads"] if min_gain is not None and plays_out(workload)]
    plain = [demonstrated(workload) for workload in env_config["workloads"] if workload not in played]
    # Every core records (the env runners idle until PPO starts).
    workers = len(os.sched_getaffinity(0))
    until = None if playout_s is None else time.time() + playout_s
    parts = [record_demonstrations(policy_name, {**env_config, "workloads": workloads}, seeds=seeds,
                                   min_gain=gain, workers=workers, playout_until=until)
             for workloads, seeds, gain in ((played, range(DEMO_SEED_BASE, DEMO_SEED_BASE + IMPROVED[0]), min_gain),
                                            (plain, range(DEMO_SEED_BASE, DEMO_SEED_BASE + PLAIN[0]), None))
             if workloads]
    demos = Demonstrations.concatenate(parts)
    record_s = time.monotonic() - start
    _, epochs = IMPROVED if played else PLAIN
    calls = algo.learner_group.foreach_learner(lambda learner: clone_into(learner.module[DEFAULT_MODULE_ID], demos,
                                                                              epochs=epochs, smoothing=smoothing))
    fit = next(iter(calls)).get()     # RemoteCallResults; raises the learner's error, if any
    algo.env_runner_group.sync_weights(from_worker_or_learner_group=algo.learner_group, inference_only=True)
    return {"policy": policy_name, "min_gain": min_gain, "played_out": played,
            "decisions": len(demos.actions),
            "relabelled": demos.relabelled, "played_decisions": demos.played, "playout_s": playout_s,
            "record_s": record_s, "record_workers": workers,
            "fit_s": time.monotonic() - start - record_s, "add_fraction": demos.add_fraction, **fit}
