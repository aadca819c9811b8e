# rl_bench: experience throughput and publish-to-worker latency of the RL helpers (not a test;
# its --smoke mode is registered as a ctest test labelled bench by tests/integration/rl/CMakeLists.txt).
add_executable(rl_bench ${CMAKE_CURRENT_LIST_DIR}/rl_bench.c)
target_link_libraries(rl_bench PRIVATE tensorshare ts_build)
target_compile_definitions(rl_bench PRIVATE TS_TENSORD_PATH="$<TARGET_FILE:tensord>")
