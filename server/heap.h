/*
 * heap.h - the sift steps of an index-tracking binary min-heap, shared by the deadline heap of
 * waits and the table code (internal to tensord).
 *
 * The waits' deadline heap (deadline.c, one for streams and one for tables) and the
 * lowest-priority table remover each keep an array of pointers ordered as a binary min-heap
 * whose elements remember their own slot (so that one can be removed from the middle). Only the
 * order and the slot bookkeeping differ between them, so the sift loops live here once and each
 * user supplies three small callbacks. Loop thread only.
 */
#ifndef TSD_HEAP_H
#define TSD_HEAP_H

#include <stddef.h>

/* How one heap reads, places and orders its elements. `heap` is the caller's owner object. */
typedef struct tsd_heap_ops {
    /* The element in slot i (i < the heap's size). */
    void *(*get)(void *heap, size_t i);
    /* Stores x in slot i and records i in x. */
    void (*set)(void *heap, size_t i, void *x);
    /* Nonzero when a must sit above b (a strict order, ties broken by the caller). */
    int (*before)(const void *a, const void *b);
} tsd_heap_ops;

/*
 * The steps are inline so that, called with a constant ops table, the compiler can call the
 * callbacks directly (the table remover's heap is on the insert and remove path). Each step holds
 * the moving element aside and shifts the others by one slot, updating every element's recorded
 * slot through ops->set.
 */

/* Moves the element in slot i towards the root until its parent comes before it. */
static inline void tsd_heap_up(void *heap, size_t i, const tsd_heap_ops *ops)
{
    void *x = ops->get(heap, i);
    while (i > 0) {
        size_t p = (i - 1) / 2;
        void *parent = ops->get(heap, p);
        if (!ops->before(x, parent))
            break;
        ops->set(heap, i, parent);
        i = p;
    }
    ops->set(heap, i, x);
}

/* Moves the element in slot i towards the leaves of a heap of n elements until no child comes
 * before it. */
static inline void tsd_heap_down(void *heap, size_t i, size_t n, const tsd_heap_ops *ops)
{
    void *x = ops->get(heap, i);
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        void *best = x;
        if (l < n && ops->before(ops->get(heap, l), best)) {
            m = l;
            best = ops->get(heap, l);
        }
        if (l + 1 < n && ops->before(ops->get(heap, l + 1), best))
            m = l + 1;
        if (m == i)
            break;
        ops->set(heap, i, ops->get(heap, m));
        i = m;
    }
    ops->set(heap, i, x);
}

#endif
