# ctest (label install): installs libdecodepack's runtime component into a temporary prefix, then builds
# and runs a tiny consumer with find_package(decodepack) and, separately, with pkg-config; checks that
# the library needs no GPU and no archive library, that pkg-config prints normalised paths, and that the
# Python binding installs with pip and loads the installed library.
# Inputs: BUILD_DIR, SOURCE_DIR (this directory), WORK_DIR, BUNDLE (optional, a .dpk to open), PYTHON
# (optional, an interpreter with pip and setuptools), PYTHON_SOURCE (runtime/python).
cmake_minimum_required(VERSION 3.25)
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(LAST_OUTPUT "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} --component runtime)

# What was installed: the library (no GPU library among its dependencies), headers, package files.
file(GLOB_RECURSE libs ${prefix}/lib*/libdecodepack.so*)
file(GLOB_RECURSE pcs ${prefix}/*/decodepack.pc)
file(GLOB_RECURSE configs ${prefix}/*/decodepackConfig.cmake)
if(NOT libs OR NOT pcs OR NOT configs OR NOT EXISTS ${prefix}/include/decodepack/decodepack.h
   OR NOT EXISTS ${prefix}/include/decodepack/decodepack.hpp)
  message(FATAL_ERROR "incomplete install in ${prefix}: libs '${libs}', pc '${pcs}', config '${configs}'")
endif()
list(GET libs 0 lib)
run(readelf -d ${lib})
if(LAST_OUTPUT MATCHES "libcuda|libamdhip64|libcudart")
  message(FATAL_ERROR "${lib} links a GPU library:\n${LAST_OUTPUT}")
endif()
# A serving host needs no archive library: the bundle reader parses ustar itself (issue 16). ldd lists
# what comes in indirectly too (libarchive would bring libxml2 and ICU).
run(ldd ${lib})
if(LAST_OUTPUT MATCHES "libarchive|libxml2|libicu|liblzma|libzstd|libbz2")
  message(FATAL_ERROR "${lib} depends on an archive library or what it brings:\n${LAST_OUTPUT}")
endif()
get_filename_component(libdir ${lib} DIRECTORY)

# 1. find_package
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/consumer -B ${WORK_DIR}/cmake-build -DCMAKE_PREFIX_PATH=${prefix}
    -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/cmake-build)
run(${WORK_DIR}/cmake-build/consumer_c ${BUNDLE})
message(STATUS "find_package consumer: ${LAST_OUTPUT}")
run(${WORK_DIR}/cmake-build/consumer_cpp)

# 2. pkg-config (a plain compiler line, as a Makefile would write it)
get_filename_component(pcdir ${pcs} DIRECTORY)
set(ENV{PKG_CONFIG_PATH} ${pcdir})
run(pkg-config --cflags --libs decodepack)
string(STRIP "${LAST_OUTPUT}" flags)
# Normalised, absolute paths into the prefix installed to (no ../.. or // from the .pc's location).
if(NOT flags STREQUAL "-I${prefix}/include -L${libdir} -ldecodepack")
  message(FATAL_ERROR "pkg-config --cflags --libs decodepack: '${flags}', expected "
                      "'-I${prefix}/include -L${libdir} -ldecodepack'")
endif()
separate_arguments(flags UNIX_COMMAND "${flags}")
run(pkg-config --modversion decodepack)
message(STATUS "pkg-config decodepack ${LAST_OUTPUT}")
run(cc -std=c99 -Wall -Wextra -pedantic -Werror ${SOURCE_DIR}/consumer/consumer.c ${flags} -o ${WORK_DIR}/consumer_pc)
set(ENV{LD_LIBRARY_PATH} ${libdir})
run(${WORK_DIR}/consumer_pc ${BUNDLE})
message(STATUS "pkg-config consumer: ${LAST_OUTPUT}")
unset(ENV{LD_LIBRARY_PATH})

# 3. The Python binding, installed with pip from the installed tree's copy (offline: the interpreter's
# own setuptools), then loading the installed library through DECODEPACK_LIBRARY and from beside the
# package. No GPU driver here: device_count() is 0.
# pip builds a wheel with setuptools' bdist_wheel, which needs the `wheel` package (Debian: python3-pip
# brings python3-wheel); the configured interpreter may lack it, the system's then stands in.
set(pip_python "")
foreach(py ${PYTHON} /usr/bin/python3)
  # (pip and setuptools imported in one process trip setuptools' distutils check: two processes)
  execute_process(COMMAND ${py} -c "import setuptools, wheel" RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
  execute_process(COMMAND ${py} -m pip --version RESULT_VARIABLE rc_pip OUTPUT_QUIET ERROR_QUIET)
  if(rc EQUAL 0 AND rc_pip EQUAL 0)
    set(pip_python ${py})
    break()
  endif()
endforeach()
if(NOT pip_python)
  message(FATAL_ERROR "no Python with pip, setuptools and wheel (tried ${PYTHON} /usr/bin/python3): install the "
                      "Debian packages python3-pip and python3-setuptools (./dev.sh does)")
endif()
set(PYTHON ${pip_python})
if(PYTHON)
  set(site ${WORK_DIR}/site)
  run(${PYTHON} -m pip install --quiet --no-index --no-build-isolation --no-deps --target ${site}
      ${prefix}/share/decodepack/python)
  # (no ';' in the script: run() passes its arguments on as a CMake list)
  set(check "import decodepack as dp
print(dp.__version__, dp.version(), dp.device_count(), dp._lib()._name)
assert dp.__version__ == dp.version(), (dp.__version__, dp.version())
assert isinstance(dp.device_count(), int) and dp.device_count() >= 0")
  set(ENV{PYTHONPATH} ${site})
  set(ENV{DECODEPACK_LIBRARY} ${lib})
  run(${PYTHON} -c "${check}")
  message(STATUS "pip-installed binding, DECODEPACK_LIBRARY: ${LAST_OUTPUT}")
  unset(ENV{DECODEPACK_LIBRARY})
  file(REAL_PATH ${lib} real_lib)  # ${lib} may be the libdecodepack.so link
  file(COPY ${real_lib} DESTINATION ${site}/decodepack)
  run(${PYTHON} -c "${check}")
  if(NOT LAST_OUTPUT MATCHES "${site}/decodepack/libdecodepack")
    message(FATAL_ERROR "the binding did not load the library beside it: ${LAST_OUTPUT}")
  endif()
  message(STATUS "pip-installed binding, library beside the package: ${LAST_OUTPUT}")
  unset(ENV{PYTHONPATH})
endif()
file(REMOVE_RECURSE ${WORK_DIR})
