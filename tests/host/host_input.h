// Reading a runner's input file (little-endian, as the tests write it): plain values, and
// buffers as their byte count (u64) then their bytes.
#pragma once

#include <cstdint>
#include <fstream>
#include <vector>

template <typename V> static V take(std::ifstream& in) {
  V v;
  in.read(reinterpret_cast<char*>(&v), sizeof v);
  return v;
}

static std::vector<unsigned char> take_bytes(std::ifstream& in) {
  std::vector<unsigned char> v(take<uint64_t>(in));
  in.read(reinterpret_cast<char*>(v.data()), v.size());
  return v;
}
