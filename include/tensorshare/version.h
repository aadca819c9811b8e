/* tensorshare version. Versions with the same major number are ABI compatible. */
#ifndef TENSORSHARE_VERSION_H
#define TENSORSHARE_VERSION_H

#define TS_VERSION_MAJOR  0
#define TS_VERSION_MINOR  1
#define TS_VERSION_PATCH  0
#define TS_VERSION_STRING "0.1.0"
/* 0xMMmmpp: compare with >= to require a version. */
#define TS_VERSION_HEX ((TS_VERSION_MAJOR << 16) | (TS_VERSION_MINOR << 8) | TS_VERSION_PATCH)

#endif /* TENSORSHARE_VERSION_H */
