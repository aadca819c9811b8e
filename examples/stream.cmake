# The stream example: one producer making image batches (real CPU work) and training consumers
# reading them at their own batch sizes, as separate processes against one tensord
# (examples/stream_demo.sh runs it end to end).
foreach(prog stream_producer stream_consumer)
  add_executable(${prog} ${CMAKE_CURRENT_LIST_DIR}/${prog}.c)
  target_link_libraries(${prog} PRIVATE tensorshare ts_build)
endforeach()
