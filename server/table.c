/*
 * Replay tables (table.h; docs/PROTOCOL.md 8.33 to 8.38).
 *
 * Structures. A table's items live in a dense array (items[0 .. n)): a uniform draw picks an
 * index in O(1) and a removal moves the last item into the hole. A sum tree over the same
 * positions holds each item's weight (priority ^ priority_exponent): a prioritized draw descends
 * it in O(log n), a priority change or a move updates one leaf and its ancestors (each node is
 * recomputed from its two children, so rounding never accumulates). Keys are given in increasing
 * order, so insertion order is key order: a doubly linked list (oldest, newest) serves the FIFO
 * and LIFO samplers and removers. The lowest-priority remover keeps a binary min-heap of items by
 * (priority, key). Keys are found through a chained hash of buckets sized to the items.
 *
 * Rate limiter (as Reverb defines it): with spi = samples_per_insert and the band
 * [min_diff, max_diff] = min_size_to_sample * spi -/+ error_buffer, an insert may go when the
 * table holds fewer than min_size_to_sample items after it, or when
 * (inserts + 1) * spi - samples <= max_diff; a draw may go when the table holds at least
 * min_size_to_sample items and inserts * spi - (samples + 1) >= min_diff. error_buffer 0 turns
 * the ratio off (only min_size_to_sample holds samplers back). Inserts and samples counted here
 * are the table's since its creation; its size is what it holds (inserts less deletes).
 *
 * Waits. An insert or a sample the limiter holds back waits on the server (a tsd_twait in its
 * table's insert or sample queue and its connection's list, counted against --max-watch and
 * --max-memory as a WAIT, its deadline in one heap served by one timer). Each change that can
 * move the ratio (an insert, a draw, a removal) serves the queues oldest first until neither
 * can move. Each wait is answered exactly once: served, TIMEOUT, NOT_FOUND when its table is
 * deleted, SHUTTING_DOWN when tensord stops, or dropped without an answer when its connection
 * closes. Requests that arrive while others of their kind wait queue behind them.
 */
#include "table.h"
#include "deadline.h"
#include "heap.h"
#include "snapfile.h"
#include "stream.h"

#include "msg.h"
#include "record.h"

#include <math.h>
#include <stdio.h>
#include <unistd.h>

/* Room for a printable name in messages (255 bytes, each at most 4 bytes of UTF-8). */
#define TNAME_CAP (TS_MAX_NAME_LEN * 4 + 1)
/* Slots of the dense array, the sum tree and the heap when first allocated (they double). */
#define TABLE_MIN_SLOTS 16u
/*
 * The largest weight (priority ^ exponent) an item may have: 2^24 of them still sum to a finite
 * double (about 1.7e257 at most), so the sum tree never overflows.
 */
#define TABLE_MAX_WEIGHT 1e250

typedef struct titem {
    uint64_t key;
    double priority;
    tsd_item *it;
    uint64_t time_ms; /* uv_now at insertion */
    uint32_t times_sampled;
    uint32_t pos;      /* in items[] */
    uint32_t heap_idx; /* in the lowest-priority heap */
    struct titem *older, *newer;
    struct titem *hnext; /* in its key bucket */
} titem;

/* What one entry of TABLE_CREATE sets (checked). */
typedef struct tcfg {
    uint64_t capacity, min_size;
    double spi, error_buffer, exponent, min_diff, max_diff;
    uint32_t max_times;
    uint8_t remover, sampler;
} tcfg;

struct tsd_table {
    tsd_hnode node; /* first: in tsd_tables.table (name after the struct) */
    tsd_server *srv;
    tcfg cfg;
    titem **items;
    uint32_t n, cap;
    double *tree;       /* 2 * leaves; tree[1] is the total, leaf of position p at leaves + p */
    uint32_t leaves;    /* a power of two >= cap (0 before the first insert) */
    titem **buckets;    /* by key & (n_buckets - 1) */
    uint32_t n_buckets; /* a power of two */
    titem **heap;       /* lowest-priority remover only: heap[0 .. n) */
    titem *oldest, *newest;
    uint64_t next_key, inserts, samples, deletes, bytes, cost;
    tsd_twait *ins_head, *ins_tail, *smp_head, *smp_tail;
    uint32_t n_ins_waits, n_smp_waits;
};

struct tsd_twait {
    tsd_deadline dl; /* first: the deadline heap points here */
    tsd_table *t;
    tsd_conn *c;
    uint32_t rid;
    uint8_t op;
    tsd_twait *prev, *next;   /* in its table's queue */
    tsd_twait *cprev, *cnext; /* in its connection */
    tsd_item *it;             /* INSERT: the record (reference and held reservation) */
    double priority;          /* INSERT */
    uint32_t n;               /* SAMPLE: draws asked for */
};

/* What a wait counts against --max-memory (its block and its heap slot). */
#define TWAIT_COST ((uint64_t)(sizeof(tsd_twait) + 16 + sizeof(tsd_twait *)))

typedef struct tsd_tables {
    tsd_htab table;
    tsd_deadlines deadlines;
    uint64_t rng, n_waits;
} tsd_tables;

/* One draw of a SAMPLE reply (the record referenced until the reply is queued). */
typedef struct drawn {
    tsd_item *it;
    uint64_t key, age_ms;
    double probability;
    uint32_t times_sampled;
} drawn;

static drawn g_drawn[TS_TABLE_MAX_SAMPLE];

static tsd_tables *tx(tsd_server *srv)
{
    return srv->tables;
}

static uint64_t now_ms(tsd_server *srv)
{
    return uv_now(srv->loop);
}

static void printable(const uint8_t *name, size_t len, char *out)
{
    tsd_name_printable(name, len, out, TNAME_CAP);
}

/* ---------------------------------------------------------------------------------------------
 * Random numbers: xorshift64*, seeded once per process (no fixed sequence is promised)
 */

static uint64_t rng_next(tsd_tables *s)
{
    uint64_t x = s->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    s->rng = x;
    return x * 0x2545F4914F6CDD1DULL;
}

/* A uniform double in [0, 1). */
static double rng_unit(tsd_tables *s)
{
    return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

/* A uniform integer in [0, n), n >= 1 (Lemire's reduction; its bias is below 2^-32 here). */
static uint32_t rng_below(tsd_tables *s, uint32_t n)
{
    return (uint32_t)(((rng_next(s) >> 32) * (uint64_t)n) >> 32);
}

/* ---------------------------------------------------------------------------------------------
 * The sum tree, the key buckets, the order list and the lowest-priority heap
 */

static double weight_of(const tsd_table *t, double priority)
{
    if (t->cfg.exponent == 0.0)
        return 1.0;
    return pow(priority, t->cfg.exponent);
}

static void tree_set(tsd_table *t, uint32_t pos, double w)
{
    if (t->tree == NULL)
        return;
    uint32_t i = t->leaves + pos;
    t->tree[i] = w;
    for (i >>= 1; i >= 1; i >>= 1)
        t->tree[i] = t->tree[2 * i] + t->tree[2 * i + 1];
}

/* The position whose cumulative weight range holds u (0 <= u < total). */
static uint32_t tree_find(const tsd_table *t, double u)
{
    uint32_t i = 1;
    while (i < t->leaves) {
        double left = t->tree[2 * i];
        if (u < left || t->tree[2 * i + 1] <= 0.0) {
            i = 2 * i;
        } else {
            u -= left;
            i = 2 * i + 1;
        }
    }
    uint32_t pos = i - t->leaves;
    return pos < t->n ? pos : t->n - 1; /* rounding at the very end of the range */
}

static int heap_less(const void *a, const void *b)
{
    const titem *x = a, *y = b;
    return x->priority < y->priority || (x->priority == y->priority && x->key < y->key);
}

static void *hget(void *h, size_t i)
{
    return ((tsd_table *)h)->heap[i];
}

static void hset(void *h, size_t i, void *p)
{
    titem *x = p;
    ((tsd_table *)h)->heap[i] = x;
    x->heap_idx = (uint32_t)i; /* i < t->n, a uint32_t */
}

static const tsd_heap_ops item_heap = {hget, hset, heap_less};

static void hup(tsd_table *t, uint32_t i)
{
    tsd_heap_up(t, i, &item_heap);
}

static void hdown(tsd_table *t, uint32_t i)
{
    tsd_heap_down(t, i, t->n, &item_heap);
}

static titem *key_find(const tsd_table *t, uint64_t key)
{
    if (t->n_buckets == 0)
        return NULL;
    for (titem *x = t->buckets[key & (t->n_buckets - 1)]; x != NULL; x = x->hnext)
        if (x->key == key)
            return x;
    return NULL;
}

/*
 * Room for one more item: the dense array, the tree and the heap double, the buckets follow the
 * item count. 0, TS_EOOM or TS_ENOMEM (nothing changed then).
 */
static int grow(tsd_server *srv, tsd_table *t)
{
    if (t->n < t->cap && t->n < t->n_buckets)
        return 0;
    if (t->n == t->cap) {
        uint64_t ncap = t->cap != 0 ? (uint64_t)t->cap * 2 : TABLE_MIN_SLOTS;
        if (ncap > t->cfg.capacity)
            ncap = t->cfg.capacity;
        uint64_t nleaves = 1;
        while (nleaves < ncap)
            nleaves *= 2;
        int heap = t->cfg.remover == TS_TABLE_REMOVER_LOWEST;
        uint64_t more = (ncap - t->cap) * sizeof(titem *) * (heap ? 2 : 1) +
                        (nleaves - t->leaves) * 2 * sizeof(double);
        if (tsd_store_charge(srv, &t->cost, more) != 0)
            return TS_EOOM;
        titem **items = ts__realloc(t->items, (size_t)ncap * sizeof(*items));
        titem **hp = heap ? ts__realloc(t->heap, (size_t)ncap * sizeof(*hp)) : NULL;
        double *tree = nleaves != t->leaves ? ts__calloc((size_t)nleaves * 2, sizeof(*tree)) : NULL;
        if (items != NULL)
            t->items = items;
        if (hp != NULL)
            t->heap = hp;
        if (items == NULL || (heap && hp == NULL) || (nleaves != t->leaves && tree == NULL)) {
            ts__free(tree);
            tsd_store_uncharge(srv, &t->cost, more);
            return TS_ENOMEM;
        }
        if (tree != NULL) {
            for (uint32_t p = 0; p < t->n; p++)
                tree[nleaves + p] = t->tree[t->leaves + p];
            for (uint64_t i = nleaves - 1; i >= 1; i--)
                tree[i] = tree[2 * i] + tree[2 * i + 1];
            ts__free(t->tree);
            t->tree = tree;
            t->leaves = (uint32_t)nleaves;
        }
        t->cap = (uint32_t)ncap;
    }
    if (t->n >= t->n_buckets) {
        uint32_t nb = t->n_buckets != 0 ? t->n_buckets * 2 : TABLE_MIN_SLOTS;
        uint64_t more = (uint64_t)(nb - t->n_buckets) * sizeof(titem *);
        if (tsd_store_charge(srv, &t->cost, more) != 0)
            return TS_EOOM;
        titem **b = ts__calloc(nb, sizeof(*b));
        if (b == NULL) {
            tsd_store_uncharge(srv, &t->cost, more);
            return TS_ENOMEM;
        }
        for (uint32_t i = 0; i < t->n_buckets; i++) {
            for (titem *x = t->buckets[i], *next; x != NULL; x = next) {
                next = x->hnext;
                x->hnext = b[x->key & (nb - 1)];
                b[x->key & (nb - 1)] = x;
            }
        }
        ts__free(t->buckets);
        t->buckets = b;
        t->n_buckets = nb;
    }
    return 0;
}

/* Link a new item x (room made by grow). */
static void item_link(tsd_table *t, titem *x)
{
    x->pos = t->n;
    t->items[t->n++] = x;
    tree_set(t, x->pos, weight_of(t, x->priority));
    x->hnext = t->buckets[x->key & (t->n_buckets - 1)];
    t->buckets[x->key & (t->n_buckets - 1)] = x;
    x->older = t->newest;
    x->newer = NULL;
    if (t->newest != NULL)
        t->newest->newer = x;
    else
        t->oldest = x;
    t->newest = x;
    if (t->cfg.remover == TS_TABLE_REMOVER_LOWEST) {
        /* t->n already counts x: the heap's size is the item count. */
        hset(t, t->n - 1, x);
        hup(t, t->n - 1);
    }
}

static uint64_t titem_cost(void)
{
    return tsd_heap_block(sizeof(titem));
}

/*
 * A zeroed item, with room made for it in t (grow) and its cost charged. 0 with *out, or
 * TS_EOOM/TS_ENOMEM (its cost is not charged then).
 */
static int item_new(tsd_server *srv, tsd_table *t, titem **out)
{
    int rc = grow(srv, t);
    if (rc == 0)
        rc = tsd_store_charge(srv, &t->cost, titem_cost());
    if (rc != 0)
        return rc;
    titem *x = ts__calloc(1, sizeof(*x));
    if (x == NULL) {
        tsd_store_uncharge(srv, &t->cost, titem_cost());
        return TS_ENOMEM;
    }
    *out = x;
    return 0;
}

/* Remove x (a delete for the rate limiter) and free it; orphan as tsd_store_item_drop's. */
static void item_unlink(tsd_server *srv, tsd_table *t, titem *x, int orphan)
{
    uint32_t pos = x->pos, last = t->n - 1;
    if (pos != last) {
        titem *y = t->items[last];
        t->items[pos] = y;
        y->pos = pos;
        tree_set(t, pos, t->tree != NULL ? t->tree[t->leaves + last] : 0.0);
    }
    tree_set(t, last, 0.0);
    if (t->cfg.remover == TS_TABLE_REMOVER_LOWEST) {
        uint32_t hi = x->heap_idx;
        titem *hl = t->heap[last];
        t->n--; /* the heap shrinks with the count */
        if (hi != last) {
            hset(t, hi, hl);
            hup(t, hi);
            hdown(t, hl->heap_idx);
        }
    } else {
        t->n--;
    }
    titem **pp = &t->buckets[x->key & (t->n_buckets - 1)];
    while (*pp != x)
        pp = &(*pp)->hnext;
    *pp = x->hnext;
    if (x->older != NULL)
        x->older->newer = x->newer;
    else
        t->oldest = x->newer;
    if (x->newer != NULL)
        x->newer->older = x->older;
    else
        t->newest = x->older;
    t->bytes -= tsd_item_len(x->it);
    t->deletes++;
    tsd_store_item_drop(&srv->store, x->it, orphan);
    ts__free(x);
    tsd_store_uncharge(srv, &t->cost, titem_cost());
    (void)tsd_server_next_version(srv); /* a change a snapshot must hold */
}

/* Change x's priority (already checked). */
static void item_reprioritize(tsd_table *t, titem *x, double priority)
{
    x->priority = priority;
    (void)tsd_server_next_version(t->srv);
    tree_set(t, x->pos, weight_of(t, priority));
    if (t->cfg.remover == TS_TABLE_REMOVER_LOWEST) {
        hup(t, x->heap_idx);
        hdown(t, x->heap_idx);
    }
}

/* The item the remover evicts from a full table. */
static titem *remover_pick(const tsd_table *t)
{
    switch (t->cfg.remover) {
    case TS_TABLE_REMOVER_LIFO:
        return t->newest;
    case TS_TABLE_REMOVER_LOWEST:
        return t->heap[0];
    default:
        return t->oldest;
    }
}

/* ---------------------------------------------------------------------------------------------
 * The rate limiter and the samplers
 */

static int can_insert(const tsd_table *t)
{
    /* A full table evicts one first: its size stays at capacity. */
    uint64_t size_after = t->n < t->cfg.capacity ? (uint64_t)t->n + 1 : t->n;
    if (size_after <= t->cfg.min_size || t->cfg.error_buffer == 0.0)
        return 1;
    return (double)(t->inserts + 1) * t->cfg.spi - (double)t->samples <= t->cfg.max_diff;
}

static int can_sample(const tsd_table *t)
{
    if (t->n == 0 || t->n < t->cfg.min_size)
        return 0;
    if (t->cfg.error_buffer == 0.0)
        return 1;
    return (double)t->inserts * t->cfg.spi - (double)(t->samples + 1) >= t->cfg.min_diff;
}

/* One draw: the item and the probability it had. */
static titem *draw(tsd_table *t, double *prob)
{
    tsd_tables *s = tx(t->srv);
    switch (t->cfg.sampler) {
    case TS_TABLE_SAMPLER_FIFO:
        *prob = 1.0;
        return t->oldest;
    case TS_TABLE_SAMPLER_LIFO:
        *prob = 1.0;
        return t->newest;
    case TS_TABLE_SAMPLER_PRIORITIZED: {
        double total = t->tree[1];
        if (total > 0.0 && isfinite(total)) {
            titem *x = t->items[tree_find(t, rng_unit(s) * total)];
            *prob = weight_of(t, x->priority) / total;
            return x;
        }
        /* Every weight is 0: every item is as likely as the others. */
        break;
    }
    default:
        break;
    }
    *prob = 1.0 / (double)t->n;
    return t->items[rng_below(s, t->n)];
}

/*
 * Up to max draws while the limiter allows them (at least one when can_sample held), into
 * g_drawn with a reference each; items that reach max_times_sampled are removed. The count.
 */
static uint32_t draw_many(tsd_table *t, uint32_t max)
{
    tsd_server *srv = t->srv;
    uint64_t now = now_ms(srv);
    uint32_t k = 0;
    while (k < max && can_sample(t)) {
        double prob;
        titem *x = draw(t, &prob);
        x->times_sampled++;
        t->samples++;
        (void)tsd_server_next_version(srv); /* times_sampled and samples are in a snapshot */
        drawn *d = &g_drawn[k++];
        d->it = x->it;
        tsd_item_ref(x->it);
        d->key = x->key;
        d->age_ms = now - x->time_ms;
        d->probability = prob;
        d->times_sampled = x->times_sampled;
        if (t->cfg.max_times != 0 && x->times_sampled >= t->cfg.max_times)
            item_unlink(srv, t, x, 1);
    }
    return k;
}

/* ---------------------------------------------------------------------------------------------
 * Replies
 */

static void reply_state(tsd_conn *c, uint8_t op, uint32_t rid, const tsd_table *t, uint64_t key,
                        uint32_t done, uint32_t skipped)
{
    ts__msg_table_state m = {.key = key,
                             .size = t->n,
                             .inserts = t->inserts,
                             .samples = t->samples,
                             .done = done,
                             .skipped = skipped};
    uint8_t body[TS_MSG_TABLE_STATE_SIZE];
    size_t len;
    (void)ts__msg_table_state_encode(body, sizeof(body), &m, &len);
    tsd_reply(c, op, rid, TS_ST_OK, body, len);
}

/* The SAMPLES reply of the k draws in g_drawn; their references are released here. */
static void reply_samples(tsd_conn *c, uint8_t op, uint32_t rid, const tsd_table *t, uint32_t k)
{
    size_t head = (size_t)ts__msg_table_samples_head_size(k);
    uint64_t body_len = head;
    for (uint32_t i = 0; i < k; i++)
        body_len += tsd_item_len(g_drawn[i].it) + ts__msg_items_pad(tsd_item_len(g_drawn[i].it));
    uint8_t *p = NULL;
    size_t hlen;
    if (tsd_out_begin(c, op, rid) == 0 && tsd_out_hdr(c, op, rid, TS_ST_OK, body_len) == 0 &&
        (p = tsd_out_bytes(c, head)) != NULL &&
        ts__msg_table_samples_head_encode(p, head, t->n, k, NULL, &hlen) == 0) {
        for (uint32_t i = 0; i < k; i++) {
            ts__msg_table_sample e = {.key = g_drawn[i].key,
                                      .len = tsd_item_len(g_drawn[i].it),
                                      .probability = g_drawn[i].probability,
                                      .age_ms = g_drawn[i].age_ms,
                                      .times_sampled = g_drawn[i].times_sampled};
            ts__msg_table_samples_set(p, i, &e);
        }
        for (uint32_t i = 0; i < k; i++)
            if (tsd_out_item(c, g_drawn[i].it, 1) != 0)
                break;
    }
    for (uint32_t i = 0; i < k; i++)
        tsd_item_unref(g_drawn[i].it);
}

static void reply_no_table(tsd_conn *c, uint8_t op, uint32_t rid, const uint8_t *name, size_t len)
{
    char pn[TNAME_CAP];
    printable(name, len, pn);
    if (tsd_store_find(&c->srv->store, name, len) != NULL ||
        tsd_stream_find(c->srv, name, len) != NULL)
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "bin '%s' is not a replay table", pn);
    else
        tsd_reply_err(c, op, rid, TS_ST_NOT_FOUND, "no such replay table: '%s'", pn);
}

/* ---------------------------------------------------------------------------------------------
 * Waits: the deadline heap and its timer
 */

static void on_timer(uv_timer_t *timer);

static void timer_rearm(tsd_server *srv)
{
    tsd_deadlines_rearm(&tx(srv)->deadlines, now_ms(srv), on_timer);
}

/* Unlink and free w (no answer here); an insert's record is released. The caller rearms. */
static void wait_drop(tsd_server *srv, tsd_twait *w)
{
    tsd_tables *s = tx(srv);
    tsd_table *t = w->t;
    int ins = w->op == TS_OP_TABLE_INSERT;
    tsd_twait **head = ins ? &t->ins_head : &t->smp_head;
    tsd_twait **tail = ins ? &t->ins_tail : &t->smp_tail;
    if (w->prev != NULL)
        w->prev->next = w->next;
    else
        *head = w->next;
    if (w->next != NULL)
        w->next->prev = w->prev;
    else
        *tail = w->prev;
    if (ins)
        t->n_ins_waits--;
    else
        t->n_smp_waits--;
    if (w->cprev != NULL)
        w->cprev->cnext = w->cnext;
    else
        w->c->twaits = w->cnext;
    if (w->cnext != NULL)
        w->cnext->cprev = w->cprev;
    if (w->it != NULL)
        tsd_store_item_drop(&srv->store, w->it, 1);
    s->n_waits--;
    tsd_wait_free(&s->deadlines, w->c, &w->dl, TWAIT_COST);
}

/* Park a request. 0; TS_ETOOMANY (--max-watch); TS_EOOM; TS_ENOMEM. */
static int wait_add(tsd_conn *c, tsd_table *t, uint8_t op, uint32_t rid, uint32_t timeout_ms,
                    tsd_twait **out)
{
    tsd_server *srv = c->srv;
    tsd_tables *s = tx(srv);
    int rc = 0;
    tsd_twait *w = tsd_wait_new(&s->deadlines, c, sizeof(*w), TWAIT_COST, &rc);
    if (w == NULL)
        return rc;
    if (timeout_ms > TSD_MAX_WAIT_MS)
        timeout_ms = TSD_MAX_WAIT_MS;
    w->t = t;
    w->c = c;
    w->rid = rid;
    w->op = op;
    int ins = op == TS_OP_TABLE_INSERT;
    tsd_twait **head = ins ? &t->ins_head : &t->smp_head;
    tsd_twait **tail = ins ? &t->ins_tail : &t->smp_tail;
    w->prev = *tail;
    if (*tail != NULL)
        (*tail)->next = w;
    else
        *head = w;
    *tail = w;
    if (ins)
        t->n_ins_waits++;
    else
        t->n_smp_waits++;
    w->cnext = c->twaits;
    if (c->twaits != NULL)
        c->twaits->cprev = w;
    c->twaits = w;
    s->n_waits++;
    if (tsd_deadlines_push(&s->deadlines, &w->dl, now_ms(srv) + timeout_ms))
        timer_rearm(srv);
    *out = w;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Inserting and serving the queues
 */

/*
 * Insert it (its reference and held bytes become the table's) with priority; the remover
 * evicts one first when the table is full. 0 with *key, or TS_EOOM/TS_ENOMEM (it untouched).
 */
static int insert_now(tsd_table *t, tsd_item *it, double priority, uint64_t *key)
{
    tsd_server *srv = t->srv;
    if (t->n >= t->cfg.capacity)
        item_unlink(srv, t, remover_pick(t), 1);
    titem *x;
    int rc = item_new(srv, t, &x);
    if (rc != 0)
        return rc;
    x->key = t->next_key++;
    x->priority = priority;
    x->it = it;
    x->time_ms = now_ms(srv);
    item_link(t, x);
    t->bytes += tsd_item_len(it);
    t->inserts++;
    *key = x->key;
    (void)tsd_server_next_version(srv);
    return 0;
}

/* Serve the waiting inserts and samples of t, oldest first, while the limiter lets them go. */
static void serve(tsd_table *t)
{
    tsd_server *srv = t->srv;
    int moved = 1, any = 0;
    while (moved) {
        moved = 0;
        while (t->ins_head != NULL && can_insert(t)) {
            tsd_twait *w = t->ins_head;
            uint64_t key = 0;
            int rc = insert_now(t, w->it, w->priority, &key);
            if (rc == 0) {
                w->it = NULL; /* the table's now */
                reply_state(w->c, w->op, w->rid, t, key, 1, 0);
            } else {
                tsd_reply_oom(w->c, w->op, w->rid, rc, "inserting into a replay table");
            }
            wait_drop(srv, w);
            moved = any = 1;
        }
        while (t->smp_head != NULL && can_sample(t)) {
            tsd_twait *w = t->smp_head;
            uint32_t k = draw_many(t, w->n);
            reply_samples(w->c, w->op, w->rid, t, k);
            wait_drop(srv, w);
            moved = any = 1;
        }
    }
    if (any)
        timer_rearm(srv);
}

static void on_timer(uv_timer_t *timer)
{
    tsd_server *srv = timer->data;
    tsd_tables *s = tx(srv);
    uint64_t now = now_ms(srv);
    while (s->deadlines.n > 0 && tsd_deadlines_first(&s->deadlines)->deadline <= now) {
        tsd_twait *w = (tsd_twait *)tsd_deadlines_first(&s->deadlines);
        char pn[TNAME_CAP];
        printable(w->t->node.name, w->t->node.name_len, pn);
        tsd_reply_err(w->c, w->op, w->rid, TS_ST_TIMEOUT,
                      "replay table '%s': the rate limiter held the %s back until its timeout", pn,
                      w->op == TS_OP_TABLE_INSERT ? "insert" : "sample");
        wait_drop(srv, w);
    }
    timer_rearm(srv);
    tsd_server_flush(srv); /* the answers go now, not at the next turn that flushes */
}

/* ---------------------------------------------------------------------------------------------
 * Life cycle
 */

static uint64_t table_block(size_t len)
{
    return tsd_heap_block(sizeof(tsd_table) + len) + 2 * sizeof(tsd_hnode *);
}

static void table_free(tsd_server *srv, tsd_table *t, int final)
{
    while (t->n > 0)
        item_unlink(srv, t, t->items[t->n - 1], !final);
    ts__free(t->items);
    ts__free(t->tree);
    ts__free(t->buckets);
    ts__free(t->heap);
    srv->store.overhead -= t->cost;
    ts__free(t);
}

int tsd_tables_init(tsd_server *srv)
{
    tsd_tables *s = ts__calloc(1, sizeof(*s));
    if (s == NULL)
        return TS_ENOMEM;
    if (tsd_htab_init(&s->table) != 0) {
        ts__free(s);
        return TS_ENOMEM;
    }
    s->rng = (uv_hrtime() ^ ((uint64_t)getpid() << 32)) | 1u;
    srv->tables = s;
    return 0;
}

int tsd_table_each(tsd_server *srv, int (*fn)(tsd_table *t, void *arg), void *arg)
{
    tsd_tables *s = tx(srv);
    if (s == NULL || s->table.buckets == NULL)
        return 0;
    for (size_t i = 0; i <= s->table.mask; i++) {
        for (tsd_hnode *n = s->table.buckets[i], *next; n != NULL; n = next) {
            next = n->next;
            int rc = fn((tsd_table *)n, arg);
            if (rc != 0)
                return rc;
        }
    }
    return 0;
}

size_t tsd_table_count(const tsd_server *srv)
{
    return srv->tables != NULL ? srv->tables->table.count : 0;
}

tsd_table *tsd_table_find(tsd_server *srv, const uint8_t *name, size_t len)
{
    if (srv->tables == NULL)
        return NULL;
    return (tsd_table *)tsd_htab_find(&tx(srv)->table, name, len);
}

void tsd_table_list_entry(const tsd_table *t, ts__msg_list_entry *e)
{
    e->name = t->node.name;
    e->name_len = t->node.name_len;
    e->n_items = t->n;
    e->bytes = t->bytes;
    e->version = t->inserts;
}

static void waits_gone(tsd_server *srv, tsd_table *t)
{
    int had = t->ins_head != NULL || t->smp_head != NULL;
    while (t->ins_head != NULL || t->smp_head != NULL) {
        tsd_twait *w = t->ins_head != NULL ? t->ins_head : t->smp_head;
        reply_no_table(w->c, w->op, w->rid, t->node.name, t->node.name_len);
        wait_drop(srv, w);
    }
    if (had)
        timer_rearm(srv);
}

void tsd_table_delete(tsd_conn *c, const ts__hdr *h, tsd_table *t)
{
    tsd_server *srv = c->srv;
    uint64_t version = t->inserts;
    uint32_t n = t->n;
    uint8_t name[TS_MAX_NAME_LEN];
    size_t len = t->node.name_len;
    memcpy(name, t->node.name, len);
    tsd_htab_remove(&tx(srv)->table, &t->node);
    waits_gone(srv, t);
    table_free(srv, t, 0);
    (void)tsd_server_next_version(srv);
    tsd_reply_state(c, h->opcode, h->request_id, TS_ST_OK, version, n);
    tsd_notify_change(srv, name, len, version, 0, TS_NOTE_DELETE);
}

void tsd_table_conn_gone(tsd_server *srv, tsd_conn *c)
{
    if (c->twaits == NULL)
        return;
    while (c->twaits != NULL) {
        tsd_twait *w = c->twaits;
        wait_drop(srv, w); /* the counters did not move: nothing else can go now */
    }
    timer_rearm(srv);
}

size_t tsd_table_conn_stop(tsd_server *srv, tsd_conn *c)
{
    size_t n = 0;
    if (c->twaits == NULL)
        return 0;
    while (c->twaits != NULL) {
        tsd_twait *w = c->twaits;
        tsd_reply_msg(c, w->op, w->rid, TS_ST_SHUTTING_DOWN, TSD_SHUTDOWN_MSG,
                      sizeof(TSD_SHUTDOWN_MSG) - 1);
        wait_drop(srv, w);
        n++;
    }
    timer_rearm(srv);
    return n;
}

int tsd_table_refuse_name(tsd_conn *c, uint8_t op, uint32_t rid, const uint8_t *name, size_t len)
{
    if (tsd_table_find(c->srv, name, len) == NULL)
        return 0;
    char pn[TNAME_CAP];
    printable(name, len, pn);
    tsd_reply_err(c, op, rid, TS_ST_INVALID, "bin '%s' is a replay table", pn);
    return 1;
}

static int stats_one(tsd_table *t, void *arg)
{
    tsd_table_stats *o = arg;
    o->items += t->n;
    o->bytes += t->bytes;
    o->inserts += t->inserts;
    o->samples += t->samples;
    return 0;
}

void tsd_table_stats_get(tsd_server *srv, tsd_table_stats *out)
{
    memset(out, 0, sizeof(*out));
    tsd_tables *s = tx(srv);
    if (s == NULL)
        return;
    out->tables = s->table.count;
    out->waits = s->n_waits;
    (void)tsd_table_each(srv, stats_one, out);
}

void tsd_tables_stop(tsd_server *srv)
{
    tsd_tables *s = tx(srv);
    if (s == NULL)
        return;
    tsd_deadlines_stop(&s->deadlines);
}

static int free_one(tsd_table *t, void *arg)
{
    tsd_server *srv = arg;
    while (t->ins_head != NULL || t->smp_head != NULL)
        wait_drop(srv, t->ins_head != NULL ? t->ins_head : t->smp_head);
    tsd_htab_remove(&tx(srv)->table, &t->node);
    table_free(srv, t, 1);
    return 0;
}

void tsd_tables_free(tsd_server *srv)
{
    tsd_tables *s = tx(srv);
    if (s == NULL)
        return;
    (void)tsd_table_each(srv, free_one, srv);
    tsd_htab_free(&s->table);
    tsd_deadlines_free(&s->deadlines);
    ts__free(s);
    srv->tables = NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Requests
 */

/* A priority the table takes: finite, >= 0, with a finite weight under TABLE_MAX_WEIGHT. */
static int priority_ok(const tcfg *cfg, double p)
{
    if (!isfinite(p) || p < 0.0)
        return 0;
    double w = cfg->exponent == 0.0 ? 1.0 : pow(p, cfg->exponent);
    return isfinite(w) && w <= TABLE_MAX_WEIGHT;
}

static tsd_table *table_of(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t len)
{
    tsd_table *t = tsd_table_find(c->srv, name, len);
    if (t == NULL)
        reply_no_table(c, h->opcode, h->request_id, name, len);
    return t;
}

/*
 * A new, empty table named name with these settings (checked by the caller), linked into the
 * tables and counted against --max-memory. 0 with *out, or TS_EOOM / TS_ENOMEM.
 */
static int table_new(tsd_server *srv, const uint8_t *name, size_t len, uint64_t capacity,
                     uint64_t min_size, double spi, double eb, double exponent, uint32_t max_times,
                     uint8_t remover, uint8_t sampler, tsd_table **out)
{
    uint64_t cost = table_block(len);
    if (tsd_store_charge(srv, NULL, cost) != 0)
        return TS_EOOM;
    tsd_table *t = ts__calloc(1, sizeof(*t) + len);
    if (t == NULL) {
        tsd_store_uncharge(srv, NULL, cost);
        return TS_ENOMEM;
    }
    t->node.name = (uint8_t *)(t + 1);
    if (len > 0)
        memcpy(t->node.name, name, len);
    t->node.name_len = (uint8_t)len;
    t->node.hash = tsd_hash(name, len);
    t->srv = srv;
    t->cost = cost;
    t->next_key = 1;
    t->cfg.capacity = capacity;
    t->cfg.min_size = min_size;
    t->cfg.spi = spi;
    t->cfg.error_buffer = eb;
    t->cfg.min_diff = (double)min_size * spi - eb;
    t->cfg.max_diff = (double)min_size * spi + eb;
    t->cfg.exponent = exponent;
    t->cfg.max_times = max_times;
    t->cfg.remover = remover;
    t->cfg.sampler = sampler;
    tsd_htab_insert(&tx(srv)->table, &t->node);
    *out = t;
    return 0;
}

static void op_create(tsd_conn *c, const ts__hdr *h, const ts__msg_table_create_req *q)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    const char *bad = NULL;
    double eb = q->error_buffer, spi = q->samples_per_insert;
    if (q->name_len == 0)
        bad = "a replay table needs a name";
    else if (q->capacity < 1 || q->capacity > TS_TABLE_MAX_CAPACITY)
        bad = "capacity must be 1..2^24";
    else if (q->min_size_to_sample < 1 || q->min_size_to_sample > q->capacity)
        bad = "min_size_to_sample must be 1..capacity";
    else if (!isfinite(spi) || spi <= 0.0)
        bad = "samples_per_insert must be finite and above 0";
    else if (!isfinite(eb) || eb < 0.0 || (eb != 0.0 && eb < (spi > 1.0 ? spi : 1.0)))
        bad = "error_buffer must be 0 (no ratio limit) or at least max(1, samples_per_insert)";
    else if (!isfinite(q->priority_exponent) || q->priority_exponent < 0.0)
        bad = "priority_exponent must be finite and at least 0";
    else if (q->sampler > TS_TABLE_SAMPLER_LIFO)
        bad = "unknown sampler";
    else if (q->remover > TS_TABLE_REMOVER_LOWEST)
        bad = "unknown remover";
    if (bad != NULL) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "TABLE_CREATE: %s", bad);
        return;
    }
    char pn[TNAME_CAP];
    printable(q->name, q->name_len, pn);
    if (tsd_table_find(srv, q->name, q->name_len) != NULL) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "replay table '%s' exists", pn);
        return;
    }
    if (tsd_store_find(&srv->store, q->name, q->name_len) != NULL) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "bin '%s' exists and is not a replay table", pn);
        return;
    }
    if (tsd_stream_refuse_name(c, op, rid, q->name, q->name_len))
        return;
    tsd_table *t;
    int rc = table_new(srv, q->name, q->name_len, q->capacity, q->min_size_to_sample, spi, eb,
                       q->priority_exponent, q->max_times_sampled, q->remover, q->sampler, &t);
    if (rc != 0) {
        tsd_reply_oom(c, op, rid, rc, "creating a replay table");
        return;
    }
    (void)tsd_server_next_version(srv);
    reply_state(c, op, rid, t, 0, 0, 0);
}

void tsd_table_insert(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t len,
                      const uint8_t *fixed, size_t fixed_len, tsd_item *item)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    srv->stats.ops[op]++;
    ts__msg_table_insert_fixed f;
    tsd_table *t = NULL;
    if (fixed_len != TS_MSG_TABLE_INSERT_FIXED ||
        ts__msg_table_insert_fixed_decode(fixed, &f) != 0) {
        tsd_store_unreserve(&srv->store, tsd_item_len(item));
        tsd_item_unref(item);
        tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "TABLE_INSERT: reserved field not zero");
        return;
    }
    if (tsd_writes_refused(srv)) {
        tsd_store_unreserve(&srv->store, tsd_item_len(item));
        tsd_item_unref(item);
        tsd_refuse_write(c, op, rid);
        return;
    }
    t = tsd_table_find(srv, name, len);
    if (t == NULL || !priority_ok(&t->cfg, f.priority)) {
        tsd_store_unreserve(&srv->store, tsd_item_len(item));
        tsd_item_unref(item);
        if (t == NULL)
            reply_no_table(c, op, rid, name, len);
        else
            tsd_reply_err(c, op, rid, TS_ST_INVALID,
                          "TABLE_INSERT: a priority must be finite and at least 0 (and its "
                          "weight finite)");
        return;
    }
    tsd_store_item_take(&srv->store, item); /* from here on the record is counted as held */
    if (t->ins_head == NULL && can_insert(t)) {
        uint64_t key = 0;
        int rc = insert_now(t, item, f.priority, &key);
        if (rc != 0) {
            tsd_store_item_drop(&srv->store, item, 0);
            tsd_reply_oom(c, op, rid, rc, "inserting into a replay table");
            return;
        }
        reply_state(c, op, rid, t, key, 1, 0);
        serve(t);
        return;
    }
    if (f.timeout_ms == 0) {
        tsd_store_item_drop(&srv->store, item, 0);
        tsd_reply_err(c, op, rid, TS_ST_TIMEOUT,
                      "TABLE_INSERT: the rate limiter holds inserts back (timeout 0)");
        return;
    }
    tsd_twait *w;
    int rc = wait_add(c, t, op, rid, f.timeout_ms, &w);
    if (rc != 0) {
        tsd_store_item_drop(&srv->store, item, 0);
        tsd_reply_wait_error(c, op, rid, rc);
        return;
    }
    w->it = item;
    w->priority = f.priority;
}

/* Why tsd_table_insert_check refuses an insert (0: it does not). */
enum {
    TINS_BAD_FIXED = 1, /* a reserved field not zero: BAD_REQUEST, the connection closes */
    TINS_NO_TABLE,      /* NOT_FOUND, or INVALID for a bin or a stream of that name */
    TINS_BAD_PRIORITY,  /* INVALID */
    TINS_HELD,          /* the limiter holds inserts back and the timeout is 0: TIMEOUT */
};

uint16_t tsd_table_insert_check(tsd_server *srv, const uint8_t *name, size_t len,
                                const uint8_t *fixed, size_t fixed_len)
{
    ts__msg_table_insert_fixed f;
    if (fixed_len != TS_MSG_TABLE_INSERT_FIXED || ts__msg_table_insert_fixed_decode(fixed, &f) != 0)
        return TINS_BAD_FIXED;
    tsd_table *t = tsd_table_find(srv, name, len);
    if (t == NULL)
        return TINS_NO_TABLE;
    if (!priority_ok(&t->cfg, f.priority))
        return TINS_BAD_PRIORITY;
    if (f.timeout_ms == 0 && (t->ins_head != NULL || !can_insert(t)))
        return TINS_HELD;
    return 0;
}

void tsd_table_refuse_insert(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t len,
                             uint16_t reason)
{
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    switch (reason) {
    case TINS_BAD_FIXED:
        tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "TABLE_INSERT: reserved field not zero");
        return;
    case TINS_NO_TABLE:
        reply_no_table(c, op, rid, name, len);
        return;
    case TINS_BAD_PRIORITY:
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      "TABLE_INSERT: a priority must be finite and at least 0 (and its weight "
                      "finite)");
        return;
    default:
        tsd_reply_err(c, op, rid, TS_ST_TIMEOUT,
                      "TABLE_INSERT: the rate limiter holds inserts back (timeout 0)");
        return;
    }
}

static void op_sample(tsd_conn *c, const ts__hdr *h, tsd_table *t, uint32_t n, uint32_t timeout_ms)
{
    if (n < 1 || n > TS_TABLE_MAX_SAMPLE) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID, "TABLE_SAMPLE: n must be 1..%u",
                      TS_TABLE_MAX_SAMPLE);
        return;
    }
    if (t->smp_head == NULL && can_sample(t)) {
        uint32_t k = draw_many(t, n);
        reply_samples(c, h->opcode, h->request_id, t, k);
        serve(t);
        return;
    }
    if (timeout_ms == 0) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_TIMEOUT,
                      "TABLE_SAMPLE: the rate limiter holds samples back (timeout 0)");
        return;
    }
    tsd_twait *w;
    int rc = wait_add(c, t, h->opcode, h->request_id, timeout_ms, &w);
    if (rc != 0) {
        tsd_reply_wait_error(c, h->opcode, h->request_id, rc);
        return;
    }
    w->n = n;
}

static void op_update(tsd_conn *c, const ts__hdr *h, tsd_table *t, const ts__msg_table_keys_req *q)
{
    /* Every priority is checked first: a bad one changes nothing. */
    for (uint32_t i = 0; i < q->n; i++) {
        uint64_t key;
        double p;
        ts__msg_table_key_at(q, i, &key, &p);
        if (!priority_ok(&t->cfg, p)) {
            tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                          "TABLE_UPDATE: priority %u is not finite, negative, or too large", i);
            return;
        }
    }
    uint32_t done = 0, skipped = 0;
    for (uint32_t i = 0; i < q->n; i++) {
        uint64_t key;
        double p;
        ts__msg_table_key_at(q, i, &key, &p);
        titem *x = key_find(t, key);
        if (x == NULL) {
            skipped++;
            continue;
        }
        item_reprioritize(t, x, p);
        done++;
    }
    reply_state(c, h->opcode, h->request_id, t, 0, done, skipped);
}

static void op_remove(tsd_conn *c, const ts__hdr *h, tsd_table *t, const ts__msg_table_keys_req *q)
{
    uint32_t done = 0, skipped = 0;
    for (uint32_t i = 0; i < q->n; i++) {
        uint64_t key;
        double p;
        ts__msg_table_key_at(q, i, &key, &p);
        titem *x = key_find(t, key);
        if (x == NULL) {
            skipped++;
            continue;
        }
        item_unlink(c->srv, t, x, 1);
        done++;
    }
    reply_state(c, h->opcode, h->request_id, t, 0, done, skipped);
    if (done > 0)
        serve(t);
}

static int put_u64(ts_value_t *map, const char *key, uint64_t v)
{
    return ts_map_set(map, key, ts_int_new(v > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)v));
}

static int put_f64(ts_value_t *map, const char *key, double v)
{
    return ts_map_set(map, key, ts_float_new(v));
}

static const char *sampler_name(uint8_t s)
{
    static const char *const names[] = {"uniform", "prioritized", "fifo", "lifo"};
    return names[s];
}

static const char *remover_name(uint8_t r)
{
    static const char *const names[] = {"fifo", "lifo", "lowest_priority"};
    return names[r];
}

static void op_info(tsd_conn *c, const ts__hdr *h, const tsd_table *t)
{
    ts_value_t *root = ts_map_new();
    int rc = root == NULL ? TS_ENOMEM : 0;
    if (rc == 0) {
        rc |= put_u64(root, "size", t->n);
        rc |= put_u64(root, "capacity", t->cfg.capacity);
        rc |= put_u64(root, "bytes", t->bytes);
        rc |= put_u64(root, "inserts", t->inserts);
        rc |= put_u64(root, "samples", t->samples);
        rc |= put_u64(root, "deletes", t->deletes);
        rc |= put_u64(root, "next_key", t->next_key);
        rc |= ts_map_set(
            root, "sampler",
            ts_string_new(sampler_name(t->cfg.sampler), strlen(sampler_name(t->cfg.sampler))));
        rc |= ts_map_set(
            root, "remover",
            ts_string_new(remover_name(t->cfg.remover), strlen(remover_name(t->cfg.remover))));
        rc |= put_f64(root, "priority_exponent", t->cfg.exponent);
        rc |= put_u64(root, "max_times_sampled", t->cfg.max_times);
        rc |= put_u64(root, "min_size_to_sample", t->cfg.min_size);
        rc |= put_f64(root, "samples_per_insert", t->cfg.spi);
        rc |= put_f64(root, "error_buffer", t->cfg.error_buffer);
        rc |= put_f64(root, "min_diff", t->cfg.min_diff);
        rc |= put_f64(root, "max_diff", t->cfg.max_diff);
        rc |= put_f64(root, "diff", (double)t->inserts * t->cfg.spi - (double)t->samples);
        rc |= put_u64(root, "can_insert", (uint64_t)can_insert(t));
        rc |= put_u64(root, "can_sample", (uint64_t)can_sample(t));
        rc |= put_u64(root, "waiting_inserts", t->n_ins_waits);
        rc |= put_u64(root, "waiting_samples", t->n_smp_waits);
    }
    uint8_t *rec = NULL;
    size_t len = 0;
    if (rc != 0 || ts__record_encode(root, &rec, &len) != 0) {
        ts_value_free(root);
        c->srv->stats.out_of_memory++;
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL, "out of memory in TABLE_INFO");
        return;
    }
    ts_value_free(root);
    tsd_reply(c, h->opcode, h->request_id, TS_ST_OK, rec, len);
    ts__free_aligned(rec, len);
}

void tsd_table_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m)
{
    uint8_t op = h->opcode;
    if (ts__msg_op_info(op)->changes && tsd_writes_refused(c->srv)) {
        tsd_refuse_write(c, op, h->request_id);
        return;
    }
    tsd_table *t;
    switch (op) {
    case TS_OP_TABLE_CREATE:
        op_create(c, h, &m->u.table_create);
        return;
    case TS_OP_TABLE_SAMPLE: {
        const ts__msg_table_sample_req *q = &m->u.table_sample;
        if ((t = table_of(c, h, q->name, q->name_len)) != NULL)
            op_sample(c, h, t, q->n, q->timeout_ms);
        return;
    }
    case TS_OP_TABLE_UPDATE:
    case TS_OP_TABLE_REMOVE: {
        const ts__msg_table_keys_req *q = &m->u.table_keys;
        if ((t = table_of(c, h, q->name, q->name_len)) == NULL)
            return;
        if (op == TS_OP_TABLE_UPDATE)
            op_update(c, h, t, q);
        else
            op_remove(c, h, t, q);
        return;
    }
    case TS_OP_TABLE_INFO: {
        const ts__msg_name_req *q = &m->u.name_req;
        if ((t = table_of(c, h, q->name, q->name_len)) != NULL)
            op_info(c, h, t);
        return;
    }
    default:
        tsd_conn_fail(c, op, h->request_id, TS_ST_UNKNOWN_OPCODE, "unknown opcode 0x%02x", op);
        return;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Snapshots (snapshot.c)
 */

uint32_t tsd_table_size(const tsd_table *t)
{
    return t->n;
}

void tsd_table_capture(const tsd_table *t, uint64_t now, tsd_snapfile_table *out, uint8_t *rows,
                       tsd_item **recs)
{
    *out = (tsd_snapfile_table){.name = t->node.name,
                                .name_len = t->node.name_len,
                                .capacity = t->cfg.capacity,
                                .min_size = t->cfg.min_size,
                                .spi = t->cfg.spi,
                                .error_buffer = t->cfg.error_buffer,
                                .exponent = t->cfg.exponent,
                                .max_times = t->cfg.max_times,
                                .remover = t->cfg.remover,
                                .sampler = t->cfg.sampler,
                                .next_key = t->next_key,
                                .inserts = t->inserts,
                                .samples = t->samples,
                                .deletes = t->deletes,
                                .n_items = t->n,
                                .items = rows};
    /* Oldest first: keys grow with insertion, so this is key order. */
    size_t k = 0;
    for (const titem *x = t->oldest; x != NULL; x = x->newer, k++) {
        uint64_t age = now > x->time_ms ? now - x->time_ms : 0;
        tsd_snapfile_titem_put(rows, k, x->key, x->priority, tsd_item_len(x->it), age,
                               x->times_sampled);
        recs[k] = x->it;
    }
}

int tsd_table_restore(tsd_server *srv, const tsd_snapfile_table *s, tsd_table **out)
{
    if (tsd_table_find(srv, s->name, s->name_len) != NULL ||
        tsd_store_find(&srv->store, s->name, s->name_len) != NULL ||
        tsd_stream_find(srv, s->name, s->name_len) != NULL)
        return TS_EINVAL;
    tsd_table *t;
    int rc = table_new(srv, s->name, s->name_len, s->capacity, s->min_size, s->spi, s->error_buffer,
                       s->exponent, s->max_times, s->remover, s->sampler, &t);
    if (rc != 0)
        return rc;
    t->next_key = s->next_key;
    t->inserts = s->inserts;
    t->samples = s->samples;
    t->deletes = s->deletes;
    *out = t;
    return 0;
}

int tsd_table_restore_item(tsd_server *srv, tsd_table *t, uint64_t key, double priority,
                           uint32_t times_sampled, uint64_t time_ms, tsd_item *it)
{
    if (!priority_ok(&t->cfg, priority) || t->n >= t->cfg.capacity || key >= t->next_key ||
        (t->newest != NULL && key <= t->newest->key))
        return TS_EINVAL;
    titem *x;
    int rc = item_new(srv, t, &x);
    if (rc != 0)
        return rc;
    tsd_store_item_take(&srv->store, it);
    x->key = key;
    x->priority = priority;
    x->it = it;
    x->time_ms = time_ms;
    x->times_sampled = times_sampled;
    item_link(t, x);
    t->bytes += tsd_item_len(it);
    return 0;
}
