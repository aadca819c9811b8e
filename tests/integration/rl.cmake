# The RL helpers' integration tests: a real tensord (the harness), trainer and workers in one
# process (test_rl) and worker processes (test_rl_procs, with rl/rl_test_worker).
add_executable(rl_test_worker ${CMAKE_CURRENT_LIST_DIR}/rl/rl_test_worker.c)
target_link_libraries(rl_test_worker PRIVATE tensorshare ts_build)

ts_add_test(test_rl
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_rl.c
  LIBS tensorshare
  LABELS integration rl client
  TIMEOUT 120)

ts_add_test(test_rl_procs
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_rl_procs.c
  LIBS tensorshare
  LABELS integration rl client
  TIMEOUT 120)
target_compile_definitions(test_rl_procs PRIVATE RL_TEST_WORKER="$<TARGET_FILE:rl_test_worker>")
add_dependencies(test_rl_procs rl_test_worker)

# The benchmark's smoke run (tiny counts): checks that rl_bench still works, measures nothing.
if(TARGET rl_bench)
  add_test(NAME rl_bench_smoke COMMAND rl_bench --smoke --workers 2 --no-pin)
  set_tests_properties(rl_bench_smoke PROPERTIES
    LABELS bench
    TIMEOUT 120
    ENVIRONMENT "TS_TENSORD=$<TARGET_FILE:tensord>")
endif()

# docs/RL.md's example, run as written (smaller counts): trainer and workers as processes.
if(TARGET rl_trainer AND TARGET rl_worker AND TARGET tensord)
  add_test(NAME test_rl_example
    COMMAND sh ${CMAKE_CURRENT_LIST_DIR}/rl/rl_example_test.sh $<TARGET_FILE:tensord>
      $<TARGET_FILE:rl_trainer> $<TARGET_FILE:rl_worker>)
  set_tests_properties(test_rl_example PROPERTIES LABELS "integration;rl;client" TIMEOUT 180)
endif()
