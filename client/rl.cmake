# The RL helpers (client/rl.c) are compiled into libtensorshare; this installs their header.
install(FILES ${PROJECT_SOURCE_DIR}/include/tensorshare/rl.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tensorshare)
