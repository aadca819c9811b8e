# The batcher's tests. test_batcher runs the manager in process with a plain C model; it compiles
# client/batcher.c itself (without the remote part), so it needs neither the client library nor
# libtorch. The remote test needs the client library and a real tensord.
ts_add_test(test_batcher
  SOURCES test_batcher.c ${PROJECT_SOURCE_DIR}/client/batcher.c
  LABELS batcher
  TIMEOUT 120)
target_compile_definitions(test_batcher PRIVATE TS_BATCHER_NO_REMOTE)

if(TARGET tensorshare AND TARGET tensord)
  ts_add_test(test_batcher_remote
    SOURCES test_batcher_remote.c
    LIBS tensorshare
    LABELS batcher integration
    TIMEOUT 120)
endif()
