#!/usr/bin/env bash
# The main job on a fresh machine: set up, start a local JPFS cluster on loopback (no
# configuration needed), generate a LeRobot-shaped dataset, import it, and read it back three
# ways: the CLI, the native client, and the PyTorch ShardDataset. Everything lives under ./run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate

RUN=${RUN:-run}
mkdir -p "$RUN"
jpfs cluster up --dir "$RUN/cluster"
export JPFS_CLUSTER="$PWD/$RUN/cluster/cluster.toml"

if [ ! -f "$RUN/dataset/meta/info.json" ]; then
  jpfs bench gen "$RUN/dataset" --episodes 40 --cameras 2 --format v2.1
fi
jpfs import "$RUN/dataset" jpfs:/datasets/demo-v2.1
jpfs lerobot convert jpfs:/datasets/demo-v2.1 jpfs:/datasets/demo-v3.0 --video-file-mb 1 \
  || true  # already converted on a rerun
jpfs lerobot info jpfs:/datasets/demo-v3.0
jpfs ls -l jpfs:/datasets/demo-v3.0/data/chunk-000
jpfs du -s -H jpfs:/datasets

python - <<'PY'
import torch
from jpfs.torch import ShardDataset

ds = ShardDataset("jpfs://datasets/demo-v3.0", video=False, seed=0,
                  delta_timestamps={"action": [i / 30 for i in range(16)]})
loader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=2)
n = 0
for batch in loader:
    n += batch["index"].numel()
print(f"ShardDataset over jpfs://datasets/demo-v3.0: {n} frames, "
      f"action chunk {tuple(batch['action'].shape[1:])}, pad mask {tuple(batch['action_is_pad'].shape[1:])}")
PY

jpfs fsck
jpfs cluster status
echo
echo "The cluster is still running: export JPFS_CLUSTER=$JPFS_CLUSTER"
echo "Stop it with: jpfs cluster down --dir $RUN/cluster"
