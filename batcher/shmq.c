/*
 * Same-host slots: requesters on the serving process's host exchange requests and answers with
 * it through shared memory instead of sending them through tensord.
 *
 * The region is a POSIX shared-memory object (/dev/shm, mode 0600, a random name) that the
 * server creates, reserves in full (posix_fallocate: a full /dev/shm fails here, not later as a
 * SIGBUS in a writer) and advertises in the bin NAME/shm. A name found through a bin was chosen
 * over a memfd passed on a unix socket: the predictor already talks to the tensord the server
 * publishes through, so finding the slots costs one PEEK and no socket or listener of the
 * server's own. The price is a name in /dev/shm that a crashed server leaves behind (a new one
 * never reuses it: each name is random).
 *
 * Layout: a header page, then one control block per slot, then each slot's request area and
 * answer area (page multiples). In a slot, the requester writes its input into the request area
 * (a flat encoding of the tree, each tensor's data 64-byte aligned), its length and timeout,
 * then increments req_seq and rings the header's bell (a futex word the slot thread sleeps on
 * when it found nothing to do). The slot thread takes every slot whose req_seq moved and whose
 * previous request is answered, copies the input out and submits it to the batcher. The thread
 * that answers it writes the output into the answer area, the status, version and message, then
 * sets ans_seq to the request's number and wakes the requester's futex when it sleeps.
 *
 * Ownership of a slot is a robust process-shared mutex that the requester's predictor thread
 * holds as long as the predictor lives: when that process dies the kernel marks the mutex
 * owner-dead, and the next predictor that tries it takes the slot over. The server never takes
 * those mutexes, so a requester can never block it. The server's slot thread holds the header's
 * alive mutex the same way: a requester that finds it free or owner-dead while the header does
 * not say stopped knows that the server died.
 *
 * Everything a requester writes is checked by the server before use (lengths within the areas,
 * dtypes, shapes, nesting), and the other way round; a process that scribbles in its own slot
 * only garbles its own answers.
 */
#define _GNU_SOURCE
#include "shmq.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <semaphore.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define TS__SHM_MAGIC  0x3151534D48535354ull /* "TSSHMSQ1" */
#define TS__SHM_LAYOUT 1                     /* the region's layout version */
#define TS__SHM_PAGE   4096u                 /* bytes; areas are page multiples */
#define TS__SHM_HDR    4096u                 /* bytes; the header page */
#define TS__SHM_CTL    512u                  /* bytes per slot's control block (own cache lines) */
/* bytes; the most a region may reserve in /dev/shm (slots x areas), a sanity bound */
#define TS__SHM_MAX_REGION ((size_t)4 << 30)
/* bytes; the default answer area without an output schema, at least */
#define TS__SHM_MIN_ANSWER ((size_t)64 << 10)
/* bytes; a map key carried through a slot at most (longer ones go through tensord) */
#define TS__SHM_MAX_KEY 255
/* ms; the slot thread sleeps at most this long on its bell, then checks for a stop */
#define TS__SHM_NAP_MS 200
/*
 * ns; after taking requests, the slot thread keeps looking (yielding the core between looks)
 * this long before it sleeps: requesters that come back meanwhile ring no futex and wake no
 * thread. Bounded so that an idle server stops spending CPU almost at once.
 */
#define TS__SHM_SPIN_NS 50000u
/*
 * ns; after ringing, a requester keeps looking for its answer (yielding the core between looks)
 * at most this long before it sleeps on its futex. An answer that comes meanwhile costs the
 * answering thread no FUTEX_WAKE (waiting stays 0) and the requester no sleep and wake-up, the
 * costs that dominate a small model's request; with every requester back sooner, the next batch
 * forms sooner. 10 to 50 us caught too few answers of a small MLP with 8 requesters on 2 cores
 * (bench/batcher_shm_bench.c). Bounded: a slow model costs a request at most this much CPU.
 */
#define TS__SHM_WAIT_SPIN_NS 100000u
/*
 * requests; after a look that missed its answer, a requester sleeps straight away for this many
 * requests, doubling per miss from 1 up to this bound, and back to 1 after a look that caught
 * its answer. On an oversubscribed host (the answers come later than the look) yielding
 * requesters would only take turns from the server: they then sleep as without looking, and try
 * a look once in a while to find out whether answers came back within it.
 */
#define TS__SHM_WAIT_SPIN_BACKOFF 64u
/* bytes; the object's name "/tensorshare-PID-RANDOM" */
#define TS__SHM_PATH_LEN 64
/* bytes; a boot id is 36 characters */
#define TS__SHM_BOOT_LEN 64

_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "futex words must be lock-free atomics");

typedef struct shm_header {
    uint64_t magic;
    uint32_t layout;
    uint32_t nslots;
    uint64_t token; /* random; the descriptor carries it too */
    uint64_t req_bytes, ans_bytes;
    uint64_t region_bytes;
    int32_t pid;           /* the serving process */
    atomic_uint closed;    /* no new requests: requesters go through tensord */
    atomic_uint stopped;   /* the slot thread ended: what it took is final (taken_seq) */
    atomic_uint bell;      /* rung by requesters; the slot thread's futex */
    atomic_uint sleeping;  /* the slot thread sleeps (or is about to) on bell */
    pthread_mutex_t alive; /* robust; held by the slot thread while it runs */
} shm_header;

typedef struct shm_slot {
    pthread_mutex_t owner; /* robust; held by the requester's predictor thread */
    atomic_uint req_seq;   /* the requester's latest request */
    atomic_uint taken_seq; /* the latest one the server took */
    atomic_uint ans_seq;   /* the latest one answered (the requester's futex) */
    atomic_uint waiting;   /* the requester sleeps (or is about to) on ans_seq */
    atomic_uint req_len;   /* bytes of the request area used */
    atomic_int timeout_ms; /* as the relay's record: 0 default, < 0 none */
    atomic_int status;     /* the answer's */
    atomic_uint ans_len;
    _Atomic int64_t version;
    char msg[TS__BERR_LEN]; /* the reason of a failed answer */
} shm_slot;

_Static_assert(sizeof(shm_header) <= TS__SHM_HDR, "the header fits its page");
_Static_assert(sizeof(shm_slot) <= TS__SHM_CTL, "a slot's control block fits");

static long futex_wait(atomic_uint *w, unsigned val, uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
    /* Not FUTEX_PRIVATE: the word is in memory shared with other processes. */
    return syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake(atomic_uint *w, int n)
{
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, n, NULL, NULL, 0);
}

static shm_slot *slot_at(uint8_t *map, uint32_t i)
{
    return (shm_slot *)(map + TS__SHM_HDR + (size_t)i * TS__SHM_CTL);
}

static uint8_t *req_area(uint8_t *map, uint32_t n, size_t rq, size_t an, uint32_t i)
{
    return map + TS__SHM_HDR + (size_t)n * TS__SHM_CTL + (size_t)i * (rq + an);
}

/* The region's bytes for n slots, or 0 past TS__SHM_MAX_REGION. */
static size_t region_size(uint32_t n, size_t rq, size_t an)
{
    if (n == 0 || n > TS_BATCHER_SHM_MAX_SLOTS || rq > TS_BATCHER_SHM_MAX_AREA ||
        an > TS_BATCHER_SHM_MAX_AREA)
        return 0;
    /* Each term is bounded above, so the sum cannot overflow 64 bits. */
    size_t total = TS__SHM_HDR + (size_t)n * TS__SHM_CTL + (size_t)n * (rq + an);
    return total <= TS__SHM_MAX_REGION ? total : 0;
}

/* ---------------------------------------------------------------------------------------------
 * The flat encoding of a value tree in an area: entries in pre-order, each an ent header, the
 * shape (tensors), the key (a map's children), padding to 8 bytes and, for a tensor, its data at
 * the next 64-byte boundary of the area. Maps, tensors, integers and floats only.
 */
enum { ENT_MAP = 1, ENT_TENSOR = 2, ENT_INT = 3, ENT_FLOAT = 4 };

typedef struct ent {
    uint8_t kind, dtype, ndim, pad;
    uint32_t keylen;
    uint64_t n; /* map: entries; tensor: data bytes; int, float: the value's bits */
} ent;

static size_t align_up(size_t x, size_t a)
{
    return (x + a - 1) & ~(a - 1);
}

/* Reserve len bytes at *off aligned to a; NULL when they do not fit in cap. */
static uint8_t *reserve(uint8_t *base, size_t cap, size_t *off, size_t len, size_t a)
{
    size_t at = align_up(*off, a);
    if (at > cap || len > cap - at)
        return NULL;
    *off = at + len;
    return base + at;
}

/*
 * Encode v under key. 0, TS_EMSGSIZE (does not fit), TS_ENOTSUP (a type or key the slots do not
 * carry, too deep).
 */
static int enc(uint8_t *base, size_t cap, size_t *off, const ts_value_t *v, const char *key,
               size_t keylen, int depth)
{
    if (depth > TS_MAX_DEPTH || keylen > TS__SHM_MAX_KEY)
        return TS_ENOTSUP;
    ent e;
    memset(&e, 0, sizeof(e));
    e.keylen = (uint32_t)keylen;
    const ts_tensor_t *t = NULL;
    switch (ts_value_type(v)) {
    case TS_TYPE_MAP:
        e.kind = ENT_MAP;
        e.n = ts_value_len(v);
        break;
    case TS_TYPE_TENSOR:
        t = ts_value_tensor(v);
        e.kind = ENT_TENSOR;
        e.dtype = (uint8_t)t->dtype;
        e.ndim = (uint8_t)t->ndim;
        e.n = ts_tensor_nbytes(t);
        break;
    case TS_TYPE_INT: {
        int64_t x = 0;
        ts_value_int(v, &x);
        e.kind = ENT_INT;
        memcpy(&e.n, &x, sizeof(x));
        break;
    }
    case TS_TYPE_FLOAT: {
        double x = 0;
        ts_value_float(v, &x);
        e.kind = ENT_FLOAT;
        memcpy(&e.n, &x, sizeof(x));
        break;
    }
    default:
        return TS_ENOTSUP;
    }
    size_t shape_len = t != NULL ? (size_t)t->ndim * sizeof(int64_t) : 0;
    uint8_t *p = reserve(base, cap, off, sizeof(e) + shape_len + keylen, 8);
    if (p == NULL)
        return TS_EMSGSIZE;
    memcpy(p, &e, sizeof(e));
    if (shape_len > 0)
        memcpy(p + sizeof(e), t->shape, shape_len);
    if (keylen > 0)
        memcpy(p + sizeof(e) + shape_len, key, keylen);
    if (t != NULL) {
        uint8_t *d = reserve(base, cap, off, (size_t)e.n, 64);
        if (d == NULL)
            return TS_EMSGSIZE;
        if (e.n > 0)
            memcpy(d, t->data, (size_t)e.n);
    }
    if (e.kind == ENT_MAP) {
        for (size_t i = 0; i < e.n; i++) {
            const char *k = ts_map_key_at(v, i);
            int rc = enc(base, cap, off, ts_map_value_at(v, i), k, strlen(k), depth + 1);
            if (rc != 0)
                return rc;
        }
    }
    return 0;
}

/*
 * Decode one entry (and its subtree) written by the other side: every field is checked before
 * use. tflags: TS_BORROW (tensors over the area) or TS_COPY. On success *out is a new value and
 * key (TS__SHM_MAX_KEY + 1 bytes) its key. 0, TS_EPROTO (malformed, with the reason in why) or
 * TS_ENOMEM.
 */
static int dec(const uint8_t *base, size_t len, size_t *off, int depth, unsigned tflags,
               ts_value_t **out, char *key, const char **why)
{
    ent e;
    size_t at = align_up(*off, 8);
    if (depth > TS_MAX_DEPTH) {
        *why = "nested too deep";
        return TS_EPROTO;
    }
    if (at > len || sizeof(e) > len - at) {
        *why = "an entry runs past the area";
        return TS_EPROTO;
    }
    memcpy(&e, base + at, sizeof(e));
    at += sizeof(e);
    int64_t shape[TS_MAX_NDIM];
    size_t shape_len = e.kind == ENT_TENSOR ? (size_t)e.ndim * sizeof(int64_t) : 0;
    if (e.kind < ENT_MAP || e.kind > ENT_FLOAT || e.ndim > TS_MAX_NDIM ||
        e.keylen > TS__SHM_MAX_KEY || shape_len + e.keylen > len - at) {
        *why = "a malformed entry";
        return TS_EPROTO;
    }
    if (shape_len > 0)
        memcpy(shape, base + at, shape_len);
    memcpy(key, base + at + shape_len, e.keylen);
    key[e.keylen] = '\0';
    if (memchr(key, '\0', e.keylen) != NULL) {
        *why = "a key with a NUL byte";
        return TS_EPROTO;
    }
    *off = at + shape_len + e.keylen;
    ts_value_t *v = NULL;
    switch (e.kind) {
    case ENT_INT: {
        int64_t x;
        memcpy(&x, &e.n, sizeof(x));
        v = ts_int_new(x);
        break;
    }
    case ENT_FLOAT: {
        double x;
        memcpy(&x, &e.n, sizeof(x));
        v = ts_float_new(x);
        break;
    }
    case ENT_TENSOR: {
        size_t es = ts_dtype_size((ts_dtype_t)e.dtype);
        size_t numel = 1;
        int ok = es != 0;
        for (int i = 0; ok && i < e.ndim; i++) {
            if (shape[i] < 0 || (shape[i] > 0 && numel > SIZE_MAX / (size_t)shape[i]))
                ok = 0;
            else
                numel *= (size_t)shape[i];
        }
        if (!ok || numel > SIZE_MAX / es || numel * es != e.n) {
            *why = "a tensor's dtype or shape does not match its size";
            return TS_EPROTO;
        }
        size_t d = align_up(*off, 64);
        if (d > len || e.n > len - d) {
            *why = "a tensor's data runs past the area";
            return TS_EPROTO;
        }
        *off = d + (size_t)e.n;
        v = ts_tensor_new((ts_dtype_t)e.dtype, e.ndim, shape, e.n > 0 ? base + d : NULL, tflags);
        break;
    }
    default: { /* ENT_MAP */
        /* Each child takes at least an entry header: a count past that is malformed. */
        if (e.n > (len - *off) / sizeof(ent)) {
            *why = "a map with more entries than the area holds";
            return TS_EPROTO;
        }
        v = ts_map_new();
        char ck[TS__SHM_MAX_KEY + 1];
        for (uint64_t i = 0; v != NULL && i < e.n; i++) {
            ts_value_t *child = NULL;
            int rc = dec(base, len, off, depth + 1, tflags, &child, ck, why);
            if (rc != 0) {
                ts_value_free(v);
                return rc;
            }
            if (ts_map_set(v, ck, child) != 0) {
                ts_value_free(v);
                return TS_ENOMEM;
            }
        }
        break;
    }
    }
    if (v == NULL) {
        *why = "out of memory";
        return TS_ENOMEM;
    }
    *out = v;
    return 0;
}

/* Decode a whole area: exactly one root entry. */
static int dec_root(const uint8_t *base, size_t len, unsigned tflags, ts_value_t **out,
                    const char **why)
{
    char key[TS__SHM_MAX_KEY + 1];
    size_t off = 0;
    return dec(base, len, &off, 0, tflags, out, key, why);
}

/* This host's boot id ("" when it cannot be read). */
static void boot_id(char *buf, size_t len)
{
    buf[0] = '\0';
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, buf, len - 1);
    close(fd);
    if (n <= 0) {
        buf[0] = '\0';
        return;
    }
    buf[n] = '\0';
    char *nl = strchr(buf, '\n');
    if (nl != NULL)
        *nl = '\0';
}

/* ---------------------------------------------------------------------------------------------
 * The serving side
 */
typedef struct slot_priv {
    uint32_t taken;      /* the slot thread's: the last req_seq it took */
    atomic_int inflight; /* a request of this slot is in the batcher */
} slot_priv;

struct shm_server {
    ts_batcher_t *b;
    ts_client_t *client;
    atomic_int refs; /* the server's own, and one per request in the batcher */
    uint8_t *map;
    size_t map_len;
    shm_header *hdr;
    uint32_t nslots;
    size_t req_bytes, ans_bytes;
    slot_priv *priv;
    char path[TS__SHM_PATH_LEN];
    char desc_bin[TS_MAX_NAME_LEN + 1];
    pthread_t th;
    sem_t started; /* the slot thread holds alive */
    atomic_int stop;
};

/* One request of a slot in the batcher. */
typedef struct shm_request {
    shm_server *s;
    ts_value_t *input; /* copied out of the slot, freed with the request */
    uint32_t slot;
    uint32_t seq;
} shm_request;

static void srv_unref(shm_server *s)
{
    if (atomic_fetch_sub(&s->refs, 1) != 1)
        return;
    munmap(s->map, s->map_len);
    ts__free(s->priv);
    sem_destroy(&s->started);
    ts__free(s);
}

static void ring(shm_header *h)
{
    atomic_fetch_add(&h->bell, 1);
    if (atomic_load(&h->sleeping))
        futex_wake(&h->bell, 1);
}

/* Write an answer (output borrowed) into slot i for request seq, and wake its requester. */
static void answer_write(shm_server *s, uint32_t i, uint32_t seq, int status,
                         const ts_value_t *output, int64_t version, const char *msg)
{
    shm_slot *sl = slot_at(s->map, i);
    uint8_t *area = req_area(s->map, s->nslots, s->req_bytes, s->ans_bytes, i) + s->req_bytes;
    char why[TS__BERR_LEN];
    size_t off = 0;
    if (status == 0) {
        int rc = enc(area, s->ans_bytes, &off, output, "", 0, 0);
        if (rc == TS_EMSGSIZE) {
            snprintf(why, sizeof(why),
                     "the answer does not fit the slot's answer area of %zu bytes "
                     "(ts_batcher_shm_options_t.answer_bytes)",
                     s->ans_bytes);
            status = rc;
            msg = why;
        } else if (rc != 0) {
            status = rc;
            msg = "the answer holds a value the shared-memory slots do not carry (lists, "
                  "strings, bytes)";
        }
    }
    atomic_store_explicit(&sl->ans_len, status == 0 ? (unsigned)off : 0u, memory_order_relaxed);
    atomic_store_explicit(&sl->status, status, memory_order_relaxed);
    atomic_store_explicit(&sl->version, version, memory_order_relaxed);
    snprintf(sl->msg, sizeof(sl->msg), "%s",
             status == 0                     ? ""
             : msg != NULL && msg[0] != '\0' ? msg
                                             : ts_strerror(status));
    atomic_store(&sl->ans_seq, seq); /* publishes the above */
    if (atomic_load(&sl->waiting))
        futex_wake(&sl->ans_seq, INT_MAX);
}

static void shm_done(ts_batcher_t *b, int status, ts_value_t *output, int64_t version, void *arg)
{
    (void)b;
    shm_request *r = arg;
    shm_server *s = r->s;
    answer_write(s, r->slot, r->seq, status, output, version, status != 0 ? ts_last_error() : NULL);
    ts_value_free(output);
    ts_value_free(r->input);
    atomic_store(&s->priv[r->slot].inflight, 0);
    /* A newer request of this slot waited for this answer: the slot thread takes it now. */
    if (atomic_load(&slot_at(s->map, r->slot)->req_seq) != r->seq)
        ring(s->hdr);
    ts__free(r);
    srv_unref(s);
}

static void count_malformed(shm_server *s)
{
    pthread_mutex_lock(&s->b->mu);
    s->b->st.malformed++;
    pthread_mutex_unlock(&s->b->mu);
}

/* Take request seq of slot i: copy the input out and submit it, or answer at once. */
static void take(shm_server *s, uint32_t i, uint32_t seq)
{
    shm_slot *sl = slot_at(s->map, i);
    atomic_store(&sl->taken_seq, seq);
    uint32_t len = atomic_load_explicit(&sl->req_len, memory_order_relaxed);
    int t = atomic_load_explicit(&sl->timeout_ms, memory_order_relaxed);
    const uint8_t *area = req_area(s->map, s->nslots, s->req_bytes, s->ans_bytes, i);
    ts_value_t *in = NULL;
    const char *why = "";
    /* Copied out (TS_COPY): the slot's memory stays the requester's to scribble on. */
    int rc = len <= s->req_bytes ? dec_root(area, len, TS_COPY, &in, &why) : TS_EPROTO;
    if (len > s->req_bytes)
        why = "the request's length runs past the area";
    if (rc != 0) {
        char msg[TS__BERR_LEN];
        snprintf(msg, sizeof(msg), "malformed request in slot %u: %s", i, why);
        if (rc == TS_EPROTO)
            count_malformed(s);
        answer_write(s, i, seq, rc, NULL, 0, msg);
        return;
    }
    shm_request *r = ts__malloc(sizeof(*r));
    if (r == NULL) {
        ts_value_free(in);
        answer_write(s, i, seq, TS_ENOMEM, NULL, 0, "out of memory");
        return;
    }
    r->s = s;
    r->input = in;
    r->slot = i;
    r->seq = seq;
    atomic_fetch_add(&s->refs, 1);
    atomic_store(&s->priv[i].inflight, 1);
    /* As the relay's record: milliseconds, 0 the batcher's default, < 0 none. */
    int to = t < 0 ? TS_TIMEOUT_INFINITE : t == 0 ? TS_TIMEOUT_DEFAULT : t;
    rc = ts_batcher_predict_async(s->b, in, 0, to, shm_done, r);
    if (rc != 0) {
        ts_value_free(in);
        char msg[TS__BERR_LEN];
        snprintf(msg, sizeof(msg), "%s", ts_last_error());
        if (rc == TS_ESCHEMA)
            count_malformed(s);
        atomic_store(&s->priv[i].inflight, 0);
        ts__free(r);
        atomic_fetch_sub(&s->refs, 1); /* the server's own keeps s */
        answer_write(s, i, seq, rc, NULL, 0, msg);
    }
}

/* Take every new request whose slot is free on the server's side; nonzero when one was. */
static int scan(shm_server *s)
{
    int found = 0;
    for (uint32_t i = 0; i < s->nslots; i++) {
        uint32_t seq = atomic_load(&slot_at(s->map, i)->req_seq);
        if (seq == s->priv[i].taken || atomic_load(&s->priv[i].inflight))
            continue;
        s->priv[i].taken = seq;
        take(s, i, seq);
        found = 1;
    }
    return found;
}

static void *slot_main(void *arg)
{
    shm_server *s = arg;
    shm_header *h = s->hdr;
    pthread_mutex_lock(&h->alive);
    sem_post(&s->started);
    uint64_t busy_until = 0;
    while (!atomic_load(&s->stop)) {
        unsigned rung = atomic_load(&h->bell);
        if (scan(s)) {
            busy_until = ts__now_ns() + TS__SHM_SPIN_NS;
            continue;
        }
        if (busy_until != 0 && ts__now_ns() < busy_until) {
            sched_yield();
            continue;
        }
        busy_until = 0;
        atomic_store(&h->sleeping, 1);
        if (atomic_load(&h->bell) == rung && !atomic_load(&s->stop))
            futex_wait(&h->bell, rung, (uint64_t)TS__SHM_NAP_MS * 1000000u);
        atomic_store(&h->sleeping, 0);
    }
    /* What was taken is final: requesters whose request was not send it to the service. */
    atomic_store(&h->stopped, 1);
    pthread_mutex_unlock(&h->alive);
    return NULL;
}

/* Bytes of an area holding max_batch rows of a schema, with the entries' overhead. */
static size_t schema_bytes(const schema_field *f, int n, int64_t max_batch)
{
    size_t total = TS__SHM_PAGE; /* maps, keys, padding */
    for (int i = 0; i < n; i++) {
        size_t row = f[i].row_bytes;
        if (row != 0 && (size_t)max_batch > TS_BATCHER_SHM_MAX_AREA / row)
            return TS_BATCHER_SHM_MAX_AREA + 1;
        total += 64 + sizeof(ent) + TS_MAX_NDIM * sizeof(int64_t) + strlen(f[i].name) +
                 row * (size_t)max_batch;
        if (total > TS_BATCHER_SHM_MAX_AREA)
            return TS_BATCHER_SHM_MAX_AREA + 1;
    }
    return total;
}

static int init_robust(pthread_mutex_t *m)
{
    pthread_mutexattr_t a;
    int rc = pthread_mutexattr_init(&a);
    if (rc == 0)
        rc = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    if (rc == 0)
        rc = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    if (rc == 0)
        rc = pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
    return rc;
}

/* The descriptor record of NAME/shm. NULL when out of memory. */
static ts_value_t *descriptor(const shm_server *s)
{
    char boot[TS__SHM_BOOT_LEN];
    boot_id(boot, sizeof(boot));
    ts_value_t *d = ts_map_new();
    int rc = d != NULL ? 0 : TS_ENOMEM;
    if (rc == 0)
        rc = ts_map_set(d, "path", ts_string_new(s->path, strlen(s->path)));
    if (rc == 0)
        rc = ts_map_set(d, "token", ts_int_new((int64_t)(s->hdr->token >> 1)));
    if (rc == 0)
        rc = ts_map_set(d, "pid", ts_int_new(getpid()));
    if (rc == 0)
        rc = ts_map_set(d, "boot_id", ts_string_new(boot, strlen(boot)));
    if (rc == 0)
        rc = ts_map_set(d, "layout", ts_int_new(TS__SHM_LAYOUT));
    if (rc == 0)
        rc = ts_map_set(d, "slots", ts_int_new(s->nslots));
    if (rc == 0)
        rc = ts_map_set(d, "request_bytes", ts_int_new((int64_t)s->req_bytes));
    if (rc == 0)
        rc = ts_map_set(d, "answer_bytes", ts_int_new((int64_t)s->ans_bytes));
    if (rc != 0) {
        ts_value_free(d);
        return NULL;
    }
    return d;
}

int ts__shm_serve_start(ts_batcher_t *b, ts_client_t *client, const char *name,
                        const ts_batcher_shm_options_t *opts, shm_server **out)
{
    ts_batcher_shm_options_t o;
    if (opts != NULL)
        o = *opts;
    else
        ts_batcher_shm_options_init(&o);
    if (o.slots < 1 || o.slots > TS_BATCHER_SHM_MAX_SLOTS ||
        o.request_bytes > TS_BATCHER_SHM_MAX_AREA || o.answer_bytes > TS_BATCHER_SHM_MAX_AREA) {
        ts__batcher_set_err("shared-memory slots: 1 to %d slots, areas of at most %zu bytes",
                            TS_BATCHER_SHM_MAX_SLOTS, TS_BATCHER_SHM_MAX_AREA);
        return TS_EINVAL;
    }
    size_t rq = o.request_bytes != 0 ? o.request_bytes : schema_bytes(b->in, b->n_in, b->max_batch);
    size_t an = o.answer_bytes;
    if (an == 0)
        an = b->n_out > 0 ? schema_bytes(b->out, b->n_out, b->max_batch)
                          : (rq > TS__SHM_MIN_ANSWER ? rq : TS__SHM_MIN_ANSWER);
    if (rq > TS_BATCHER_SHM_MAX_AREA)
        rq = TS_BATCHER_SHM_MAX_AREA; /* larger requests go through the service */
    if (an > TS_BATCHER_SHM_MAX_AREA)
        an = TS_BATCHER_SHM_MAX_AREA;
    rq = align_up(rq, TS__SHM_PAGE);
    an = align_up(an, TS__SHM_PAGE);
    size_t total = region_size((uint32_t)o.slots, rq, an);
    if (total == 0) {
        ts__batcher_set_err("shared-memory slots: %d slots of %zu + %zu bytes exceed %zu bytes",
                            o.slots, rq, an, TS__SHM_MAX_REGION);
        return TS_EINVAL;
    }
    shm_server *s = ts__calloc(1, sizeof(*s));
    slot_priv *priv = ts__calloc((size_t)o.slots, sizeof(*priv));
    uint64_t rnd[2];
    if (s == NULL || priv == NULL || getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd)) {
        ts__free(s);
        ts__free(priv);
        return ts__fail(TS_ENOMEM, "shared-memory slots: no memory or no randomness");
    }
    s->b = b;
    s->client = client;
    s->priv = priv;
    s->nslots = (uint32_t)o.slots;
    s->req_bytes = rq;
    s->ans_bytes = an;
    s->map_len = total;
    atomic_init(&s->refs, 1);
    atomic_init(&s->stop, 0);
    for (int i = 0; i < o.slots; i++)
        atomic_init(&priv[i].inflight, 0);
    snprintf(s->path, sizeof(s->path), "/tensorshare-%d-%016llx", (int)getpid(),
             (unsigned long long)rnd[0]);
    snprintf(s->desc_bin, sizeof(s->desc_bin), "%s%s", name, TS_BATCHER_SHM_SUFFIX);
    int fd = shm_open(s->path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    int err = fd < 0 ? errno : 0;
    if (err == 0)
        err = posix_fallocate(fd, 0, (off_t)total);
    void *map = MAP_FAILED;
    if (err == 0) {
        map = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        err = map == MAP_FAILED ? errno : 0;
    }
    if (fd >= 0)
        close(fd);
    if (err != 0) {
        if (fd >= 0)
            shm_unlink(s->path);
        ts__set_errorf("shared-memory slots: %s (%zu bytes): %s", s->path, total, strerror(err));
        ts__free(priv);
        ts__free(s);
        return err == ENOSPC ? TS_ENOMEM : TS_EINVAL;
    }
    s->map = map;
    shm_header *h = map;
    s->hdr = h;
    h->magic = TS__SHM_MAGIC;
    h->layout = TS__SHM_LAYOUT;
    h->nslots = s->nslots;
    h->token = rnd[1] & ~1ull; /* even: the descriptor carries it halved, as an int64 */
    h->req_bytes = rq;
    h->ans_bytes = an;
    h->region_bytes = total;
    h->pid = (int32_t)getpid();
    int rc = init_robust(&h->alive);
    for (uint32_t i = 0; rc == 0 && i < s->nslots; i++)
        rc = init_robust(&slot_at(s->map, i)->owner);
    if (rc == 0)
        rc = sem_init(&s->started, 0, 0);
    if (rc == 0 && pthread_create(&s->th, NULL, slot_main, s) != 0) {
        sem_destroy(&s->started);
        rc = EAGAIN;
    }
    if (rc != 0) {
        shm_unlink(s->path);
        munmap(map, total);
        ts__free(priv);
        ts__free(s);
        return ts__fail(TS_ENOMEM, "shared-memory slots: cannot start: %s", strerror(rc));
    }
    while (sem_wait(&s->started) != 0 && errno == EINTR) {
    }
    /* Advertised only now that the slot thread holds alive: no requester can find it free. */
    ts_value_t *d = descriptor(s);
    rc = d != NULL ? ts_put(client, s->desc_bin, d, NULL) : TS_ENOMEM;
    ts_value_free(d);
    if (rc != 0) {
        char why[TS__BERR_LEN];
        snprintf(why, sizeof(why), "%s", ts_last_error());
        ts__shm_serve_stop(s);
        ts__batcher_set_err("shared-memory slots: publishing the descriptor failed: %s", why);
        return rc;
    }
    *out = s;
    return 0;
}

void ts__shm_serve_stop(shm_server *s)
{
    if (s == NULL)
        return;
    shm_header *h = s->hdr;
    atomic_store(&h->closed, 1);
    atomic_store(&s->stop, 1);
    atomic_fetch_add(&h->bell, 1);
    futex_wake(&h->bell, 1);
    pthread_join(s->th, NULL);
    /* Waiting requesters look again: those whose request was not taken call the service. */
    for (uint32_t i = 0; i < s->nslots; i++)
        futex_wake(&slot_at(s->map, i)->ans_seq, INT_MAX);
    shm_unlink(s->path);
    ts_delete(s->client, s->desc_bin, NULL);
    srv_unref(s);
}

void ts_batcher_shm_options_init(ts_batcher_shm_options_t *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->slots = TS_BATCHER_SHM_DEFAULT_SLOTS;
}

/* ---------------------------------------------------------------------------------------------
 * The requesting side
 */
struct shm_client {
    uint8_t *map;
    size_t map_len;
    shm_header *hdr;
    uint32_t nslots;
    size_t req_bytes, ans_bytes;
    pid_t server_pid;
    int slot;     /* claimed, or -1 */
    uint32_t seq; /* the slot's last request number of ours */
    /* Looking for answers before sleeping (TS__SHM_WAIT_SPIN_NS, TS__SHM_WAIT_SPIN_BACKOFF). */
    uint32_t spin_skip;    /* requests left that sleep without looking */
    uint32_t spin_backoff; /* the skip after the next miss */
    atomic_int gone;       /* the server closed or died (read by ts_predictor_stats) */
};

static int server_state(shm_client *c);

int ts__shm_attach(ts_client_t *client, const char *name, shm_client **out)
{
    char bin[TS_MAX_NAME_LEN + 1];
    if (strlen(name) + strlen(TS_BATCHER_SHM_SUFFIX) > TS_MAX_NAME_LEN)
        return ts__fail(TS_ENOENT, "the name is too long for a descriptor bin");
    snprintf(bin, sizeof(bin), "%s%s", name, TS_BATCHER_SHM_SUFFIX);
    ts_items_t *items = NULL;
    int rc = ts_peek(client, bin, 0, &items);
    if (rc != 0)
        return ts__fail(rc == TS_ENOENT ? TS_ENOENT : rc, "no shared-memory slots advertised in %s",
                        bin);
    size_t n = ts_items_count(items);
    const ts_value_t *d = n > 0 ? ts_items_at(items, n - 1) : NULL;
    const char *path = NULL, *boot = NULL;
    size_t path_len = 0, boot_len = 0;
    int64_t token = 0, pid = 0, layout = 0;
    char mine[TS__SHM_BOOT_LEN];
    boot_id(mine, sizeof(mine));
    if (d == NULL || ts_value_string(ts_map_get(d, "path"), &path, &path_len) != 0 ||
        ts_value_string(ts_map_get(d, "boot_id"), &boot, &boot_len) != 0 ||
        ts_map_get_int(d, "token", &token) != 0 || ts_map_get_int(d, "pid", &pid) != 0 ||
        ts_map_get_int(d, "layout", &layout) != 0 || layout != TS__SHM_LAYOUT ||
        path_len >= TS__SHM_PATH_LEN || strncmp(path, "/tensorshare-", 13) != 0 ||
        strchr(path + 1, '/') != NULL || pid <= 0 || pid > INT32_MAX) {
        ts_items_free(items);
        return ts__fail(TS_ENOENT, "%s: not a descriptor of this layout", bin);
    }
    if (boot_len != strlen(mine) || memcmp(boot, mine, boot_len) != 0 || mine[0] == '\0') {
        ts_items_free(items);
        return ts__fail(TS_ENOENT, "%s: the slots are on another host", bin);
    }
    char p[TS__SHM_PATH_LEN];
    memcpy(p, path, path_len);
    p[path_len] = '\0';
    ts_items_free(items);
    int fd = shm_open(p, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0)
        return ts__fail(TS_ENOENT, "%s: cannot open %s here: %s", bin, p, strerror(errno));
    struct stat st;
    void *map = MAP_FAILED;
    if (fstat(fd, &st) == 0 && st.st_size >= (off_t)TS__SHM_HDR &&
        (uint64_t)st.st_size <= TS__SHM_MAX_REGION)
        map = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED)
        return ts__fail(TS_ENOENT, "%s: cannot map %s", bin, p);
    shm_header *h = map;
    size_t len = (size_t)st.st_size;
    if (h->magic != TS__SHM_MAGIC || h->layout != TS__SHM_LAYOUT ||
        h->token != (uint64_t)token << 1 || h->req_bytes % TS__SHM_PAGE != 0 ||
        h->ans_bytes % TS__SHM_PAGE != 0 ||
        region_size(h->nslots, (size_t)h->req_bytes, (size_t)h->ans_bytes) == 0 ||
        region_size(h->nslots, (size_t)h->req_bytes, (size_t)h->ans_bytes) > len) {
        munmap(map, len);
        return ts__fail(TS_ENOENT, "%s: %s is not the advertised region", bin, p);
    }
    shm_client *c = ts__calloc(1, sizeof(*c));
    if (c == NULL) {
        munmap(map, len);
        return ts__fail(TS_ENOMEM, NULL);
    }
    c->map = map;
    c->hdr = h;
    c->server_pid = (pid_t)pid;
    /* A descriptor left by a server that stopped or died: its slots would answer nothing. */
    if (atomic_load(&h->closed) || server_state(c) != 0) {
        munmap(map, len);
        ts__free(c);
        return ts__fail(TS_ENOENT, "%s: the server of %s stopped or died", bin, p);
    }
    c->map = map;
    c->map_len = len;
    c->hdr = h;
    c->nslots = h->nslots;
    c->req_bytes = (size_t)h->req_bytes;
    c->ans_bytes = (size_t)h->ans_bytes;
    c->server_pid = (pid_t)pid;
    c->slot = -1;
    c->spin_skip = 0;
    c->spin_backoff = 1;
    atomic_init(&c->gone, 0);
    *out = c;
    return 0;
}

int ts__shm_claim(shm_client *c, int *reclaimed)
{
    *reclaimed = 0;
    /* Start where other processes are unlikely to: fewer failed tries when many open at once. */
    uint32_t start = ((uint32_t)getpid() * 2654435761u) % c->nslots;
    for (uint32_t k = 0; k < c->nslots; k++) {
        uint32_t i = (start + k) % c->nslots;
        shm_slot *sl = slot_at(c->map, i);
        int rc = pthread_mutex_trylock(&sl->owner);
        if (rc == EOWNERDEAD) {
            /* Its owner died: the slot is ours; its last request's answer is discarded. */
            pthread_mutex_consistent(&sl->owner);
            *reclaimed = 1;
            rc = 0;
        }
        if (rc == 0) {
            c->slot = (int)i;
            c->seq = atomic_load(&sl->req_seq);
            return 0;
        }
    }
    return ts__fail(TS_EAGAIN, "every shared-memory slot is taken");
}

void ts__shm_release(shm_client *c)
{
    if (c != NULL && c->slot >= 0) {
        pthread_mutex_unlock(&slot_at(c->map, (uint32_t)c->slot)->owner);
        c->slot = -1;
    }
}

void ts__shm_detach(shm_client *c)
{
    if (c == NULL)
        return;
    munmap(c->map, c->map_len);
    ts__free(c);
}

int ts__shm_gone(shm_client *c)
{
    return atomic_load(&c->gone);
}

/*
 * The server's state: 0 serving; 1 stopped cleanly (its slot thread ended; the process may
 * still answer what it took); 2 dead (the process, or the slot thread without stopping).
 */
static int server_state(shm_client *c)
{
    shm_header *h = c->hdr;
    if (atomic_load(&h->stopped))
        return kill(c->server_pid, 0) == 0 || errno == EPERM ? 1 : 2;
    int rc = pthread_mutex_trylock(&h->alive);
    if (rc == EBUSY)
        return 0;
    if (rc == EOWNERDEAD)
        pthread_mutex_consistent(&h->alive);
    if (rc == 0 || rc == EOWNERDEAD)
        pthread_mutex_unlock(&h->alive);
    /* Free: a clean stop sets stopped before letting go of alive. */
    return atomic_load(&h->stopped) ? 1 : 2;
}

int ts__shm_predict(shm_client *c, const ts_value_t *input, int timeout_ms, ts_value_t **output,
                    int64_t *version, int *sent)
{
    *sent = 0;
    if (atomic_load(&c->gone) || c->slot < 0 || atomic_load(&c->hdr->closed)) {
        atomic_store(&c->gone, 1);
        return ts__fail(TS_ECONNRESET, "the shared-memory slots are closed");
    }
    uint32_t i = (uint32_t)c->slot;
    shm_slot *sl = slot_at(c->map, i);
    uint8_t *area = req_area(c->map, c->nslots, c->req_bytes, c->ans_bytes, i);
    size_t off = 0;
    int rc = enc(area, c->req_bytes, &off, input, "", 0, 0);
    if (rc == TS_EMSGSIZE)
        return ts__fail(rc, "the input does not fit the slot's request area of %zu bytes",
                        c->req_bytes);
    if (rc != 0)
        return ts__fail(rc, "the input holds a value the shared-memory slots do not carry");
    int t = timeout_ms == TS_TIMEOUT_DEFAULT    ? TS_PREDICTOR_DEFAULT_TIMEOUT_MS
            : timeout_ms == TS_TIMEOUT_INFINITE ? -1
                                                : timeout_ms;
    uint64_t deadline = t > 0 ? ts__now_ns() + (uint64_t)t * 1000000u : UINT64_MAX;
    atomic_store_explicit(&sl->req_len, (unsigned)off, memory_order_relaxed);
    atomic_store_explicit(&sl->timeout_ms, t, memory_order_relaxed);
    uint32_t seq = ++c->seq;
    atomic_store(&sl->req_seq, seq); /* publishes the area */
    ring(c->hdr);
    *sent = 1;
    if (c->spin_skip > 0) {
        c->spin_skip--;
    } else {
        uint64_t spin_until = ts__now_ns() + TS__SHM_WAIT_SPIN_NS;
        if (spin_until > deadline)
            spin_until = deadline;
        while (atomic_load(&sl->ans_seq) != seq && ts__now_ns() < spin_until)
            sched_yield();
        if (atomic_load(&sl->ans_seq) == seq) {
            c->spin_backoff = 1;
        } else {
            c->spin_skip = c->spin_backoff;
            if (c->spin_backoff < TS__SHM_WAIT_SPIN_BACKOFF)
                c->spin_backoff *= 2;
        }
    }
    for (;;) {
        unsigned a = atomic_load(&sl->ans_seq);
        if (a == seq)
            break;
        atomic_store(&sl->waiting, 1);
        a = atomic_load(&sl->ans_seq);
        if (a == seq) {
            atomic_store(&sl->waiting, 0);
            break;
        }
        uint64_t now = ts__now_ns();
        uint64_t nap = (uint64_t)TS_PREDICTOR_SHM_CHECK_MS * 1000000u;
        if (deadline != UINT64_MAX && deadline - now < nap)
            nap = deadline > now ? deadline - now : 0;
        if (nap > 0)
            futex_wait(&sl->ans_seq, a, nap);
        atomic_store(&sl->waiting, 0);
        if (atomic_load(&sl->ans_seq) == seq)
            break;
        int st = server_state(c);
        if (st == 2) {
            atomic_store(&c->gone, 1);
            if (atomic_load(&sl->taken_seq) != seq)
                *sent = 0; /* never taken: the caller calls the service (another server may) */
            return ts__fail(TS_ECONNRESET,
                            "the serving process (pid %d) of the shared-memory slots died",
                            (int)c->server_pid);
        }
        if (st == 1) {
            atomic_store(&c->gone, 1);
            if (atomic_load(&sl->taken_seq) != seq) {
                *sent = 0; /* never taken: the caller calls the service */
                return ts__fail(TS_ECONNRESET, "the shared-memory slots closed");
            }
        }
        if (ts__now_ns() >= deadline)
            return ts__fail(TS_ETIMEDOUT, "no answer in the shared-memory slot before the "
                                          "deadline");
    }
    int status = atomic_load_explicit(&sl->status, memory_order_relaxed);
    if (status != 0) {
        char msg[TS__BERR_LEN];
        memcpy(msg, sl->msg, sizeof(msg));
        msg[sizeof(msg) - 1] = '\0';
        ts_set_last_error(msg);
        return status;
    }
    size_t len = atomic_load_explicit(&sl->ans_len, memory_order_relaxed);
    const char *why = "";
    ts_value_t *v = NULL;
    rc = len <= c->ans_bytes ? dec_root(area + c->req_bytes, len, TS_COPY, &v, &why) : TS_EPROTO;
    if (rc != 0)
        return ts__fail(rc, "a malformed answer in the shared-memory slot: %s",
                        len > c->ans_bytes ? "past the area" : why);
    *output = v;
    if (version != NULL)
        *version = atomic_load_explicit(&sl->version, memory_order_relaxed);
    return 0;
}
