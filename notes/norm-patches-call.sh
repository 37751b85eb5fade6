#!/bin/bash
# The device call that measures the prepared norm patches against HEAD, then checks the two
# most likely to land (p and k together) for correctness. Not yet run: no device machine was
# lent in the sessions that wrote it. On the host, p + k pass tests/host_norm_split.rs and
# host_norm.rs's chosen kernels, and g the latter (notes/performance.md, 2026-12-08).
# The staged binaries below were built before the host branches of cluster.cuh, bulk.cuh and
# tma.cuh (1e36301), which leave the GPU's code byte-identical: rebuilding is not needed.
#
# Build on the development machine, one binary set a variant, from a clean tree each time:
#   l  = HEAD;  c = notes/norm-ring-copies-ca.patch;  g = notes/norm-forward-three-stages.patch
#   p  = notes/norm-long-ring-pairs.patch;  k = notes/norm-paired-packed-rows.patch;  pk = p + k
#   git apply PATCH...; cargo build --release --bench norm --test gpu_norm --example norm_profile
#   copy target/release/deps/{norm,gpu_norm}-<hash> (not the .d files) and
#   target/release/examples/norm_profile to .gpu/VARIANT/{norm,gpu_norm,norm_profile},
#   strip --strip-debug (about 9 MB a variant; only pk needs gpu_norm and norm_profile).
# Run on the device with carry [".gpu"]: LIMIT=seconds bash notes/norm-patches-call.sh.
# Each step runs only while enough of LIMIT is left, most valuable first; rounds alternate the
# variants (l pk p k c g g c k p pk l) so that drift averages out. `--only f16` keeps the
# 16-bit rows (it matches f16 and bf16), the only ones the patches change.
LIMIT=${LIMIT:-420}
export KILN_REQUIRE_GPU=1 KILN_CACHE_DIR=/tmp/kc1 KILN_STAND_INS=0 MLX_USE_CUDA_GRAPHS=0
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
L=$OUT/log.txt
left() { echo $((LIMIT - SECONDS)); }
for v in l pk p k c g g c k p pk l; do
  [ "$(left)" -gt $((LIMIT * 55 / 100)) ] || break
  echo "== ab $v" >> "$L"
  timeout 40 ".gpu/$v/norm" --bench --long --ds 3000,5120,16385,18432,20480 \
    --ops layer_norm,rms_norm --only f16 --no-anchor >> "$L" 2>&1
  echo "round $v $SECONDS"
done
for v in l c; do
  [ "$(left)" -gt $((LIMIT * 50 / 100)) ] || break
  echo "== vj $v" >> "$L"
  timeout 30 ".gpu/$v/norm" --bench --long --ds 3000,5120 \
    --ops layer_norm_vjp,rms_norm_vjp --only f16 --no-anchor >> "$L" 2>&1
done
echo "ab done $SECONDS"
T=$(($(left) - 45)); [ $T -gt 170 ] && T=170
( time timeout $T .gpu/pk/gpu_norm --test-threads=16 ) > "$OUT/gpu_norm_pk.txt" 2>&1
tail -4 "$OUT/gpu_norm_pk.txt"; echo "gpu_norm done $SECONDS"
# The new code paths: paired 16,385/18,001 rows (k) and the pairs-of-warps rings (p).
S="bf16 layer_norm 600 16385 f16 layer_norm 400 18001 bf16 layer_norm 300 18432 f16 rms_norm 300 20480"
for t in racecheck synccheck memcheck; do
  T=$(($(left) - 5)); [ $T -gt 50 ] && T=50; [ $T -gt 10 ] || break
  timeout $T compute-sanitizer --tool $t --print-limit 20 .gpu/pk/norm_profile $S \
    > "$OUT/san_$t.txt" 2>&1
  echo "$t rc=$? $(tail -1 "$OUT/san_$t.txt") $SECONDS"
done
