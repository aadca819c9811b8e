/*
 * TLS over a libuv stream (see tlsio.h). One state machine, run() (from the socket's read
 * callback, a ciphertext write's callback, the shutdown's callback and the idle handle): advance
 * the handshake, encrypt queued plaintext while little ciphertext is queued, call back the
 * writes whose ciphertext is all written, hand decrypted bytes to the owner while it reads, send
 * close_notify once a shutdown's writes are out, and read the socket only while that is needed.
 */
#include "tlsio.h"

#ifdef TS_WITH_TLS

#include "common.h"

#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include <openssl/err.h>
#include <openssl/x509.h>

/* uv_bufs of a write kept inside its record; more take an allocation. */
#define TLS_INLINE_BUFS 4

/* One write of the owner: its plaintext and how far it has been encrypted. */
typedef struct tls_wreq {
    struct tls_wreq *next;
    uv_write_t *req;
    uv_write_cb cb;
    uv_buf_t *bufs;
    unsigned int nbufs, idx;
    size_t off;          /* bytes of bufs[idx] encrypted */
    uint64_t cipher_end; /* ciphertext count once its last byte is handed out; 0 = not yet */
    uv_buf_t inl[TLS_INLINE_BUFS];
} tls_wreq;

/* One uv_write of ciphertext. */
typedef struct tls_chunk {
    uv_write_t w;
    ts__tls *t;
    size_t len;
    size_t cap; /* bytes of data */
    uint8_t data[];
} tls_chunk;

/*
 * bytes; the data of a reusable chunk: a full TS_TLS_CHUNK, the last piece that crossed it and
 * the records' overhead (a few dozen bytes per 16 KiB record). Larger flushes get a chunk of
 * their own size, freed after use.
 */
#define TLS_CHUNK_CAP (TS_TLS_CHUNK + TS_TLS_WRITE_PIECE + ((size_t)64 << 10))
/*
 * Chunks kept for reuse per session. A chunk this large comes from mmap, so a fresh one per
 * write costs a page fault per 4 KiB touched (a quarter of TLS's CPU per byte in
 * bench/tls_bench.c); two cover a steady stream. A small write touches only its first pages.
 */
#define TLS_SPARE_CHUNKS 2

struct ts__tls {
    SSL *ssl;
    BIO *bio; /* both directions, owned by ssl: reads from rbuf, writes into wcur */
    uv_stream_t *stream;
    void *user_data; /* the owner's stream->data */
    uv_idle_t idle;  /* runs deferred work outside the owner's calls */
    int idle_on;

    /* Reading. */
    uv_alloc_cb alloc_cb;
    uv_read_cb read_cb;
    int user_reading;  /* the owner wants plaintext */
    int net_reading;   /* uv_read_start is on for the socket */
    uint8_t *rbuf;     /* TS_TLS_READ_BUF bytes: ciphertext read from the socket... */
    size_t rpos, rlen; /* ... of which [rpos, rlen) has not been taken by SSL yet */
    tls_chunk *wcur;   /* ciphertext SSL wrote, not yet handed to the socket, or NULL */
    tls_chunk *spare[TLS_SPARE_CHUNKS]; /* written chunks kept for the next writes */
    int n_spare;
    int net_eof;       /* the socket reached its end */
    int net_err;       /* a libuv read error of the socket, 0 = none */
    int end_told;      /* the owner was told the end of the stream (or an error) */
    int established;   /* the handshake completed */
    int wr_wants_read; /* SSL_write needs input (a post-handshake message) */

    /* Writing. */
    tls_wreq *pend_head, *pend_tail; /* not yet wholly encrypted */
    tls_wreq *done_head, *done_tail; /* encrypted, their ciphertext not yet all written */
    size_t pend_bytes;               /* plaintext bytes not yet encrypted */
    uint64_t cipher_sent;            /* ciphertext bytes handed to uv_write */
    uint64_t cipher_done;            /* ... and written */
    uv_shutdown_t *shut_req;         /* the owner's shutdown, not yet called back */
    uv_shutdown_cb shut_cb;
    int shut_issued; /* close_notify queued and uv_shutdown started */
    uv_shutdown_t ushut;

    /* Failure and closing. */
    int failed; /* a libuv code once the session failed, 0 while it has not */
    int fail_told;
    int verify_failed;
    char err[256];
    int closed;
    int stream_closed, idle_closed;
    uv_close_cb close_cb;
};

static void run(ts__tls *t);

/* ---------------------------------------------------------------------------------------------
 * Helpers
 */

/* The owner's callbacks find their own pointer in the stream's data field. */
static void enter_user(ts__tls *t)
{
    t->stream->data = t->user_data;
}

static void leave_user(ts__tls *t)
{
    t->stream->data = t;
}

static void idle_cb(uv_idle_t *h)
{
    ts__tls *t = h->data;
    uv_idle_stop(h);
    t->idle_on = 0;
    run(t);
}

/* Run the state machine soon, from the loop, outside the caller's stack. */
static void kick(ts__tls *t)
{
    if (t->idle_on || t->closed)
        return;
    if (uv_idle_start(&t->idle, idle_cb) == 0)
        t->idle_on = 1;
}

/* The session failed (code a libuv code): record why once; the owner learns from run(). */
static void fail(ts__tls *t, int code, const char *why)
{
    if (t->failed)
        return;
    t->failed = code;
    snprintf(t->err, sizeof(t->err), "%s", why);
    kick(t);
}

/* An OpenSSL failure of step (ssl_err from SSL_get_error): the reason in words. */
static void fail_ssl(ts__tls *t, int ssl_err, const char *step)
{
    char why[200];
    long vr = SSL_get_verify_result(t->ssl);
    unsigned long code = ERR_peek_last_error();
    if (vr != X509_V_OK) {
        t->verify_failed = 1;
        snprintf(why, sizeof(why), "%s: certificate verification failed: %s", step,
                 X509_verify_cert_error_string(vr));
    } else if (code != 0) {
        const char *r = ERR_reason_error_string(code);
        snprintf(why, sizeof(why), "%s: %s", step, r != NULL ? r : "OpenSSL error");
    } else if (ssl_err == SSL_ERROR_SYSCALL || ssl_err == SSL_ERROR_ZERO_RETURN) {
        snprintf(why, sizeof(why), "%s: the peer closed the connection", step);
    } else {
        snprintf(why, sizeof(why), "%s: OpenSSL error %d", step, ssl_err);
    }
    ERR_clear_error();
    fail(t, UV_EPROTO, why);
}

/* ---------------------------------------------------------------------------------------------
 * Ciphertext out
 */

static void chunk_cb(uv_write_t *w, int status)
{
    tls_chunk *ch = (tls_chunk *)(void *)w;
    ts__tls *t = ch->t;
    size_t len = ch->len;
    if (ch->cap == TLS_CHUNK_CAP && t->n_spare < TLS_SPARE_CHUNKS)
        t->spare[t->n_spare++] = ch; /* freed with the session at the latest */
    else
        ts__free(ch);
    if (t->closed)
        return; /* cancelled by the close: the owner's writes are cancelled there too */
    if (status < 0) {
        char why[96];
        snprintf(why, sizeof(why), "write: %s", uv_strerror(status));
        fail(t, status, why);
    } else {
        t->cipher_done += len;
    }
    run(t);
}

/* ---------------------------------------------------------------------------------------------
 * The BIO between SSL and the socket: SSL reads ciphertext straight from the buffer libuv read
 * into and writes it straight into the buffer uv_write sends, so no byte is copied on its way
 * through (memory BIOs copied, and cleared, every byte twice more each way).
 */

/* Bytes of ciphertext SSL wrote that are not yet handed to the socket. */
static size_t wpending(const ts__tls *t)
{
    return t->wcur != NULL ? t->wcur->len : 0;
}

/* A chunk with room for at least need bytes: a spare full-size one, or a new one. */
static tls_chunk *chunk_get(ts__tls *t, size_t need)
{
    if (need <= TLS_CHUNK_CAP && t->n_spare > 0)
        return t->spare[--t->n_spare];
    size_t cap = need <= TLS_CHUNK_CAP ? TLS_CHUNK_CAP : need;
    tls_chunk *ch = ts__malloc(sizeof(*ch) + cap);
    if (ch != NULL) {
        ch->cap = cap;
        ch->len = 0;
    }
    return ch;
}

static void flush_cipher(ts__tls *t);

static int bio_write_cb(BIO *b, const char *data, int len)
{
    ts__tls *t = BIO_get_data(b);
    BIO_clear_retry_flags(b);
    if (len <= 0)
        return 0;
    if (t == NULL || t->closed)
        return len; /* nobody will read it any more: dropped */
    if (t->wcur != NULL && t->wcur->len + (size_t)len > t->wcur->cap)
        flush_cipher(t);
    if (t->wcur == NULL) {
        t->wcur = chunk_get(t, (size_t)len);
        if (t->wcur == NULL) {
            fail(t, UV_ENOMEM, "out of memory for TLS output");
            return -1;
        }
        t->wcur->len = 0;
    }
    memcpy(t->wcur->data + t->wcur->len, data, (size_t)len);
    t->wcur->len += (size_t)len;
    return len;
}

static int bio_read_cb(BIO *b, char *out, int len)
{
    ts__tls *t = BIO_get_data(b);
    BIO_clear_retry_flags(b);
    size_t avail = t != NULL ? t->rlen - t->rpos : 0;
    if (avail == 0 || len <= 0) {
        BIO_set_retry_read(b); /* more may come: the socket says when it ends */
        return -1;
    }
    size_t n = avail < (size_t)len ? avail : (size_t)len;
    memcpy(out, t->rbuf + t->rpos, n);
    t->rpos += n;
    return (int)n;
}

static long bio_ctrl_cb(BIO *b, int cmd, long num, void *ptr)
{
    ts__tls *t = BIO_get_data(b);
    (void)num;
    (void)ptr;
    switch (cmd) {
    case BIO_CTRL_FLUSH:
        return 1;
    case BIO_CTRL_PENDING:
        return t != NULL ? (long)(t->rlen - t->rpos) : 0;
    case BIO_CTRL_WPENDING:
        return t != NULL ? (long)wpending(t) : 0;
    default:
        return 0;
    }
}

static int bio_create_cb(BIO *b)
{
    BIO_set_init(b, 1);
    return 1;
}

static BIO_METHOD *bio_method;
static pthread_once_t bio_once = PTHREAD_ONCE_INIT;

/* The method, made once per process (it lives as long as the process). */
static void bio_method_make(void)
{
    BIO_METHOD *m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "tensorshare-uv");
    if (m != NULL &&
        (BIO_meth_set_write(m, bio_write_cb) != 1 || BIO_meth_set_read(m, bio_read_cb) != 1 ||
         BIO_meth_set_ctrl(m, bio_ctrl_cb) != 1 || BIO_meth_set_create(m, bio_create_cb) != 1)) {
        BIO_meth_free(m);
        m = NULL;
    }
    bio_method = m;
}

/* Write out the ciphertext SSL produced, and stamp the writes wholly encrypted by now. */
static void flush_cipher(ts__tls *t)
{
    tls_chunk *ch = t->wcur;
    if (ch != NULL && ch->len > 0 && !t->closed) {
        t->wcur = NULL;
        ch->t = t;
        uv_buf_t b = uv_buf_init((char *)ch->data, (unsigned int)ch->len);
        int rc = uv_write(&ch->w, t->stream, &b, 1, chunk_cb);
        if (rc != 0) {
            ts__free(ch);
            fail(t, rc, "write: the socket refused the write");
            return;
        }
        t->cipher_sent += (uint64_t)ch->len;
    }
    for (tls_wreq *w = t->done_head; w != NULL; w = w->next)
        if (w->cipher_end == 0)
            w->cipher_end = t->cipher_sent;
}

/* ---------------------------------------------------------------------------------------------
 * The state machine
 */

static void handshake_step(ts__tls *t)
{
    if (t->established || t->failed)
        return;
    ERR_clear_error();
    int r = SSL_do_handshake(t->ssl);
    if (r == 1) {
        t->established = 1;
    } else {
        int e = SSL_get_error(t->ssl, r);
        if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) {
            flush_cipher(t); /* the alert that tells the peer why */
            fail_ssl(t, e, "TLS handshake");
            return;
        }
        if (t->net_eof || t->net_err)
            fail(t, UV_EPROTO, "TLS handshake: the peer closed the connection");
    }
    flush_cipher(t);
}

/* Encrypt queued plaintext while less than TS_TLS_MAX_INFLIGHT bytes of ciphertext are out. */
static void pump_writes(ts__tls *t)
{
    if (!t->established || t->failed || t->closed)
        return;
    t->wr_wants_read = 0;
    while (t->pend_head != NULL) {
        tls_wreq *w = t->pend_head;
        if (w->idx == w->nbufs) {
            t->pend_head = w->next;
            if (t->pend_head == NULL)
                t->pend_tail = NULL;
            w->next = NULL;
            w->cipher_end = 0;
            if (t->done_tail != NULL)
                t->done_tail->next = w;
            else
                t->done_head = w;
            t->done_tail = w;
            continue;
        }
        uint64_t queued = t->cipher_sent - t->cipher_done + wpending(t);
        if (queued >= TS_TLS_MAX_INFLIGHT)
            break;
        uv_buf_t *b = &w->bufs[w->idx];
        size_t n = b->len - w->off;
        if (n == 0) {
            w->idx++;
            w->off = 0;
            continue;
        }
        if (n > TS_TLS_WRITE_PIECE)
            n = TS_TLS_WRITE_PIECE;
        ERR_clear_error();
        int r = SSL_write(t->ssl, b->base + w->off, (int)n);
        if (r <= 0) {
            int e = SSL_get_error(t->ssl, r);
            if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
                t->wr_wants_read = e == SSL_ERROR_WANT_READ;
                break;
            }
            fail_ssl(t, e, "TLS write");
            return;
        }
        w->off += (size_t)r;
        t->pend_bytes -= (size_t)r;
        if (w->off == b->len) {
            w->idx++;
            w->off = 0;
        }
        if (wpending(t) >= TS_TLS_CHUNK)
            flush_cipher(t);
        if (t->failed)
            return;
    }
    flush_cipher(t);
}

/* Call back one write of the owner (its record freed first). */
static void write_done(ts__tls *t, tls_wreq *w, int status)
{
    uv_write_t *req = w->req;
    uv_write_cb cb = w->cb;
    if (w->bufs != w->inl)
        ts__free(w->bufs);
    ts__free(w);
    enter_user(t);
    cb(req, status);
    leave_user(t);
}

static tls_wreq *pop(tls_wreq **head, tls_wreq **tail)
{
    tls_wreq *w = *head;
    if (w != NULL) {
        *head = w->next;
        if (*head == NULL)
            *tail = NULL;
    }
    return w;
}

/* Call back every pending write and the shutdown with status (failure or close). */
static void fail_writes(ts__tls *t, int status)
{
    for (;;) {
        tls_wreq *w = pop(&t->done_head, &t->done_tail);
        if (w == NULL)
            w = pop(&t->pend_head, &t->pend_tail);
        if (w == NULL)
            break;
        write_done(t, w, status);
    }
    t->pend_bytes = 0;
    if (t->shut_req != NULL && !t->shut_issued) {
        uv_shutdown_t *req = t->shut_req;
        t->shut_req = NULL;
        enter_user(t);
        t->shut_cb(req, status);
        leave_user(t);
    }
}

/* Call back the writes whose ciphertext is all written (or all of them, failed). */
static void complete_writes(ts__tls *t)
{
    while (!t->closed && t->done_head != NULL && t->done_head->cipher_end != 0 &&
           t->done_head->cipher_end <= t->cipher_done)
        write_done(t, pop(&t->done_head, &t->done_tail), 0);
    if (!t->closed && t->failed)
        fail_writes(t, t->failed);
}

static void user_read(ts__tls *t, ssize_t n, const uv_buf_t *buf)
{
    uv_buf_t none = uv_buf_init(NULL, 0);
    enter_user(t);
    t->read_cb(t->stream, n, buf != NULL ? buf : &none);
    leave_user(t);
}

/* Hand decrypted bytes to the owner while it reads. */
static void deliver(ts__tls *t)
{
    while (t->user_reading && !t->closed) {
        if (t->failed) {
            if (!t->fail_told) {
                t->fail_told = 1;
                user_read(t, UV_EPROTO, NULL);
            }
            return;
        }
        if (!t->established || t->end_told)
            return;
        uv_buf_t b = uv_buf_init(NULL, 0);
        enter_user(t);
        t->alloc_cb((uv_handle_t *)t->stream, TS_TLS_READ_BUF, &b);
        leave_user(t);
        if (b.base == NULL || b.len == 0) {
            user_read(t, UV_ENOBUFS, &b);
            return;
        }
        ERR_clear_error();
        int n = SSL_read(t->ssl, b.base, b.len > INT_MAX ? INT_MAX : (int)b.len);
        if (n > 0) {
            user_read(t, n, &b);
            continue;
        }
        int e = SSL_get_error(t->ssl, n);
        user_read(t, 0, &b); /* gives the buffer back, as libuv does when nothing was read */
        if (t->closed)
            return;
        if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
            flush_cipher(t); /* post-handshake messages (TLS 1.3 tickets, key updates) */
            if ((t->net_eof || t->net_err) && !t->end_told) {
                t->end_told = 1;
                user_read(t, t->net_err != 0 ? t->net_err : UV_EOF, NULL);
            }
            return;
        }
        if (e == SSL_ERROR_ZERO_RETURN) { /* close_notify: the peer's orderly end */
            t->end_told = 1;
            user_read(t, UV_EOF, NULL);
            return;
        }
        fail_ssl(t, e, "TLS read");
    }
}

static void ushut_cb(uv_shutdown_t *req, int status)
{
    ts__tls *t = req->data;
    /* Called back even when closing (UV_ECANCELED): the owner still exists until close_cb. */
    uv_shutdown_t *r = t->shut_req;
    t->shut_req = NULL;
    if (r != NULL) {
        enter_user(t);
        t->shut_cb(r, status);
        leave_user(t);
    }
    if (!t->closed)
        run(t);
}

/* A shutdown whose writes are all encrypted: close_notify, then shut the socket's writing. */
static void shutdown_step(ts__tls *t)
{
    if (t->shut_req == NULL || t->shut_issued || t->pend_head != NULL || t->failed)
        return;
    if (t->established) {
        ERR_clear_error();
        (void)SSL_shutdown(t->ssl);
        ERR_clear_error();
        flush_cipher(t);
        if (t->failed)
            return;
    }
    t->shut_issued = 1;
    t->ushut.data = t;
    int rc = uv_shutdown(&t->ushut, t->stream, ushut_cb);
    if (rc != 0)
        fail(t, rc, "shutdown: the socket refused it");
}

static void net_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    ts__tls *t = h->data;
    (void)suggested;
    if (t->rbuf == NULL)
        t->rbuf = ts__malloc(TS_TLS_READ_BUF);
    if (t->rbuf == NULL) {
        *buf = uv_buf_init(NULL, 0);
        return;
    }
    /* What SSL has not taken yet (at most part of a record) moves to the front. */
    if (t->rpos > 0) {
        memmove(t->rbuf, t->rbuf + t->rpos, t->rlen - t->rpos);
        t->rlen -= t->rpos;
        t->rpos = 0;
    }
    *buf = uv_buf_init((char *)t->rbuf + t->rlen, (unsigned int)(TS_TLS_READ_BUF - t->rlen));
}

static void net_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    ts__tls *t = s->data;
    if (t->closed)
        return;
    (void)buf;
    if (n > 0) {
        t->rlen += (size_t)n; /* read in place (net_alloc) */
    } else if (n == UV_EOF) {
        t->net_eof = 1;
    } else if (n == UV_ENOBUFS) {
        fail(t, UV_ENOMEM, "out of memory for TLS input");
    } else if (n < 0) {
        t->net_err = (int)n;
    }
    run(t);
}

/* Read the socket while the handshake, the owner or a write needs its bytes. */
static void update_net_reading(ts__tls *t)
{
    /* A full buffer waits for SSL to take from it (the owner reading again). */
    int want = !t->closed && !t->failed && !t->net_eof && !t->net_err &&
               (t->rpos > 0 || t->rlen < TS_TLS_READ_BUF) &&
               (!t->established || t->user_reading || t->wr_wants_read);
    if (want && !t->net_reading) {
        int rc = uv_read_start(t->stream, net_alloc, net_read);
        if (rc == 0 || rc == UV_EALREADY)
            t->net_reading = 1;
        else
            fail(t, rc, "read: the socket refused it");
    } else if (!want && t->net_reading) {
        uv_read_stop(t->stream);
        t->net_reading = 0;
    }
}

static void run(ts__tls *t)
{
    if (t->closed)
        return;
    handshake_step(t);
    pump_writes(t);
    if (t->failed) {
        /* The reader hears why first (a handshake's reason), then the writes fail. */
        deliver(t);
        if (t->closed)
            return;
    }
    complete_writes(t);
    if (t->closed)
        return;
    deliver(t);
    if (t->closed)
        return;
    shutdown_step(t);
    if (t->closed)
        return;
    /* Writes encrypted or failed meanwhile are called back on the next turn. */
    if (t->failed || (t->done_head != NULL && t->done_head->cipher_end != 0 &&
                      t->done_head->cipher_end <= t->cipher_done))
        kick(t);
    update_net_reading(t);
}

/* ---------------------------------------------------------------------------------------------
 * The API
 */

ts__tls *ts__tls_new(SSL *ssl, uv_stream_t *stream)
{
    pthread_once(&bio_once, bio_method_make);
    ts__tls *t = ts__calloc(1, sizeof(*t));
    BIO *bio = bio_method != NULL ? BIO_new(bio_method) : NULL;
    if (t == NULL || bio == NULL || uv_idle_init(stream->loop, &t->idle) != 0) {
        BIO_free(bio);
        SSL_free(ssl);
        ts__free(t);
        return NULL;
    }
    BIO_set_data(bio, t);
    SSL_set_bio(ssl, bio, bio); /* one reference, both directions */
    SSL_set_mode(ssl, SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    t->ssl = ssl;
    t->bio = bio;
    t->stream = stream;
    t->idle.data = t;
    t->user_data = stream->data;
    stream->data = t;
    /* A client speaks first (ClientHello); both sides then read for the handshake. */
    kick(t);
    return t;
}

int ts__tls_read_start(ts__tls *t, uv_alloc_cb alloc_cb, uv_read_cb read_cb)
{
    if (t->closed)
        return UV_EINVAL;
    t->alloc_cb = alloc_cb;
    t->read_cb = read_cb;
    if (t->user_reading)
        return 0;
    t->user_reading = 1;
    /* Plaintext, an end or a failure already in hand is delivered from the loop. */
    kick(t);
    return 0;
}

void ts__tls_read_stop(ts__tls *t)
{
    t->user_reading = 0;
}

int ts__tls_write(ts__tls *t, uv_write_t *req, const uv_buf_t bufs[], unsigned int nbufs,
                  uv_write_cb cb)
{
    if (t->closed || t->shut_req != NULL || t->shut_issued)
        return UV_EPIPE;
    if (t->failed)
        return t->failed;
    tls_wreq *w = ts__calloc(1, sizeof(*w));
    if (w == NULL)
        return UV_ENOMEM;
    w->bufs = nbufs <= TLS_INLINE_BUFS ? w->inl : ts__malloc(sizeof(uv_buf_t) * nbufs);
    if (w->bufs == NULL) {
        ts__free(w);
        return UV_ENOMEM;
    }
    size_t total = 0;
    for (unsigned int i = 0; i < nbufs; i++) {
        w->bufs[i] = bufs[i];
        total += bufs[i].len;
    }
    w->nbufs = nbufs;
    w->req = req;
    w->cb = cb;
    req->handle = t->stream;
    req->cb = cb;
    t->pend_bytes += total;
    if (t->pend_tail != NULL)
        t->pend_tail->next = w;
    else
        t->pend_head = w;
    t->pend_tail = w;
    pump_writes(t);
    if (t->failed || t->pend_head != NULL || t->done_head != NULL)
        kick(t); /* the completion (or the failure) is called back from the loop */
    return 0;
}

int ts__tls_shutdown(ts__tls *t, uv_shutdown_t *req, uv_shutdown_cb cb)
{
    if (t->closed || t->shut_req != NULL || t->shut_issued)
        return UV_EPIPE;
    req->handle = t->stream;
    req->cb = cb;
    t->shut_req = req;
    t->shut_cb = cb;
    kick(t);
    return 0;
}

size_t ts__tls_queue_size(const ts__tls *t)
{
    return t->pend_bytes + (size_t)(t->cipher_sent - t->cipher_done);
}

static void maybe_free(ts__tls *t)
{
    if (!t->stream_closed || !t->idle_closed)
        return;
    BIO_set_data(t->bio, NULL); /* SSL_free must not reach back into t */
    SSL_free(t->ssl);           /* and the BIO */
    ts__free(t->rbuf);
    ts__free(t->wcur);
    for (int i = 0; i < t->n_spare; i++)
        ts__free(t->spare[i]);
    ts__free(t);
}

static void idle_closed(uv_handle_t *h)
{
    ts__tls *t = h->data;
    t->idle_closed = 1;
    maybe_free(t);
}

static void stream_closed(uv_handle_t *h)
{
    ts__tls *t = h->data;
    h->data = t->user_data;
    /* Like libuv's own close: the writes still pending fail first, then the close callback. */
    fail_writes(t, UV_ECANCELED);
    h->data = t->user_data;
    if (t->close_cb != NULL)
        t->close_cb(h);
    t->stream_closed = 1;
    maybe_free(t);
}

void ts__tls_close(ts__tls *t, uv_close_cb close_cb)
{
    if (t->closed)
        return;
    t->closed = 1;
    t->close_cb = close_cb;
    if (t->idle_on)
        uv_idle_stop(&t->idle);
    t->idle_on = 0;
    uv_close((uv_handle_t *)&t->idle, idle_closed);
    t->stream->data = t;
    uv_close((uv_handle_t *)t->stream, stream_closed);
}

int ts__tls_established(const ts__tls *t)
{
    return t->established;
}

const char *ts__tls_error(const ts__tls *t, int *verify_failed)
{
    if (verify_failed != NULL)
        *verify_failed = t->verify_failed;
    return t->err;
}

SSL *ts__tls_ssl(ts__tls *t)
{
    return t->ssl;
}

#else
/* Without OpenSSL this file has nothing to compile; ISO C wants one declaration all the same. */
typedef int ts__tlsio_unused;
#endif /* TS_WITH_TLS */
