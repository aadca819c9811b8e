# Client integration tests: libtensorshare against a real tensord (found through TS_TENSORD).
# They link the static library so that the tests and the library share one allocator hook.
ts_add_test(test_client SOURCES test_client.c
  LIBS tensorshare_static LABELS integration client TIMEOUT 120)
ts_add_test(test_client_failure SOURCES test_client_failure.c
  LIBS tensorshare_static LABELS integration client TIMEOUT 120)
ts_add_test(test_client_threads SOURCES test_client_threads.c
  LIBS tensorshare_static LABELS integration client TIMEOUT 180)
