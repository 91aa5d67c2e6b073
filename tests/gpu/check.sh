#!/usr/bin/env bash
# The CUDA/NCCL paths, on a machine with a GPU: one prepared script for the `device` tool.
#   bash tests/gpu/check.sh        (after the README's install, with a CUDA build of torch 2.13)
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name(0))"
failed=0
# NCCL abort and re-formation in place: a DDP generation, then an fsdp one (FSDP2 on the GPU) whose
# sharded state the next generation rebuilds through the region exchange (issue 41).
timeout 300 python3 tests/gpu/nccl_reform.py || failed=1
# Every CUDA test of the suite (they skip on CPU): mixed precision, the overlapped snapshot's
# side stream and pinned buffers, the NCCL process group, the session on a GPU, fsdp's redundancy
# copies (a large CUDA shard through pinned buffers on a side stream, raced by the next step).
python3 -m pytest -q -p no:cacheprovider -k "cuda or CUDA or gpu" tests/unit || failed=1
# The launcher: workers forked from a forkserver that is a fork of the agent (the agent never
# initializes CUDA: --nproc-per-node gpu counts through NVML) train on the GPU over NCCL.
out=$(mktemp)
if elastictrain run --debug --nproc-per-node gpu examples/mlp.py --steps 300 >"$out" 2>&1 \
    && grep -q "workers' forkserver: a fork of this process" "$out" && grep -q "backend nccl" "$out"; then
  echo "launcher on the GPU: OK (forked forkserver, NCCL)"
else
  echo "launcher on the GPU: FAILED"; tail -30 "$out"; failed=1
fi
# Restart mode on the GPU: the session's settings check gathers CUDA tensors over NCCL there.
if elastictrain run --recovery restart --nproc-per-node gpu examples/mlp.py --steps 50 >"$out" 2>&1; then
  echo "restart mode on the GPU: OK"
else
  echo "restart mode on the GPU: FAILED"; tail -30 "$out"; failed=1
fi
# Sharded training on the GPU (issue 41): FSDP2 over NCCL, bf16, sharded checkpoints, then the
# same job again restoring them (world 1 on a one-GPU machine: the mesh and the checkpoint paths).
ckpt=$(mktemp -d)
for steps in 40 60; do
  if elastictrain run --recovery restart --nproc-per-node gpu examples/transformer_lm.py --sharding fsdp \
      --precision bf16 --steps "$steps" --checkpoint-dir "$ckpt" --keep-checkpoints >"$out" 2>&1 \
      && { [ "$steps" = 40 ] || grep -q "restored step 40" "$out"; }; then
    echo "fsdp on the GPU (to step $steps): OK"
  else
    echo "fsdp on the GPU (to step $steps): FAILED"; tail -30 "$out"; failed=1
  fi
done
exit "$failed"
