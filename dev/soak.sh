#!/usr/bin/env bash
# The long randomized soak (tests/tests/soak.rs): many concurrent runs of mixed graphs
# while the reducer, the executor and the gateway are killed at random fault points on a
# schedule drawn from a seed. The seed is printed first; pass it back to replay a failure.
#
#   dev/soak.sh                                  # 500 runs, 50 faults, a fresh seed
#   SORTIE_SOAK_RUNS=2000 SORTIE_SOAK_FAULTS=300 dev/soak.sh
#   SORTIE_SOAK_SEED=1795947140307420890 dev/soak.sh   # replay a seed
#
# The schedule also has a second reducer join the group and leave it (SIGTERM).
# Also: SORTIE_SOAK_RECON_TIMEOUT (the reconcilable step's timeout; drawn from the seed,
# 3s or 8s, otherwise: see soak.rs). Logs of every process: target/test-runs/t.soak.*/.
set -euo pipefail
cd "$(dirname "$0")/.."
export SORTIE_SOAK_RUNS=${SORTIE_SOAK_RUNS:-500}
cargo build -q -p sortie
exec cargo test -p sortie-tests --test soak -- --ignored --nocapture "$@"
