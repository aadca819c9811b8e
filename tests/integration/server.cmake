# tensord integration tests: a real daemon per test case, raw sockets.
add_library(ts_server_testutil STATIC test_server_util.c)
target_link_libraries(ts_server_testutil PUBLIC ts_testing)

ts_add_test(test_server SOURCES test_server.c LIBS ts_server_testutil
  LABELS integration server TIMEOUT 120)
ts_add_test(test_server_attack SOURCES test_server_attack.c LIBS ts_server_testutil
  LABELS integration server TIMEOUT 120)
ts_add_test(test_server_load SOURCES test_server_load.c LIBS ts_server_testutil
  LABELS integration server TIMEOUT 180)
foreach(t test_server test_server_attack test_server_load)
  add_dependencies(${t} tensord)
endforeach()
ts_add_test(test_docs SOURCES test_docs.c LIBS ts_server_testutil LABELS integration server docs TIMEOUT 60)
add_dependencies(test_docs tensord)
