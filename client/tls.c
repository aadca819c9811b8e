/*
 * TLS on the client's TCP connection (addresses "tls://host:port", or the tls option): the
 * SSL_CTX made at open from the tls_* options (the server verified against tls_ca_file, else
 * TS_TLS_CA, else the system store; its certificate must name tls_server_name, else the host),
 * one session per connection (a reconnect makes a new one: a full handshake), and the stream
 * calls of recv.c, send.c and conn.c. The caller-side fast path (direct.c) reads and writes the
 * socket itself, so it is off on TLS connections: every byte goes through the I/O thread.
 */
#include "internal.h"

#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef TS_WITH_TLS
#include "tlsio.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

/*
 * OpenSSL's reason in words (and its queue cleared): the operating system's when a call it made
 * failed (a file that cannot be opened: "No such file or directory", not OpenSSL's own "system
 * lib"), else OpenSSL's last one.
 */
static const char *ssl_reason(void)
{
    const char *r = NULL;
    int sys_err = 0;
    for (unsigned long e = ERR_get_error(); e != 0; e = ERR_get_error()) {
        if (ERR_SYSTEM_ERROR(e)) {
            if (sys_err == 0)
                sys_err = ERR_GET_REASON(e);
        } else if (ERR_reason_error_string(e) != NULL) {
            r = ERR_reason_error_string(e);
        }
    }
    if (sys_err != 0)
        return strerror(sys_err);
    return r != NULL ? r : "unknown OpenSSL error";
}
#endif

int ts__client_tls_setup(ts_client_t *c, const ts_client_options_t *opts)
{
    if (opts != NULL && opts->tls)
        c->tls = 1;
    if (!c->tls)
        return 0;
    if (c->unix_path != NULL)
        return ts__fail(TS_EINVAL, "%s: TLS is for TCP addresses (unix sockets stay plain)",
                        c->address);
#ifndef TS_WITH_TLS
    return ts__fail(TS_ENOTSUP, "%s: this libtensorshare was built without TLS", c->address);
#else
    const char *ca = opts != NULL ? opts->tls_ca_file : NULL;
    if (ca == NULL)
        ca = getenv("TS_TLS_CA");
    const char *cert = opts != NULL ? opts->tls_cert_file : NULL;
    const char *key = opts != NULL ? opts->tls_key_file : NULL;
    const char *name =
        opts != NULL && opts->tls_server_name != NULL ? opts->tls_server_name : c->host;
    if ((cert == NULL) != (key == NULL))
        return ts__fail(TS_EINVAL, "tls_cert_file and tls_key_file go together");
    SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
    if (ctx == NULL)
        return ts__fail(TS_ENOMEM, "cannot create a TLS context: %s", ssl_reason());
    int rc = 0;
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    if (ca != NULL && ca[0] != '\0') {
        if (SSL_CTX_load_verify_locations(ctx, ca, NULL) != 1)
            rc = ts__fail(TS_EINVAL, "TLS CA file %s: %s", ca, ssl_reason());
    } else if (SSL_CTX_set_default_verify_paths(ctx) != 1) {
        rc = ts__fail(TS_EINVAL, "the system's TLS CA store: %s", ssl_reason());
    }
    if (rc == 0 && cert != NULL) {
        if (SSL_CTX_use_certificate_chain_file(ctx, cert) != 1)
            rc = ts__fail(TS_EINVAL, "tls_cert_file %s: %s", cert, ssl_reason());
        else if (SSL_CTX_use_PrivateKey_file(ctx, key, SSL_FILETYPE_PEM) != 1)
            rc = ts__fail(TS_EINVAL, "tls_key_file %s: %s", key, ssl_reason());
        else if (SSL_CTX_check_private_key(ctx) != 1)
            rc = ts__fail(TS_EINVAL, "tls_key_file %s does not match tls_cert_file %s", key, cert);
    }
    if (rc == 0 && (c->tls_name = ts__strndup(name, strlen(name))) == NULL)
        rc = ts__fail(TS_ENOMEM, NULL);
    if (rc != 0) {
        SSL_CTX_free(ctx);
        return rc;
    }
    c->tls_ctx = ctx;
    return 0;
#endif
}

void ts__client_tls_free(ts_client_t *c)
{
#ifdef TS_WITH_TLS
    SSL_CTX_free(c->tls_ctx);
#endif
    c->tls_ctx = NULL;
    ts__free(c->tls_name);
    c->tls_name = NULL;
}

int ts__conn_tls_start(ts_client_t *c, ts__conn *conn)
{
#ifdef TS_WITH_TLS
    SSL *ssl = SSL_new(c->tls_ctx);
    if (ssl == NULL) {
        ERR_clear_error();
        return TS_ENOMEM;
    }
    SSL_set_connect_state(ssl);
    /* An IP address is checked against the certificate's IP entries, a name against its DNS
     * names (and sent as SNI, which takes no addresses). */
    unsigned char ip[16];
    int is_ip =
        inet_pton(AF_INET, c->tls_name, ip) == 1 || inet_pton(AF_INET6, c->tls_name, ip) == 1;
    int ok = is_ip ? X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), c->tls_name) == 1
                   : SSL_set_tlsext_host_name(ssl, c->tls_name) == 1 &&
                         SSL_set1_host(ssl, c->tls_name) == 1;
    if (!ok) {
        ERR_clear_error();
        SSL_free(ssl);
        return TS_ENOMEM;
    }
    conn->tls = ts__tls_new(ssl, &conn->u.stream);
    return conn->tls != NULL ? 0 : TS_ENOMEM;
#else
    (void)c;
    (void)conn;
    return TS_ENOTSUP;
#endif
}

int ts__conn_read_start(ts__conn *conn, uv_alloc_cb alloc_cb, uv_read_cb read_cb)
{
#ifdef TS_WITH_TLS
    if (conn->tls != NULL)
        return ts__tls_read_start(conn->tls, alloc_cb, read_cb);
#endif
    return uv_read_start(&conn->u.stream, alloc_cb, read_cb);
}

int ts__conn_write(ts__conn *conn, uv_write_t *req, const uv_buf_t *bufs, unsigned int n,
                   uv_write_cb cb)
{
#ifdef TS_WITH_TLS
    if (conn->tls != NULL)
        return ts__tls_write(conn->tls, req, bufs, n, cb);
#endif
    return uv_write(req, &conn->u.stream, bufs, n, cb);
}

void ts__conn_close_stream(ts__conn *conn, uv_close_cb cb)
{
#ifdef TS_WITH_TLS
    if (conn->tls != NULL) {
        ts__tls *t = conn->tls;
        conn->tls = NULL;
        ts__tls_close(t, cb); /* the session frees itself once the stream is closed */
        return;
    }
#endif
    uv_close(&conn->u.handle, cb);
}

int ts__conn_tls_failed(ts__conn *conn, int *err, const char **msg)
{
#ifdef TS_WITH_TLS
    if (conn->tls == NULL)
        return 0;
    int verify = 0;
    const char *why = ts__tls_error(conn->tls, &verify);
    if (why[0] == '\0')
        return 0;
    *err = verify ? TS_EAUTH : TS_EPROTO;
    *msg = why;
    return 1;
#else
    (void)conn;
    (void)err;
    (void)msg;
    return 0;
#endif
}
