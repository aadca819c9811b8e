/* tensorshare version. From 1.0.0 on, versions with the same major number are ABI compatible. */
#ifndef TENSORSHARE_VERSION_H
#define TENSORSHARE_VERSION_H

/*
 * The version these headers belong to. Until the major version leaves 0, a minor release may
 * change the API and the ABI (docs/DESIGN.md "API conventions"). Added in 0.1.0.
 */
#define TS_VERSION_MAJOR  0
#define TS_VERSION_MINOR  7
#define TS_VERSION_PATCH  2
#define TS_VERSION_STRING "0.7.2"
/* 0xMMmmpp: compare with >= to require a version. Added in 0.1.0. */
#define TS_VERSION_HEX ((TS_VERSION_MAJOR << 16) | (TS_VERSION_MINOR << 8) | TS_VERSION_PATCH)

#endif /* TENSORSHARE_VERSION_H */
