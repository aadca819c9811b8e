/*
 * The token proof of the HELLO handshake (docs/PROTOCOL.md section 4): instead of the token,
 * HELLO carries an HMAC-SHA256 keyed by the token over a direction label and the two nonces of
 * AUTH_CHALLENGE, and the server answers with its own proof under the other label. Shared by
 * tensord and the client; pure functions, any thread. Added in 0.5.0.
 */
#ifndef TS_AUTH_H
#define TS_AUTH_H

#include <stddef.h>
#include <stdint.h>

#include "msg.h"

/*
 * The labels hashed first (their terminating NUL included, so neither is a prefix of the other's
 * input). Two labels, one per direction, so a proof one side sent can never be played back to
 * it as the other side's (reflection), and the version in them retires every proof at once
 * should the construction ever change.
 */
#define TS_AUTH_LABEL_CLIENT "tensorshare token proof v1 client"
#define TS_AUTH_LABEL_SERVER "tensorshare token proof v1 server"

enum { TS_AUTH_CLIENT = 0, TS_AUTH_SERVER = 1 };

/*
 * out = HMAC-SHA256(key = the token's tlen bytes, message = label || NUL || client_nonce ||
 * server_nonce), the label of side (TS_AUTH_CLIENT: the proof HELLO carries; TS_AUTH_SERVER: the
 * one the HELLO reply carries).
 */
void ts__auth_proof(const void *token, size_t tlen, int side,
                    const uint8_t client_nonce[TS_MSG_AUTH_NONCE_SIZE],
                    const uint8_t server_nonce[TS_MSG_AUTH_NONCE_SIZE],
                    uint8_t out[TS_MSG_TOKEN_PROOF_SIZE]);

/*
 * Fill out with TS_MSG_AUTH_NONCE_SIZE bytes from the kernel's random generator (getrandom). 0,
 * or TS_EAGAIN when none could be had (the caller must then not authenticate: a guessable nonce
 * would allow replays).
 */
int ts__auth_nonce(uint8_t out[TS_MSG_AUTH_NONCE_SIZE]);

#endif /* TS_AUTH_H */
