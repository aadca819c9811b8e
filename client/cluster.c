/*
 * The cluster client (docs/CLUSTER.md): ts_client_open with "h1:p1,h2:p2,..." or
 * "cluster:/path/map" returns a cluster handle, a ts_client_t without a connection or a thread of
 * its own. It holds one ordinary client per shard (each with its connection, I/O thread,
 * reconnects and subscriptions, as a single client has) and routes every call that names a bin,
 * stream, table or counter to the shard that owns the name's slot (src/slot.c), through
 * ts__route at the top of each such entry point. Calls without a name fan out: LIST, STATS, PING
 * and SAVE go to every shard at once and their answers are merged; MGET is split by shard.
 *
 * What the client knows of the cluster:
 *   - shards[]: every shard client it has made, in the order made (the map's shards first, then
 *     any address a WRONG_SHARD or SHARD_MAP named). Entries are never removed before the handle
 *     is freed, so a pointer read from it stays valid for as long as the handle lives.
 *   - owner[slot]: the index into shards[] a slot goes to. Read on every call without a lock
 *     (one atomic load); changed under mu when a WRONG_SHARD or a newer map says otherwise.
 *   - each shard's own index (self), which its daemon reports in SHARD_MAP: daemons started with
 *     "--shard I/N" know their index but not the others' addresses, so a WRONG_SHARD naming
 *     "shard 2" (without an address) is resolved to the shard client whose daemon said it is 2.
 *
 * Threads: routing is lock-free; mu guards the learning (owner writes, shards[] growth, epoch).
 * A redirected asynchronous request is handed from the I/O thread that got WRONG_SHARD to the
 * owner's inbox (ts__submit); a blocking one is re-submitted by its caller. A call that may move
 * between shards after waiting on one holds the handle open (ts__cluster_enter), so that
 * ts_client_free never frees a shard under it.
 */
#include "internal.h"

#include "tensorshare/coord.h"

#include "msg.h"
#include "slot.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* bytes; a shard's description in messages: "shard N (ADDRESS)" */
#define TS__SHARD_LABEL_MAX (TS_SHARD_ADDR_MAX + 32)
/* bytes; why a shard is down, for the TS_ENOTCONN of its requests */
#define TS__SHARD_DOWN_MAX (TS__SHARD_LABEL_MAX + 160)
/* bytes; the message of a failed open, naming every shard's reason (then cut) */
#define TS__CLUSTER_OPEN_MSG_MAX 1024

typedef struct ts__cluster ts__cluster;
typedef struct ts__cluster_shard ts__cluster_shard;

/* One shard client of a cluster. */
struct ts__cluster_shard {
    struct ts__cluster *cl;
    ts_client_t *c;
    char *address;    /* as in the map or list */
    int pos;          /* its index in the map it came from, or -1 (learned later) */
    atomic_int self;  /* the index its daemon reported in SHARD_MAP; -1 unknown */
    int map_answered; /* under cl->mu: a SHARD_MAP answer (any) came since it was made */
    /* The shard client's I/O thread only. */
    int down; /* a connection attempt failed or the connection was lost, not ready since */
    char down_msg[TS__SHARD_DOWN_MAX];
};

struct ts__cluster {
    pthread_mutex_t mu;
    pthread_cond_t cond; /* map answers at open; the last caller leaving a closing handle */
    atomic_int closing;  /* ts_client_free was called (set under mu) */
    atomic_int callers;  /* calls inside ts__cluster_enter / leave */
    uint64_t epoch;      /* under mu: the epoch of the map the client follows */
    /*
     * For every shard client, those made later included: the options given at open, with
     * auth_token pointing at the handle's token and the TLS strings at the copies below.
     */
    ts_client_options_t opts;
    char *tls_ca_file; /* the option, else TS_TLS_CA as it was at open, else "": the system's */
    char *tls_cert_file;
    char *tls_key_file;
    char *tls_server_name;
    atomic_uint n_shards; /* entries of shards[] */
    _Atomic(ts__cluster_shard *) shards[TS_SHARD_MAX];
    _Atomic uint16_t owner[TS_SLOTS]; /* slot -> index into shards[] */
    atomic_ullong redirects;          /* WRONG_SHARD answers learned from (ts__cluster_learn) */
    atomic_ullong maps;               /* newer maps adopted */
};

/* ---------------------------------------------------------------------------------------------
 * Addresses, shard clients, learning
 */

int ts__cluster_address(const char *address)
{
    return strncmp(address, "cluster:", 8) == 0 || strchr(address, ',') != NULL;
}

/* The address without a "tcp://" prefix, so that a map's and a list's spellings match. */
static const char *addr_key(const char *a)
{
    return strncmp(a, "tcp://", 6) == 0 ? a + 6 : a;
}

static ts__cluster_shard *shard_at(ts__cluster *cl, unsigned k)
{
    return atomic_load_explicit(&cl->shards[k], memory_order_acquire);
}

/*
 * A shard's description for messages into buf (TS__SHARD_LABEL_MAX bytes): "shard N (ADDRESS)"
 * with the index STATS reports for it (the one its daemon reported, else its place in the map it
 * came from), or "shard at ADDRESS" when it has neither. Returns buf.
 */
static const char *shard_label(const ts__cluster_shard *sh, char *buf)
{
    int index = atomic_load(&sh->self);
    if (index < 0)
        index = sh->pos;
    if (index >= 0)
        snprintf(buf, TS__SHARD_LABEL_MAX, "shard %d (%s)", index, sh->address);
    else
        snprintf(buf, TS__SHARD_LABEL_MAX, "shard at %s", sh->address);
    return buf;
}

/*
 * The index of the shard client for address, made (and connecting in the background) when the
 * client has none yet; else TS_ECANCELED when closing, TS_EINVAL when it would be client
 * number TS_SHARD_MAX + 1, TS_ENOMEM, or what starting the shard client failed with (TS_EINVAL
 * with a message for a malformed address). mu held.
 */
static int shard_find_or_add_locked(ts__cluster *cl, ts_client_t *h, const char *address, int pos)
{
    unsigned n = atomic_load(&cl->n_shards);
    for (unsigned k = 0; k < n; k++) {
        if (strcmp(addr_key(shard_at(cl, k)->address), addr_key(address)) == 0)
            return (int)k;
    }
    if (atomic_load(&cl->closing))
        return TS_ECANCELED;
    if (n >= TS_SHARD_MAX)
        return TS_EINVAL;
    ts__cluster_shard *sh = ts__calloc(1, sizeof(*sh));
    if (sh == NULL || (sh->address = ts__strndup(address, strlen(address))) == NULL) {
        ts__free(sh);
        return TS_ENOMEM;
    }
    sh->cl = cl;
    sh->pos = pos;
    atomic_init(&sh->self, -1);
    int rc = ts__client_start(&sh->c, address, &cl->opts, h, sh);
    if (rc != 0) {
        ts__free(sh->address);
        ts__free(sh);
        return rc;
    }
    atomic_store_explicit(&cl->shards[n], sh, memory_order_release);
    atomic_store(&cl->n_shards, n + 1);
    return (int)n;
}

/*
 * The shard client whose daemon said it is shard index, or -1. When several say so (a daemon
 * started with another's index), the one the client's own map puts at that index wins, and
 * without such agreement none does: a misconfigured daemon never takes over a healthy one's
 * slots. mu held.
 */
static int shard_by_self_locked(ts__cluster *cl, int index)
{
    unsigned n = atomic_load(&cl->n_shards);
    int found = -1, count = 0;
    for (unsigned k = 0; k < n; k++) {
        ts__cluster_shard *sh = shard_at(cl, k);
        if (atomic_load(&sh->self) != index)
            continue;
        if (sh->pos == index)
            return (int)k;
        found = (int)k;
        count++;
    }
    return count == 1 ? found : -1;
}

/* Send a SHARD_MAP question to shard client c (any thread); its answer goes to map_done. */
static void ask_map(ts_client_t *c)
{
    ts__req *r = ts__calloc(1, sizeof(*r));
    if (r == NULL)
        return; /* the next reconnect or redirect asks again */
    r->c = c;
    r->kind = TS__K_SHARDMAP;
    r->op = TS_OP_SHARD_MAP;
    ts__msg_name_req m;
    memset(&m, 0, sizeof(m));
    if (ts__req_body(r, &m) != 0) {
        ts__free(r);
        return;
    }
    r->deadline_ns = ts__now_ns() + (uint64_t)c->opts.request_timeout_ms * 1000000u;
    if (ts__submit(c, r) != 0)
        ts__req_free(r);
}

/*
 * Adopt map m, which a shard's daemon sent, when its epoch is higher than the
 * client's. Its shards are resolved to shard clients by address, or (address unknown) by the
 * index each daemon reported; the slots of shards that cannot be resolved yet keep their owner,
 * and the epoch is taken only once every shard is resolved, so a later answer completes it.
 * mu held.
 */
static void adopt_locked(ts__cluster *cl, ts_client_t *h, const ts__shard_map *m)
{
    if (m->epoch <= cl->epoch)
        return;
    int idx[TS_SHARD_MAX];
    int all = 1;
    for (uint32_t i = 0; i < m->n_shards; i++) {
        idx[i] = -1;
        if (m->addrs[i][0] != '\0')
            idx[i] = shard_find_or_add_locked(cl, h, m->addrs[i], -1);
        else
            idx[i] = shard_by_self_locked(cl, (int)i);
        all &= idx[i] >= 0;
    }
    for (uint32_t s = 0; s < TS_SLOTS; s++) {
        int k = idx[m->owner[s]];
        if (k >= 0)
            atomic_store_explicit(&cl->owner[s], (uint16_t)k, memory_order_release);
    }
    if (all) {
        cl->epoch = m->epoch;
        atomic_fetch_add(&cl->maps, 1);
    }
}

void ts__cluster_map_done(ts_client_t *c, ts__req *r, int status)
{
    ts__cluster_shard *sh = c->shard;
    ts__cluster *cl = sh->cl;
    pthread_mutex_lock(&cl->mu);
    if (status == 0) {
        atomic_store(&sh->self, r->shard_self == TS_SHARD_NONE ? -1 : (int)r->shard_self);
        if (r->shard_map != NULL)
            adopt_locked(cl, c->pub, r->shard_map);
    }
    sh->map_answered = 1;
    pthread_cond_broadcast(&cl->cond);
    pthread_mutex_unlock(&cl->mu);
}

ts_client_t *ts__cluster_learn(ts_client_t *c, ts__req *r)
{
    ts__cluster_shard *sh = c->shard;
    ts__cluster *cl = sh->cl;
    if (!r->have_ws)
        return NULL;
    atomic_fetch_add(&cl->redirects, 1);
    pthread_mutex_lock(&cl->mu);
    int k = -1;
    if (r->ws_addr != NULL) {
        k = shard_find_or_add_locked(cl, c->pub, r->ws_addr, -1);
    } else if (r->ws_owner != TS_SHARD_NONE) {
        k = shard_by_self_locked(cl, r->ws_owner);
        if (k < 0 && r->ws_owner < atomic_load(&cl->n_shards)) {
            /*
             * No daemon has said it is that index (not asked yet, or down since the client
             * started): the map's shard at that position is the best guess.
             */
            ts__cluster_shard *guess = shard_at(cl, r->ws_owner);
            if (guess->pos == (int)r->ws_owner && atomic_load(&guess->self) < 0)
                k = (int)r->ws_owner;
        }
    }
    ts__cluster_shard *to = k >= 0 ? shard_at(cl, (unsigned)k) : NULL;
    if (to != NULL && to != sh)
        atomic_store_explicit(&cl->owner[r->ws_slot % TS_SLOTS], (uint16_t)k, memory_order_release);
    int newer = r->ws_epoch > cl->epoch;
    pthread_mutex_unlock(&cl->mu);
    if (newer)
        ask_map(c); /* the daemon's map is newer than the client's: take all of it */
    return to != NULL && to != sh ? to->c : NULL;
}

static size_t fanout_targets(ts__cluster *cl, ts_client_t **cs, ts__cluster_shard **shs);

ts_client_t *ts__cluster_route(ts_client_t *h, const char *name)
{
    ts__cluster *cl = h->cl;
    uint16_t slot = name != NULL ? ts__slot(name, strlen(name)) : 0;
    uint16_t k = atomic_load_explicit(&cl->owner[slot], memory_order_acquire);
    return shard_at(cl, k)->c;
}

ts_client_t *ts__cluster_route_slot(ts_client_t *h, uint16_t slot)
{
    ts__cluster *cl = h->cl;
    uint16_t k = atomic_load_explicit(&cl->owner[slot % TS_SLOTS], memory_order_acquire);
    return shard_at(cl, k)->c;
}

size_t ts__cluster_shard_clients(ts_client_t *h, ts_client_t **cs)
{
    ts__cluster_shard *shs[TS_SHARD_MAX];
    return fanout_targets(h->cl, cs, shs);
}

/* ---------------------------------------------------------------------------------------------
 * Holding the handle open; redirects
 */

int ts__cluster_enter(ts_client_t *h)
{
    ts__cluster *cl = h->cl;
    atomic_fetch_add(&cl->callers, 1);
    if (atomic_load(&cl->closing)) {
        ts__cluster_leave(h);
        return TS_ECANCELED;
    }
    return 0;
}

void ts__cluster_leave(ts_client_t *h)
{
    ts__cluster *cl = h->cl;
    if (atomic_fetch_sub(&cl->callers, 1) == 1 && atomic_load(&cl->closing)) {
        pthread_mutex_lock(&cl->mu);
        pthread_cond_broadcast(&cl->cond);
        pthread_mutex_unlock(&cl->mu);
    }
}

/*
 * Make a finished request new again for shard client c: same body, same deadline, nothing of
 * its first answer left. The frame's memory (a copy, or the caller's tensors, which a blocking
 * caller and an asynchronous put's retained memory both keep valid until the final answer)
 * is sent again from where it is.
 */
static void req_reset(ts__req *r, ts_client_t *c)
{
    r->c = c;
    r->next = NULL;
    r->id = 0;
    r->woff = 0;
    r->conn = NULL;
    r->in_map = 0;
    r->wstate = TS__W_NONE;
    r->status = 0;
    ts_items_free(r->res.items);
    ts_bin_list_free(r->res.bins);
    ts_value_free(r->res.value);
    memset(&r->res, 0, sizeof(r->res));
    ts__free(r->msg);
    r->msg = NULL;
    r->have_state = 0;
    memset(&r->stream, 0, sizeof(r->stream));
    r->bstate = TS__B_QUEUED;
    r->wbusy = 0;
    r->rfd = 0;
    r->rblock = 0;
    r->rlz4 = 0;
    r->have_ws = 0;
    ts__free(r->ws_addr);
    r->ws_addr = NULL;
    r->redirects++;
}

int ts__cluster_block(ts_client_t *c, ts__req *r, int *gone)
{
    ts_client_t *h = c->pub;
    *gone = 0;
    if (ts__cluster_enter(h) != 0)
        return ts__fail(TS_ECANCELED, "the client is closing");
    int rc;
    for (;;) {
        rc = ts__api_block_on(c, r, gone);
        if (*gone || rc != TS_EWRONGSHARD)
            break;
        ts_client_t *next = ts__cluster_learn(c, r);
        /* MGET names several bins: ts__cluster_mget splits it again with what was learned. */
        if (r->op == TS_OP_MGET || next == NULL || r->redirects >= TS__CLUSTER_REDIRECTS)
            break;
        req_reset(r, next);
        c = next;
    }
    ts__cluster_leave(h);
    return rc;
}

int ts__cluster_redirect_async(ts_client_t *c, ts__req *r)
{
    /* Learned (and counted) even when the request gives up, as on the blocking path. */
    ts_client_t *next = ts__cluster_learn(c, r);
    if (next == NULL || r->redirects >= TS__CLUSTER_REDIRECTS)
        return 0;
    /*
     * From this I/O thread into the owner's inbox. Every shard client outlives the others'
     * threads (ts_client_free joins them all before it frees any), so next is valid here.
     */
    req_reset(r, next);
    if (ts__submit(next, r) != 0) {
        r->c = c;
        ts__req_finish(c, r, TS_ECANCELED);
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * Shard state (the shard client's I/O thread)
 */

void ts__cluster_shard_ready(ts_client_t *c)
{
    c->shard->down = 0;
    ask_map(c); /* a restarted daemon may have another index or a newer map */
}

void ts__cluster_shard_failed(ts_client_t *c, int err, const char *msg)
{
    ts__cluster_shard *sh = c->shard;
    char label[TS__SHARD_LABEL_MAX];
    shard_label(sh, label);
    sh->down = 1;
    snprintf(sh->down_msg, sizeof(sh->down_msg), "%s is down: %s", label,
             msg != NULL ? msg : ts_strerror(err));
    /* What waited for this connection fails now, not at its deadline. */
    ts__req *w = c->waitq_head;
    c->waitq_head = c->waitq_tail = NULL;
    ts__fail_list(c, w, TS_ENOTCONN, sh->down_msg);
    pthread_mutex_lock(&c->mu);
    if (!c->open_done) {
        /* The opening thread learns of the first failure; the client goes on trying. */
        c->open_done = 1;
        c->open_status = err;
        snprintf(c->open_msg, sizeof(c->open_msg), "%.120s: %.120s", label,
                 msg != NULL ? msg : ts_strerror(err));
        pthread_cond_broadcast(&c->open_cond);
    }
    pthread_mutex_unlock(&c->mu);
}

int ts__cluster_shard_down(ts_client_t *c, const char **msg)
{
    *msg = c->shard->down_msg;
    return c->shard->down;
}

/* ---------------------------------------------------------------------------------------------
 * Opening and closing
 */

/* Free what ts__cluster_open built before any shard client started. */
static void handle_free(ts_client_t *h)
{
    if (h->cl != NULL) {
        pthread_mutex_destroy(&h->cl->mu);
        pthread_cond_destroy(&h->cl->cond);
        ts__free(h->cl->tls_ca_file);
        ts__free(h->cl->tls_cert_file);
        ts__free(h->cl->tls_key_file);
        ts__free(h->cl->tls_server_name);
        ts__free(h->cl);
    }
    ts__free(h->address);
    ts__free(h->token);
    ts__free(h);
}

/* A copy of s (NULL: none) into *out, kept until the handle is freed. 0 or TS_ENOMEM. */
static int keep_string(const char *s, char **out)
{
    if (s == NULL)
        return 0;
    *out = ts__strndup(s, strlen(s));
    return *out != NULL ? 0 : TS_ENOMEM;
}

/*
 * The TLS fields of opts into cl->opts, pointing at copies the handle owns, so that every shard
 * client (those made later too) gets the TLS a single client would: the CA option, else
 * TS_TLS_CA read now, once; the client certificate and key; the server name, which every shard's
 * certificate must then carry; and the tls flag. The shard clients check them as a single client
 * does when they start. 0 or TS_ENOMEM.
 */
static int keep_tls_options(ts__cluster *cl, const ts_client_options_t *opts)
{
    const char *ca = opts != NULL ? opts->tls_ca_file : NULL;
    if (ca == NULL)
        ca = getenv("TS_TLS_CA");
    if (ca == NULL)
        ca = ""; /* the system's store, even if TS_TLS_CA is set later */
    int rc = keep_string(ca, &cl->tls_ca_file);
    if (rc == 0 && opts != NULL) {
        rc = keep_string(opts->tls_cert_file, &cl->tls_cert_file);
        if (rc == 0)
            rc = keep_string(opts->tls_key_file, &cl->tls_key_file);
        if (rc == 0)
            rc = keep_string(opts->tls_server_name, &cl->tls_server_name);
        cl->opts.tls = opts->tls;
    }
    cl->opts.tls_ca_file = cl->tls_ca_file;
    cl->opts.tls_cert_file = cl->tls_cert_file;
    cl->opts.tls_key_file = cl->tls_key_file;
    cl->opts.tls_server_name = cl->tls_server_name;
    return rc;
}

/* The map of a cluster address: a map file, or the default split of a list. */
static int address_map(const char *address, ts__shard_map **out)
{
    char err[TS_SHARD_MAP_ERR_MAX];
    if (strncmp(address, "cluster:", 8) == 0) {
        int rc = ts__shard_map_load(address + 8, out, err, sizeof(err));
        if (rc == TS_EINVAL)
            return ts__fail(rc, "cluster map '%s': %s", address + 8, err);
        if (rc != 0)
            return ts__fail(rc, NULL);
        /* The file has no address twice; "tcp://" or not, the client would merge two lines. */
        const ts__shard_map *m = *out;
        for (uint32_t i = 1; i < m->n_shards; i++) {
            for (uint32_t k = 0; k < i && m->addrs[i][0] != '\0'; k++) {
                if (strcmp(addr_key(m->addrs[k]), addr_key(m->addrs[i])) == 0) {
                    rc = ts__fail(TS_EINVAL,
                                  "cluster map '%s': shard %u's address '%s' is also "
                                  "shard %u's ('%s')",
                                  address + 8, (unsigned)i, m->addrs[i], (unsigned)k, m->addrs[k]);
                    ts__shard_map_free(*out);
                    *out = NULL;
                    return rc;
                }
            }
        }
        return 0;
    }
    char *copy = ts__strndup(address, strlen(address));
    const char **addrs = ts__calloc(TS_SHARD_MAX, sizeof(*addrs));
    int rc = copy == NULL || addrs == NULL ? TS_ENOMEM : 0;
    uint32_t n = 0;
    for (char *p = copy; rc == 0;) {
        char *comma = strchr(p, ',');
        if (comma != NULL)
            *comma = '\0';
        if (n == TS_SHARD_MAX)
            rc = ts__fail(TS_EINVAL, "more than %u shards in '%s'", TS_SHARD_MAX, address);
        else if (!ts__shard_addr_ok(p, strlen(p)))
            rc = ts__fail(TS_EINVAL, "malformed address '%s' in the shard list '%s'", p, address);
        for (uint32_t k = 0; rc == 0 && k < n; k++) {
            /* As a map file refuses an address twice (the same daemon would be two shards). */
            if (strcmp(addr_key(addrs[k]), addr_key(p)) == 0)
                rc = ts__fail(TS_EINVAL,
                              "shard %u's address '%s' is also shard %u's ('%s') in the shard "
                              "list '%s'",
                              (unsigned)n, p, (unsigned)k, addrs[k], address);
        }
        if (rc == 0)
            addrs[n++] = p;
        if (comma == NULL)
            break;
        p = comma + 1;
    }
    if (rc == 0) {
        rc = ts__shard_map_default(n, addrs, 0, out);
        if (rc != 0)
            ts__fail(rc, NULL);
    } else if (rc == TS_ENOMEM) {
        ts__fail(rc, NULL);
    }
    ts__free(addrs);
    ts__free(copy);
    return rc;
}

int ts__cluster_open(ts_client_t **out, const char *address, const ts_client_options_t *opts)
{
    ts__shard_map *m;
    int rc = address_map(address, &m);
    if (rc != 0)
        return rc;
    ts_client_t *h = ts__calloc(1, sizeof(*h));
    ts__cluster *cl = ts__calloc(1, sizeof(*cl));
    if (h == NULL || cl == NULL || (h->address = ts__strndup(address, strlen(address))) == NULL) {
        ts__free(cl);
        if (h != NULL)
            ts__free(h->address);
        ts__free(h);
        ts__shard_map_free(m);
        return ts__fail(TS_ENOMEM, NULL);
    }
    h->pub = h;
    h->cl = cl;
    pthread_mutex_init(&cl->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&cl->cond, &ca);
    pthread_condattr_destroy(&ca);
    if ((rc = ts__client_setup_options(h, opts)) != 0) {
        handle_free(h);
        ts__shard_map_free(m);
        return rc == TS_ENOMEM ? ts__fail(rc, NULL) : rc;
    }
    cl->opts = h->opts;
    cl->opts.auth_token = h->token; /* NULL: none, and none from the environment either */
    if (cl->opts.auth_token == NULL)
        cl->opts.auth_token = "";
    if (keep_tls_options(cl, opts) != 0) {
        handle_free(h);
        ts__shard_map_free(m);
        return ts__fail(TS_ENOMEM, NULL);
    }
    cl->epoch = m->epoch;

    /* Every shard connects at once; the open waits for each one's first verdict. */
    int idx[TS_SHARD_MAX];
    char start_err[TS_MAX_ERROR_LEN + 1] = "";
    pthread_mutex_lock(&cl->mu);
    for (uint32_t i = 0; i < m->n_shards && rc == 0; i++) {
        idx[i] = shard_find_or_add_locked(cl, h, m->addrs[i], (int)i);
        if (idx[i] < 0) {
            /* Kept before ts__cluster_free below, which may set messages of its own. */
            rc = idx[i];
            snprintf(start_err, sizeof(start_err), "%s (shard %u of '%s')",
                     rc == TS_ENOMEM ? ts_strerror(rc) : ts_last_error(), (unsigned)i, address);
        }
    }
    for (uint32_t s = 0; s < TS_SLOTS && rc == 0; s++)
        atomic_init(&cl->owner[s], (uint16_t)idx[m->owner[s]]);
    pthread_mutex_unlock(&cl->mu);
    ts__shard_map_free(m);
    unsigned n = atomic_load(&cl->n_shards);
    char msg[TS__CLUSTER_OPEN_MSG_MAX] = "";
    size_t mlen = 0;
    int up = 0, first_err = 0;
    for (unsigned k = 0; k < n && rc == 0; k++) {
        char why[256];
        int src = ts__client_wait_open(shard_at(cl, k)->c, why, sizeof(why));
        if (src == 0) {
            up++;
            continue;
        }
        if (first_err == 0)
            first_err = src;
        int w = snprintf(msg + mlen, sizeof(msg) - mlen, "%s%s", mlen > 0 ? "; " : "", why);
        if (w > 0)
            mlen = mlen + (size_t)w < sizeof(msg) ? mlen + (size_t)w : sizeof(msg) - 1;
    }
    if (rc == 0 && up == 0)
        rc = first_err != 0 ? first_err : TS_ENOTCONN;
    if (rc == 0) {
        /*
         * Each shard that answered asks its daemon for its map as soon as it is ready: wait for
         * those answers (bounded), so that the first calls already follow the newest map.
         */
        uint64_t until = ts__now_ns() + (uint64_t)h->opts.request_timeout_ms * 1000000u;
        struct timespec ts = {(time_t)(until / 1000000000u), (long)(until % 1000000000u)};
        pthread_mutex_lock(&cl->mu);
        for (;;) {
            int waiting = 0;
            for (unsigned k = 0; k < atomic_load(&cl->n_shards); k++) {
                ts__cluster_shard *sh = shard_at(cl, k);
                waiting |= atomic_load(&sh->c->connected) && !sh->map_answered;
            }
            if (!waiting || pthread_cond_timedwait(&cl->cond, &cl->mu, &ts) != 0)
                break;
        }
        pthread_mutex_unlock(&cl->mu);
        ts__set_last_error(NULL, 0);
        *out = h;
        return 0;
    }
    ts__cluster_free(h);
    if (start_err[0] != '\0')
        return ts__fail(rc, "%s", start_err);
    if (mlen > 0)
        return ts__fail(rc, "no shard of the cluster answered: %s", msg);
    return ts__fail(rc, NULL);
}

void ts__cluster_free(ts_client_t *h)
{
    ts__cluster *cl = h->cl;
    pthread_mutex_lock(&cl->mu);
    int already = atomic_exchange(&cl->closing, 1);
    unsigned n = atomic_load(&cl->n_shards);
    pthread_mutex_unlock(&cl->mu);
    if (already)
        return; /* a second call (from a cancellation callback): the first one finishes */
    for (unsigned k = 0; k < n; k++)
        ts__client_stop(shard_at(cl, k)->c);
    ts_client_t *self = NULL;
    for (unsigned k = 0; k < n; k++) {
        ts_client_t *c = shard_at(cl, k)->c;
        if (ts__io_thread_is(c))
            self = c; /* called from one of its callbacks: that thread ends after it */
        else
            ts__client_join(c);
    }
    if (self != NULL) {
        self->free_on_exit = 1; /* its thread frees the whole cluster (ts__cluster_destroy) */
        return;
    }
    ts__cluster_destroy(h);
}

void ts__cluster_destroy(ts_client_t *h)
{
    ts__cluster *cl = h->cl;
    pthread_mutex_lock(&cl->mu);
    while (atomic_load(&cl->callers) > 0)
        pthread_cond_wait(&cl->cond, &cl->mu);
    pthread_mutex_unlock(&cl->mu);
    unsigned n = atomic_load(&cl->n_shards);
    for (unsigned k = 0; k < n; k++) {
        ts__cluster_shard *sh = shard_at(cl, k);
        ts__client_destroy(sh->c); /* waits for its blocked callers to leave */
        ts__free(sh->address);
        ts__free(sh);
    }
    handle_free(h);
}

/* Mark in used[] the shard clients that own at least one slot; returns how many. */
static unsigned owning_shards(ts__cluster *cl, unsigned char *used)
{
    unsigned n = atomic_load(&cl->n_shards), count = 0;
    memset(used, 0, n);
    for (uint32_t s = 0; s < TS_SLOTS; s++) {
        uint16_t k = atomic_load_explicit(&cl->owner[s], memory_order_acquire);
        if (k < n && !used[k]) {
            used[k] = 1;
            count++;
        }
    }
    return count;
}

int ts__cluster_connected(ts_client_t *h)
{
    ts__cluster *cl = h->cl;
    unsigned char used[TS_SHARD_MAX];
    owning_shards(cl, used);
    unsigned n = atomic_load(&cl->n_shards);
    for (unsigned k = 0; k < n; k++) {
        if (used[k] && !atomic_load(&shard_at(cl, k)->c->connected))
            return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * Fan-outs: LIST, STATS, PING, SAVE
 */

/* The shard clients a fan-out asks (each owning shard once) into cs; returns how many. */
static size_t fanout_targets(ts__cluster *cl, ts_client_t **cs, ts__cluster_shard **shs)
{
    unsigned char used[TS_SHARD_MAX];
    owning_shards(cl, used);
    unsigned n = atomic_load(&cl->n_shards);
    size_t count = 0;
    for (unsigned k = 0; k < n; k++) {
        if (!used[k])
            continue;
        shs[count] = shard_at(cl, k);
        cs[count] = shs[count]->c;
        count++;
    }
    return count;
}

/* One shard's answer to a fan-out. */
typedef struct fan_part {
    ts__cluster_shard *sh;
    int status;
    char *msg;           /* ts__malloc'd, or NULL */
    ts_bin_list_t *bins; /* LIST */
    ts_value_t *value;   /* STATS */
} fan_part;

static int cmp_bin(const void *a, const void *b)
{
    return strcmp(((const ts_bin_info_t *)a)->name, ((const ts_bin_info_t *)b)->name);
}

/*
 * The first failure among parts, with ts_last_error() naming its shard (once: a shard that is
 * down already says which it is); 0 when none failed.
 */
static int first_failure(const fan_part *parts, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (parts[i].status == 0)
            continue;
        char buf[TS__SHARD_LABEL_MAX];
        const char *label = shard_label(parts[i].sh, buf);
        const char *msg = parts[i].msg != NULL ? parts[i].msg : ts_strerror(parts[i].status);
        if (strncmp(msg, label, strlen(label)) == 0)
            return ts__fail(parts[i].status, "%s", msg);
        return ts__fail(parts[i].status, "%s: %s", label, msg);
    }
    return 0;
}

/*
 * LIST merged: every shard's bins in one list sorted by name (a name lives on one shard only).
 * Fails like the first shard that failed (a listing without a shard's bins would look like
 * they were deleted).
 */
static int merge_list(const fan_part *parts, size_t n, ts_bin_list_t **out)
{
    int rc = first_failure(parts, n);
    if (rc != 0)
        return rc;
    size_t count = 0, names = 0;
    for (size_t i = 0; i < n; i++) {
        count += parts[i].bins->count;
        for (size_t j = 0; j < parts[i].bins->count; j++)
            names += strlen(parts[i].bins->bins[j].name) + 1;
    }
    size_t head = sizeof(ts_bin_list_t) + count * sizeof(ts_bin_info_t);
    ts_bin_list_t *l = ts__malloc(head + names + 1);
    if (l == NULL)
        return ts__fail(TS_ENOMEM, NULL);
    l->count = count;
    l->bins = (ts_bin_info_t *)(void *)(l + 1);
    char *p = (char *)l + head;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        for (size_t j = 0; j < parts[i].bins->count; j++) {
            ts_bin_info_t b = parts[i].bins->bins[j];
            size_t len = strlen(b.name) + 1;
            memcpy(p, b.name, len);
            b.name = p;
            p += len;
            l->bins[k++] = b;
        }
    }
    qsort(l->bins, count, sizeof(ts_bin_info_t), cmp_bin);
    *out = l;
    return 0;
}

/*
 * The STATS keys that add up over the shards, besides every ops_* counter: counters of events
 * (bytes sent, errors, timeouts ...) and gauges of what each daemon holds (bins, bytes,
 * connections ...), whose sum is the cluster's total. Every other key is taken from the first
 * shard that answered: limits (max_frame, max_memory, max_disk, fds_budget), identities
 * (server_id, version, shard, shards, map_epoch), flags (last_save_ok), times and durations
 * (uptime_ms, last_save_time, snapshot_last_ms, view_turn_max_us ...), whose sum means nothing.
 * So a key a newer tensord adds is not summed until it is listed here. docs/CLUSTER.md lists
 * the same keys.
 */
static const char *const k_summed[] = {
    "connections",
    "connections_total",
    "rejected_clients",
    "connections_unauth",
    "bins",
    "items",
    "bytes",
    "bytes_reserved",
    "used_memory",
    "overhead_bytes",
    "output_bytes",
    "connection_bytes",
    "orphaned_bytes",
    "slabs",
    "slab_bytes",
    "slab_meta_bytes",
    "slab_slots_used",
    "slab_empty_kept_bytes",
    "listeners",
    "waiters",
    "watch_bytes",
    "wake_deferred",
    "lists_offloop",
    "notifications_sent",
    "protocol_errors",
    "oom_rejections",
    "slow_readers",
    "bytes_received",
    "bytes_sent",
    "body_timeouts",
    "auth_failures",
    "hello_timeouts",
    "notes_coalesced",
    "out_of_memory",
    "accept_pauses",
    "snapshots",
    "snapshot_failures",
    "writes_refused",
    "wrong_shard",
    "view_passes",
    "view_active",
    "view_captures",
    "disk_bytes",
    "disk_files",
    "disk_loaded",
    "disk_damaged",
    "disk_refused",
    "shm_items",
    "shm_bytes",
    "shm_pool_bytes",
    "fds_held",
    "fds_sent",
    "fds_received",
    "fds_pending",
    "puts_fd",
    "reclaim_pending_bytes",
    "reclaim_jobs",
    "reclaim_bytes",
    "streams",
    "stream_entries",
    "stream_bytes",
    "stream_groups",
    "stream_groups_stale",
    "stream_backpressure",
    "stream_entries_lost",
    "stream_waits",
    "tables",
    "table_items",
    "table_bytes",
    "table_inserts",
    "table_samples",
    "table_waits",
    "services",
    "service_servers",
    "service_calls_waiting",
    "service_calls_handed",
    "service_calls",
    "service_answers",
    "service_calls_gone",
    "service_timeouts",
    "service_late_answers",
    "allocations",
};

/* 1 when the STATS key adds up over the shards (see k_summed). */
static int stats_summed(const char *key)
{
    if (strncmp(key, "ops_", 4) == 0)
        return 1;
    for (size_t i = 0; i < TS__ARRAY_SIZE(k_summed); i++)
        if (strcmp(key, k_summed[i]) == 0)
            return 1;
    return 0;
}

/*
 * Add src's entries into dst: the integers of the keys that add up (stats_summed) summed,
 * anything else kept from the first shard.
 */
static int stats_sum(ts_value_t *dst, const ts_value_t *src)
{
    size_t n = ts_value_len(src);
    for (size_t i = 0; i < n; i++) {
        const char *key = ts_map_key_at(src, i);
        const ts_value_t *v = ts_map_value_at(src, i);
        const ts_value_t *have = ts_map_get(dst, key);
        int64_t a, b;
        int rc = 0;
        if (have == NULL)
            rc = ts_map_set(dst, key, ts_value_clone(v));
        else if (stats_summed(key) && ts_value_int(have, &a) == 0 && ts_value_int(v, &b) == 0)
            rc = ts_map_set(dst, key, ts_int_new((int64_t)((uint64_t)a + (uint64_t)b)));
        if (rc != 0)
            return rc;
    }
    return 0;
}

/*
 * STATS merged: the counters and gauges that add up summed (stats_summed: ops_*, bins, bytes
 * ... are the cluster's totals), other entries from the first shard that answered; plus
 * "shards" (a list with each shard's own map, with "shard" and "address" added, or for a shard
 * that did not answer only those and "error"), "shards_down", "cluster_epoch" (the map the client
 * follows), "cluster_redirects" (WRONG_SHARD answers this client followed) and "cluster_maps"
 * (newer maps it adopted). Fails only when no shard answered.
 */
static int merge_stats(ts__cluster *cl, const fan_part *parts, size_t n, ts_value_t **out)
{
    size_t ok = 0;
    for (size_t i = 0; i < n; i++)
        ok += parts[i].status == 0;
    if (ok == 0)
        return first_failure(parts, n);
    ts_value_t *m = ts_map_new();
    ts_value_t *list = ts_list_new();
    int rc = m == NULL || list == NULL ? TS_ENOMEM : 0;
    int64_t down = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        const fan_part *p = &parts[i];
        ts_value_t *one = p->status == 0 ? ts_value_clone(p->value) : ts_map_new();
        rc = one == NULL ? TS_ENOMEM : 0;
        if (rc == 0 && p->status == 0)
            rc = stats_sum(m, p->value);
        if (rc == 0)
            rc = ts_map_set(one, "address", ts_string_new(p->sh->address, strlen(p->sh->address)));
        if (rc == 0)
            rc = ts_map_set(one, "shard",
                            ts_int_new(atomic_load(&p->sh->self) >= 0 ? atomic_load(&p->sh->self)
                                                                      : p->sh->pos));
        if (rc == 0 && p->status != 0) {
            down++;
            const char *why = p->msg != NULL ? p->msg : ts_strerror(p->status);
            rc = ts_map_set(one, "error", ts_string_new(why, strlen(why)));
        }
        if (rc == 0)
            rc = ts_list_push(list, one);
        else
            ts_value_free(one);
    }
    pthread_mutex_lock(&cl->mu);
    uint64_t epoch = cl->epoch;
    pthread_mutex_unlock(&cl->mu);
    if (rc == 0)
        rc = ts_map_set(m, "shards", list);
    else
        ts_value_free(list);
    if (rc == 0)
        rc = ts_map_set(m, "shards_down", ts_int_new(down));
    if (rc == 0)
        rc = ts_map_set(m, "cluster_epoch", ts_int_new((int64_t)epoch));
    if (rc == 0)
        rc = ts_map_set(m, "cluster_redirects", ts_int_new((int64_t)atomic_load(&cl->redirects)));
    if (rc == 0)
        rc = ts_map_set(m, "cluster_maps", ts_int_new((int64_t)atomic_load(&cl->maps)));
    if (rc != 0) {
        ts_value_free(m);
        return ts__fail(TS_ENOMEM, NULL);
    }
    *out = m;
    return 0;
}

static void parts_free(fan_part *parts, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        ts__free(parts[i].msg);
        ts_bin_list_free(parts[i].bins);
        ts_value_free(parts[i].value);
    }
}

/*
 * Run op on every owning shard at once (blocking) into parts[0..*n-1]. 0, or the error that
 * stopped the fan-out before it started.
 */
static int fanout_blocking(ts_client_t *h, uint8_t op, fan_part *parts, size_t *n)
{
    ts__cluster *cl = h->cl;
    ts_client_t *cs[TS_SHARD_MAX];
    ts__cluster_shard *shs[TS_SHARD_MAX];
    ts__req *rs[TS_SHARD_MAX];
    int rcs[TS_SHARD_MAX];
    size_t k = fanout_targets(cl, cs, shs);
    int rc = 0;
    for (size_t i = 0; i < k; i++) {
        rs[i] = rc == 0 ? ts__api_req_new(cs[i], TS__K_BLOCK, op, NULL, &rc) : NULL;
    }
    if (rc != 0) {
        for (size_t i = 0; i < k; i++)
            ts__req_free(rs[i]);
        return rc;
    }
    ts__api_run_blocking_all(cs, rs, k, rcs);
    for (size_t i = 0; i < k; i++) {
        memset(&parts[i], 0, sizeof(parts[i]));
        parts[i].sh = shs[i];
        parts[i].status = rcs[i];
        if (rs[i] == NULL)
            continue;
        if (rs[i]->msg != NULL)
            parts[i].msg = ts__strndup(rs[i]->msg, strlen(rs[i]->msg));
        parts[i].bins = rs[i]->res.bins;
        parts[i].value = rs[i]->res.value;
        rs[i]->res.bins = NULL;
        rs[i]->res.value = NULL;
        ts__req_free(rs[i]);
    }
    *n = k;
    return 0;
}

/* The common start of a blocking fan-out: the call checks, then the handle held open. */
static int fan_begin(ts_client_t *h, int args_ok)
{
    int rc = ts__api_check_call(h, 1);
    if (rc != 0)
        return rc;
    if (!args_ok)
        return ts__fail(TS_EINVAL, NULL);
    rc = ts__cluster_enter(h);
    return rc != 0 ? ts__fail(rc, "the client is closing") : 0;
}

int ts__cluster_list(ts_client_t *h, ts_bin_list_t **out)
{
    int rc = fan_begin(h, out != NULL);
    if (rc != 0)
        return rc;
    fan_part parts[TS_SHARD_MAX];
    size_t n = 0;
    rc = fanout_blocking(h, TS_OP_LIST, parts, &n);
    if (rc == 0)
        rc = merge_list(parts, n, out);
    parts_free(parts, n);
    ts__cluster_leave(h);
    return rc;
}

int ts__cluster_stats(ts_client_t *h, ts_value_t **out)
{
    int rc = fan_begin(h, out != NULL);
    if (rc != 0)
        return rc;
    fan_part parts[TS_SHARD_MAX];
    size_t n = 0;
    rc = fanout_blocking(h, TS_OP_STATS, parts, &n);
    if (rc == 0)
        rc = merge_stats(h->cl, parts, n, out);
    parts_free(parts, n);
    ts__cluster_leave(h);
    return rc;
}

int ts__cluster_each(ts_client_t *h, uint8_t op)
{
    int rc = fan_begin(h, 1);
    if (rc != 0)
        return rc;
    fan_part parts[TS_SHARD_MAX];
    size_t n = 0;
    rc = fanout_blocking(h, op, parts, &n);
    if (rc == 0)
        rc = first_failure(parts, n);
    parts_free(parts, n);
    ts__cluster_leave(h);
    return rc;
}

/* An asynchronous fan-out: one request per shard, one user callback once all have answered. */
typedef struct fan_async {
    pthread_mutex_t mu;
    ts_client_t *h;
    uint8_t op;
    size_t n;
    size_t left; /* under mu */
    ts_result_cb cb;
    void *arg;
    fan_part parts[];
} fan_async;

/* The parts of an asynchronous fan-out point back at it through this. */
typedef struct fan_ref {
    fan_async *f;
    size_t i;
} fan_ref;

static void fan_part_cb(ts_client_t *h, int status, ts_result_t *res, void *arg)
{
    fan_ref *ref = arg;
    fan_async *f = ref->f;
    fan_part *p = &f->parts[ref->i];
    ts__free(ref);
    p->status = status;
    if (status != 0) {
        const char *why = ts_last_error();
        p->msg = ts__strndup(why, strlen(why));
    }
    p->bins = res->bins;
    p->value = res->value;
    res->bins = NULL;
    res->value = NULL;
    pthread_mutex_lock(&f->mu);
    int last = --f->left == 0;
    pthread_mutex_unlock(&f->mu);
    if (!last)
        return;
    /* The last answer: merge, and call the user's callback on this thread. */
    ts_result_t out;
    memset(&out, 0, sizeof(out));
    int rc;
    if (f->op == TS_OP_LIST)
        rc = merge_list(f->parts, f->n, &out.bins);
    else if (f->op == TS_OP_STATS)
        rc = merge_stats(h->cl, f->parts, f->n, &out.value);
    else
        rc = first_failure(f->parts, f->n);
    f->cb(h, rc, &out, f->arg);
    ts_bin_list_free(out.bins);
    ts_value_free(out.value);
    parts_free(f->parts, f->n);
    pthread_mutex_destroy(&f->mu);
    ts__free(f);
}

int ts__cluster_fanout_async(ts_client_t *h, uint8_t op, ts_result_cb cb, void *arg)
{
    int rc = ts__api_check_call(h, 0);
    if (rc != 0)
        return rc;
    ts__cluster *cl = h->cl;
    ts_client_t *cs[TS_SHARD_MAX];
    ts__cluster_shard *shs[TS_SHARD_MAX];
    ts__req *rs[TS_SHARD_MAX];
    size_t k = fanout_targets(cl, cs, shs);
    fan_async *f = ts__calloc(1, sizeof(*f) + k * sizeof(fan_part));
    if (f == NULL)
        return ts__fail(TS_ENOMEM, NULL);
    pthread_mutex_init(&f->mu, NULL);
    f->h = h;
    f->op = op;
    f->n = k;
    f->cb = cb;
    f->arg = arg;
    for (size_t i = 0; i < k; i++) {
        f->parts[i].sh = shs[i];
        fan_ref *ref = rc == 0 ? ts__calloc(1, sizeof(*ref)) : NULL;
        rs[i] = NULL;
        if (rc == 0 && ref == NULL)
            rc = TS_ENOMEM;
        if (rc == 0)
            rs[i] = ts__api_req_new(cs[i], TS__K_ASYNC, op, NULL, &rc);
        if (rs[i] == NULL) {
            ts__free(ref);
            continue;
        }
        ref->f = f;
        ref->i = i;
        rs[i]->cb = fan_part_cb;
        rs[i]->arg = ref;
    }
    if (rc != 0) {
        for (size_t i = 0; i < k; i++) {
            if (rs[i] != NULL)
                ts__free(rs[i]->arg);
            ts__req_free(rs[i]);
        }
        pthread_mutex_destroy(&f->mu);
        ts__free(f);
        return ts__fail(rc, NULL);
    }
    /*
     * Every part is submitted; one a closing shard refuses completes here as cancelled, and the
     * user's callback comes once the last part is in (never from inside this call when a shard
     * answers: only when every shard refused at once does it run on this thread, as
     * ts_client_free's cancellations do).
     */
    f->left = k;
    for (size_t i = 0; i < k; i++) {
        if (ts__submit(cs[i], rs[i]) != 0) {
            ts__req_set_msg(rs[i], "the client is closing");
            ts__req_finish(cs[i], rs[i], TS_ECANCELED);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * MGET: split by shard, merged in the order of the names
 */

int ts__cluster_mget(ts_client_t *h, const char *const *names, size_t n, size_t max_items,
                     ts_items_t **out)
{
    int rc = fan_begin(h, names != NULL && out != NULL && n > 0 && n <= TS_MGET_MAX);
    if (rc != 0)
        return rc;
    for (size_t i = 0; i < n; i++) {
        if (names[i] == NULL) {
            ts__cluster_leave(h);
            return ts__fail(TS_EINVAL, "no bin name");
        }
    }
    ts_items_t *res[TS_MGET_MAX];
    const char *sub[TS_MGET_MAX];
    ts_items_t *subout[TS_MGET_MAX];
    size_t pos[TS_MGET_MAX];
    /*
     * Each round asks every shard for its names; a WRONG_SHARD teaches the client one slot's
     * owner (ts__cluster_block), so the next round splits differently. Bounded by the redirects
     * one request may take, and by the names (each round that fails learns one of them).
     */
    for (size_t round = 0;; round++) {
        memset(res, 0, n * sizeof(res[0]));
        ts_client_t *cs[TS_MGET_MAX];
        for (size_t i = 0; i < n; i++)
            cs[i] = ts__cluster_route(h, names[i]);
        unsigned char done[TS_MGET_MAX];
        memset(done, 0, n);
        rc = 0;
        for (size_t i = 0; i < n && rc == 0; i++) {
            if (done[i])
                continue;
            size_t m = 0;
            for (size_t j = i; j < n; j++) {
                if (!done[j] && cs[j] == cs[i]) {
                    done[j] = 1;
                    pos[m] = j;
                    sub[m++] = names[j];
                }
            }
            rc = ts_mget(cs[i], sub, m, max_items, subout);
            for (size_t j = 0; rc == 0 && j < m; j++)
                res[pos[j]] = subout[j];
        }
        if (rc == 0) {
            memcpy(out, res, n * sizeof(res[0]));
            break;
        }
        for (size_t i = 0; i < n; i++)
            ts_items_free(res[i]);
        if (rc != TS_EWRONGSHARD || round >= n + TS__CLUSTER_REDIRECTS)
            break;
    }
    ts__cluster_leave(h);
    return rc;
}
