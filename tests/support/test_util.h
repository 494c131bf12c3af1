// Small helpers shared by the test suites: error-message assertions and temporary directories.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <string_view>

#include "core/error.h"

#define EXPECT_CONTAINS(text, part) EXPECT_NE((text).find(part), std::string::npos) << "in: " << (text)

namespace memtune::testing_support {

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

}  // namespace memtune::testing_support
