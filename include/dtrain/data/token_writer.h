#pragma once
// Writing token files in Megatron's indexed format (prefix.bin + prefix.idx), without libtorch:
// what dtrain-tokenize writes and data::TokenDataset (token_dataset.h) reads. The .idx: the magic
// "MMIDIDX\0\0", version 1 (uint64), the token type code (uint8: 8 uint16, 4 int32), the number of
// sequences and of document starts (uint64 each), the sequences' lengths (int32), their byte
// offsets in the .bin (int64) and the document starts (int64: 0, 1, ..., n: one sequence each).
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::data {

inline constexpr char kMegatronIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};

// One document per entry of `documents`, as uint16 when every token fits, else int32. Throws
// std::invalid_argument for a token outside [0, 2^31), std::runtime_error when writing fails.
void write_indexed_tokens(const std::string& prefix, const std::vector<std::vector<int64_t>>& documents);

}  // namespace dtrain::data
