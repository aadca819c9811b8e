# ts_add_test(<name> SOURCES <files...> [LIBS <targets...>] [LABELS <labels...>] [TIMEOUT <s>])
# One executable per test module, registered with ctest. Tests find tensord through the
# TS_TENSORD environment variable, and their timeout is scaled by TS_TEST_TIMEOUT_MULTIPLIER.
function(ts_add_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 60)
  endif()
  math(EXPR timeout "${T_TIMEOUT} * ${TS_TEST_TIMEOUT_MULTIPLIER}")
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ts_testing ${T_LIBS})
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES
    TIMEOUT ${timeout}
    LABELS "${T_LABELS}"
    ENVIRONMENT "TS_TENSORD=$<TARGET_FILE:tensord>;TS_BUILD_DIR=${PROJECT_BINARY_DIR};TS_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
endfunction()
