# The batcher is part of libtensorshare (client/batcher.c); this installs its header.
install(FILES ${PROJECT_SOURCE_DIR}/include/tensorshare/batcher.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tensorshare)
