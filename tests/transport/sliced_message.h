#pragma once
// A message's bytes as gRPC receives them: several slices of uneven sizes.

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace verifyd::testing {

// The bytes of `text` as a gRPC message of `pieces` slices of uneven sizes.
inline grpc::ByteBuffer Sliced(const std::string& text, int pieces, std::mt19937& rng) {
  std::vector<size_t> cuts;
  for (int i = 0; i + 1 < pieces; ++i) cuts.push_back(rng() % (text.size() + 1));
  cuts.push_back(0);
  cuts.push_back(text.size());
  std::sort(cuts.begin(), cuts.end());
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    slices.emplace_back(text.data() + cuts[i], cuts[i + 1] - cuts[i]);
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace verifyd::testing
