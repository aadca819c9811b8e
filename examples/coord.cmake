# The coordination example: N processes take ranks with ADD, exchange addresses through bins and
# meet at a BARRIER (tests/integration/client/rendezvous_test.sh runs 4 of them).
add_executable(rendezvous ${CMAKE_CURRENT_LIST_DIR}/rendezvous.c)
target_link_libraries(rendezvous PRIVATE tensorshare ts_build)
