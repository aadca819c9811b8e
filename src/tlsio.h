/*
 * TLS over a libuv stream with OpenSSL memory BIOs, shared by tensord (server/tls.c) and the
 * client (client/tls.c). The owner keeps its own read, write, shutdown and close code and calls
 * these instead of the libuv functions of the same name: ciphertext read from the socket goes
 * into the SSL object and the plaintext comes out through the owner's alloc and read callbacks
 * (so tensord still reads a record straight into its item buffer); plaintext the owner writes is
 * encrypted as the socket drains (at most TS_TLS_MAX_INFLIGHT bytes of ciphertext queued at a
 * time) and the owner's write callback runs once its last byte is on the socket. The handshake
 * runs by itself before any plaintext goes out. Callbacks keep libuv's contract: every write
 * and shutdown callback runs exactly once, those still pending when the stream is closed get
 * UV_ECANCELED before the close callback, and nothing is called from inside the call that
 * queued it (deferred work runs from an idle handle of the stream's loop).
 *
 * While TLS is on, the stream's data field points to the session; the owner's callbacks still
 * find their own pointer there (it is put back for the duration of each call). Loop thread only.
 * Compiled with TS_WITH_TLS only. Added in 0.5.0.
 */
#ifndef TS_TLSIO_H
#define TS_TLSIO_H

#ifdef TS_WITH_TLS

#include <stddef.h>
#include <stdint.h>

#include <openssl/ssl.h>
#include <uv.h>

/* bytes; plaintext encrypted per SSL_write call (16 TLS records of 16 KiB) */
#define TS_TLS_WRITE_PIECE ((size_t)256 << 10)
/* bytes; ciphertext gathered into one uv_write */
#define TS_TLS_CHUNK ((size_t)1 << 20)
/*
 * bytes; ciphertext handed to the socket and not yet written. The rest of the owner's output
 * waits as plaintext, so a 1 GiB reply costs at most this much of encrypted copy at a time;
 * large enough that the socket always has a few chunks queued while the next is encrypted
 * (bench/tls_bench.c: 4 MiB with 1 MiB chunks was slightly faster than 1 MiB with 256 KiB).
 */
#define TS_TLS_MAX_INFLIGHT ((size_t)4 << 20)
/* bytes; the buffer ciphertext is read into from the socket */
#define TS_TLS_READ_BUF ((size_t)256 << 10)

typedef struct ts__tls ts__tls;

/*
 * Wrap stream (open, connected or accepted, its data field set to the owner's pointer) with ssl,
 * already set up for its role (SSL_set_accept_state or SSL_set_connect_state, host name...);
 * ssl passes to the session whatever happens. NULL when memory ran out.
 */
ts__tls *ts__tls_new(SSL *ssl, uv_stream_t *stream);

/* uv_read_start / uv_read_stop for the plaintext. read_cb gets UV_EPROTO for a TLS failure. */
int ts__tls_read_start(ts__tls *t, uv_alloc_cb alloc_cb, uv_read_cb read_cb);
void ts__tls_read_stop(ts__tls *t);

/* uv_write of plaintext (bufs are copied; their memory must stay until cb, as with libuv). */
int ts__tls_write(ts__tls *t, uv_write_t *req, const uv_buf_t bufs[], unsigned int nbufs,
                  uv_write_cb cb);

/* uv_shutdown: after the writes queued before it, send close_notify, then shut down writing. */
int ts__tls_shutdown(ts__tls *t, uv_shutdown_t *req, uv_shutdown_cb cb);

/* Bytes queued and not yet on the socket (plaintext still to encrypt plus ciphertext queued). */
size_t ts__tls_queue_size(const ts__tls *t);

/*
 * uv_close the stream and end the session: pending writes and shutdown get UV_ECANCELED, then
 * close_cb runs with the stream (its data field the owner's again); the session frees itself.
 */
void ts__tls_close(ts__tls *t, uv_close_cb close_cb);

/* 1 once the handshake has completed. */
int ts__tls_established(const ts__tls *t);

/*
 * Why the session failed ("" while it has not): OpenSSL's reason, with the certificate
 * verification's when that is what failed. verify_failed is set to 1 in that case.
 */
const char *ts__tls_error(const ts__tls *t, int *verify_failed);

/* The SSL object (peer certificate, version, cipher), owned by the session. */
SSL *ts__tls_ssl(ts__tls *t);

#endif /* TS_WITH_TLS */
#endif /* TS_TLSIO_H */
