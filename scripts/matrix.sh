#!/usr/bin/env bash
# Version matrix: for each TensorFlow minor, a fresh venv with that TensorFlow
# and its tf_keras, the project installed from this checkout (pip builds the
# wheel; Keras 3 is what pip resolves from pyproject.toml), then
#   * the fast tier:   python -m pytest -q -n 2 -m "not cluster"
#   * a cluster smoke, run outside the repo with the installed tf-asyncps:
#       the digits main job (configs/digits_async.flags), the MovieLens job
#       (configs/movielens_async.flags), the main job under Keras 3 model.fit
#       (--keras=3), and each other policy family on 2 workers (--epochs=1).
# One row per minor goes to $MATRIX_DIR/matrix.md (the README "Compatibility"
# table), one JSON object per minor to $MATRIX_DIR/matrix.jsonl.
#
# Usage: scripts/matrix.sh [MINOR ...]          (default: 2.18 through 2.21, the
#   supported minors; 2.16/2.17 need TF_ASYNCPS_SKIP_VERSION_CHECK=1, README
#   "Compatibility" says why they are refused)
#   MATRIX_DIR=/tmp/tf_asyncps-matrix   venvs, job outputs and logs
#   MATRIX_KEEP_VENVS=1                 keep each venv (~2 GB) after its row
#   MATRIX_KERAS="keras==3.x.y"         pin Keras 3 (default: pip's choice)
#   MATRIX_SKIP_FAST=1                  smoke only
# Minors run one after another (2 cores); each takes ~5 min here with the
# cores free (2.17: install 47 s, fast tier 41 s, jobs 3.2 min).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DIR=${MATRIX_DIR:-/tmp/tf_asyncps-matrix}
PYTHON=${MATRIX_PYTHON:-python3}
mkdir -p "$DIR"
[ $# -gt 0 ] && MINORS=("$@") || MINORS=(2.18 2.19 2.20 2.21)
POLICIES=(drop_stale staleness_aware ssp dc_asgd sync_replicas local_sgd)  # async: the main job

metric() {  # metric FILE KEY -> the value rounded to 4 places, or "fail"
  "$venv/bin/python" - "$1" "$2" <<'EOF' 2>/dev/null || echo fail
import json, sys
print(f"{json.load(open(sys.argv[1]))[sys.argv[2]]:.4f}")
EOF
}

launch() {  # launch NAME ARGS... -> runs a job in $out/NAME; echoes its seconds
  local name=$1; shift
  local t0=$SECONDS
  # --output_dir last: a flagfile's own --output_dir would win otherwise
  (cd "$out" && timeout 900 "$venv/bin/tf-asyncps" launch "$@" --output_dir="$out/$name" \
     > "$out/$name.log" 2>&1)
  echo $? $((SECONDS - t0))
}

for minor in "${MINORS[@]}"; do
  venv=$DIR/venv-$minor out=$DIR/run-$minor
  rm -rf "$venv" "$out"; mkdir -p "$out"
  echo "== TensorFlow $minor: venv $venv" >&2
  t0=$SECONDS
  "$PYTHON" -m venv "$venv" && "$venv/bin/python" -m pip install -q --upgrade pip \
    > "$out/install.log" 2>&1
  "$venv/bin/python" -m pip install -q "tensorflow~=$minor.0" "tf_keras~=$minor.0" \
    ${MATRIX_KERAS:+"$MATRIX_KERAS"} "$REPO[test,examples]" >> "$out/install.log" 2>&1
  install_rc=$? install_s=$((SECONDS - t0))
  versions=$(cd "$out" && "$venv/bin/python" -c "from importlib import metadata as m
print(' '.join(m.version(n) for n in ('tensorflow', 'tf_keras', 'keras')))" 2>/dev/null \
    || echo "? ? ?")
  read -r tf_v tfk_v keras_v <<< "$versions"
  echo "   installed in ${install_s}s (rc $install_rc): TF $tf_v tf_keras $tfk_v Keras $keras_v" >&2

  fast="not run" fast_s=0
  if [ "$install_rc" = 0 ] && [ "${MATRIX_SKIP_FAST:-0}" != 1 ]; then
    t0=$SECONDS
    timeout 1800 "$venv/bin/python" -m pytest -q -n 2 -m "not cluster" -p no:cacheprovider \
      > "$out/fast.log" 2>&1
    fast_s=$((SECONDS - t0))
    fast=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error).* in " "$out/fast.log" \
      | tail -1 | sed -E 's/=//g; s/ in [0-9.]+s.*//; s/^ +| +$//g')
    echo "   fast tier (${fast_s}s): $fast" >&2
  fi

  digits=fail movielens=fail keras3=fail policies_ok=0 failed_policies="" policy_acc=""
  if [ "$install_rc" = 0 ]; then
    read -r rc s <<< "$(launch digits --flagfile="$REPO/configs/digits_async.flags")"
    [ "$rc" = 0 ] && digits=$(metric "$out/digits/metrics.json" test_accuracy)
    echo "   digits main job: rc $rc, ${s}s, test accuracy $digits" >&2
    read -r rc s <<< "$(launch movielens --flagfile="$REPO/configs/movielens_async.flags")"
    [ "$rc" = 0 ] && movielens=$(metric "$out/movielens/metrics.json" test_auc)
    echo "   MovieLens job: rc $rc, ${s}s, test AUC $movielens" >&2
    read -r rc s <<< "$(launch keras3 --flagfile="$REPO/configs/digits_async.flags" --keras=3)"
    [ "$rc" = 0 ] && keras3=$(metric "$out/keras3/metrics.json" test_accuracy)
    echo "   Keras 3 fit: rc $rc, ${s}s, test accuracy $keras3" >&2
    for p in "${POLICIES[@]}"; do
      read -r rc s <<< "$(launch "policy-$p" --flagfile="$REPO/configs/digits_async.flags" \
        --policy="$p" --epochs=1)"
      acc=fail; [ "$rc" = 0 ] && acc=$(metric "$out/policy-$p/metrics.json" test_accuracy)
      echo "   policy $p: rc $rc, ${s}s, test accuracy $acc" >&2
      policy_acc="${policy_acc:+$policy_acc, }$p $acc"
      if [ "$acc" != fail ]; then policies_ok=$((policies_ok + 1)); else
        failed_policies="$failed_policies $p"; fi
    done
  fi
  policies="$policies_ok/${#POLICIES[@]}${failed_policies:+ (failed:$failed_policies)}"
  row="| $tf_v | $tfk_v | $keras_v | $install_s | $fast | $digits | $movielens | $keras3 | $policies |"
  echo "$row" | tee -a "$DIR/matrix.md"
  printf '{"minor": "%s", "tensorflow": "%s", "tf_keras": "%s", "keras": "%s", "install_s": %s, "fast": "%s", "fast_s": %s, "digits_accuracy": "%s", "movielens_auc": "%s", "keras3_accuracy": "%s", "policies": "%s", "policy_accuracy": "%s"}\n' \
    "$minor" "$tf_v" "$tfk_v" "$keras_v" "$install_s" "$fast" "$fast_s" "$digits" "$movielens" \
    "$keras3" "$policies" "$policy_acc" >> "$DIR/matrix.jsonl"
  [ "${MATRIX_KEEP_VENVS:-0}" = 1 ] || rm -rf "$venv"
done
echo "| TensorFlow | tf_keras | Keras | install s | fast tier | digits accuracy | MovieLens AUC | Keras 3 accuracy | policies (2 workers) |" >&2
cat "$DIR/matrix.md" >&2
