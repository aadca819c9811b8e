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
