// The deploy tests' way to read a refusal: the message of the error that parsing a deploy file throws.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "common/error.h"
#include "common/json.h"
#include "deploy/deploy.h"

namespace dp::test {

// The message of the dp::Error(input) that parsing `j` as deploy.json throws; fails the test if none is.
inline std::string deploy_error_of(const Json& j) {
  try {
    deploy::parse_deploy(j, "deploy.json");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::input) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error for " << j.dump();
  return {};
}

}  // namespace dp::test

// Parsing `json` is refused with a message containing `fragment`.
#define EXPECT_MSG(json, fragment)                                        \
  do {                                                                    \
    const std::string m_ = dp::test::deploy_error_of(json);               \
    EXPECT_NE(m_.find(fragment), std::string::npos) << "message: " << m_; \
  } while (0)
