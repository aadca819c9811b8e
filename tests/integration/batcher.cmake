# The batcher's tests. test_batcher runs the engine in process with a plain C model: it links the
# engine's objects (batcher/, without serve.c and predictor.c) and the core, so it needs neither
# the client library nor libtorch. The remote test needs the client library and a real tensord.
ts_add_test(test_batcher
  SOURCES test_batcher.c $<TARGET_OBJECTS:ts_batcher_engine>
  LABELS batcher
  TIMEOUT 120)

ts_add_test(test_batcher_remote
  SOURCES test_batcher_remote.c
  LIBS tensorshare
  LABELS batcher integration
  TIMEOUT 120)
