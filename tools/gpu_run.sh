#!/usr/bin/env bash
# The Makefile's GPU targets on the lent device machine, which stops a command after 10 minutes, has no network and
# returns only what is under $OUT. Run from the repository root, as the device command:
#
#   MOK_COMMIT=<your HEAD> bash tools/gpu_run.sh gpu-test sanitize      (any of gpu-test bench sanitize profile)
#
# - with a carried, git-ignored .whl/ (the peers' wheels: `pip download --no-deps liger-kernel==0.8.5 -d .whl` here,
#   SonicMoE's as docs/results.md says), sources tools/gpu_env.sh: installed into /tmp/site, on PYTHONPATH;
# - MOK_COMMIT is required: the device's copy of .git can be stale, so benchmark rows record this instead;
# - runs the targets one after another, all within GPU_BUDGET_S seconds (default 560), each under `timeout`, its
#   log in $OUT/TARGET.log (its last lines printed), reports in $OUT (GPU_OUT), and copies the files under data/
#   that the run wrote (bench's rows) to $OUT/data/. Exits non-zero when any target failed, ran out of time or
#   was skipped.
set -u
: "${MOK_COMMIT:?set MOK_COMMIT to the commit whose tree you carried}"
export MOK_COMMIT
out=$(realpath -m "${OUT:-build/gpu}") budget=${GPU_BUDGET_S:-560} start=$(date +%s) rc=0
mkdir -p "$out" && stamp=$(mktemp) || exit
if compgen -G ".whl/*.whl" >/dev/null; then source tools/gpu_env.sh >/dev/null || exit; fi  # the peers' wheels
for target in "$@"; do
  left=$((budget - $(date +%s) + start))
  if ((left < 30)); then echo "$target: skipped, ${left} s left"; rc=1; continue; fi
  find .cache -name lock -delete 2>/dev/null  # a build killed by a timeout leaves torch's lock: later builds would wait
  timeout "$left" make --no-print-directory GPU_OUT="$out" "$target" >"$out/$target.log" 2>&1
  code=$?
  ((code == 0)) || rc=$code
  echo "== $target: rc=$code$( ((code == 124)) && echo ", timed out") at $(($(date +%s) - start)) s"
  tail -n 15 "$out/$target.log"
done
find data -type f -newer "$stamp" -exec cp --parents {} "$out/" \; 2>/dev/null
exit $rc
