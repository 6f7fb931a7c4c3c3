/* Consumer of the installed C ABI: version, status objects, and a host-only look at a bundle when one
   is given. Exit 0 on success. */
#include <decodepack/decodepack.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char** argv) {
  dp_bundle* bundle = NULL;
  dp_status* st;
  dp_bundle_info info;
  if (dp_version() != DP_VERSION_NUMBER) {
    fprintf(stderr, "header %d, library %u\n", DP_VERSION_NUMBER, dp_version());
    return 1;
  }
  st = dp_bundle_open("/nonexistent.dpk", NULL, &bundle);
  if (dp_status_code(st) != DP_ERR_IO || strstr(dp_status_message(st), "nonexistent.dpk") == NULL) {
    fprintf(stderr, "unexpected: %s\n", dp_status_message(st));
    return 1;
  }
  dp_status_free(st);
  if (argc > 1) {
    st = dp_bundle_open(argv[1], NULL, &bundle);
    if (st) {
      fprintf(stderr, "%s: %s\n", dp_code_name(dp_status_code(st)), dp_status_message(st));
      dp_status_free(st);
      return 1;
    }
    info.size = sizeof(info);
    st = dp_bundle_get_info(bundle, &info);
    if (st) return 1;
    printf("bundle %s: %d layers, %d widths\n", info.digest, info.num_layers, info.num_widths);
    dp_bundle_close(bundle);
  }
  printf("libdecodepack %s\n", dp_version_string());
  return 0;
}
