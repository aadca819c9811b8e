# Unit tests of tensord's pure parts: the bin store compiled straight from server/.
ts_add_test(test_store SOURCES test_store.c ${PROJECT_SOURCE_DIR}/server/store.c
  ${PROJECT_SOURCE_DIR}/server/slab.c LIBS PkgConfig::LIBUV LABELS unit server)
target_include_directories(test_store PRIVATE ${PROJECT_SOURCE_DIR}/server)
ts_add_test(test_slab SOURCES test_slab.c ${PROJECT_SOURCE_DIR}/server/store.c
  ${PROJECT_SOURCE_DIR}/server/slab.c LIBS PkgConfig::LIBUV LABELS unit server)
target_include_directories(test_slab PRIVATE ${PROJECT_SOURCE_DIR}/server)
