/*
 * Slabs: the buffers of small records. A 4 KiB tensor arrives as a 4160-byte record; given a
 * 64-byte aligned allocation of its own (and a header allocation beside it) it cost about 64
 * bytes of malloc bookkeeping and alignment slack per item. Here a record takes a slot of its
 * size class in a shared mapping, and its header is an entry of the slab's header array: 16
 * bytes per item (the record's address is computed from the slot, its length is 16 bits) plus
 * about one byte of the slab's bookkeeping, and no allocator call per item once a slab exists.
 *
 * Everything here runs on the loop thread (items are released there only), so no locks.
 */
#include "alloc.h"
#include "server.h"

#include <assert.h>
#include <stddef.h>

/*
 * Under AddressSanitizer, slots that hold no record are poisoned, so that a use after the last
 * unref is reported as it is for memory from malloc.
 */
#if defined(__SANITIZE_ADDRESS__)
#define TSD_SLAB_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TSD_SLAB_ASAN 1
#endif
#endif
#ifdef TSD_SLAB_ASAN
#include <sanitizer/asan_interface.h>
#define SLOT_POISON(p, n)   ASAN_POISON_MEMORY_REGION((p), (n))
#define SLOT_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define SLOT_POISON(p, n)   ((void)(p), (void)(n))
#define SLOT_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

/*
 * Per class, the slabs with at least one free slot: partly used ones first (so that new records
 * fill them and the empty ones at the end can go), empty kept ones at the end.
 */
static struct {
    tsd_slab *head[TSD_SLAB_CLASSES];
    tsd_slab *tail[TSD_SLAB_CLASSES];
    tsd_slab_stats st;
} slabs;

static size_t map_bytes(const tsd_slab *s)
{
    return (size_t)s->nslots * s->size;
}

static size_t meta_bytes(uint32_t nslots)
{
    return sizeof(tsd_slab) + (size_t)nslots * sizeof(tsd_item);
}

static void list_push_head(tsd_slab *s)
{
    s->prev = NULL;
    s->next = slabs.head[s->cls];
    if (s->next != NULL)
        s->next->prev = s;
    else
        slabs.tail[s->cls] = s;
    slabs.head[s->cls] = s;
}

static void list_push_tail(tsd_slab *s)
{
    s->next = NULL;
    s->prev = slabs.tail[s->cls];
    if (s->prev != NULL)
        s->prev->next = s;
    else
        slabs.head[s->cls] = s;
    slabs.tail[s->cls] = s;
}

static void list_remove(tsd_slab *s)
{
    if (s->prev != NULL)
        s->prev->next = s->next;
    else
        slabs.head[s->cls] = s->next;
    if (s->next != NULL)
        s->next->prev = s->prev;
    else
        slabs.tail[s->cls] = s->prev;
    s->prev = s->next = NULL;
}

/* A new, empty slab of class cls (not linked); NULL on allocation failure. */
static tsd_slab *slab_new(uint32_t cls)
{
    uint32_t size = (cls + 1) * TSD_SLAB_GRAIN;
    /* 64 slots of a multiple of 64 bytes make a multiple of 4096; take enough of them. */
    size_t per64 = (size_t)64 * size;
    uint32_t nslots = (uint32_t)(64 * ((TSD_SLAB_MIN_MAP + per64 - 1) / per64));
    assert(nslots < TSD_ITEM_OWN);
    tsd_slab *s = ts__malloc(meta_bytes(nslots));
    if (s == NULL)
        return NULL;
    s->base = ts__pages_alloc((size_t)nslots * size);
    if (s->base == NULL) {
        ts__free(s);
        return NULL;
    }
    SLOT_POISON(s->base, (size_t)nslots * size);
    s->prev = s->next = NULL;
    s->free = NULL;
    s->size = size;
    s->nslots = nslots;
    s->used = 0;
    s->fresh = 0;
    s->cls = cls;
    slabs.st.slabs++;
    slabs.st.mapped += map_bytes(s);
    slabs.st.meta += meta_bytes(nslots);
    return s;
}

static void slab_destroy(tsd_slab *s)
{
    assert(s->used == 0);
    slabs.st.slabs--;
    slabs.st.mapped -= map_bytes(s);
    slabs.st.meta -= meta_bytes(s->nslots);
    /* The shadow outlives the mapping: whatever is mapped here next must not look poisoned. */
    SLOT_UNPOISON(s->base, map_bytes(s));
    ts__pages_free(s->base, map_bytes(s));
    ts__free(s);
}

tsd_item *tsd_slab_alloc(size_t len)
{
    assert(len <= TSD_SLAB_MAX);
    uint32_t cls = len > 0 ? (uint32_t)((len - 1) / TSD_SLAB_GRAIN) : 0;
    tsd_slab *s = slabs.head[cls];
    if (s == NULL) {
        s = slab_new(cls);
        if (s == NULL)
            return NULL;
        list_push_head(s);
    } else if (s->used == 0) {
        slabs.st.empty_kept -= map_bytes(s);
    }
    tsd_item *it = s->free;
    if (it != NULL)
        s->free = it->next;
    else
        it = &s->items[s->fresh++];
    uint32_t idx = (uint32_t)(it - s->items);
    it->slot = (uint16_t)idx;
    it->next = NULL;
    SLOT_UNPOISON(s->base + (size_t)idx * s->size, s->size);
    s->used++;
    slabs.st.slots_used++;
    if (s->used == s->nslots)
        list_remove(s);
    return it;
}

void tsd_slab_free(tsd_item *it)
{
    tsd_slab *s = tsd_item_slab(it);
    assert(it->slot < s->fresh && s->used > 0);
    int was_full = s->used == s->nslots;
    SLOT_POISON(s->base + (size_t)it->slot * s->size, s->size);
    it->next = s->free;
    s->free = it;
    s->used--;
    slabs.st.slots_used--;
    if (s->used > 0) {
        if (was_full)
            list_push_head(s);
        return;
    }
    /* Empty: keep it for the next records of its class while the allowance lasts. */
    if (!was_full)
        list_remove(s);
    if (slabs.st.empty_kept + map_bytes(s) > TSD_SLAB_KEEP) {
        slab_destroy(s);
        return;
    }
    /* Reused slots start over from the beginning of the mapping. */
    s->free = NULL;
    s->fresh = 0;
    slabs.st.empty_kept += map_bytes(s);
    list_push_tail(s);
}

size_t tsd_slab_slot_size(const tsd_item *it)
{
    return tsd_item_slab(it)->size;
}

void tsd_slab_drain(void)
{
    for (uint32_t c = 0; c < TSD_SLAB_CLASSES; c++) {
        tsd_slab *s = slabs.tail[c];
        while (s != NULL && s->used == 0) {
            tsd_slab *prev = s->prev;
            list_remove(s);
            slabs.st.empty_kept -= map_bytes(s);
            slab_destroy(s);
            s = prev;
        }
    }
}

void tsd_slab_stats_get(tsd_slab_stats *st)
{
    *st = slabs.st;
}
