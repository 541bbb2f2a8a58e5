#!/usr/bin/env bash
# The shipped suites at full size as resumable background jobs (issue 28), seed-major so that
# every method's first seed finishes before any second seed starts:
#   nice -n 19 bash experiments/suites/run_full.sh pfedes OUT   # pfedes_vs_baselines_fmnist: 60k, 2 settings, 50 rounds, 3 seeds
#   nice -n 19 bash experiments/suites/run_full.sh fedfd OUT    # fedfd_fmnist_full: 60k, ResNet-18 server, 50 rounds, 3 seeds
# Rerunning the same command resumes: finished runs are skipped, the unfinished one continues
# from its last checkpoint (every round). The serial executor gives the numbers of the Ray one
# (the determinism contract) without a Ray cluster to outlive the job; no MLflow tracking.
# Progress: python experiments/make_results.py --progress OUT
set -euo pipefail
which="${1:?usage: run_full.sh pfedes|fedfd OUT}"
out="${2:?usage: run_full.sh pfedes|fedfd OUT}"
here="$(cd "$(dirname "$0")" && pwd)"
common=(engine.executor=serial engine.checkpoint_every=1 tracking.backend=none)
case "$which" in
  pfedes) suite="$here/pfedes_vs_baselines_fmnist.yaml"; settings=(dir0.1 path2) ;;
  fedfd) suite="$here/fedfd_fmnist_full.yaml"; settings=(full60k) ;;
  *) echo "run_full.sh: unknown suite $which (pfedes or fedfd)" >&2; exit 2 ;;
esac
for seed in 0 1 2; do
  for setting in "${settings[@]}"; do
    python3 -m rayfl.cli compare "$suite" "seeds=[$seed]" "settings=[$setting]" "${common[@]}" --out "$out"
  done
done
# every run finished: one table over all of them
python3 -m rayfl.cli compare "$suite" "${common[@]}" --out "$out"
