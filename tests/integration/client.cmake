# Client integration tests: libtensorshare against a real tensord (found through TS_TENSORD).
# They link the static library so that the tests and the library share one allocator hook.
ts_add_test(test_client SOURCES test_client.c
  LIBS tensorshare_static LABELS integration client TIMEOUT 120)
ts_add_test(test_client_failure SOURCES test_client_failure.c
  LIBS tensorshare_static LABELS integration client TIMEOUT 120)
ts_add_test(test_client_threads SOURCES test_client_threads.c
  LIBS tensorshare_static LABELS integration client TIMEOUT 180)

# The shared library exports the public API only.
add_test(NAME test_client_exports
  COMMAND sh ${PROJECT_SOURCE_DIR}/tests/install/check_exports.sh $<TARGET_FILE:tensorshare>)
set_tests_properties(test_client_exports PROPERTIES LABELS "client" TIMEOUT 60)

# The installed headers keep the conventions a compiler cannot check: a version on every
# declaration, version.h at the project version, no removed names (docs/DESIGN.md).
add_test(NAME test_client_headers
  COMMAND sh ${PROJECT_SOURCE_DIR}/tests/install/check_headers.sh ${PROJECT_SOURCE_DIR}/include
    ${PROJECT_VERSION})
set_tests_properties(test_client_headers PROPERTIES LABELS "client" TIMEOUT 60)

# Install into a temporary prefix and build the quickstart outside the tree against it.
if(TARGET tensord)
  set(_ts_san_flags "")
  if(TS_SANITIZE)
    set(_ts_san_flags "-fsanitize=${TS_SANITIZE}")
  endif()
  add_test(NAME test_client_install
    COMMAND sh ${PROJECT_SOURCE_DIR}/tests/install/install_test.sh ${PROJECT_BINARY_DIR}
      ${PROJECT_SOURCE_DIR} $<TARGET_FILE:tensord> "${_ts_san_flags}")
  math(EXPR _ts_install_timeout "300 * ${TS_TEST_TIMEOUT_MULTIPLIER}")
  set_tests_properties(test_client_install PROPERTIES
    LABELS "integration;client;install" TIMEOUT ${_ts_install_timeout})
endif()

# The programs built on the library: quickstart and tsctl (with tsctl's .npy code linked in).
ts_add_test(test_client_tools SOURCES test_client_tools.c ${PROJECT_SOURCE_DIR}/tools/tsctl/npy.c
  LIBS tensorshare_static LABELS integration client TIMEOUT 120)
target_include_directories(test_client_tools PRIVATE ${PROJECT_SOURCE_DIR}/tools/tsctl)
add_dependencies(test_client_tools tsctl)
if(TARGET quickstart)
  add_dependencies(test_client_tools quickstart)
endif()

# The in-flight request map on its own (a unit test of client internals).
ts_add_test(test_client_idmap SOURCES test_client_idmap.c
  LIBS tensorshare_static PkgConfig::LIBUV LABELS unit client)
target_include_directories(test_client_idmap PRIVATE ${PROJECT_SOURCE_DIR}/client)

# A fake server that answers with malformed frames: TS_EPROTO, dropped connection, reconnection.
ts_add_test(test_client_badserver SOURCES test_client_badserver.c
  LIBS tensorshare_static LABELS integration client TIMEOUT 120)

# Allocation torture: the N-th allocation of a client's life fails, for every N.
ts_add_test(test_client_alloc SOURCES test_client_alloc.c
  LIBS tensorshare_static LABELS integration client TIMEOUT 300)
