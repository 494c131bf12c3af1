// Checkpoint rotation leaves nothing half-deleted under a checkpoint's name: the directory is
// renamed away before its first file is deleted, so a kill at any moment leaves checkpoint-N whole
// or gone. Proved by the order of events: inotify queues the events of every watch on one
// descriptor in the order they happened, so the rename of checkpoint-N (seen from the output
// directory) must come before any deletion inside it.
#include <gtest/gtest.h>

#include <sys/inotify.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "support/test_util.h"
#include "train/training_checkpoint.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;

TEST(CheckpointRotation, ACheckpointIsRenamedAwayBeforeAnyOfItsFilesIsDeleted) {
  const fs::path out = testing_support::make_temp_dir("rotation");
  for (int step : {1, 2, 3}) {
    fs::create_directories(out / ("checkpoint-" + std::to_string(step)));
    for (const char* file : {"model.safetensors", "optimizer.safetensors", "trainer_state.json"})
      std::ofstream(out / ("checkpoint-" + std::to_string(step)) / file) << "x";
  }
  const int fd = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  const int out_watch = ::inotify_add_watch(fd, out.c_str(), IN_MOVED_FROM | IN_DELETE);
  const int oldest_watch = ::inotify_add_watch(fd, (out / "checkpoint-1").c_str(), IN_DELETE);
  ASSERT_GE(out_watch, 0);
  ASSERT_GE(oldest_watch, 0);

  rotate_checkpoints(out, 2, "");

  std::vector<std::string> events;  // "renamed NAME" or "deleted FILE" in the order they happened
  alignas(inotify_event) char buffer[8192];
  for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) > 0;)
    for (ssize_t at = 0; at < n;) {
      const auto* e = reinterpret_cast<const inotify_event*>(buffer + at);
      if (e->len > 0 && e->wd == out_watch && (e->mask & IN_MOVED_FROM)) events.push_back(std::string("renamed ") + e->name);
      if (e->len > 0 && e->wd == oldest_watch && (e->mask & IN_DELETE)) events.push_back(std::string("deleted ") + e->name);
      at += static_cast<ssize_t>(sizeof(inotify_event) + e->len);
    }
  ::close(fd);
  std::string order;
  for (const std::string& e : events) order += e + "; ";
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.front(), "renamed checkpoint-1") << order;
  EXPECT_EQ(events.size(), 4u) << "the rename, then the three files: " << order;
  EXPECT_FALSE(fs::exists(out / "checkpoint-1"));
  EXPECT_TRUE(fs::exists(out / "checkpoint-2") && fs::exists(out / "checkpoint-3"));
  for (const auto& e : fs::directory_iterator(out))
    EXPECT_FALSE(e.path().filename().string().starts_with("tmp-")) << e.path() << " left behind";
  fs::remove_all(out);
}

}  // namespace
}  // namespace memtune
