/*
 * TLS on tensord's TCP connections (--tls-cert, --tls-key, --tls-client-ca): the flags, the
 * SSL_CTX made from them at start, and the stream calls conn.c and output.c make, which go
 * through src/tlsio.c on a TLS connection and straight to libuv otherwise. The unix socket
 * always stays plain: only processes of this host reach it (its file mode decides which), and
 * descriptors (GET_REF, PUT_FD) could not travel inside TLS. docs/TLS.md tells how to use it.
 */
#include "server.h"

#include <stdio.h>
#include <string.h>

#ifdef TS_WITH_TLS
#include "tlsio.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#endif

void tsd_tls_usage(FILE *f)
{
    fprintf(f,
            "TLS on TCP connections (the unix socket stays plain)%s:\n"
            "  --tls-cert FILE       certificate chain (PEM) for TLS 1.2+; needs --tls-key\n"
            "  --tls-key FILE        its private key (PEM)\n"
            "  --tls-client-ca FILE  require client certificates signed by these CAs (PEM)\n",
#ifdef TS_WITH_TLS
            ""
#else
            " [not in this build]"
#endif
    );
}

int tsd_tls_flag(tsd_config *cfg, const char *flag, const char *val, int argc, char **argv, int *i)
{
    const char **dst = NULL;
    if (strcmp(flag, "--tls-cert") == 0)
        dst = &cfg->tls_cert;
    else if (strcmp(flag, "--tls-key") == 0)
        dst = &cfg->tls_key;
    else if (strcmp(flag, "--tls-client-ca") == 0)
        dst = &cfg->tls_client_ca;
    else
        return 0;
#ifndef TS_WITH_TLS
    fprintf(stderr,
            "tensord: %s: this tensord was built without TLS (cmake -DTS_WITH_TLS=ON "
            "with OpenSSL 3 installed)\n",
            flag);
    (void)val;
    (void)argc;
    (void)argv;
    (void)i;
    (void)dst;
    return -1;
#else
    return tsd_flag_string(flag, val, argc, argv, i, dst);
#endif
}

#ifdef TS_WITH_TLS
/* Print why OpenSSL failed at what (its queue of errors, oldest first), then clear it. */
static void print_ssl_errors(const char *what)
{
    unsigned long e = ERR_get_error();
    if (e == 0) {
        fprintf(stderr, "tensord: %s\n", what);
        return;
    }
    for (; e != 0; e = ERR_get_error()) {
        char buf[256];
        ERR_error_string_n(e, buf, sizeof(buf));
        fprintf(stderr, "tensord: %s: %s\n", what, buf);
    }
}
#endif

int tsd_tls_setup(tsd_config *cfg)
{
    if (cfg->tls_cert == NULL && cfg->tls_key == NULL && cfg->tls_client_ca == NULL)
        return 0;
    if (cfg->tls_cert == NULL || cfg->tls_key == NULL) {
        fprintf(stderr, "tensord: --tls-cert and --tls-key go together%s\n",
                cfg->tls_client_ca != NULL ? " (and --tls-client-ca needs both)" : "");
        return -1;
    }
#ifndef TS_WITH_TLS
    return -1; /* tsd_tls_flag refused the flags already */
#else
    char what[1200];
    SSL_CTX *ctx = SSL_CTX_new(TLS_server_method());
    if (ctx == NULL) {
        print_ssl_errors("cannot create the TLS context");
        return -1;
    }
    /* TLS 1.2 at least: every older version has known weaknesses. */
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    /* No renegotiation: nothing needs it, and it complicates a memory-BIO session. */
    SSL_CTX_set_options(ctx, SSL_OP_NO_RENEGOTIATION);
    if (SSL_CTX_use_certificate_chain_file(ctx, cfg->tls_cert) != 1) {
        snprintf(what, sizeof(what), "--tls-cert %s", cfg->tls_cert);
        goto fail;
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, cfg->tls_key, SSL_FILETYPE_PEM) != 1) {
        snprintf(what, sizeof(what), "--tls-key %s", cfg->tls_key);
        goto fail;
    }
    if (SSL_CTX_check_private_key(ctx) != 1) {
        snprintf(what, sizeof(what), "--tls-key %s does not match --tls-cert %s", cfg->tls_key,
                 cfg->tls_cert);
        goto fail;
    }
    if (cfg->tls_client_ca != NULL) {
        STACK_OF(X509_NAME) *names = SSL_load_client_CA_file(cfg->tls_client_ca);
        if (names == NULL || SSL_CTX_load_verify_locations(ctx, cfg->tls_client_ca, NULL) != 1) {
            if (names != NULL)
                sk_X509_NAME_pop_free(names, X509_NAME_free);
            snprintf(what, sizeof(what), "--tls-client-ca %s", cfg->tls_client_ca);
            goto fail;
        }
        SSL_CTX_set_client_CA_list(ctx, names);
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    }
    cfg->tls_ctx = ctx;
    return 0;
fail:
    print_ssl_errors(what);
    SSL_CTX_free(ctx);
    return -1;
#endif
}

void tsd_tls_cleanup(tsd_config *cfg)
{
#ifdef TS_WITH_TLS
    SSL_CTX_free(cfg->tls_ctx);
#endif
    cfg->tls_ctx = NULL;
}

int tsd_conn_tls_start(tsd_conn *c)
{
#ifdef TS_WITH_TLS
    SSL *ssl = SSL_new(c->srv->cfg.tls_ctx);
    if (ssl == NULL) {
        ERR_clear_error();
        return -1;
    }
    SSL_set_accept_state(ssl);
    c->tls = (struct tsd_tls *)ts__tls_new(ssl, &c->h.stream);
    return c->tls != NULL ? 0 : -1;
#else
    (void)c;
    return -1;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * The stream calls of a connection: TLS or plain
 */
#ifdef TS_WITH_TLS
#define TLS_OF(c) ((ts__tls *)(void *)(c)->tls)
#endif

int tsd_conn_tls_handshaking(const tsd_conn *c)
{
#ifdef TS_WITH_TLS
    if (c->tls != NULL)
        return !ts__tls_established((const ts__tls *)(const void *)c->tls);
#endif
    (void)c;
    return 0;
}

int tsd_read_start(tsd_conn *c, uv_alloc_cb alloc_cb, uv_read_cb read_cb)
{
#ifdef TS_WITH_TLS
    if (c->tls != NULL)
        return ts__tls_read_start(TLS_OF(c), alloc_cb, read_cb);
#endif
    return uv_read_start(&c->h.stream, alloc_cb, read_cb);
}

void tsd_read_stop(tsd_conn *c)
{
#ifdef TS_WITH_TLS
    if (c->tls != NULL) {
        ts__tls_read_stop(TLS_OF(c));
        return;
    }
#endif
    uv_read_stop(&c->h.stream);
}

int tsd_stream_write(tsd_conn *c, uv_write_t *req, const uv_buf_t *bufs, unsigned int n,
                     uv_write_cb cb)
{
#ifdef TS_WITH_TLS
    if (c->tls != NULL)
        return ts__tls_write(TLS_OF(c), req, bufs, n, cb);
#endif
    return uv_write(req, &c->h.stream, bufs, n, cb);
}

int tsd_stream_try_write(tsd_conn *c, const uv_buf_t *bufs, unsigned int n)
{
    /* Encryption goes through the queue: nothing is ever written at once. */
    if (c->tls != NULL)
        return UV_EAGAIN;
    return uv_try_write(&c->h.stream, bufs, n);
}

int tsd_stream_shutdown(tsd_conn *c, uv_shutdown_t *req, uv_shutdown_cb cb)
{
#ifdef TS_WITH_TLS
    if (c->tls != NULL)
        return ts__tls_shutdown(TLS_OF(c), req, cb);
#endif
    return uv_shutdown(req, &c->h.stream, cb);
}

size_t tsd_stream_queue_size(tsd_conn *c)
{
#ifdef TS_WITH_TLS
    if (c->tls != NULL)
        return ts__tls_queue_size(TLS_OF(c));
#endif
    return uv_stream_get_write_queue_size(&c->h.stream);
}

void tsd_stream_close(tsd_conn *c, uv_close_cb cb)
{
#ifdef TS_WITH_TLS
    if (c->tls != NULL) {
        ts__tls *t = TLS_OF(c);
        c->tls = NULL; /* the session frees itself once the stream has closed */
        ts__tls_close(t, cb);
        return;
    }
#endif
    uv_close(&c->h.handle, cb);
}
