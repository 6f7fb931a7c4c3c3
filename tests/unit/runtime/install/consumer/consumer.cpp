// Consumer of the installed C++ wrapper.
#include <decodepack/decodepack.hpp>

#include <iostream>

int main() {
  try {
    decodepack::Bundle::open("/nonexistent.dpk");
  } catch (const decodepack::Error& e) {
    if (e.code() != DP_ERR_IO) return 1;
    std::cout << "libdecodepack " << dp_version_string() << ": " << e.code_name() << "\n";
    return 0;
  }
  return 1;
}
