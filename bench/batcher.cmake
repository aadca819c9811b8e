# batcher_bench: dynamic batching versus one forward per request on a small TorchScript MLP,
# in process and through tensord (not a test; tests/shim runs its --smoke mode as a test).
if(TS_HAVE_TORCH)
  add_executable(batcher_bench ${CMAKE_CURRENT_LIST_DIR}/batcher_bench.c)
  target_link_libraries(batcher_bench PRIVATE tensorshare_torch tensorshare ts_build
    Threads::Threads)
endif()
# batcher_shm_bench: requester processes through the same-host slots against the relay through
# tensord, in the same run (not a test).
if(TS_HAVE_TORCH)
  add_executable(batcher_shm_bench ${CMAKE_CURRENT_LIST_DIR}/batcher_shm_bench.c)
  target_link_libraries(batcher_shm_bench PRIVATE tensorshare_torch tensorshare ts_build)
endif()
