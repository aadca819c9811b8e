/*
 * Page-granular allocation for allocators of our own (tensord's slabs). The general hooks
 * (ts__malloc and friends) are declared in common.h; these pass the same counting and failure
 * injection, so a test that fails the N-th allocation reaches them too.
 */
#ifndef TS_ALLOC_H
#define TS_ALLOC_H

#include <stddef.h>

/*
 * n bytes of zeroed, page-aligned anonymous memory (n a multiple of the page size is exact; any
 * other n wastes the rest of its last page), or NULL. Pages cost resident memory only once
 * touched. Free with ts__pages_free and the same n. Thread-safe.
 */
void *ts__pages_alloc(size_t n);
void ts__pages_free(void *p, size_t n);

#endif /* TS_ALLOC_H */
