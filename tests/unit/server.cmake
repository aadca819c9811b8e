# Unit tests of tensord's pure parts (the bin store, the slabs), linked with tsd_core: the
# daemon's own objects, as tensord links them.
ts_add_test(test_store SOURCES test_store.c LIBS tsd_core LABELS unit server)
ts_add_test(test_slab SOURCES test_slab.c LIBS tsd_core LABELS unit server)
ts_add_test(test_store_hash SOURCES test_store_hash.c LIBS tsd_core LABELS unit server)
