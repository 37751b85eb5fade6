#!/usr/bin/env bash
# Runs test executables under compute-sanitizer, on a machine with a GPU: memcheck (memory
# errors, and every CUDA API call that fails, even one kiln recovers from) and racecheck
# (shared-memory hazards). Exit status 1 if any tool reports anything.
#
#   scripts/sanitize.sh [DIR]      DIR: test executables (default: .gpu/tests, the staged tests)
#
# KILN_SANITIZE_TOOLS picks the tools (default "memcheck racecheck"); KILN_SANITIZE_ONLY picks
# the executables by name (default "gpu_", the GPU suite). The long loop test runs 2,000 steps
# instead of 20,000 (KILN_TEST_LOOP_STEPS), since every launch is slower under the tools.
set -uo pipefail
dir=${1:-.gpu/tests}
[ -d "$dir" ] || { echo "sanitize: no test executables in $dir (stage them first)" >&2; exit 2; }
command -v compute-sanitizer >/dev/null || { echo "sanitize: compute-sanitizer not found" >&2; exit 2; }
export KILN_REQUIRE_GPU=${KILN_REQUIRE_GPU:-1} KILN_TEST_LOOP_STEPS=${KILN_TEST_LOOP_STEPS:-2000}
log=${OUT:-/tmp}/sanitize.log
: > "$log"
summary=()
status=0
for tool in ${KILN_SANITIZE_TOOLS:-memcheck racecheck}; do
  for t in "$dir"/*; do
    name=$(basename "$t")
    [[ -x "$t" && "$name" == *"${KILN_SANITIZE_ONLY:-gpu_}"* ]] || continue
    echo "== $tool $name" | tee -a "$log"
    out=$(compute-sanitizer --tool "$tool" --report-api-errors all --error-exitcode 99 \
      --print-limit 20 "$t" 2>&1)
    rc=$?
    printf '%s\n' "$out" >> "$log"
    line=$(printf '%s\n' "$out" | grep -E '(ERROR|RACECHECK) SUMMARY' | tail -n 1)
    tests=$(printf '%s\n' "$out" | grep -E '^test result:' | tail -n 1)
    summary+=("$tool $name: ${line#========= } | ${tests:-no test result} | exit $rc")
    [ "$rc" -eq 0 ] || status=1
  done
done
echo
printf '%s\n' "${summary[@]}"
exit $status
