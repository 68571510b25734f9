#!/usr/bin/env bash
# The main job on a fresh machine: set up, start a local JPFS cluster on loopback (no
# configuration needed), generate a LeRobot-shaped dataset, import it, and read it back three
# ways: the CLI, the native client, and the PyTorch ShardDataset; then measure read rates through
# the native client and a FUSE mount beside the local disk's. Everything lives under ./run.
# About a minute on a 2-core machine once set up.
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

# The figures a newcomer comes for, measured now on this machine: whole-file reads of a
# LeRobot-shaped tree (parquet + mp4 stand-ins), each beside the local disk in the same run.
# Each benchmark makes its own tree and cluster in a temporary folder (~20 s together).
echo
echo "measuring read rates (jpfs bench read, jpfs bench mount) ..."
jpfs bench read --episodes 400 --large 0 --rounds 1 --no-cold --no-progress --json \
  > "$RUN/bench-read.txt" 2>&1 || echo "  (jpfs bench read failed: see $RUN/bench-read.txt)"
if [ -e /dev/fuse ] && command -v fusermount3 >/dev/null; then
  jpfs bench mount --episodes 200 --cameras 2 --readers 1 --orders shuffled --via local,fuse \
    --no-drop-caches --json > "$RUN/bench-mount.txt" 2>&1 \
    || echo "  (jpfs bench mount failed: see $RUN/bench-mount.txt)"
fi
python - "$RUN/bench-read.txt" "$RUN/bench-mount.txt" <<'PY'
import json, sys

def last_json(path):
    try:
        with open(path) as f:
            return json.loads(f.read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None

def row(what, gbps, files, base=None):
    ratio = f"{gbps / base:5.2f}x local" if base else ""
    print(f"  {what:<34} {gbps:6.2f} GB/s {files:>9,.0f} files/s  {ratio}")

print("\nRead rates measured in this run (warm page cache, whole files):")
r = last_json(sys.argv[1])
if r and "small local" in r.get("warm", {}):
    w = r["warm"]
    n = r["small"]["files"]
    print(f" native client, {n} files of {r['small']['bytes'] / n / 1e3:.0f} KB on average:")
    row("local disk", w["small local"]["GBps"], w["small local"]["files_per_s"])
    row("jpfs.connect().read_many", w["small read_many"]["GBps"],
        w["small read_many"]["files_per_s"], w["small local"]["GBps"])
else:
    print("  native client: not measured")
m = last_json(sys.argv[2])
runs = {x["via"]: x for x in (m or {}).get("runs", []) if x["epoch"] == 2}
if "local" in runs and "fuse" in runs:
    print(f" FUSE mount (jpfs mount --read-only), {runs['fuse']['files']} files, one reader:")
    row("local disk", runs["local"]["MBps"] / 1e3, runs["local"]["files_s"])
    row("/mnt/jpfs (second epoch)", runs["fuse"]["MBps"] / 1e3, runs["fuse"]["files_s"],
        runs["local"]["MBps"] / 1e3)
else:
    print("  FUSE mount: not measured (needs /dev/fuse and root, or user_allow_other)")
print(" On 2 shared cores client CPU bounds these; README's Performance section has the rest.")
PY

echo
echo "The cluster is still running: export JPFS_CLUSTER=$JPFS_CLUSTER"
echo "Stop it with: jpfs cluster down --dir $RUN/cluster"
