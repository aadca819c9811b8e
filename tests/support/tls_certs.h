/*
 * Throwaway certificates for the TLS tests, made at test time with the openssl command line into
 * a private temporary directory: a CA, a server certificate for 127.0.0.1 and localhost signed
 * by it, a client certificate signed by it, and a second CA that signed nothing tensord
 * presents (a client that trusts only it must refuse the server). EC P-256 keys: quick to make.
 */
#ifndef TS_TLS_CERTS_H
#define TS_TLS_CERTS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct tls_certs {
    char dir[256];
    char ca[300], server_cert[300], server_key[300], client_cert[300], client_key[300];
    char other_ca[300];
} tls_certs;

/* Make the files; 0, or -1 (the openssl command's output says why). */
static inline int tls_certs_make(tls_certs *t)
{
    const char *tmp = getenv("TMPDIR") != NULL ? getenv("TMPDIR") : "/tmp";
    snprintf(t->dir, sizeof(t->dir), "%s/tstls.XXXXXX", tmp);
    if (mkdtemp(t->dir) == NULL)
        return -1;
    snprintf(t->ca, sizeof(t->ca), "%s/ca.pem", t->dir);
    snprintf(t->server_cert, sizeof(t->server_cert), "%s/server.pem", t->dir);
    snprintf(t->server_key, sizeof(t->server_key), "%s/server.key", t->dir);
    snprintf(t->client_cert, sizeof(t->client_cert), "%s/client.pem", t->dir);
    snprintf(t->client_key, sizeof(t->client_key), "%s/client.key", t->dir);
    snprintf(t->other_ca, sizeof(t->other_ca), "%s/other-ca.pem", t->dir);
    static const char script[] =
        "set -e; cd '%s'; K='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes';"
        "CA='-addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign';"
        "openssl req -x509 $K -keyout ca.key -out ca.pem -days 2 -subj /CN=ts-test-ca $CA;"
        "openssl req -x509 $K -keyout other-ca.key -out other-ca.pem -days 2 "
        "-subj /CN=ts-other-ca $CA;"
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth\\n'"
        " > server.ext;"
        "printf 'extendedKeyUsage=clientAuth\\n' > client.ext;"
        "openssl req $K -keyout server.key -out server.csr -subj /CN=127.0.0.1;"
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out server.pem -days 2 -extfile server.ext;"
        "openssl req $K -keyout client.key -out client.csr -subj /CN=ts-test-client;"
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out client.pem -days 2 -extfile client.ext";
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), script, t->dir);
    char full[2560];
    if (snprintf(full, sizeof(full), "(%s) >'%s/openssl.log' 2>&1", cmd, t->dir) >=
        (int)sizeof(full))
        return -1;
    if (system(full) != 0) {
        char show[400];
        snprintf(show, sizeof(show), "cat '%s/openssl.log' >&2", t->dir);
        if (system(show) != 0)
            fprintf(stderr, "tls_certs: openssl failed\n");
        return -1;
    }
    return 0;
}

/* Remove the directory and everything in it. */
static inline void tls_certs_remove(tls_certs *t)
{
    if (t->dir[0] == '\0')
        return;
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", t->dir);
    if (system(cmd) != 0)
        fprintf(stderr, "tls_certs: cannot remove %s\n", t->dir);
    t->dir[0] = '\0';
}

#endif /* TS_TLS_CERTS_H */
