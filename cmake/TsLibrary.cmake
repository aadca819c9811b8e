# libtensorshare: ONE library, shared and static, linked from the modules' objects (each source
# compiled once): ts_common (src/), ts_client (client/), ts_rl (rl/), ts_batcher_engine and
# ts_batcher_remote (batcher/).
# The list is explicit: a module that is missing fails the configure instead of silently
# dropping its functions from the ABI (tests/install/check_exports.sh checks what is exported).
include(CMakePackageConfigHelpers)

set(TS_LIBRARY_OBJECTS
  $<TARGET_OBJECTS:ts_common>
  $<TARGET_OBJECTS:ts_client>
  $<TARGET_OBJECTS:ts_rl>
  $<TARGET_OBJECTS:ts_batcher_engine>
  $<TARGET_OBJECTS:ts_batcher_remote>)
add_library(tensorshare SHARED ${TS_LIBRARY_OBJECTS})
set_target_properties(tensorshare PROPERTIES
  VERSION ${PROJECT_VERSION}
  SOVERSION ${PROJECT_VERSION_MAJOR})
add_library(tensorshare_static STATIC ${TS_LIBRARY_OBJECTS})
foreach(tgt tensorshare tensorshare_static)
  set_target_properties(${tgt} PROPERTIES OUTPUT_NAME tensorshare
    LIBRARY_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/lib
    ARCHIVE_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/lib)
  target_include_directories(${tgt} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    $<BUILD_INTERFACE:${TS_DLPACK_INCLUDE_DIR}>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(${tgt} PRIVATE $<BUILD_INTERFACE:ts_build>
    PkgConfig::LIBUV PkgConfig::LZ4 Threads::Threads)
  if(TS_WITH_TLS)
    target_link_libraries(${tgt} PRIVATE OpenSSL::SSL)
  endif()
endforeach()
add_library(tensorshare::tensorshare ALIAS tensorshare)
add_library(tensorshare::tensorshare_static ALIAS tensorshare_static)

# ---------------------------------------------------------------------------------------------
# Install: headers, libraries, pkg-config file and CMake package.
set(TS_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/tensorshare)
install(TARGETS tensorshare tensorshare_static
  EXPORT tensorshareTargets
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# Every public header of the library, named one by one (torch.h is installed by shim/).
install(FILES
  ${PROJECT_SOURCE_DIR}/include/tensorshare/tensorshare.h
  ${PROJECT_SOURCE_DIR}/include/tensorshare/version.h
  ${PROJECT_SOURCE_DIR}/include/tensorshare/dlpack.h
  ${PROJECT_SOURCE_DIR}/include/tensorshare/rl.h
  ${PROJECT_SOURCE_DIR}/include/tensorshare/batcher.h
  ${PROJECT_SOURCE_DIR}/include/tensorshare/coord.h
  ${PROJECT_SOURCE_DIR}/include/tensorshare/ps.h
  ${PROJECT_SOURCE_DIR}/include/tensorshare/replay.h
  ${PROJECT_SOURCE_DIR}/include/tensorshare/service.h
  ${PROJECT_SOURCE_DIR}/include/tensorshare/stream.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tensorshare)

install(EXPORT tensorshareTargets
  NAMESPACE tensorshare::
  DESTINATION ${TS_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/tensorshareConfig.cmake.in
  ${PROJECT_BINARY_DIR}/tensorshareConfig.cmake
  INSTALL_DESTINATION ${TS_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/tensorshareConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMajorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/tensorshareConfig.cmake
  ${PROJECT_BINARY_DIR}/tensorshareConfigVersion.cmake
  DESTINATION ${TS_CMAKE_DIR})

# The .pc files locate the prefix from their own directory, so an install moved with
# `cmake --install --prefix` (or DESTDIR) still works. shim/ uses the same value for its own.
file(RELATIVE_PATH TS_PC_RELATIVE_PREFIX
  ${CMAKE_INSTALL_FULL_LIBDIR}/pkgconfig ${CMAKE_INSTALL_PREFIX})
string(REGEX REPLACE "/$" "" TS_PC_RELATIVE_PREFIX "${TS_PC_RELATIVE_PREFIX}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/tensorshare.pc.in
  ${PROJECT_BINARY_DIR}/tensorshare.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/tensorshare.pc
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
