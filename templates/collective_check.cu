// Checks that every rank called the same collective: each rank put a 32-bit hash of what it
// called (op, dtype, element count, root) beside the collective's data, and `gathered` holds the
// hashes that reached this rank. On the first mismatch this records which rank differed (plus
// one) and this rank's own hash in `status`, host memory the host reads once the collective's
// commit has finished. A zero hash was never written (the collective did not deliver it); the
// slots are zeroed again for the next collective.
extern "C" __global__ void {{kernel}}(unsigned int* gathered, int count, int first_rank,
                                     unsigned int own, unsigned long long* status) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (int r = 0; r < count; ++r) {
    unsigned int theirs = gathered[r];
    gathered[r] = 0u;
    if (theirs != 0u && theirs != own) {
      if (atomicCAS(status, 0ull, (unsigned long long)(first_rank + r) + 1ull) == 0ull) {
        status[1] = own;
        __threadfence_system();
      }
    }
  }
}
