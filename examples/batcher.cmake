# The batched-inference quick start (needs the libtorch shim).
if(TS_HAVE_TORCH)
  add_executable(batch_quickstart ${CMAKE_CURRENT_LIST_DIR}/batch_quickstart.c)
  target_link_libraries(batch_quickstart PRIVATE tensorshare_torch tensorshare::tensorshare
    ts_build Threads::Threads)
endif()
