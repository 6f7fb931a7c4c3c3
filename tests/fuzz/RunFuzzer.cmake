# ctest driver for one libFuzzer target (see CMakeLists.txt, dp_add_fuzzer). Runs the fuzzer for TIME
# seconds and fails when libFuzzer reports anything (crash, sanitizer report, leak, timeout, OOM).
#
# Inputs: FUZZER (binary), NAME, WORK (scratch dir in the build tree), SEEDS (list of read-only corpus
# dirs), DICT (dictionary or empty), TIME (seconds), RSS_MB, TIMEOUT (seconds per input; default 60).
#
# libFuzzer writes the inputs it discovers into its first corpus directory, so that one is WORK/corpus
# (in the build tree, kept between runs to make later runs start deeper); the committed seed dirs come
# after it and are only read.
foreach(v FUZZER NAME WORK TIME RSS_MB)
  if(NOT DEFINED ${v} OR "${${v}}" STREQUAL "")
    message(FATAL_ERROR "RunFuzzer.cmake: -D${v}=... is required")
  endif()
endforeach()
if(NOT EXISTS "${FUZZER}")
  message(FATAL_ERROR "${FUZZER} does not exist; build target dp_fuzz_${NAME} first")
endif()

set(corpus "${WORK}/corpus")
set(artifacts "${WORK}/artifacts/")
file(REMOVE_RECURSE "${artifacts}")
file(MAKE_DIRECTORY "${corpus}" "${artifacts}")

if(NOT DEFINED TIMEOUT OR "${TIMEOUT}" STREQUAL "")
  set(TIMEOUT 60)
endif()
set(args -max_total_time=${TIME} -rss_limit_mb=${RSS_MB} -timeout=${TIMEOUT} -print_final_stats=1
         -artifact_prefix=${artifacts})
if(DICT)
  list(APPEND args -dict=${DICT})
endif()
set(dirs "${corpus}")
foreach(d IN LISTS SEEDS)
  if(IS_DIRECTORY "${d}")
    list(APPEND dirs "${d}")
  endif()
endforeach()

# Stack traces for UBSan; ASan already prints them. Leak detection stays on (libFuzzer's default).
set(ENV{UBSAN_OPTIONS} "print_stacktrace=1:halt_on_error=1")
message(STATUS "${FUZZER} ${args} ${dirs}")
execute_process(COMMAND "${FUZZER}" ${args} ${dirs} RESULT_VARIABLE rc)

file(GLOB found "${artifacts}*")
if(NOT rc EQUAL 0 OR found)
  list(JOIN found "\n  " found_list)
  message(FATAL_ERROR "fuzz.${NAME}: the fuzzer failed (exit ${rc}). Inputs that reproduce it:\n  ${found_list}\n"
                      "Replay one with: ${FUZZER} <file>; after the fix, commit it to tests/fuzz/corpus/${NAME}/.")
endif()
message(STATUS "fuzz.${NAME}: no failure in ${TIME} s")
