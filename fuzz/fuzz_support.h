// What every libFuzzer harness shares. A harness feeds the bytes to one reader of user input and
// treats a memtune::Error as the expected answer to bad input; anything else (another exception,
// an InternalError from MT_ASSERT, a sanitizer report, an abort) escapes and is a finding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include <unistd.h>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace memtune::fuzz {

inline std::string_view text_of(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// Runs f; a memtune::Error is a correct refusal, anything else propagates and crashes.
template <class F>
void refusals_are_errors(F&& f) {
  try {
    f();
  } catch (const Error&) {
  }
}

// A directory of this process for harnesses that must hand a file path to the reader; removed
// when the process exits normally.
inline const std::filesystem::path& scratch_dir() {
  struct Scratch {
    std::filesystem::path path;
    Scratch() : path(std::filesystem::temp_directory_path() / ("memtune_fuzz_" + std::to_string(::getpid()))) {
      std::filesystem::create_directories(path);
    }
    ~Scratch() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  };
  static const Scratch scratch;
  return scratch.path;
}

inline void write_bytes(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::abort();
  }
}

// The real Qwen2.5 tokenizer, from the directory in MEMTUNE_TOKENIZER_DIR (scripts/fuzz.sh sets
// it with scripts/prepare-tokenizer.sh); loaded once per process. Harnesses call it from
// LLVMFuzzerInitialize, so its second of loading is not charged to the first input (which
// libFuzzer would report as a slow unit).
inline const Tokenizer& qwen_tokenizer() {
  static const Tokenizer tokenizer = [] {
    const char* dir = std::getenv("MEMTUNE_TOKENIZER_DIR");
    if (dir == nullptr || *dir == '\0') {
      std::fprintf(stderr, "MEMTUNE_TOKENIZER_DIR must name the Qwen2.5 tokenizer directory\n");
      std::abort();
    }
    return Tokenizer::load(dir);
  }();
  return tokenizer;
}

}  // namespace memtune::fuzz

// The LLVMFuzzerInitialize of a harness that uses the real tokenizer: it is loaded before the
// first input.
#define MEMTUNE_FUZZ_LOAD_QWEN_TOKENIZER_FIRST()          \
  extern "C" int LLVMFuzzerInitialize(int*, char***) { \
    memtune::fuzz::qwen_tokenizer();                    \
    return 0;                                           \
  }
