"""What one step of policy iteration gains over the Feather rule.

On the training mix's held-out evaluation seeds (``feather-train``'s defaults for ``--profile``:
its built-in mix, KV capacity and ``eval_seeds``), the Feather rule and the simulator-only
playout references (:data:`~feather_gym.policies.PLAYOUT_REFERENCES`: ``rule-playout`` and
``rule-playout-sampled``, both :class:`~feather_gym.policies.RulePlayout`) run on the same
traces, and each workload reports the per-seed paired throughput ratio reference / rule
(:func:`trainer.evaluate.paired_ratio`: mean, standard error, seeds faster and slower) beside
each over FCFS; ``--policy`` adds a trained ONNX policy, paired against the rule too.
``rule-playout`` plays out the true output lengths: a clairvoyant bound on one step of improving
the rule. ``rule-playout-sampled`` plays out output lengths drawn from the trace's distribution
given what each request has emitted: the part of that bound reachable without foresight of
output lengths (both still read the whole queue and the cost model). A trained policy's column
shows how much of it a policy that sees only its observation has taken. Neither reference is a
policy to deploy.
"""

from __future__ import annotations


def headroom(config, *, seeds: int, policy_path: str | None = None) -> dict:
    """``{"profile", "seeds", "workloads": [...]}``: per workload of ``config`` (a resolved
    :class:`~trainer.config.TrainConfig`) on its first ``seeds`` evaluation seeds, each policy's
    mean throughput over FCFS's and its :func:`~trainer.evaluate.paired_ratio` over the rule's."""
    from feather_gym.policies import PLAYOUT_REFERENCES, FeatherRule, make_policy
    from trainer.evaluate import Benchmark, paired_ratio

    if not 1 <= seeds <= len(config.eval_seeds):
        raise ValueError(f"--seeds: between 1 and {len(config.eval_seeds)}, got {seeds}")
    benchmark = Benchmark(workloads=config.evaluation_workloads(), profile=config.profile,
                          seeds=config.eval_seeds[:seeds], engine=config.engine())
    policies = ({name: make_policy(name) for name in PLAYOUT_REFERENCES}
                | ({"policy": make_policy(policy_path)} if policy_path else {}))
    workloads = []
    for spec in benchmark.baselines:
        fcfs = benchmark.baselines[spec]["fcfs"]
        rule = benchmark.runs(spec, FeatherRule())["throughput_tok_s"]
        row = {"workload": spec, "runs": len(rule), "feather_rule_over_fcfs": float(rule.mean()) / fcfs}
        for label, policy in policies.items():
            runs = benchmark.runs(spec, policy)["throughput_tok_s"]
            key = label.replace("-", "_")
            row[f"{key}_over_fcfs"] = float(runs.mean()) / fcfs
            row[f"{key}_over_rule_paired"] = paired_ratio(runs, rule)
        workloads.append(row)
    return {"profile": config.profile, "seeds": list(benchmark.seeds), "workloads": workloads}


def format_headroom(report: dict, labels: list[str]) -> str:
    """The headroom table: per workload, the rule over FCFS, then each of ``labels`` over FCFS and
    paired over the rule (mean +- standard error, seeds faster/slower). Workloads are named by
    their short labels (:func:`traces.workload.workload_labels`); the table keeps within
    :data:`traces.table.WIDTH`."""
    from traces.table import format_table
    from traces.workload import workload_labels

    rows = [[label, f"{row['feather_rule_over_fcfs']:.3f}",
             *(cell for name in labels for cell in (f"{row[f'{name}_over_fcfs']:.3f}",
                                                    _paired(row[f"{name}_over_rule_paired"])))]
            for label, row in zip(workload_labels(row["workload"] for row in report["workloads"]), report["workloads"])]
    header = ["workload", "rule", *(cell for name in labels for cell in (name, f"{name} / rule"))]
    return "\n".join([f"headroom over the Feather rule, profile {report['profile']}, {len(report['seeds'])} held-out "
                      "seeds (x FCFS)", "paired ratio over the rule: mean +- standard error (seeds faster/slower)",
                      format_table(header, rows), f"{report['elapsed_s']:.0f} s"])


def _paired(pair: dict) -> str:
    return f"{pair['ratio_mean']:.4f} +- {pair['ratio_sem']:.4f} ({pair['runs_faster']}/{pair['runs_slower']})"
