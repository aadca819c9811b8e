/* The token proof (see auth.h). */
#include "auth.h"

#include "common.h"
#include "sha256.h"

#include <errno.h>
#include <string.h>
#include <sys/random.h>

_Static_assert(TS_MSG_TOKEN_PROOF_SIZE == TS_SHA256_LEN, "a proof is one HMAC-SHA256 tag");

void ts__auth_proof(const void *token, size_t tlen, int side,
                    const uint8_t client_nonce[TS_MSG_AUTH_NONCE_SIZE],
                    const uint8_t server_nonce[TS_MSG_AUTH_NONCE_SIZE],
                    uint8_t out[TS_MSG_TOKEN_PROOF_SIZE])
{
    static const char client_label[] = TS_AUTH_LABEL_CLIENT;
    static const char server_label[] = TS_AUTH_LABEL_SERVER;
    ts__hmac256_ctx m;
    ts__hmac256_init(&m, token, tlen);
    if (side == TS_AUTH_SERVER)
        ts__hmac256_update(&m, server_label, sizeof(server_label)); /* the NUL included */
    else
        ts__hmac256_update(&m, client_label, sizeof(client_label));
    ts__hmac256_update(&m, client_nonce, TS_MSG_AUTH_NONCE_SIZE);
    ts__hmac256_update(&m, server_nonce, TS_MSG_AUTH_NONCE_SIZE);
    ts__hmac256_final(&m, out);
}

int ts__auth_nonce(uint8_t out[TS_MSG_AUTH_NONCE_SIZE])
{
    size_t got = 0;
    /* getrandom never returns short for 32 bytes once the pool is ready; loop for EINTR. */
    for (int tries = 0; got < TS_MSG_AUTH_NONCE_SIZE && tries < 16; tries++) {
        ssize_t n = getrandom(out + got, TS_MSG_AUTH_NONCE_SIZE - got, 0);
        if (n > 0)
            got += (size_t)n;
        else if (n < 0 && errno != EINTR)
            break;
    }
    return got == TS_MSG_AUTH_NONCE_SIZE ? 0 : TS_EAGAIN;
}
