# tensord hardening tests: authentication, limits, snapshots, allocation failures, faults.
add_library(ts_harden_testutil STATIC test_harden_util.c)
target_link_libraries(ts_harden_testutil PUBLIC ts_server_testutil)

# Sanitizer builds run the timed fault tests for less long (and scale their bounds).
if(TS_SANITIZE)
  set(ts_harden_env "TS_TEST_SLOW=1;TS_HARDEN_FUZZ_SECONDS=10")
else()
  set(ts_harden_env "TS_HARDEN_FUZZ_SECONDS=30")
endif()

foreach(t auth limits snapshot daemon alloc fuzz conn)
  set(_timeout 180)
  if(t STREQUAL "alloc")
    set(_timeout 400)
  endif()
  ts_add_test(test_harden_${t} SOURCES test_harden_${t}.c
    LIBS ts_harden_testutil tensorshare_static LABELS integration server harden
    TIMEOUT ${_timeout})
  add_dependencies(test_harden_${t} tensord tsctl)
  set_property(TEST test_harden_${t} APPEND PROPERTY ENVIRONMENT "${ts_harden_env}")
endforeach()
