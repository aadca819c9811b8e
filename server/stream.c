/*
 * Streams: append-only logs with dense ids, server-kept cursors (groups of members), retention
 * and back-pressure (docs/PROTOCOL.md, STREAM_* opcodes; the structures are in stream.h).
 *
 * Bounded work. Every request walks at most: the stream's groups (TS_STREAM_MAX_GROUPS), one
 * group's members (TS_STREAM_MAX_MEMBERS), and TS_STREAM_MAX_READ entries, plus the pending
 * entries of the member making the request (it holds them itself: its own array, sorted by
 * id). Claiming the entries of members that are not live merges the sorted arrays of those
 * members, taking each claimed entry in O(members): it never walks entries of live members.
 * Retention drops entries one at a time, each in O(groups) plus the pending entries dropped.
 *
 * Waits. A STREAM_READ or STREAM_RANGE that finds nothing, and a STREAM_CREDIT that finds no
 * credit, wait (when they were given a timeout): each is a tsd_swait linked into its stream and
 * its connection, counted against --max-watch and --max-memory as a WAIT, with its deadline in
 * one heap served by one timer. They are woken by the changes that can satisfy them (append and
 * mark: reads and ranges; ack, leave, a group going stale, a reconfiguring create: credit waits
 * and reads), never by polling: a stream with waits keeps a timer for the next moment a lease
 * ends that matters to them (a member whose entries become claimable, a group holding the credit
 * that goes stale). Each wait is answered exactly once: satisfied, timed out (OK with nothing or
 * with credit 0), NOT_FOUND when its stream is deleted, SHUTTING_DOWN when tensord stops, or
 * dropped without an answer when its connection closes.
 *
 * Liveness. A member is live while now - last_seen <= its group's lease, and also while it waits
 * in a STREAM_READ (it is reading: it must not lose its entries to others meanwhile); its
 * last_seen is refreshed when that read is answered.
 */
#include "stream.h"
#include "names.h"
#include "table.h"

#include "msg.h"
#include "record.h"

#include <stdio.h>
#include <stdlib.h>

/* Room for a printable name in messages (255 bytes, each at most 4 bytes of UTF-8). */
#define SNAME_CAP (TS_MAX_NAME_LEN * 4 + 1)
/* Entries of a ring when it is first allocated (it doubles from there). */
#define RING_MIN 16u
/* Pending entries a member's array holds when first allocated (it doubles from there). */
#define PEND_MIN 8u
/* Pending entries an emptied array may keep its room for (larger ones are given back). */
#define PEND_KEEP 64u
/*
 * lease_due of a stream whose lease timer could not be allocated: the cron then tries its waits
 * (out of memory only; otherwise nothing here is ever polled).
 */
#define LEASE_NO_TIMER 1u

/* What ENTRIES says of one entry handed out. */
typedef struct handed {
    uint64_t id;
    uint32_t rows_done;
    uint32_t deliveries;
    uint8_t flags;
} handed;

/* A pending STREAM_READ, STREAM_RANGE or STREAM_CREDIT. */
struct tsd_swait {
    tsd_deadline dl; /* first: the deadline heap points here */
    tsd_stream *st;
    tsd_conn *c;
    uint32_t rid;
    uint8_t op;
    tsd_swait *sprev, *snext; /* in the stream */
    tsd_swait *cprev, *cnext; /* in the connection */
    uint64_t after_id;        /* RANGE */
    uint32_t max;             /* READ, RANGE: entries asked for */
    tsd_stream_group *g;      /* READ: the group and member (cleared when they go) */
    tsd_stream_member *m;
};

/* What a pending wait counts against --max-memory (its block and its heap slot). */
#define SWAIT_COST ((uint64_t)(sizeof(tsd_swait) + 16 + sizeof(tsd_swait *)))

/* One loop thread: scratch for the entries of one reply and the claims of one read. */
static handed g_handed[TS_STREAM_MAX_READ];
static tsd_stream_pending g_claimed[TS_STREAM_MAX_READ];

/* ---------------------------------------------------------------------------------------------
 * Small helpers
 */

static tsd_streams *sx(tsd_server *srv)
{
    return srv->streams;
}

static uint64_t now_ms(tsd_server *srv)
{
    return uv_now(srv->loop);
}

static int same_name(const uint8_t *a, size_t alen, const uint8_t *b, size_t blen)
{
    return alen == blen && (alen == 0 || memcmp(a, b, alen) == 0);
}

static void printable(const uint8_t *name, size_t len, char *out)
{
    tsd_name_printable(name, len, out, SNAME_CAP);
}

tsd_stream *tsd_stream_find(tsd_server *srv, const uint8_t *name, size_t len)
{
    if (srv->streams == NULL)
        return NULL;
    return (tsd_stream *)tsd_htab_find(&sx(srv)->table, name, len);
}

uint32_t tsd_stream_n_entries(const tsd_stream *st)
{
    return (uint32_t)(st->last_id + 1 - st->first_id);
}

static uint64_t n_entries(const tsd_stream *st)
{
    return st->last_id + 1 - st->first_id;
}

tsd_stream_entry *tsd_stream_entry_get(const tsd_stream *st, uint64_t id)
{
    if (id < st->first_id || id > st->last_id)
        return NULL;
    return &st->ring[(st->ring_head + (id - st->first_id)) & (st->ring_cap - 1)];
}

static int member_live(const tsd_stream_group *g, const tsd_stream_member *m, uint64_t now)
{
    if (m->name_len == 0)
        return 0; /* the orphans: never live */
    if (m->n_reading > 0)
        return 1;
    return now - m->last_seen <= g->lease_ms;
}

int tsd_stream_group_live(const tsd_stream_group *g, uint64_t now)
{
    if (g->n_members == 0)
        return 0;
    if (g->n_reading > 0)
        return 1;
    return now - g->newest_seen <= g->lease_ms;
}

/* The moment (uv_now) m stops being live by its lease (it may be live longer while reading). */
static uint64_t member_lease_end(const tsd_stream_group *g, const tsd_stream_member *m)
{
    return m->last_seen + g->lease_ms + 1;
}

static tsd_stream_pending *pend_at(const tsd_stream_member *m, uint32_t k)
{
    return &m->pend[m->pend_head + k];
}

/* The first index k of m's pending entries whose id is >= id (n_pend when none). */
static uint32_t pend_lower(const tsd_stream_member *m, uint64_t id)
{
    uint32_t lo = 0, hi = m->n_pend;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (pend_at(m, mid)->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Recompute g's floor (smallest pending id, else next_id): O(members). */
static void group_floor(tsd_stream_group *g)
{
    uint64_t f = g->next_id;
    if (g->orphans.n_pend > 0 && pend_at(&g->orphans, 0)->id < f)
        f = pend_at(&g->orphans, 0)->id;
    for (uint32_t i = 0; i < g->n_members; i++) {
        const tsd_stream_member *m = g->members[i];
        if (m->n_pend > 0 && pend_at(m, 0)->id < f)
            f = pend_at(m, 0)->id;
    }
    g->floor = f;
}

/* Recompute g's newest last_seen: O(members). */
static void group_seen(tsd_stream_group *g)
{
    uint64_t s = 0;
    for (uint32_t i = 0; i < g->n_members; i++)
        if (g->members[i]->last_seen > s)
            s = g->members[i]->last_seen;
    g->newest_seen = s;
}

static void member_touch(tsd_stream_group *g, tsd_stream_member *m, uint64_t now)
{
    m->last_seen = now;
    if (now > g->newest_seen)
        g->newest_seen = now;
}

/* lag(g) = last_id + 1 - floor(g). */
static uint64_t group_lag(const tsd_stream *st, const tsd_stream_group *g)
{
    return st->last_id + 1 - g->floor;
}

/*
 * The stream's credit now: window - the largest lag of a live group, at least 0; UINT32_MAX when
 * there is no window or no live group. *who (may be NULL) gets the group with that lag.
 */
static uint32_t stream_credit(const tsd_stream *st, uint64_t now, const tsd_stream_group **who)
{
    if (who != NULL)
        *who = NULL;
    if (st->cfg.window == 0)
        return UINT32_MAX;
    int any = 0;
    uint64_t worst = 0;
    for (uint32_t i = 0; i < st->n_groups; i++) {
        const tsd_stream_group *g = st->groups[i];
        if (!tsd_stream_group_live(g, now))
            continue;
        uint64_t lag = group_lag(st, g);
        if (!any || lag > worst) {
            worst = lag;
            if (who != NULL)
                *who = g;
        }
        any = 1;
    }
    if (!any)
        return UINT32_MAX;
    return worst >= st->cfg.window ? 0 : (uint32_t)(st->cfg.window - worst);
}

static uint32_t n_stale(const tsd_stream *st, uint64_t now)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < st->n_groups; i++)
        n += !tsd_stream_group_live(st->groups[i], now);
    return n;
}

static tsd_stream_group *group_find(const tsd_stream *st, const uint8_t *name, size_t len)
{
    for (uint32_t i = 0; i < st->n_groups; i++)
        if (same_name(st->groups[i]->name, st->groups[i]->name_len, name, len))
            return st->groups[i];
    return NULL;
}

static tsd_stream_member *member_find(const tsd_stream_group *g, const uint8_t *name, size_t len)
{
    for (uint32_t i = 0; i < g->n_members; i++)
        if (same_name(g->members[i]->name, g->members[i]->name_len, name, len))
            return g->members[i];
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Pending arrays (a member's, sorted by id, used as a deque)
 */

/* Make room for more entries at the end of m's array. 0, TS_EOOM or TS_ENOMEM. */
static int pend_reserve(tsd_server *srv, tsd_stream *st, tsd_stream_member *m, uint32_t more)
{
    uint64_t need = (uint64_t)m->n_pend + more;
    if ((uint64_t)m->pend_head + need <= m->pend_cap)
        return 0;
    if (need <= m->pend_cap) {
        /* Room enough once the live part moves to the front. */
        memmove(m->pend, m->pend + m->pend_head, (size_t)m->n_pend * sizeof(*m->pend));
        m->pend_head = 0;
        return 0;
    }
    uint64_t cap = m->pend_cap != 0 ? m->pend_cap : PEND_MIN;
    while (cap < need)
        cap *= 2;
    if (cap > UINT32_MAX)
        return TS_ENOMEM;
    uint64_t delta = (cap - m->pend_cap) * sizeof(*m->pend);
    if (tsd_store_charge(srv, &st->cost, delta) != 0)
        return TS_EOOM;
    tsd_stream_pending *p = ts__malloc((size_t)cap * sizeof(*p));
    if (p == NULL) {
        tsd_store_uncharge(srv, &st->cost, delta);
        return TS_ENOMEM;
    }
    if (m->n_pend > 0)
        memcpy(p, m->pend + m->pend_head, (size_t)m->n_pend * sizeof(*p));
    ts__free(m->pend);
    m->pend = p;
    m->pend_head = 0;
    m->pend_cap = (uint32_t)cap;
    return 0;
}

/* Give a large empty array back (a member that read much once should not keep it). */
static void pend_trim(tsd_server *srv, tsd_stream *st, tsd_stream_member *m)
{
    if (m->n_pend > 0) {
        return;
    }
    m->pend_head = 0;
    if (m->pend_cap > PEND_KEEP) {
        tsd_store_uncharge(srv, &st->cost, (uint64_t)m->pend_cap * sizeof(*m->pend));
        ts__free(m->pend);
        m->pend = NULL;
        m->pend_cap = 0;
    }
}

/* Remove m's pending entries [k0, k1). */
static void pend_remove(tsd_stream_member *m, uint32_t k0, uint32_t k1)
{
    for (uint32_t k = k0; k < k1; k++)
        if (pend_at(m, k)->redeliver)
            m->n_redeliver--;
    if (k0 == 0) {
        m->pend_head += k1;
    } else if (k1 < m->n_pend) {
        memmove(pend_at(m, k0), pend_at(m, k1), (size_t)(m->n_pend - k1) * sizeof(*m->pend));
    }
    m->n_pend -= k1 - k0;
    if (m->n_pend == 0)
        m->pend_head = 0;
}

/*
 * Merge n entries (ids ascending, none pending in m) into m's array. 0 or the error of
 * pend_reserve (m unchanged then).
 */
static int pend_merge(tsd_server *srv, tsd_stream *st, tsd_stream_member *m,
                      const tsd_stream_pending *add, uint32_t n)
{
    if (n == 0)
        return 0;
    int rc = pend_reserve(srv, st, m, n);
    if (rc != 0)
        return rc;
    /* From the back: the largest of both goes last, so nothing is overwritten before it moves. */
    int64_t i = (int64_t)m->n_pend - 1, j = (int64_t)n - 1;
    int64_t out = (int64_t)m->n_pend + n - 1;
    while (j >= 0) {
        if (i >= 0 && pend_at(m, (uint32_t)i)->id > add[j].id) {
            *pend_at(m, (uint32_t)out) = *pend_at(m, (uint32_t)i);
            i--;
        } else {
            *pend_at(m, (uint32_t)out) = add[j];
            j--;
        }
        out--;
    }
    m->n_pend += n;
    for (uint32_t k = 0; k < n; k++)
        if (add[k].redeliver)
            m->n_redeliver++;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Groups and members
 */

static void member_free(tsd_server *srv, tsd_stream *st, tsd_stream_member *m)
{
    tsd_store_uncharge(srv, &st->cost, (uint64_t)m->pend_cap * sizeof(*m->pend));
    ts__free(m->pend);
    if (m->name_len > 0) {
        tsd_store_uncharge(srv, &st->cost, tsd_heap_block(sizeof(*m) + m->name_len));
        ts__free(m);
    }
}

static void group_free(tsd_server *srv, tsd_stream *st, tsd_stream_group *g)
{
    for (uint32_t i = 0; i < g->n_members; i++)
        member_free(srv, st, g->members[i]);
    member_free(srv, st, &g->orphans);
    tsd_store_uncharge(srv, &st->cost, (uint64_t)g->members_cap * sizeof(*g->members));
    ts__free(g->members);
    tsd_store_uncharge(srv, &st->cost, tsd_heap_block(sizeof(*g) + g->name_len));
    ts__free(g);
}

/*
 * The full array arr of *cap pointers (the groups, or a group's members) grown for one more: to
 * first, then doubling, at most max, the growth charged to st. The array, perhaps moved, with
 * *cap raised; or NULL with *rc TS_EOOM or TS_ENOMEM, and arr and *cap as they were.
 */
static void *ptrs_grow(tsd_server *srv, tsd_stream *st, void *arr, uint32_t *cap, uint32_t first,
                       uint32_t max, int *rc)
{
    uint32_t n = *cap != 0 ? *cap * 2 : first;
    if (n > max)
        n = max;
    uint64_t delta = (uint64_t)(n - *cap) * sizeof(void *);
    if (tsd_store_charge(srv, &st->cost, delta) != 0) {
        *rc = TS_EOOM;
        return NULL;
    }
    void *grown = ts__realloc(arr, n * sizeof(void *));
    if (grown == NULL) {
        tsd_store_uncharge(srv, &st->cost, delta);
        *rc = TS_ENOMEM;
        return NULL;
    }
    *cap = n;
    return grown;
}

/*
 * A zeroed block of size bytes (a group or a member, its name after it), its heap block charged
 * to st. NULL with *rc TS_EOOM or TS_ENOMEM.
 */
static void *named_calloc(tsd_server *srv, tsd_stream *st, size_t size, int *rc)
{
    uint64_t cost = tsd_heap_block(size);
    if (tsd_store_charge(srv, &st->cost, cost) != 0) {
        *rc = TS_EOOM;
        return NULL;
    }
    void *b = ts__calloc(1, size);
    if (b == NULL) {
        tsd_store_uncharge(srv, &st->cost, cost);
        *rc = TS_ENOMEM;
    }
    return b;
}

/* A new group of st (not yet linked). TS_EOOM, TS_ENOMEM. */
static int group_new(tsd_server *srv, tsd_stream *st, const uint8_t *name, size_t len,
                     uint64_t next_id, uint32_t lease_ms, tsd_stream_group **out)
{
    int rc = 0;
    if (st->n_groups == st->groups_cap) {
        tsd_stream_group **arr =
            ptrs_grow(srv, st, st->groups, &st->groups_cap, 4, TS_STREAM_MAX_GROUPS, &rc);
        if (arr == NULL)
            return rc;
        st->groups = arr;
    }
    tsd_stream_group *g = named_calloc(srv, st, sizeof(*g) + len, &rc);
    if (g == NULL)
        return rc;
    g->name = (uint8_t *)(g + 1);
    memcpy(g->name, name, len);
    g->name_len = (uint8_t)len;
    g->next_id = next_id;
    g->floor = next_id;
    g->lease_ms = lease_ms;
    st->groups[st->n_groups++] = g;
    *out = g;
    return 0;
}

/* A new member of g. TS_EOOM, TS_ENOMEM. */
static int member_new(tsd_server *srv, tsd_stream *st, tsd_stream_group *g, const uint8_t *name,
                      size_t len, uint64_t now, tsd_stream_member **out)
{
    int rc = 0;
    if (g->n_members == g->members_cap) {
        tsd_stream_member **arr =
            ptrs_grow(srv, st, g->members, &g->members_cap, 2, TS_STREAM_MAX_MEMBERS, &rc);
        if (arr == NULL)
            return rc;
        g->members = arr;
    }
    tsd_stream_member *m = named_calloc(srv, st, sizeof(*m) + len, &rc);
    if (m == NULL)
        return rc;
    m->name = (uint8_t *)(m + 1);
    memcpy(m->name, name, len);
    m->name_len = (uint8_t)len;
    g->members[g->n_members++] = m;
    member_touch(g, m, now);
    *out = m;
    return 0;
}

static void waits_forget_member(tsd_stream *st, const tsd_stream_group *g,
                                const tsd_stream_member *m);
static void waits_forget_group(tsd_stream *st, const tsd_stream_group *g);

/*
 * Remove member m from g: its pending entries go to the orphans (claimable at once). When the
 * orphans' array cannot grow (memory), the entries are given up as acknowledged: the group's
 * floor moves on, which is the only way out that keeps every invariant.
 */
static void member_remove(tsd_server *srv, tsd_stream *st, tsd_stream_group *g,
                          tsd_stream_member *m)
{
    waits_forget_member(st, g, m);
    if (m->n_pend > 0) {
        for (uint32_t k = 0; k < m->n_pend; k++)
            pend_at(m, k)->redeliver = 0;
        m->n_redeliver = 0;
        if (pend_merge(srv, st, &g->orphans, pend_at(m, 0), m->n_pend) != 0)
            tsd_log(TSD_LOG_WARN,
                    "stream: out of memory keeping %u pending entries of a member "
                    "that left; they count as acknowledged",
                    m->n_pend);
    }
    for (uint32_t i = 0; i < g->n_members; i++) {
        if (g->members[i] == m) {
            g->members[i] = g->members[--g->n_members];
            break;
        }
    }
    member_free(srv, st, m);
    group_seen(g);
    group_floor(g);
}

static void group_remove(tsd_server *srv, tsd_stream *st, tsd_stream_group *g)
{
    waits_forget_group(st, g);
    for (uint32_t i = 0; i < st->n_groups; i++) {
        if (st->groups[i] == g) {
            /* Keep the order of the others (STREAM_INFO lists groups in creation order). */
            memmove(st->groups + i, st->groups + i + 1,
                    (size_t)(st->n_groups - i - 1) * sizeof(*st->groups));
            st->n_groups--;
            break;
        }
    }
    group_free(srv, st, g);
}

/* ---------------------------------------------------------------------------------------------
 * Entries and retention
 */

/* Make room for one more entry in the ring. 0, TS_EOOM or TS_ENOMEM. */
static int ring_reserve(tsd_server *srv, tsd_stream *st)
{
    uint64_t n = n_entries(st);
    if (n < st->ring_cap)
        return 0;
    uint64_t cap = st->ring_cap != 0 ? st->ring_cap * 2 : RING_MIN;
    uint64_t delta = (cap - st->ring_cap) * sizeof(tsd_stream_entry);
    if (tsd_store_charge(srv, &st->cost, delta) != 0)
        return TS_EOOM;
    tsd_stream_entry *r = ts__malloc((size_t)cap * sizeof(*r));
    if (r == NULL) {
        tsd_store_uncharge(srv, &st->cost, delta);
        return TS_ENOMEM;
    }
    for (uint64_t k = 0; k < n; k++)
        r[k] = st->ring[(st->ring_head + k) & (st->ring_cap - 1)];
    ts__free(st->ring);
    st->ring = r;
    st->ring_head = 0;
    st->ring_cap = cap;
    return 0;
}

/* Link entry last_id + 1 (room made by ring_reserve). it's reservation becomes held bytes. */
static void entry_push(tsd_server *srv, tsd_stream *st, tsd_item *it, uint64_t tag, uint64_t time)
{
    uint64_t n = n_entries(st);
    tsd_stream_entry *e = &st->ring[(st->ring_head + n) & (st->ring_cap - 1)];
    e->it = it;
    e->tag = it != NULL ? 0 : tag;
    e->time_ms = time;
    st->last_id++;
    if (it != NULL) {
        tsd_store_item_take(&srv->store, it);
        st->bytes += tsd_item_len(it);
        sx(srv)->bytes += tsd_item_len(it);
    }
    sx(srv)->entries++;
}

/* Drop the oldest kept entry (orphan: see tsd_store_item_drop). */
static void entry_pop(tsd_server *srv, tsd_stream *st, int orphan)
{
    tsd_stream_entry *e = &st->ring[st->ring_head & (st->ring_cap - 1)];
    if (e->it != NULL) {
        st->bytes -= tsd_item_len(e->it);
        sx(srv)->bytes -= tsd_item_len(e->it);
        tsd_store_item_drop(&srv->store, e->it, orphan);
        e->it = NULL;
    }
    st->ring_head = (st->ring_head + 1) & (st->ring_cap - 1);
    st->first_id++;
    sx(srv)->entries--;
}

/*
 * Entries [old_first, first_id) were dropped: count them in each group's lost where the group
 * had not acknowledged them, drop the group's pending entries among them, and move cursors that
 * pointed below first_id up to it.
 */
static void groups_after_drop(tsd_server *srv, tsd_stream *st, uint64_t old_first)
{
    uint64_t nf = st->first_id;
    for (uint32_t i = 0; i < st->n_groups; i++) {
        tsd_stream_group *g = st->groups[i];
        if (g->floor >= nf)
            continue;
        uint64_t lost = 0;
        /* Never handed out: [max(old_first, next_id), nf). */
        uint64_t from = g->next_id > old_first ? g->next_id : old_first;
        if (from < nf)
            lost += nf - from;
        /* Pending (handed out, not acknowledged) below nf. */
        for (uint32_t k = 0; k <= g->n_members; k++) {
            tsd_stream_member *m = k < g->n_members ? g->members[k] : &g->orphans;
            uint32_t cut = pend_lower(m, nf);
            if (cut > 0) {
                pend_remove(m, 0, cut);
                lost += cut;
                pend_trim(srv, st, m);
            }
        }
        if (g->next_id < nf)
            g->next_id = nf;
        g->lost += lost;
        sx(srv)->lost += lost;
        group_floor(g);
    }
}

/* Apply retention now (after an append, a reconfiguring create, or from the cron). */
static void retain(tsd_server *srv, tsd_stream *st, uint64_t now)
{
    uint64_t old_first = st->first_id;
    const tsd_stream_config *cfg = &st->cfg;
    for (;;) {
        uint64_t n = n_entries(st);
        if (n == 0)
            break;
        const tsd_stream_entry *oldest = &st->ring[st->ring_head & (st->ring_cap - 1)];
        int drop = n > cfg->max_entries || (cfg->max_bytes != 0 && st->bytes > cfg->max_bytes) ||
                   (cfg->max_age_ms != 0 && n > 1 && now - oldest->time_ms > cfg->max_age_ms);
        if (!drop)
            break;
        entry_pop(srv, st, 1);
    }
    if (st->first_id != old_first)
        groups_after_drop(srv, st, old_first);
}

/* ---------------------------------------------------------------------------------------------
 * Streams
 */

static uint64_t stream_block(size_t len)
{
    /* The struct and name, and the table's bucket pointers (doubling: two per stream at worst). */
    return tsd_heap_block(sizeof(tsd_stream) + len) + 2 * sizeof(tsd_hnode *);
}

/* A new stream (linked). TS_EOOM, TS_ENOMEM. */
static int stream_new(tsd_server *srv, const uint8_t *name, size_t len,
                      const tsd_stream_config *cfg, uint64_t first_id, tsd_stream **out)
{
    uint64_t cost = stream_block(len);
    if (tsd_store_charge(srv, NULL, cost) != 0)
        return TS_EOOM;
    tsd_stream *st = ts__calloc(1, sizeof(*st) + len);
    if (st == NULL) {
        tsd_store_uncharge(srv, NULL, cost);
        return TS_ENOMEM;
    }
    st->node.name = (uint8_t *)(st + 1);
    if (len > 0) /* the empty name is a name too; its pointer may be NULL */
        memcpy(st->node.name, name, len);
    st->node.name_len = (uint8_t)len;
    st->node.hash = tsd_hash(name, len);
    st->cfg = *cfg;
    st->first_id = first_id;
    st->last_id = first_id - 1;
    st->cost = cost;
    st->srv = srv;
    tsd_htab_insert(&sx(srv)->table, &st->node);
    *out = st;
    return 0;
}

static void lease_timer_close(tsd_stream *st);

/* Free st (unlinked, no waits left); final: the store goes too (see tsd_store_item_drop). */
static void stream_free(tsd_server *srv, tsd_stream *st, int final)
{
    lease_timer_close(st);
    while (n_entries(st) > 0)
        entry_pop(srv, st, !final);
    for (uint32_t i = 0; i < st->n_groups; i++)
        group_free(srv, st, st->groups[i]);
    tsd_store_uncharge(srv, &st->cost, (uint64_t)st->groups_cap * sizeof(*st->groups));
    ts__free(st->groups);
    tsd_store_uncharge(srv, &st->cost, st->ring_cap * sizeof(*st->ring));
    ts__free(st->ring);
    /* What is left is the block itself. */
    srv->store.overhead -= st->cost;
    ts__free(st);
}

int tsd_streams_init(tsd_server *srv)
{
    tsd_streams *s = ts__calloc(1, sizeof(*s));
    if (s == NULL)
        return TS_ENOMEM;
    if (tsd_htab_init(&s->table) != 0) {
        ts__free(s);
        return TS_ENOMEM;
    }
    srv->streams = s;
    return 0;
}

int tsd_stream_each(tsd_server *srv, int (*fn)(tsd_stream *st, void *arg), void *arg)
{
    tsd_streams *s = sx(srv);
    if (s == NULL || s->table.buckets == NULL)
        return 0;
    for (size_t i = 0; i <= s->table.mask; i++) {
        for (tsd_hnode *n = s->table.buckets[i], *next; n != NULL; n = next) {
            next = n->next;
            int rc = fn((tsd_stream *)n, arg);
            if (rc != 0)
                return rc;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Reply bodies
 */

static void state_of(const tsd_stream *st, uint64_t now, ts__msg_stream_state *m)
{
    m->first_id = st->first_id;
    m->last_id = st->last_id;
    m->bytes = st->bytes;
    m->n_entries = tsd_stream_n_entries(st);
    m->n_groups = st->n_groups;
    m->n_stale = n_stale(st, now);
    m->credit = stream_credit(st, now, NULL);
    m->window = st->cfg.window;
}

/* A STREAM STATE reply; no_credit: its credit reads 0 (a STREAM_CREDIT that timed out). */
static void reply_state(tsd_conn *c, uint8_t op, uint32_t rid, const tsd_stream *st, int no_credit)
{
    ts__msg_stream_state m;
    state_of(st, now_ms(c->srv), &m);
    if (no_credit)
        m.credit = 0;
    uint8_t body[TS_MSG_STREAM_STATE_SIZE];
    size_t len;
    (void)ts__msg_stream_state_encode(body, sizeof(body), &m, &len);
    tsd_reply(c, op, rid, TS_ST_OK, body, len);
}

static void reply_append(tsd_conn *c, uint8_t op, uint32_t rid, const tsd_stream *st, uint64_t id)
{
    ts__msg_stream_append_state m = {.id = id,
                                     .first_id = st->first_id,
                                     .credit = stream_credit(st, now_ms(c->srv), NULL),
                                     .n_entries = tsd_stream_n_entries(st)};
    uint8_t body[TS_MSG_STREAM_APPEND_SIZE];
    size_t len;
    (void)ts__msg_stream_append_state_encode(body, sizeof(body), &m, &len);
    tsd_reply(c, op, rid, TS_ST_OK, body, len);
}

/*
 * An ENTRIES reply of the n entries in g_handed (lost: the group's, 0 for RANGE). The records go
 * by reference (no copy). When the connection takes no more output nothing is sent.
 */
static void reply_entries(tsd_conn *c, uint8_t op, uint32_t rid, const tsd_stream *st,
                          uint64_t lost, uint32_t n)
{
    size_t head = (size_t)ts__msg_stream_entries_head_size(n);
    uint64_t body_len = head;
    for (uint32_t i = 0; i < n; i++) {
        const tsd_stream_entry *e = tsd_stream_entry_get(st, g_handed[i].id);
        if (e->it != NULL)
            body_len += tsd_item_len(e->it) + ts__msg_items_pad(tsd_item_len(e->it));
    }
    if (tsd_out_begin(c, op, rid) != 0 || tsd_out_hdr(c, op, rid, TS_ST_OK, body_len) != 0)
        return;
    uint8_t *p = tsd_out_bytes(c, head);
    size_t hlen;
    if (p == NULL || ts__msg_stream_entries_head_encode(p, head, st->first_id, st->last_id, lost, n,
                                                        NULL, &hlen) != 0)
        return;
    for (uint32_t i = 0; i < n; i++) {
        const handed *hd = &g_handed[i];
        const tsd_stream_entry *e = tsd_stream_entry_get(st, hd->id);
        ts__msg_stream_entry me = {
            .id = hd->id,
            .len = e->it != NULL ? tsd_item_len(e->it) : 0,
            .tag = e->it != NULL ? 0 : e->tag,
            .rows_done = hd->rows_done,
            .deliveries = hd->deliveries > UINT16_MAX ? UINT16_MAX : (uint16_t)hd->deliveries,
            .kind = e->it != NULL ? TS_STREAM_ENTRY_RECORD : TS_STREAM_ENTRY_MARKER,
            .flags = hd->flags};
        ts__msg_stream_entries_set(p, i, &me);
    }
    for (uint32_t i = 0; i < n; i++) {
        const tsd_stream_entry *e = tsd_stream_entry_get(st, g_handed[i].id);
        if (e->it != NULL && tsd_out_item(c, e->it, 1) != 0)
            return;
    }
}

static void reply_msg_status(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status,
                             const char *what, const uint8_t *name, size_t len)
{
    char pn[SNAME_CAP];
    printable(name, len, pn);
    tsd_reply_err(c, op, rid, status, what, pn);
}

static void reply_no_stream(tsd_conn *c, uint8_t op, uint32_t rid, const uint8_t *name, size_t len)
{
    reply_msg_status(c, op, rid, TS_ST_NOT_FOUND, "no such stream: '%s'", name, len);
}

static void reply_not_stream(tsd_conn *c, uint8_t op, uint32_t rid, const uint8_t *name, size_t len)
{
    reply_msg_status(c, op, rid, TS_ST_INVALID, "bin '%s' is not a stream", name, len);
}

static void reply_backpressure(tsd_conn *c, uint8_t op, uint32_t rid, const tsd_stream *st)
{
    const tsd_stream_group *g = NULL;
    (void)stream_credit(st, now_ms(c->srv), &g);
    char pn[SNAME_CAP], pg[SNAME_CAP];
    printable(st->node.name, st->node.name_len, pn);
    if (g != NULL)
        printable(g->name, g->name_len, pg);
    else
        pg[0] = '\0';
    sx(c->srv)->backpressure++;
    tsd_reply_err(c, op, rid, TS_ST_BACKPRESSURE,
                  "stream '%s' is full: group '%s' is %llu entries behind (window %u)", pn, pg,
                  g != NULL ? (unsigned long long)group_lag(st, g) : 0ull, st->cfg.window);
}

/* ---------------------------------------------------------------------------------------------
 * Waits: the deadline heap and its timer
 */

static void handle_free(uv_handle_t *h)
{
    ts__free(h);
}

static void on_wait_timer(uv_timer_t *t);

/* Arm the timer for the earliest deadline, or close it when no wait is left. */
static void timer_rearm(tsd_server *srv)
{
    tsd_deadlines_rearm(&sx(srv)->deadlines, now_ms(srv), on_wait_timer);
}

/* Unlink and free a wait (no answer here). The caller rearms the timer. */
static void wait_drop(tsd_server *srv, tsd_swait *w)
{
    tsd_streams *s = sx(srv);
    tsd_stream *st = w->st;
    if (w->sprev != NULL)
        w->sprev->snext = w->snext;
    else
        st->waits = w->snext;
    if (w->snext != NULL)
        w->snext->sprev = w->sprev;
    else
        st->waits_tail = w->sprev;
    if (w->cprev != NULL)
        w->cprev->cnext = w->cnext;
    else
        w->c->swaits = w->cnext;
    if (w->cnext != NULL)
        w->cnext->cprev = w->cprev;
    if (w->op == TS_OP_STREAM_READ && w->m != NULL) {
        w->m->n_reading--;
        w->g->n_reading--;
        /* It was reading until now: its lease starts over from here. */
        member_touch(w->g, w->m, now_ms(srv));
    }
    s->n_waits--;
    tsd_wait_free(&s->deadlines, w->c, &w->dl, SWAIT_COST);
}

/*
 * A member (m) or a whole group (g, m NULL) goes: its reads waiting now are answered NOT_FOUND at
 * once (a read of a member that no longer exists could only time out).
 */
static void waits_forget(tsd_stream *st, const tsd_stream_group *g, const tsd_stream_member *m)
{
    tsd_server *srv = st->srv;
    int dropped = 0;
    tsd_swait *next;
    for (tsd_swait *w = st->waits; w != NULL; w = next) {
        next = w->snext;
        if (w->op != TS_OP_STREAM_READ || w->g != g || (m != NULL && w->m != m))
            continue;
        char pn[SNAME_CAP], pg[SNAME_CAP], pm[SNAME_CAP];
        printable(st->node.name, st->node.name_len, pn);
        printable(g->name, g->name_len, pg);
        printable(w->m->name, w->m->name_len, pm);
        tsd_reply_err(w->c, w->op, w->rid, TS_ST_NOT_FOUND,
                      "member '%s' of group '%s' of stream '%s' left while reading", pm, pg, pn);
        w->m->n_reading--;
        w->g->n_reading--;
        w->m = NULL;
        w->g = NULL;
        wait_drop(srv, w);
        dropped = 1;
    }
    if (dropped)
        timer_rearm(srv);
}

static void waits_forget_member(tsd_stream *st, const tsd_stream_group *g,
                                const tsd_stream_member *m)
{
    waits_forget(st, g, m);
}

static void waits_forget_group(tsd_stream *st, const tsd_stream_group *g)
{
    waits_forget(st, g, NULL);
}

/*
 * Park a request. 0; TS_ETOOMANY (--max-watch); TS_EOOM (--max-memory); TS_ENOMEM. The caller
 * fills the wait's own fields in *out afterwards (READ: g and m, with n_reading counted).
 */
static int wait_add(tsd_conn *c, tsd_stream *st, uint8_t op, uint32_t rid, uint32_t timeout_ms,
                    tsd_swait **out)
{
    tsd_server *srv = c->srv;
    tsd_streams *s = sx(srv);
    int rc = 0;
    tsd_swait *w = tsd_wait_new(&s->deadlines, c, sizeof(*w), SWAIT_COST, &rc);
    if (w == NULL)
        return rc;
    if (timeout_ms > TSD_MAX_WAIT_MS)
        timeout_ms = TSD_MAX_WAIT_MS;
    w->st = st;
    w->c = c;
    w->rid = rid;
    w->op = op;
    /* Oldest first: the waiting readers of a work queue are served in their order of arrival. */
    w->sprev = st->waits_tail;
    if (st->waits_tail != NULL)
        st->waits_tail->snext = w;
    else
        st->waits = w;
    st->waits_tail = w;
    w->cnext = c->swaits;
    if (c->swaits != NULL)
        c->swaits->cprev = w;
    c->swaits = w;
    s->n_waits++;
    if (tsd_deadlines_push(&s->deadlines, &w->dl, now_ms(srv) + timeout_ms))
        timer_rearm(srv);
    *out = w;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Gathering entries (READ, RANGE)
 */

/* Hand out one pending entry p (deliveries, time, flags) into g_handed[*n]. */
static void hand(tsd_stream_pending *p, uint64_t now, uint32_t *n)
{
    handed *hd = &g_handed[(*n)++];
    hd->id = p->id;
    hd->flags = p->deliveries > 0 ? TS_STREAM_ENTRY_REDELIVERED : 0;
    p->deliveries = p->deliveries == UINT32_MAX ? UINT32_MAX : p->deliveries + 1;
    p->last_delivery = now;
    p->redeliver = 0;
    hd->deliveries = p->deliveries;
    hd->rows_done = p->rows_done;
}

static uint64_t entry_len(const tsd_stream *st, uint64_t id)
{
    const tsd_stream_entry *e = tsd_stream_entry_get(st, id);
    return e->it != NULL ? tsd_item_len(e->it) : 0;
}

/*
 * Gather up to max entries for member m of g into g_handed (see STREAM_READ: its own entries
 * marked for redelivery, then entries claimed from members that are not live, then new ones).
 * Returns the count; 0 changes nothing. TS_E* (negative) when memory ran out before anything
 * was gathered.
 */
static int gather_read(tsd_server *srv, tsd_stream *st, tsd_stream_group *g, tsd_stream_member *m,
                       uint32_t max, uint64_t now)
{
    uint32_t n = 0;
    uint64_t bytes = 0;
#define ROOM() (n < max && bytes < TS_STREAM_READ_BYTES)
    /* 1. Its own entries marked for redelivery, ids ascending. */
    for (uint32_t k = 0; k < m->n_pend && m->n_redeliver > 0 && ROOM(); k++) {
        tsd_stream_pending *p = pend_at(m, k);
        if (!p->redeliver)
            continue;
        m->n_redeliver--;
        bytes += entry_len(st, p->id);
        hand(p, now, &n);
    }
    /* 2. Entries of members that are not live (and of members that left), ids ascending. */
    static tsd_stream_member *from[TS_STREAM_MAX_MEMBERS + 1];
    uint32_t nfrom = 0;
    if (ROOM()) {
        if (g->orphans.n_pend > 0)
            from[nfrom++] = &g->orphans;
        for (uint32_t i = 0; i < g->n_members; i++) {
            tsd_stream_member *o = g->members[i];
            if (o != m && o->n_pend > 0 && !member_live(g, o, now))
                from[nfrom++] = o;
        }
    }
    uint32_t nclaim = 0;
    if (nfrom > 0) {
        /* m's array grows by what is claimed: make the room first, so the claims cannot fail. */
        uint32_t want = max - n;
        uint64_t avail = 0;
        for (uint32_t i = 0; i < nfrom; i++)
            avail += from[i]->n_pend;
        if (avail < want)
            want = (uint32_t)avail;
        int rc = pend_reserve(srv, st, m, want);
        if (rc != 0) {
            if (n == 0)
                return rc;
            nfrom = 0;
        }
    }
    while (nfrom > 0 && ROOM()) {
        uint32_t best = 0;
        for (uint32_t i = 1; i < nfrom; i++)
            if (pend_at(from[i], 0)->id < pend_at(from[best], 0)->id)
                best = i;
        tsd_stream_member *o = from[best];
        tsd_stream_pending p = *pend_at(o, 0);
        pend_remove(o, 0, 1);
        if (o->n_pend == 0) {
            pend_trim(srv, st, o);
            from[best] = from[--nfrom];
        }
        bytes += entry_len(st, p.id);
        g_claimed[nclaim] = p;
        hand(&g_claimed[nclaim], now, &n);
        nclaim++;
    }
    if (nclaim > 0)
        (void)pend_merge(srv, st, m, g_claimed, nclaim); /* room was made above */
    /* 3. New entries from the group's cursor. */
    if (ROOM() && g->next_id <= st->last_id) {
        uint64_t left = st->last_id + 1 - g->next_id;
        uint32_t want = max - n;
        if (left < want)
            want = (uint32_t)left;
        int rc = pend_reserve(srv, st, m, want);
        if (rc != 0) {
            if (n == 0)
                return rc;
        } else {
            while (ROOM() && g->next_id <= st->last_id) {
                tsd_stream_pending *p = pend_at(m, m->n_pend);
                memset(p, 0, sizeof(*p));
                p->id = g->next_id++;
                m->n_pend++;
                bytes += entry_len(st, p->id);
                hand(p, now, &n);
            }
        }
    }
#undef ROOM
    if (n > 0)
        group_floor(g);
    return (int)n;
}

/* Gather kept entries after after_id for RANGE (no state changes). Returns the count. */
static uint32_t gather_range(const tsd_stream *st, uint64_t after_id, uint32_t max)
{
    uint32_t n = 0;
    uint64_t bytes = 0;
    uint64_t id = after_id + 1 > st->first_id ? after_id + 1 : st->first_id;
    for (; id <= st->last_id && n < max && bytes < TS_STREAM_READ_BYTES; id++) {
        handed *hd = &g_handed[n++];
        memset(hd, 0, sizeof(*hd));
        hd->id = id;
        bytes += entry_len(st, id);
    }
    return n;
}

/* ---------------------------------------------------------------------------------------------
 * Wake-ups
 */

static void lease_rearm(tsd_server *srv, tsd_stream *st);

/*
 * Try the stream's pending waits now. appended: new entries exist (READ and RANGE); the others
 * (READ claims, CREDIT) are always checked. Each wait satisfied is answered and dropped.
 */
static void waits_try(tsd_server *srv, tsd_stream *st, int appended)
{
    static uint64_t passes;
    uint64_t pass = ++passes;
    uint64_t now = now_ms(srv);
    int dropped = 0;
    uint32_t credit = UINT32_MAX;
    int credit_known = 0;
    tsd_swait *next;
    for (tsd_swait *w = st->waits; w != NULL; w = next) {
        next = w->snext;
        if (w->op == TS_OP_STREAM_RANGE) {
            if (!appended || w->after_id >= st->last_id)
                continue;
            uint32_t n = gather_range(st, w->after_id, w->max);
            reply_entries(w->c, w->op, w->rid, st, 0, n);
        } else if (w->op == TS_OP_STREAM_CREDIT) {
            if (!credit_known) {
                credit = stream_credit(st, now, NULL);
                credit_known = 1;
            }
            if (credit == 0)
                continue;
            reply_state(w->c, w->op, w->rid, st, 0);
        } else {
            if (w->m == NULL)
                continue; /* its member left: answered empty at its deadline */
            tsd_stream_group *g = w->g;
            tsd_stream_member *m = w->m;
            /*
             * Cheap test first: nothing new, nothing of its own, nobody's to claim. A group found
             * with nothing claimable stays so for the rest of the pass (the time does not move
             * and readers answered become live), so many waiting readers of one group cost one
             * walk of its members per pass, not one each.
             */
            int maybe = g->next_id <= st->last_id || m->n_redeliver > 0 || g->orphans.n_pend > 0;
            if (!maybe && g->none_claimable_pass != pass) {
                int any = 0;
                for (uint32_t i = 0; !maybe && i < g->n_members; i++) {
                    const tsd_stream_member *o = g->members[i];
                    if (o->n_pend > 0 && !member_live(g, o, now)) {
                        any = 1;
                        maybe = o != m;
                    }
                }
                if (!any)
                    g->none_claimable_pass = pass;
            }
            if (!maybe)
                continue;
            if (w->c->out_blocked)
                continue; /* on its way out: what it would be handed would be lost */
            int n = gather_read(srv, st, g, m, w->max, now);
            if (n <= 0)
                continue;
            credit_known = 0;
            reply_entries(w->c, w->op, w->rid, st, g->lost, (uint32_t)n);
        }
        wait_drop(srv, w);
        dropped = 1;
    }
    if (dropped)
        timer_rearm(srv);
    lease_rearm(srv, st);
}

/* The deadline heap's timer: answer the waits that ran out of time (a bounded number a turn). */
static void on_wait_timer(uv_timer_t *t)
{
    tsd_server *srv = t->data;
    tsd_streams *s = sx(srv);
    uint64_t now = now_ms(srv);
    for (uint32_t k = 0; k < TSD_WAKE_BUDGET && s->deadlines.n > 0; k++) {
        tsd_swait *w = (tsd_swait *)tsd_deadlines_first(&s->deadlines);
        if (w->dl.deadline > now)
            break;
        tsd_stream *st = w->st;
        if (w->op == TS_OP_STREAM_CREDIT) {
            if (stream_credit(st, now, NULL) > 0)
                reply_state(w->c, w->op, w->rid, st, 0);
            else
                reply_state(w->c, w->op, w->rid, st, 1);
        } else {
            reply_entries(w->c, w->op, w->rid, st,
                          w->op == TS_OP_STREAM_READ && w->g != NULL ? w->g->lost : 0, 0);
        }
        wait_drop(srv, w);
        lease_rearm(srv, st);
    }
    timer_rearm(srv);
    tsd_server_flush(srv);
}

static void on_lease_timer(uv_timer_t *t)
{
    tsd_stream *st = t->data;
    tsd_server *srv = st->srv;
    st->lease_due = 0;
    waits_try(srv, st, 0);
    tsd_server_flush(srv);
}

static void lease_timer_close(tsd_stream *st)
{
    if (st->lease_timer != NULL) {
        uv_timer_stop(st->lease_timer);
        uv_close((uv_handle_t *)st->lease_timer, handle_free);
        st->lease_timer = NULL;
    }
    st->lease_due = 0;
}

/*
 * Arm st's lease timer for the next moment a lease end can satisfy one of its waits: a live
 * group holding the credit going stale (CREDIT waits), or a member whose pending entries would
 * become claimable by a waiting reader of its group (READ waits). Without such a wait the timer
 * goes. O(groups + members of the groups with waiting readers).
 */
static void lease_rearm(tsd_server *srv, tsd_stream *st)
{
    uint64_t now = now_ms(srv), due = UINT64_MAX;
    int credit_waits = 0, read_waits = 0;
    for (const tsd_swait *w = st->waits; w != NULL; w = w->snext) {
        credit_waits |= w->op == TS_OP_STREAM_CREDIT;
        read_waits |= w->op == TS_OP_STREAM_READ && w->g != NULL;
    }
    if (!credit_waits && !read_waits) {
        lease_timer_close(st);
        return;
    }
    for (uint32_t i = 0; i < st->n_groups; i++) {
        const tsd_stream_group *g = st->groups[i];
        if (!tsd_stream_group_live(g, now))
            continue;
        if (credit_waits && st->cfg.window != 0 && g->n_reading == 0 &&
            group_lag(st, g) >= st->cfg.window) {
            uint64_t t = g->newest_seen + g->lease_ms + 1;
            if (t < due)
                due = t;
        }
        if (read_waits && g->n_reading > 0) {
            for (uint32_t k = 0; k < g->n_members; k++) {
                const tsd_stream_member *o = g->members[k];
                if (o->n_pend > 0 && o->n_reading == 0 && member_live(g, o, now)) {
                    uint64_t t = member_lease_end(g, o);
                    if (t < due)
                        due = t;
                }
            }
        }
    }
    if (due == UINT64_MAX) {
        lease_timer_close(st);
        return;
    }
    if (st->lease_timer == NULL) {
        st->lease_timer = ts__malloc(sizeof(*st->lease_timer));
        if (st->lease_timer == NULL) {
            st->lease_due = LEASE_NO_TIMER; /* the cron looks again within TSD_CRON_MS */
            return;
        }
        uv_timer_init(srv->loop, st->lease_timer);
        st->lease_timer->data = st;
    }
    if (st->lease_due == due)
        return;
    st->lease_due = due;
    uv_timer_start(st->lease_timer, on_lease_timer, due > now ? due - now : 0, 0);
}

/* ---------------------------------------------------------------------------------------------
 * Requests
 */

/* The stream of a STREAM_* request other than CREATE, or NULL after replying why not. */
static tsd_stream *stream_of(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t len)
{
    tsd_stream *st = tsd_stream_find(c->srv, name, len);
    if (st != NULL)
        return st;
    if (tsd_store_find(&c->srv->store, name, len) != NULL)
        reply_not_stream(c, h->opcode, h->request_id, name, len);
    else
        reply_no_stream(c, h->opcode, h->request_id, name, len);
    return NULL;
}

/* Check STREAM_CREATE's settings into cfg; 0, or -1 after an INVALID reply. */
static int check_config(tsd_conn *c, const ts__hdr *h, uint64_t max_entries, uint64_t max_bytes,
                        uint32_t max_age_ms, uint32_t window, uint32_t lease_ms, uint32_t flags,
                        tsd_stream_config *cfg)
{
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    if (max_entries < 1 || max_entries > TS_STREAM_MAX_ENTRIES) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "max_entries %llu is not within 1..%llu",
                      (unsigned long long)max_entries, (unsigned long long)TS_STREAM_MAX_ENTRIES);
        return -1;
    }
    if (window > max_entries) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "window %u is larger than max_entries %llu",
                      window, (unsigned long long)max_entries);
        return -1;
    }
    if (lease_ms > TS_STREAM_MAX_LEASE_MS) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "lease_ms %u is over %u", lease_ms,
                      TS_STREAM_MAX_LEASE_MS);
        return -1;
    }
    if (flags != 0) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "unknown STREAM_CREATE flags 0x%x", flags);
        return -1;
    }
    cfg->max_entries = max_entries;
    cfg->max_bytes = max_bytes;
    cfg->max_age_ms = max_age_ms;
    cfg->window = window;
    cfg->lease_ms = lease_ms != 0 ? lease_ms : TS_STREAM_DEFAULT_LEASE_MS;
    return 0;
}

static void op_create(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t len,
                      const tsd_stream_config *cfg)
{
    tsd_server *srv = c->srv;
    if (tsd_store_find(&srv->store, name, len) != NULL) {
        reply_not_stream(c, h->opcode, h->request_id, name, len);
        return;
    }
    tsd_stream *st = tsd_stream_find(srv, name, len);
    if (st == NULL) {
        int rc = stream_new(srv, name, len, cfg, 1, &st);
        if (rc != 0) {
            tsd_reply_oom(c, h->opcode, h->request_id, rc, "creating a stream");
            return;
        }
    } else {
        st->cfg = *cfg;
        retain(srv, st, now_ms(srv));
    }
    (void)tsd_server_next_version(srv);
    reply_state(c, h->opcode, h->request_id, st, 0);
    /* A new window (or fewer entries kept) may give credit. */
    waits_try(srv, st, 0);
}

/* Append an entry (record it, or a marker) and answer APPEND STATE; notify. */
static void append_entry(tsd_conn *c, const ts__hdr *h, tsd_stream *st, tsd_item *it, uint64_t tag)
{
    tsd_server *srv = c->srv;
    int rc = ring_reserve(srv, st);
    if (rc != 0) {
        if (it != NULL) {
            tsd_store_unreserve(&srv->store, tsd_item_len(it));
            tsd_item_unref(it);
        }
        tsd_reply_oom(c, h->opcode, h->request_id, rc, "appending to a stream");
        return;
    }
    uint64_t now = now_ms(srv);
    entry_push(srv, st, it, tag, now);
    uint64_t id = st->last_id;
    retain(srv, st, now);
    (void)tsd_server_next_version(srv);
    reply_append(c, h->opcode, h->request_id, st, id);
    tsd_notify_change(srv, st->node.name, st->node.name_len, id, tsd_stream_n_entries(st),
                      TS_NOTE_APPEND);
    waits_try(srv, st, 1);
}

uint16_t tsd_stream_append_check(tsd_server *srv, const uint8_t *name, size_t len)
{
    tsd_stream *st = tsd_stream_find(srv, name, len);
    if (st == NULL)
        return tsd_store_find(&srv->store, name, len) != NULL ||
                       tsd_table_find(srv, name, len) != NULL
                   ? TS_ST_INVALID
                   : TS_ST_NOT_FOUND;
    return stream_credit(st, now_ms(srv), NULL) == 0 ? TS_ST_BACKPRESSURE : TS_ST_OK;
}

void tsd_stream_refuse_append(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t len,
                              uint16_t status)
{
    tsd_stream *st = tsd_stream_find(c->srv, name, len);
    if (status == TS_ST_BACKPRESSURE && st != NULL)
        reply_backpressure(c, h->opcode, h->request_id, st);
    else if (status == TS_ST_INVALID && st == NULL && tsd_table_find(c->srv, name, len) != NULL)
        (void)tsd_table_refuse_name(c, h->opcode, h->request_id, name, len);
    else if (status == TS_ST_INVALID)
        reply_not_stream(c, h->opcode, h->request_id, name, len);
    else if (status == TS_ST_BACKPRESSURE)
        reply_no_stream(c, h->opcode, h->request_id, name, len); /* deleted meanwhile */
    else
        reply_no_stream(c, h->opcode, h->request_id, name, len);
}

void tsd_stream_append(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t len,
                       tsd_item *item)
{
    tsd_server *srv = c->srv;
    srv->stats.ops[h->opcode]++;
    uint16_t status = tsd_stream_append_check(srv, name, len);
    if (status != TS_ST_OK) {
        tsd_store_unreserve(&srv->store, tsd_item_len(item));
        tsd_item_unref(item);
        tsd_stream_refuse_append(c, h, name, len, status);
        return;
    }
    append_entry(c, h, tsd_stream_find(srv, name, len), item, 0);
}

static void op_credit(tsd_conn *c, const ts__hdr *h, tsd_stream *st, uint32_t timeout_ms)
{
    uint32_t credit = stream_credit(st, now_ms(c->srv), NULL);
    if (credit > 0) {
        reply_state(c, h->opcode, h->request_id, st, 0);
        return;
    }
    if (timeout_ms == 0) {
        reply_state(c, h->opcode, h->request_id, st, 1);
        return;
    }
    tsd_swait *w;
    int rc = wait_add(c, st, h->opcode, h->request_id, timeout_ms, &w);
    if (rc != 0) {
        tsd_reply_wait_error(c, h->opcode, h->request_id, rc);
        return;
    }
    lease_rearm(c->srv, st);
}

static void op_join(tsd_conn *c, const ts__hdr *h, tsd_stream *st, const uint8_t *gname,
                    size_t glen, const uint8_t *mname, size_t mlen, uint8_t start,
                    uint32_t lease_ms)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    if (start > 1) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "start %u is neither 0 (OLDEST) nor 1 (NEWEST)",
                      start);
        return;
    }
    if (lease_ms > TS_STREAM_MAX_LEASE_MS) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "lease_ms %u is over %u", lease_ms,
                      TS_STREAM_MAX_LEASE_MS);
        return;
    }
    uint64_t now = now_ms(srv);
    tsd_stream_group *g = group_find(st, gname, glen);
    int made_group = 0;
    if (g == NULL) {
        if (st->n_groups >= TS_STREAM_MAX_GROUPS) {
            tsd_reply_err(c, op, rid, TS_ST_INVALID, "the stream has %u groups already (limit)",
                          TS_STREAM_MAX_GROUPS);
            return;
        }
        int rc = group_new(srv, st, gname, glen, start == 0 ? st->first_id : st->last_id + 1,
                           lease_ms != 0 ? lease_ms : st->cfg.lease_ms, &g);
        if (rc != 0) {
            tsd_reply_oom(c, op, rid, rc, "adding a group");
            return;
        }
        made_group = 1;
    }
    tsd_stream_member *m = member_find(g, mname, mlen);
    if (m == NULL) {
        int rc = g->n_members >= TS_STREAM_MAX_MEMBERS
                     ? TS_ETOOMANY
                     : member_new(srv, st, g, mname, mlen, now, &m);
        if (rc != 0) {
            if (made_group)
                group_remove(srv, st, g);
            if (rc == TS_ETOOMANY)
                tsd_reply_err(c, op, rid, TS_ST_INVALID, "the group has %u members already (limit)",
                              TS_STREAM_MAX_MEMBERS);
            else
                tsd_reply_oom(c, op, rid, rc, "adding a member");
            return;
        }
    }
    if (lease_ms != 0)
        g->lease_ms = lease_ms;
    for (uint32_t k = 0; k < m->n_pend; k++)
        pend_at(m, k)->redeliver = 1;
    m->n_redeliver = m->n_pend;
    member_touch(g, m, now);
    (void)tsd_server_next_version(srv);
    ts__msg_stream_join_state js = {.next_id = g->next_id,
                                    .floor = g->floor,
                                    .lost = g->lost,
                                    .pending = m->n_pend,
                                    .members = g->n_members,
                                    .rows_done = m->n_pend > 0 ? pend_at(m, 0)->rows_done : 0};
    uint8_t body[TS_MSG_STREAM_JOIN_SIZE];
    size_t blen;
    (void)ts__msg_stream_join_state_encode(body, sizeof(body), &js, &blen);
    tsd_reply(c, op, rid, TS_ST_OK, body, blen);
    /* Its entries marked for redelivery may satisfy a read of it that waits elsewhere; a group
     * that was stale is live again, so the lease timer may matter for it now. */
    if (m->n_pend > 0)
        waits_try(srv, st, 0);
    else
        lease_rearm(srv, st);
}

/* The member of a READ/ACK, or NULL after a NOT_FOUND reply. */
static tsd_stream_member *joined(tsd_conn *c, const ts__hdr *h, tsd_stream *st,
                                 const uint8_t *gname, size_t glen, const uint8_t *mname,
                                 size_t mlen, tsd_stream_group **gout)
{
    tsd_stream_group *g = group_find(st, gname, glen);
    tsd_stream_member *m = g != NULL ? member_find(g, mname, mlen) : NULL;
    if (m == NULL) {
        char pn[SNAME_CAP], pg[SNAME_CAP], pm[SNAME_CAP];
        printable(st->node.name, st->node.name_len, pn);
        printable(gname, glen, pg);
        printable(mname, mlen, pm);
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_NOT_FOUND,
                      "no member '%s' in group '%s' of stream '%s' (JOIN first)", pm, pg, pn);
        return NULL;
    }
    *gout = g;
    return m;
}

/* Acknowledge m's pending entries with ids in [first, last]. Returns how many. */
static uint64_t ack_range(tsd_server *srv, tsd_stream *st, tsd_stream_group *g,
                          tsd_stream_member *m, uint64_t first, uint64_t last)
{
    uint32_t k0 = pend_lower(m, first);
    uint32_t k1 = last == UINT64_MAX ? m->n_pend : pend_lower(m, last + 1);
    if (k1 <= k0)
        return 0;
    pend_remove(m, k0, k1);
    pend_trim(srv, st, m);
    group_floor(g);
    return k1 - k0;
}

static void reply_past(tsd_conn *c, const ts__hdr *h, uint64_t id, const tsd_stream *st)
{
    tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID, "id %llu is past the newest id %llu",
                  (unsigned long long)id, (unsigned long long)st->last_id);
}

static void op_read(tsd_conn *c, const ts__hdr *h, tsd_stream *st, const uint8_t *gname,
                    size_t glen, const uint8_t *mname, size_t mlen, uint64_t ack_through,
                    uint32_t max, uint32_t timeout_ms)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    tsd_stream_group *g = NULL;
    tsd_stream_member *m = joined(c, h, st, gname, glen, mname, mlen, &g);
    if (m == NULL)
        return;
    if (max < 1 || max > TS_STREAM_MAX_READ) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "max_entries %u is not within 1..%u", max,
                      TS_STREAM_MAX_READ);
        return;
    }
    if (ack_through > st->last_id) {
        reply_past(c, h, ack_through, st);
        return;
    }
    uint64_t now = now_ms(srv);
    member_touch(g, m, now);
    (void)tsd_server_next_version(srv);
    int acked = ack_through > 0 && ack_range(srv, st, g, m, 1, ack_through) > 0;
    /* A connection that takes no more output gets nothing handed: it would be lost. */
    int n = c->out_blocked ? 0 : gather_read(srv, st, g, m, max, now);
    if (c->out_blocked) {
        /* No reply can go out any more (the connection is on its way out). */
    } else if (n < 0) {
        tsd_reply_oom(c, op, rid, n, "handing out entries");
    } else if (n > 0 || timeout_ms == 0) {
        reply_entries(c, op, rid, st, g->lost, (uint32_t)n);
    } else {
        tsd_swait *w;
        int rc = wait_add(c, st, op, rid, timeout_ms, &w);
        if (rc != 0) {
            tsd_reply_wait_error(c, op, rid, rc);
        } else {
            w->g = g;
            w->m = m;
            w->max = max;
            m->n_reading++;
            g->n_reading++;
        }
    }
    if (acked)
        waits_try(srv, st, 0);
    else
        lease_rearm(srv, st);
}

static void op_ack(tsd_conn *c, const ts__hdr *h, tsd_stream *st, const uint8_t *gname, size_t glen,
                   const uint8_t *mname, size_t mlen, uint64_t first, uint64_t last, uint32_t rows)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    tsd_stream_group *g = NULL;
    tsd_stream_member *m = joined(c, h, st, gname, glen, mname, mlen, &g);
    if (m == NULL)
        return;
    if (first > last) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "first %llu is after last %llu",
                      (unsigned long long)first, (unsigned long long)last);
        return;
    }
    if (last > st->last_id) {
        reply_past(c, h, last, st);
        return;
    }
    if (rows > 0 && first != last) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      "rows %u given for ids %llu..%llu: a partial ack names one entry", rows,
                      (unsigned long long)first, (unsigned long long)last);
        return;
    }
    member_touch(g, m, now_ms(srv));
    (void)tsd_server_next_version(srv);
    uint64_t acked = 0;
    if (rows == 0) {
        acked = ack_range(srv, st, g, m, first, last);
    } else {
        uint32_t k = pend_lower(m, first);
        if (k < m->n_pend && pend_at(m, k)->id == first)
            pend_at(m, k)->rows_done = rows;
    }
    ts__msg_stream_ack_state as = {.acked = acked,
                                   .floor = g->floor,
                                   .pending = m->n_pend,
                                   .credit = stream_credit(st, now_ms(srv), NULL)};
    uint8_t body[TS_MSG_STREAM_ACK_SIZE];
    size_t blen;
    (void)ts__msg_stream_ack_state_encode(body, sizeof(body), &as, &blen);
    tsd_reply(c, op, rid, TS_ST_OK, body, blen);
    if (acked > 0)
        waits_try(srv, st, 0);
    else
        lease_rearm(srv, st);
}

static void op_leave(tsd_conn *c, const ts__hdr *h, tsd_stream *st, const uint8_t *gname,
                     size_t glen, const uint8_t *mname, size_t mlen)
{
    tsd_server *srv = c->srv;
    tsd_stream_group *g = group_find(st, gname, glen);
    tsd_stream_member *m = g != NULL && mlen > 0 ? member_find(g, mname, mlen) : NULL;
    if (g == NULL || (mlen > 0 && m == NULL)) {
        char pn[SNAME_CAP], pg[SNAME_CAP], pm[SNAME_CAP];
        printable(st->node.name, st->node.name_len, pn);
        printable(gname, glen, pg);
        printable(mname, mlen, pm);
        if (g == NULL)
            tsd_reply_err(c, h->opcode, h->request_id, TS_ST_NOT_FOUND,
                          "no group '%s' in stream '%s'", pg, pn);
        else
            tsd_reply_err(c, h->opcode, h->request_id, TS_ST_NOT_FOUND,
                          "no member '%s' in group '%s' of stream '%s'", pm, pg, pn);
        return;
    }
    if (m != NULL)
        member_remove(srv, st, g, m);
    else
        group_remove(srv, st, g);
    (void)tsd_server_next_version(srv);
    reply_state(c, h->opcode, h->request_id, st, 0);
    /* Its entries are claimable now, and the credit may have grown. */
    waits_try(srv, st, 0);
}

static void op_range(tsd_conn *c, const ts__hdr *h, tsd_stream *st, uint64_t after_id, uint32_t max,
                     uint32_t timeout_ms)
{
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    if (max < 1 || max > TS_STREAM_MAX_READ) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "max_entries %u is not within 1..%u", max,
                      TS_STREAM_MAX_READ);
        return;
    }
    if (after_id > st->last_id) {
        reply_past(c, h, after_id, st);
        return;
    }
    uint32_t n = gather_range(st, after_id, max);
    if (n > 0 || timeout_ms == 0) {
        reply_entries(c, op, rid, st, 0, n);
        return;
    }
    tsd_swait *w;
    int rc = wait_add(c, st, op, rid, timeout_ms, &w);
    if (rc != 0) {
        tsd_reply_wait_error(c, op, rid, rc);
        return;
    }
    w->after_id = after_id;
    w->max = max;
}

/* ---------------------------------------------------------------------------------------------
 * STREAM_INFO
 */

/* 1 when p[0..len) is valid UTF-8 (no overlong forms, no surrogates, at most U+10FFFF). */
static int utf8_ok(const uint8_t *p, size_t len)
{
    size_t i = 0;
    while (i < len) {
        uint8_t b = p[i];
        size_t n;
        uint32_t cp;
        if (b < 0x80) {
            i++;
            continue;
        }
        if ((b & 0xE0) == 0xC0) {
            n = 2;
            cp = b & 0x1Fu;
        } else if ((b & 0xF0) == 0xE0) {
            n = 3;
            cp = b & 0x0Fu;
        } else if ((b & 0xF8) == 0xF0) {
            n = 4;
            cp = b & 0x07u;
        } else {
            return 0;
        }
        if (n > len - i)
            return 0;
        for (size_t k = 1; k < n; k++) {
            if ((p[i + k] & 0xC0) != 0x80)
                return 0;
            cp = (cp << 6) | (p[i + k] & 0x3Fu);
        }
        static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < least[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += n;
    }
    return 1;
}

static ts_value_t *name_value(const uint8_t *p, size_t len)
{
    if (utf8_ok(p, len))
        return ts_string_new((const char *)p, len);
    return ts_bytes_new(p, len, TS_COPY);
}

static int put_i64(ts_value_t *map, const char *key, int64_t v)
{
    return ts_map_set(map, key, ts_int_new(v));
}

static int put_u64(ts_value_t *map, const char *key, uint64_t v)
{
    return put_i64(map, key, v > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)v);
}

static ts_value_t *info_build(tsd_server *srv, const tsd_stream *st)
{
    uint64_t now = now_ms(srv);
    ts_value_t *root = ts_map_new();
    if (root == NULL)
        return NULL;
    uint32_t credit = stream_credit(st, now, NULL);
    int rc = 0;
    rc |= put_u64(root, "first_id", st->first_id);
    rc |= put_u64(root, "last_id", st->last_id);
    rc |= put_u64(root, "entries", n_entries(st));
    rc |= put_u64(root, "bytes", st->bytes);
    rc |= put_u64(root, "max_entries", st->cfg.max_entries);
    rc |= put_u64(root, "max_bytes", st->cfg.max_bytes);
    rc |= put_u64(root, "max_age_ms", st->cfg.max_age_ms);
    rc |= put_u64(root, "window", st->cfg.window);
    rc |= put_u64(root, "lease_ms", st->cfg.lease_ms);
    rc |= put_i64(root, "credit", credit == UINT32_MAX ? -1 : (int64_t)credit);
    ts_value_t *groups = ts_list_new();
    for (uint32_t i = 0; rc == 0 && groups != NULL && i < st->n_groups; i++) {
        const tsd_stream_group *g = st->groups[i];
        ts_value_t *gm = ts_map_new();
        if (gm == NULL) {
            rc = TS_ENOMEM;
            break;
        }
        uint64_t pending = g->orphans.n_pend;
        for (uint32_t k = 0; k < g->n_members; k++)
            pending += g->members[k]->n_pend;
        rc |= ts_map_set(gm, "name", name_value(g->name, g->name_len));
        rc |= put_u64(gm, "next_id", g->next_id);
        rc |= put_u64(gm, "floor", g->floor);
        rc |= put_u64(gm, "lag", group_lag(st, g));
        rc |= put_u64(gm, "lost", g->lost);
        rc |= put_u64(gm, "pending", pending);
        rc |= put_u64(gm, "lease_ms", g->lease_ms);
        rc |= put_u64(gm, "live", (uint64_t)tsd_stream_group_live(g, now));
        ts_value_t *members = ts_list_new();
        for (uint32_t k = 0; rc == 0 && members != NULL && k < g->n_members; k++) {
            const tsd_stream_member *m = g->members[k];
            ts_value_t *mm = ts_map_new();
            rc |= ts_map_set(mm, "name", name_value(m->name, m->name_len));
            rc |= put_u64(mm, "pending", m->n_pend);
            rc |= put_u64(mm, "idle_ms", m->n_reading > 0 ? 0 : now - m->last_seen);
            rc |= ts_list_push(members, mm);
        }
        rc |= ts_map_set(gm, "members", members);
        rc |= ts_list_push(groups, gm);
    }
    rc |= ts_map_set(root, "groups", groups);
    if (rc != 0) {
        ts_value_free(root);
        return NULL;
    }
    return root;
}

static void op_info(tsd_conn *c, const ts__hdr *h, tsd_stream *st)
{
    ts_value_t *root = info_build(c->srv, st);
    uint8_t *rec = NULL;
    size_t len = 0;
    if (root == NULL || ts__record_encode(root, &rec, &len) != 0) {
        ts_value_free(root);
        c->srv->stats.out_of_memory++;
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL, "out of memory in STREAM_INFO");
        return;
    }
    ts_value_free(root);
    tsd_reply(c, h->opcode, h->request_id, TS_ST_OK, rec, len);
    ts__free_aligned(rec, len);
}

/* ---------------------------------------------------------------------------------------------
 * DELETE, connections, the cron, STATS, exit
 */

/* Answer every wait of st NOT_FOUND and drop it. */
static void waits_gone(tsd_server *srv, tsd_stream *st)
{
    int had = st->waits != NULL;
    while (st->waits != NULL) {
        tsd_swait *w = st->waits;
        reply_no_stream(w->c, w->op, w->rid, st->node.name, st->node.name_len);
        if (w->m != NULL) {
            w->m->n_reading--;
            w->g->n_reading--;
            w->m = NULL;
        }
        wait_drop(srv, w);
    }
    if (had)
        timer_rearm(srv);
}

void tsd_stream_delete(tsd_conn *c, const ts__hdr *h, tsd_stream *st)
{
    tsd_server *srv = c->srv;
    uint64_t last = st->last_id;
    uint32_t n = tsd_stream_n_entries(st);
    uint8_t name[TS_MAX_NAME_LEN];
    size_t len = st->node.name_len;
    memcpy(name, st->node.name, len);
    waits_gone(srv, st);
    tsd_htab_remove(&sx(srv)->table, &st->node);
    stream_free(srv, st, 0);
    (void)tsd_server_next_version(srv);
    tsd_reply_state(c, h->opcode, h->request_id, TS_ST_OK, last, n);
    tsd_notify_change(srv, name, len, last, 0, TS_NOTE_DELETE);
}

void tsd_stream_conn_gone(tsd_server *srv, tsd_conn *c)
{
    if (c->swaits == NULL)
        return;
    while (c->swaits != NULL) {
        tsd_swait *w = c->swaits;
        tsd_stream *st = w->st;
        wait_drop(srv, w);
        lease_rearm(srv, st);
    }
    timer_rearm(srv);
}

size_t tsd_stream_conn_stop(tsd_server *srv, tsd_conn *c)
{
    size_t n = 0;
    if (c->swaits == NULL)
        return 0;
    while (c->swaits != NULL) {
        tsd_swait *w = c->swaits;
        tsd_stream *st = w->st;
        tsd_reply_msg(c, w->op, w->rid, TS_ST_SHUTTING_DOWN, TSD_SHUTDOWN_MSG,
                      sizeof(TSD_SHUTDOWN_MSG) - 1);
        wait_drop(srv, w);
        lease_rearm(srv, st);
        n++;
    }
    timer_rearm(srv);
    return n;
}

static int by_name(const void *pa, const void *pb)
{
    const tsd_stream *a = *(const tsd_stream *const *)pa;
    const tsd_stream *b = *(const tsd_stream *const *)pb;
    return tsd_name_cmp(a->node.name, a->node.name_len, b->node.name, b->node.name_len);
}

typedef struct collect_ctx {
    tsd_stream **arr;
    size_t n;
} collect_ctx;

static int collect_one(tsd_stream *st, void *arg)
{
    collect_ctx *x = arg;
    x->arr[x->n++] = st;
    return 0;
}

int tsd_stream_sorted(tsd_server *srv, tsd_stream ***out, size_t *n)
{
    *out = NULL;
    *n = 0;
    size_t count = srv->streams != NULL ? sx(srv)->table.count : 0;
    if (count == 0)
        return 0;
    collect_ctx x = {.arr = ts__malloc(count * sizeof(tsd_stream *)), .n = 0};
    if (x.arr == NULL)
        return TS_ENOMEM;
    (void)tsd_stream_each(srv, collect_one, &x);
    qsort(x.arr, x.n, sizeof(*x.arr), by_name);
    *out = x.arr;
    *n = x.n;
    return 0;
}

int tsd_stream_refuse_name(tsd_conn *c, uint8_t op, uint32_t rid, const uint8_t *name, size_t len)
{
    if (tsd_stream_find(c->srv, name, len) == NULL)
        return 0;
    reply_msg_status(c, op, rid, TS_ST_INVALID, "bin '%s' is a stream", name, len);
    return 1;
}

static int cron_one(tsd_stream *st, void *arg)
{
    tsd_server *srv = arg;
    if (st->cfg.max_age_ms != 0 && n_entries(st) > 1) {
        uint64_t first = st->first_id;
        retain(srv, st, now_ms(srv));
        if (st->first_id != first && st->waits != NULL)
            waits_try(srv, st, 0);
    }
    /* A lease timer that could not be allocated is made up for here (never otherwise). */
    if (st->waits != NULL && st->lease_timer == NULL && st->lease_due == LEASE_NO_TIMER)
        waits_try(srv, st, 0);
    return 0;
}

void tsd_streams_cron(tsd_server *srv)
{
    if (srv->streams != NULL && !srv->stopping)
        (void)tsd_stream_each(srv, cron_one, srv);
}

typedef struct stats_ctx {
    tsd_stream_stats *out;
    uint64_t now;
} stats_ctx;

static int stale_one(tsd_stream *st, void *arg)
{
    stats_ctx *x = arg;
    x->out->groups += st->n_groups;
    x->out->groups_stale += n_stale(st, x->now);
    return 0;
}

void tsd_stream_stats_get(tsd_server *srv, tsd_stream_stats *out)
{
    memset(out, 0, sizeof(*out));
    tsd_streams *s = sx(srv);
    if (s == NULL)
        return;
    out->streams = s->table.count;
    out->entries = s->entries;
    out->bytes = s->bytes;
    out->backpressure = s->backpressure;
    out->lost = s->lost;
    out->waits = s->n_waits;
    stats_ctx x = {.out = out, .now = now_ms(srv)};
    (void)tsd_stream_each(srv, stale_one, &x);
}

static int close_timers(tsd_stream *st, void *arg)
{
    (void)arg;
    lease_timer_close(st);
    return 0;
}

void tsd_streams_stop(tsd_server *srv)
{
    tsd_streams *s = sx(srv);
    if (s == NULL)
        return;
    (void)tsd_stream_each(srv, close_timers, NULL);
    tsd_deadlines_stop(&s->deadlines);
}

static int free_one(tsd_stream *st, void *arg)
{
    tsd_server *srv = arg;
    /* Waits are gone by now (their connections were closed); unlink any left defensively. */
    while (st->waits != NULL)
        wait_drop(srv, st->waits);
    tsd_htab_remove(&sx(srv)->table, &st->node);
    stream_free(srv, st, 1);
    return 0;
}

void tsd_streams_free(tsd_server *srv)
{
    tsd_streams *s = sx(srv);
    if (s == NULL)
        return;
    (void)tsd_stream_each(srv, free_one, srv);
    tsd_htab_free(&s->table);
    tsd_deadlines_free(&s->deadlines);
    ts__free(s);
    srv->streams = NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Dispatch
 */

void tsd_stream_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    /* CREATE, MARK, JOIN, READ, ACK and LEAVE change what a snapshot holds. */
    if (ts__msg_op_info(op)->changes && tsd_writes_refused(srv)) {
        tsd_refuse_write(c, op, rid);
        return;
    }
    tsd_stream *st;
    switch (op) {
    case TS_OP_STREAM_CREATE: {
        const ts__msg_stream_create_req *q = &m->u.stream_create;
        tsd_stream_config cfg;
        if (check_config(c, h, q->max_entries, q->max_bytes, q->max_age_ms, q->window, q->lease_ms,
                         q->flags, &cfg) == 0)
            op_create(c, h, q->name, q->name_len, &cfg);
        return;
    }
    case TS_OP_STREAM_MARK: {
        const ts__msg_stream_mark_req *q = &m->u.stream_mark;
        if ((st = stream_of(c, h, q->name, q->name_len)) != NULL)
            append_entry(c, h, st, NULL, q->tag);
        return;
    }
    case TS_OP_STREAM_CREDIT: {
        const ts__msg_stream_credit_req *q = &m->u.stream_credit;
        if ((st = stream_of(c, h, q->name, q->name_len)) != NULL)
            op_credit(c, h, st, q->timeout_ms);
        return;
    }
    case TS_OP_STREAM_JOIN:
    case TS_OP_STREAM_READ:
    case TS_OP_STREAM_ACK:
    case TS_OP_STREAM_LEAVE: {
        const ts__msg_stream_member_req *q = &m->u.stream_member;
        if ((st = stream_of(c, h, q->name, q->name_len)) == NULL)
            return;
        if (op == TS_OP_STREAM_JOIN)
            op_join(c, h, st, q->group, q->group_len, q->member, q->member_len, q->start,
                    q->lease_ms);
        else if (op == TS_OP_STREAM_READ)
            op_read(c, h, st, q->group, q->group_len, q->member, q->member_len, q->ack_through,
                    q->max_entries, q->timeout_ms);
        else if (op == TS_OP_STREAM_ACK)
            op_ack(c, h, st, q->group, q->group_len, q->member, q->member_len, q->first, q->last,
                   q->rows);
        else
            op_leave(c, h, st, q->group, q->group_len, q->member, q->member_len);
        return;
    }
    case TS_OP_STREAM_INFO: {
        const ts__msg_name_req *q = &m->u.name_req;
        if ((st = stream_of(c, h, q->name, q->name_len)) != NULL)
            op_info(c, h, st);
        return;
    }
    case TS_OP_STREAM_RANGE: {
        const ts__msg_stream_range_req *q = &m->u.stream_range;
        if ((st = stream_of(c, h, q->name, q->name_len)) != NULL)
            op_range(c, h, st, q->after_id, q->max_entries, q->timeout_ms);
        return;
    }
    default:
        tsd_conn_fail(c, op, rid, TS_ST_UNKNOWN_OPCODE, "unknown opcode 0x%02x", op);
        return;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Rebuilding (snapshot loading)
 */

int tsd_stream_restore(tsd_server *srv, const uint8_t *name, size_t len,
                       const tsd_stream_config *cfg, uint64_t first_id, tsd_stream **out)
{
    if (len < 1 || len > TS_MAX_NAME_LEN || first_id < 1 || cfg->max_entries < 1 ||
        cfg->max_entries > TS_STREAM_MAX_ENTRIES || cfg->window > cfg->max_entries ||
        cfg->lease_ms < 1 || cfg->lease_ms > TS_STREAM_MAX_LEASE_MS ||
        tsd_stream_find(srv, name, len) != NULL || tsd_store_find(&srv->store, name, len) != NULL)
        return TS_EINVAL;
    return stream_new(srv, name, len, cfg, first_id, out);
}

int tsd_stream_restore_entry(tsd_server *srv, tsd_stream *st, uint64_t id, uint64_t time_ms,
                             tsd_item *it, uint64_t tag)
{
    if (id != st->last_id + 1 || n_entries(st) >= TS_STREAM_MAX_ENTRIES)
        return TS_EINVAL;
    int rc = ring_reserve(srv, st);
    if (rc != 0)
        return rc;
    entry_push(srv, st, it, tag, time_ms);
    return 0;
}

int tsd_stream_restore_group(tsd_server *srv, tsd_stream *st, const uint8_t *name, size_t len,
                             uint64_t next_id, uint64_t lost, uint32_t lease_ms,
                             tsd_stream_group **out)
{
    if (len < 1 || len > TS_STREAM_MAX_ID_LEN || next_id < st->first_id ||
        next_id > st->last_id + 1 || lease_ms < 1 || lease_ms > TS_STREAM_MAX_LEASE_MS ||
        st->n_groups >= TS_STREAM_MAX_GROUPS || group_find(st, name, len) != NULL)
        return TS_EINVAL;
    int rc = group_new(srv, st, name, len, next_id, lease_ms, out);
    if (rc == 0)
        (*out)->lost = lost;
    return rc;
}

int tsd_stream_restore_member(tsd_server *srv, tsd_stream *st, tsd_stream_group *g,
                              const uint8_t *name, size_t len, tsd_stream_member **out)
{
    if (len == 0) {
        *out = &g->orphans;
        return 0;
    }
    if (len > TS_STREAM_MAX_ID_LEN || g->n_members >= TS_STREAM_MAX_MEMBERS ||
        member_find(g, name, len) != NULL)
        return TS_EINVAL;
    return member_new(srv, st, g, name, len, now_ms(srv), out);
}

int tsd_stream_restore_pending(tsd_server *srv, tsd_stream *st, tsd_stream_group *g,
                               tsd_stream_member *m, uint64_t id, uint32_t deliveries,
                               uint32_t rows_done)
{
    if (id < st->first_id || id >= g->next_id ||
        (m->n_pend > 0 && pend_at(m, m->n_pend - 1)->id >= id))
        return TS_EINVAL;
    tsd_stream_pending p = {.id = id,
                            .last_delivery = now_ms(srv),
                            .deliveries = deliveries,
                            .rows_done = rows_done,
                            .redeliver = m->name_len > 0};
    int rc = pend_merge(srv, st, m, &p, 1);
    if (rc == 0)
        group_floor(g);
    return rc;
}
