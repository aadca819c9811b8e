/*
 * names.h - the order of bin, stream and table names (internal to tensord). It needs no libuv,
 * so that snapfile.c, which its fuzzer and unit test build alone, shares it with the loop's code.
 */
#ifndef TSD_NAMES_H
#define TSD_NAMES_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/*
 * Order two names by their bytes, a name before any longer name it begins: the order of a LIST
 * reply, of the store's sorted passes and of the snapshot file's sections. <0, 0 or >0, like
 * memcmp. A name of length 0 may have a NULL pointer, which memcmp must not see.
 */
static inline int tsd_name_cmp(const uint8_t *a, size_t a_len, const uint8_t *b, size_t b_len)
{
    size_t n = a_len < b_len ? a_len : b_len;
    int r = n > 0 ? memcmp(a, b, n) : 0;
    if (r != 0)
        return r;
    return (a_len > b_len) - (a_len < b_len);
}

#endif
