# The RL example: a trainer and workers, run as separate processes against one tensord
# (docs/RL.md shows how).
foreach(prog rl_trainer rl_worker)
  add_executable(${prog} ${CMAKE_CURRENT_LIST_DIR}/${prog}.c)
  target_link_libraries(${prog} PRIVATE tensorshare ts_build m)
endforeach()
