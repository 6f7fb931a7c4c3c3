// Helpers shared by the unit tests.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <random>
#include <string>

#include "common/error.h"

namespace dp::test {

// A fresh directory under the system temp dir, removed with its contents at scope exit.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() / ("dp-test-" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& s) const { return path_ / s; }

 private:
  std::filesystem::path path_;
};

inline std::filesystem::path data_dir() { return DP_TEST_DATA_DIR; }

// Runs f, expects a dp::Error with the given code whose message contains every fragment.
inline void expect_error(const std::function<void()>& f, Errc code, std::initializer_list<std::string> fragments) {
  try {
    f();
    ADD_FAILURE() << "expected a dp::Error, none was thrown";
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code)) << e.what();
    for (const std::string& frag : fragments)
      EXPECT_NE(std::string(e.what()).find(frag), std::string::npos)
          << "message lacks \"" << frag << "\": " << e.what();
  }
}

}  // namespace dp::test
