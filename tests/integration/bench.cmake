# The benchmark's smoke run: tiny sizes, one repeat, Redis only when installed. It measures
# nothing worth keeping; it fails when a transfer through tensord (or the ceiling) fails, so
# the benchmark cannot rot. No timing is asserted.
if(TARGET tsbench)
  add_test(NAME tsbench_smoke COMMAND tsbench --smoke --no-pin)
  set_tests_properties(tsbench_smoke PROPERTIES
    LABELS bench
    TIMEOUT 120
    ENVIRONMENT "TS_TENSORD=$<TARGET_FILE:tensord>")
endif()

# bench_stall's smoke run: every case (LIST, SAVE, a large PUT, a PUT waking many WAITs) on
# sizes small enough for a loaded 2-core CI machine, unpinned so that it does not fight other
# tests for cpu0 and cpu1. It fails when a request fails or a case misses its deadline; the
# stall it prints is not asserted. The bench target exists only where benches are built (the
# sanitizer builds set TS_BUILD_BENCH=OFF).
if(TARGET bench_stall)
  add_test(NAME bench_stall_smoke
    COMMAND bench_stall --tensord $<TARGET_FILE:tensord> --bins 20000 --record-mb 16
            --wait-conns 4 --waits 100 --no-pin)
  set_tests_properties(bench_stall_smoke PROPERTIES
    LABELS bench
    TIMEOUT 60)
endif()

# stream_bench's smoke run: 30 batches, one repeat, unpinned; the failure case with a short lease
# and pause; Redis Streams only when redis-server is installed. It fails when a transfer or a
# consumer's check (order, row hashes, exactly once) fails; no timing is asserted.
if(TARGET stream_bench)
  add_test(NAME stream_bench_smoke COMMAND stream_bench --smoke --no-pin)
  set_tests_properties(stream_bench_smoke PROPERTIES
    LABELS bench
    TIMEOUT 180
    ENVIRONMENT "TS_TENSORD=$<TARGET_FILE:tensord>")
endif()
