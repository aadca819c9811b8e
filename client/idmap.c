/*
 * The in-flight request map: request id to request, open addressing with linear probing and
 * backward-shift deletion (no tombstones, so lookups stay short however many requests come and
 * go). Used by the I/O thread only.
 */
#include "internal.h"

#define IDMAP_MIN_CAP 64 /* slots; enough for the usual handful of pipelined requests */

/* Home slot of id: a multiplicative hash, since ids are sequential. */
static size_t slot_of(uint32_t id, size_t cap)
{
    return (size_t)((id * 2654435761u) & (uint32_t)(cap - 1));
}

/* Rehash into cap slots. 0 or TS_ENOMEM. */
static int resize(ts__idmap *m, size_t cap)
{
    uint32_t *keys = ts__calloc(cap, sizeof(*keys));
    void **vals = ts__calloc(cap, sizeof(*vals));
    if (keys == NULL || vals == NULL) {
        ts__free(keys);
        ts__free(vals);
        return TS_ENOMEM;
    }
    for (size_t i = 0; i < m->cap; i++) {
        if (m->keys[i] == 0)
            continue;
        size_t j = slot_of(m->keys[i], cap);
        while (keys[j] != 0)
            j = (j + 1) & (cap - 1);
        keys[j] = m->keys[i];
        vals[j] = m->vals[i];
    }
    ts__free(m->keys);
    ts__free(m->vals);
    m->keys = keys;
    m->vals = vals;
    m->cap = cap;
    return 0;
}

int ts__idmap_put(ts__idmap *m, uint32_t id, void *val)
{
    /* Keep the load at most one half so probe sequences stay short. */
    if ((m->n + 1) * 2 > m->cap) {
        int rc = resize(m, m->cap ? m->cap * 2 : IDMAP_MIN_CAP);
        if (rc != 0)
            return rc;
    }
    size_t i = slot_of(id, m->cap);
    while (m->keys[i] != 0)
        i = (i + 1) & (m->cap - 1);
    m->keys[i] = id;
    m->vals[i] = val;
    m->n++;
    return 0;
}

/* The slot holding id, or SIZE_MAX. */
static size_t find(const ts__idmap *m, uint32_t id)
{
    if (m->cap == 0 || id == 0)
        return SIZE_MAX;
    size_t i = slot_of(id, m->cap);
    while (m->keys[i] != 0) {
        if (m->keys[i] == id)
            return i;
        i = (i + 1) & (m->cap - 1);
    }
    return SIZE_MAX;
}

void *ts__idmap_get(const ts__idmap *m, uint32_t id)
{
    size_t i = find(m, id);
    return i == SIZE_MAX ? NULL : m->vals[i];
}

void *ts__idmap_del(ts__idmap *m, uint32_t id)
{
    size_t i = find(m, id);
    if (i == SIZE_MAX)
        return NULL;
    void *val = m->vals[i];
    size_t mask = m->cap - 1;
    /*
     * Backward shift: move later entries of the probe run into the hole when their home slot
     * does not lie (cyclically) between the hole and their current slot.
     */
    size_t hole = i;
    size_t j = (i + 1) & mask;
    while (m->keys[j] != 0) {
        size_t home = slot_of(m->keys[j], m->cap);
        int movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
        if (movable) {
            m->keys[hole] = m->keys[j];
            m->vals[hole] = m->vals[j];
            hole = j;
        }
        j = (j + 1) & mask;
    }
    m->keys[hole] = 0;
    m->vals[hole] = NULL;
    m->n--;
    return val;
}

void ts__idmap_free(ts__idmap *m)
{
    ts__free(m->keys);
    ts__free(m->vals);
    memset(m, 0, sizeof(*m));
}
