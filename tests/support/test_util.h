// Small helpers shared by the test suites: error-message assertions, temporary directories, and
// reading the JSON files a run writes.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_reader.h"
#include "core/jsonl.h"

#define EXPECT_CONTAINS(text, part) EXPECT_NE((text).find(part), std::string::npos) << "in: " << (text)

// Skips the test for `why` (a missing device, tokenizer or interpreter), or fails it where every
// test is required (CI: MEMTUNE_REQUIRE_ALL_TESTS=1): a check that silently does not run is not a
// pass. The one way a test skips (TestSwitches proves the variable arrives).
#define SKIP_OR_FAIL_WHERE_REQUIRED(why)                                    \
  do {                                                                      \
    const std::string skip_reason_ = (why);                                 \
    if (::memtune::testing_support::all_tests_required()) FAIL() << skip_reason_; \
    GTEST_SKIP() << skip_reason_;                                           \
  } while (false)

namespace memtune::testing_support {

// True where every test must run (CI: configured with MEMTUNE_REQUIRE_ALL_TESTS=ON).
inline bool all_tests_required() {
  const char* v = std::getenv("MEMTUNE_REQUIRE_ALL_TESTS");
  return v && std::string(v) == "1";
}

// The message of the memtune::Error that f throws; a test failure if it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected memtune::Error";
  return "";
}

// Creates a fresh, empty directory under the system temp directory, unique per process and call.
inline std::filesystem::path make_temp_dir(std::string_view tag) {
  static std::atomic<int> counter{0};
  auto dir = std::filesystem::temp_directory_path() /
             ("memtune_" + std::string(tag) + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Every record of a JSONL file, read with the engine's JSONL rules (a bad line is an Error).
inline std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path) {
  std::vector<nlohmann::json> out;
  JsonlReader reader(path);
  for (nlohmann::json record; reader.next(record);) out.push_back(std::move(record));
  return out;
}

inline nlohmann::json read_json(const std::filesystem::path& path) {
  return read_json_file(path);
}

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

}  // namespace memtune::testing_support
