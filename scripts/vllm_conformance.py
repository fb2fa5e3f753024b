#!/usr/bin/env python
"""vLLM's own scheduler tests as a conformance suite for the Feather scheduler.

Runs a vLLM source tree's scheduler tests (``tests/v1/core``: the scheduler, async-scheduler and
prefix-caching tests, and the other modules that build a scheduler) with pytest and the plugin
:mod:`deploy.conformance`, which substitutes the Feather classes for vLLM's ``Scheduler`` and
``AsyncScheduler``. The tree must be the tag of the installed vLLM (the tests are the definition
of a correct scheduler of that version)::

    # the control: vLLM's own classes, to see what fails in this environment anyway
    python scripts/vllm_conformance.py --vllm-src ~/vllm-0.32.0 --policy vllm --report control.json
    # the Feather classes admitting FCFS: what fails here is the queue's plumbing, not the order
    python scripts/vllm_conformance.py --vllm-src ~/vllm-0.32.0 --policy fcfs --control control.json \
        --report fcfs.json
    # the Feather rule, then an untrained k = 4 ONNX policy
    python scripts/vllm_conformance.py --vllm-src ~/vllm-0.32.0 --policy feather-rule --control control.json \
        --fcfs-control fcfs.json
    python scripts/vllm_conformance.py --vllm-src ~/vllm-0.32.0 --policy k4 --control control.json -k preempt

``--policy``: ``vllm`` (no substitution), ``fcfs`` (the Feather classes, FCFS admission),
``feather-rule`` (or ``cht``, ``cht-dfs``), a ``*.onnx`` file, or ``k4`` (an untrained k = 4
network, ``tests/deploy_policies.py``'s ``untrained_policy``). Arguments after the options go to
pytest (``-x``, ``-k EXPR``, test ids).

Most of vLLM's tests leave prefix caching off, which the Feather scheduler refuses: they are
reported skipped ("refused by design"). ``--force-prefix-caching`` turns it on for them instead,
in every run (give it to the control too).

A failure is ``environment`` when the control fails it too, ``not_applicable`` (the test builds
the scheduler without ``__init__``), ``fcfs_order`` when :data:`deploy.conformance.FCFS_ORDER`
lists it with the reason (it must pass in the ``--fcfs-control`` run, when given), else ``bug``.

Offline: the hub models the tests name for text-only configs are redirected to the local
SmolLM2-135M folder (``--model-dir``) through vLLM's ``VLLM_MODEL_REDIRECT_PATH``, and
``HF_HUB_OFFLINE=1``; multimodal models are not redirected (those tests fail in the control too).
vLLM's ``tests/conftest.py`` imports much that a CPU install lacks and is not loaded
(``--noconftest``); the few tests that need its fixtures fail in the control too.

Output: a readable summary, then the result as one JSON line (the last line of stdout):
``policy``, ``counts`` (passed/failed/error/skipped; failures by ``environment``,
``fcfs_order``, ``not_applicable``, ``bug``; ``refused_by_design`` skips; ``passed_with_feather``, the passes that
built a Feather scheduler) and ``tests`` (per node id: ``outcome``, ``feather``, ``reason``,
``where``, ``classification``). Exit status 0 when no failure is classified ``bug``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The test modules run by default (relative to the vLLM tree): every one that builds a scheduler.
TEST_FILES = ("test_scheduler.py", "test_async_scheduler.py", "test_prefix_caching.py", "test_deferred_block_free.py",
              "test_prefix_replay.py", "test_priority_preemption_bug.py", "test_worker_slot_overflow.py",
              "test_swa_inflight_window_free.py")
TEST_DIR = Path("tests/v1/core")
#: Text-only hub models the tests name, served from the local config instead.
REDIRECTED_MODELS = ("facebook/opt-125m", "facebook/opt-350m", "Qwen/Qwen3-0.6B")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-src", required=True, type=Path, help="a vLLM source tree with its tests/")
    parser.add_argument("--policy", default="feather-rule", help="vllm, feather-rule, cht, cht-dfs, PATH.onnx or k4")
    parser.add_argument("--control", type=Path, help="a --policy vllm report: its failures are environment")
    parser.add_argument("--force-prefix-caching", action="store_true",
                        help="turn prefix caching on where a test leaves it off (skipped otherwise), in the control "
                             "too: give a control run with this flag")
    parser.add_argument("--fcfs-control", type=Path,
                        help="a --policy fcfs report (the Feather classes admitting FCFS): an FCFS-order failure "
                             "must pass there")
    parser.add_argument("--report", type=Path, help="also keep the JSON report in this file")
    parser.add_argument("--model-dir", type=Path, help="the local model folder (default: SmolLM2-135M's)")
    parser.add_argument("--files", nargs="+", default=list(TEST_FILES), help=f"modules of {TEST_DIR} to run")
    return parser.parse_known_args(argv)


def resolve_policy(policy: str, folder: Path) -> str:
    """The ``--feather-policy`` of the plugin: ``k4`` becomes an untrained k = 4 ONNX file in ``folder``."""
    if policy != "k4":
        return policy
    sys.path.insert(0, str(ROOT / "tests"))
    from deploy_policies import untrained_policy

    return str(untrained_policy(folder / "k4-untrained.onnx", k=4))


def pytest_command(args, pytest_args, policy: str, report: Path, rootdir: Path) -> list[str]:
    files = [str(TEST_DIR / name) for name in args.files]
    command = [sys.executable, "-m", "pytest", "-p", "deploy.conformance", "-p", "no:cacheprovider", "--noconftest",
               "--rootdir", str(rootdir), "-q", "-rN", "--feather-policy", policy,
               "--feather-report", str(report)]
    if args.force_prefix_caching:
        command.append("--feather-force-prefix-caching")
    if args.control:
        command += ["--feather-control", str(args.control.resolve())]
    if args.fcfs_control:
        command += ["--feather-fcfs-control", str(args.fcfs_control.resolve())]
    return command + files + pytest_args


def environment(model_dir: Path, folder: Path) -> dict:
    redirect = folder / "model_redirect.json"
    redirect.write_text(json.dumps(dict.fromkeys(REDIRECTED_MODELS, str(model_dir))))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_MODEL_REDIRECT_PATH=str(redirect))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def summary(result: dict) -> str:
    """The readable part: counts, every failure with its classification, the skips by reason."""
    counts, tests = result["counts"], result["tests"]
    lines = [f"vLLM scheduler conformance, policy {result['policy']}: {counts['passed']} passed "
             f"({counts['passed_with_feather']} with a Feather scheduler), {counts['failed']} failed, "
             f"{counts['error']} errors, {counts['skipped']} skipped ({counts['refused_by_design']} refused by design)",
             f"failures: {counts['environment']} environment, {counts['fcfs_order']} FCFS order, "
             f"{counts['not_applicable']} not applicable, {counts['bug']} bug"]
    for classification in ("bug", "fcfs_order", "not_applicable", "environment"):
        for nodeid, entry in sorted(tests.items()):
            if entry.get("classification") == classification:
                where = f" [{entry['where']}]" if entry.get("where") and classification != "environment" else ""
                lines.append(f"  [{classification}] {nodeid}: {entry['reason']}{where}")
    skips = Counter(entry["reason"] for entry in tests.values() if entry["outcome"] == "skipped")
    lines += [f"  [skipped x{n}] {reason}" for reason, n in skips.most_common()]
    return "\n".join(lines)


def main(argv=None) -> int:
    args, pytest_args = parse_args(sys.argv[1:] if argv is None else argv)
    args.vllm_src = args.vllm_src.resolve()
    if not (args.vllm_src / TEST_DIR).is_dir():
        raise SystemExit(f"{args.vllm_src} has no {TEST_DIR}: give a vLLM source tree with its tests")
    if args.model_dir is None:
        from feather_gym.vllm_engine import ensure_smollm2_hf

        args.model_dir = ensure_smollm2_hf()
    with tempfile.TemporaryDirectory(prefix="feather-conformance-") as tmp:
        folder = Path(tmp)
        # The tests alone, run from a folder without the tree's vllm/ package: from the tree itself,
        # pytest would import that uncompiled source instead of the installed vLLM.
        shutil.copytree(args.vllm_src / "tests", folder / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        report = args.report.resolve() if args.report else folder / "report.json"
        command = pytest_command(args, pytest_args, resolve_policy(args.policy, folder), report, folder)
        print("$", " ".join(command), flush=True)
        completed = subprocess.run(command, cwd=folder, env=environment(args.model_dir, folder), stdout=sys.stderr)
        if not report.exists():
            raise SystemExit(f"pytest exited {completed.returncode} without a report")
        result = json.loads(report.read_text())
    result["policy"] = args.policy
    print(summary(result))
    print(json.dumps({"policy": result["policy"], "force_prefix_caching": args.force_prefix_caching,
                      "pytest_exit_status": completed.returncode,
                      "counts": result["counts"], "tests": result["tests"]}, sort_keys=True))
    return 1 if result["counts"]["bug"] else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
