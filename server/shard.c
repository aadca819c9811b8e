/*
 * Sharding (docs/PROTOCOL.md section 14): the --shard and --cluster-map flags, the slot check
 * every request naming something passes, the WRONG_SHARD reply, and the SHARD_MAP reply.
 *
 * A daemon started without --shard has no map (cfg.shard_map NULL): it owns every slot, and
 * every function here returns at its first line, so it behaves as before sharding existed.
 * With a map, the check is one CRC of the name (or of its {tag}) and one table lookup. The map
 * never changes while the daemon runs: a new map means restarting the shards with it.
 *
 * Where the checks sit: ops.c's tsd_op_dispatch calls tsd_shard_refuse_request once per decoded
 * control request (every opcode, MGET's names included); conn.c checks an upload when its name
 * has arrived (start_upload, which then reads the body and drops it) and, for a compressed
 * upload whose name is inside the compressed bytes, once it is inflated (item_store).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "server.h"

/* --shard I/N or I: the index, and N when given (0 when not). */
static int parse_shard(const char *s, uint32_t *index, uint32_t *n)
{
    char *end = NULL;
    if (s[0] < '0' || s[0] > '9')
        return -1;
    errno = 0;
    unsigned long i = strtoul(s, &end, 10);
    if (errno != 0 || i >= TS_SHARD_MAX)
        return -1;
    *index = (uint32_t)i;
    *n = 0;
    if (*end == '\0')
        return 0;
    if (*end != '/' || end[1] < '0' || end[1] > '9')
        return -1;
    unsigned long k = strtoul(end + 1, &end, 10);
    if (errno != 0 || *end != '\0' || k == 0 || k > TS_SHARD_MAX || i >= k)
        return -1;
    *n = (uint32_t)k;
    return 0;
}

int tsd_shard_flag(tsd_config *cfg, const char *flag, const char *val, int argc, char **argv,
                   int *i)
{
    const char **dst;
    if (strcmp(flag, "--shard") == 0)
        dst = &cfg->shard_arg;
    else if (strcmp(flag, "--cluster-map") == 0)
        dst = &cfg->cluster_map_path;
    else
        return 0;
    return tsd_flag_string(flag, val, argc, argv, i, dst);
}

void tsd_shard_usage(FILE *f)
{
    fprintf(f,
            "Cluster (docs/PROTOCOL.md section 14):\n"
            "  --shard I/N           be shard I of N (0 <= I < N <= %u) with the default\n"
            "                        split of the %u slots; requests naming another shard's\n"
            "                        bins are answered WRONG_SHARD            [owns every slot]\n"
            "  --cluster-map FILE    the map: one 'ADDRESS FIRST-LAST,...' line per shard (ranges\n"
            "                        optional), an optional 'epoch N'; with --shard I (or I/N,\n"
            "                        N its lines) this daemon is line I and WRONG_SHARD names\n"
            "                        the owner's address\n",
            TS_SHARD_MAX, TS_SLOTS);
}

int tsd_shard_setup(tsd_config *cfg)
{
    cfg->shard_map = NULL;
    cfg->shard_self = TS_SHARD_NONE;
    if (cfg->shard_arg == NULL && cfg->cluster_map_path == NULL)
        return 0;
    if (cfg->shard_arg == NULL) {
        fprintf(stderr, "tensord: --cluster-map needs --shard I: which line of the map this "
                        "daemon is\n");
        return -1;
    }
    uint32_t index = 0, n = 0;
    if (parse_shard(cfg->shard_arg, &index, &n) != 0) {
        fprintf(stderr,
                "tensord: bad value for --shard: '%s' (I/N with 0 <= I < N <= %u, or I with "
                "--cluster-map)\n",
                cfg->shard_arg, TS_SHARD_MAX);
        return -1;
    }
    ts__shard_map *map = NULL;
    if (cfg->cluster_map_path != NULL) {
        char err[TS_SHARD_MAP_ERR_MAX + 4200];
        int rc = ts__shard_map_load(cfg->cluster_map_path, &map, err, sizeof(err));
        if (rc != 0) {
            fprintf(stderr, "tensord: --cluster-map %s\n", rc == TS_EINVAL ? err : ts_strerror(rc));
            return -1;
        }
        if (n != 0 && n != map->n_shards) {
            fprintf(stderr, "tensord: --shard %s: the map %s has %u shards\n", cfg->shard_arg,
                    cfg->cluster_map_path, map->n_shards);
            ts__shard_map_free(map);
            return -1;
        }
        if (index >= map->n_shards) {
            fprintf(stderr, "tensord: --shard %s: the map %s has %u shards (0 to %u)\n",
                    cfg->shard_arg, cfg->cluster_map_path, map->n_shards, map->n_shards - 1);
            ts__shard_map_free(map);
            return -1;
        }
    } else {
        if (n == 0) {
            fprintf(stderr, "tensord: --shard %s: give I/N (N shards), or --cluster-map FILE\n",
                    cfg->shard_arg);
            return -1;
        }
        /* Epoch 1: any map file (whose epoch is at least 1) that a client holds is as new. */
        int rc = ts__shard_map_default(n, NULL, 1, &map);
        if (rc != 0) {
            fprintf(stderr, "tensord: --shard %s: %s\n", cfg->shard_arg, ts_strerror(rc));
            return -1;
        }
    }
    cfg->shard_map = map;
    cfg->shard_self = (uint16_t)index;
    return 0;
}

void tsd_shard_cleanup(tsd_config *cfg)
{
    ts__shard_map_free(cfg->shard_map);
    cfg->shard_map = NULL;
}

void tsd_shard_log(const tsd_config *cfg)
{
    const ts__shard_map *map = cfg->shard_map;
    if (map == NULL)
        return;
    uint32_t r0 = map->range_off[cfg->shard_self], r1 = map->range_off[cfg->shard_self + 1];
    uint32_t slots = 0;
    for (uint32_t r = r0; r < r1; r++)
        slots += (uint32_t)(map->ranges[r].last - map->ranges[r].first) + 1;
    tsd_log(TSD_LOG_INFO, "shard %u of %u (map epoch %llu%s%s): %u slots in %u ranges, first %u-%u",
            cfg->shard_self, map->n_shards, (unsigned long long)map->epoch,
            cfg->cluster_map_path != NULL ? ", " : "",
            cfg->cluster_map_path != NULL ? cfg->cluster_map_path : "", slots, r1 - r0,
            map->ranges[r0].first, map->ranges[r0].last);
}

int tsd_shard_foreign(const tsd_server *srv, const uint8_t *name, size_t len)
{
    const ts__shard_map *map = srv->cfg.shard_map;
    if (map == NULL)
        return 0;
    return ts__shard_map_owner(map, ts__slot(name, len)) != srv->cfg.shard_self;
}

/* Answer WRONG_SHARD for name (whose slot this daemon does not own), with its owner. */
static void reply_wrong_shard(tsd_conn *c, uint8_t op, uint32_t rid, const uint8_t *name,
                              size_t len)
{
    tsd_server *srv = c->srv;
    const ts__shard_map *map = srv->cfg.shard_map;
    uint16_t slot = ts__slot(name, len);
    uint16_t owner = ts__shard_map_owner(map, slot);
    const char *addr = map->addrs[owner];
    size_t alen = strlen(addr);
    char pn[TS_MAX_NAME_LEN * 4 + 1];
    tsd_name_printable(name, len, pn, sizeof(pn));
    /* The message fills what the body leaves (the whole body stays an error message's size). */
    char msg[TS_MAX_ERRMSG];
    size_t room = TS_MAX_ERRMSG - TS_MSG_WRONG_SHARD_FIXED - alen;
    int k = snprintf(msg, room, "%s: slot %u belongs to shard %u%s%s%s, not to shard %u of %u", pn,
                     slot, owner, alen > 0 ? " (" : "", addr, alen > 0 ? ")" : "",
                     srv->cfg.shard_self, map->n_shards);
    size_t mlen = k < 0 ? 0 : ((size_t)k >= room ? room - 1 : (size_t)k);
    ts__msg_wrong_shard w = {
        .slot = slot,
        .owner = owner,
        .epoch = map->epoch,
        .addr = (const uint8_t *)addr,
        .addr_len = alen,
        .msg = msg,
        .msg_len = mlen,
    };
    uint8_t body[TS_MAX_ERRMSG];
    size_t blen = 0;
    (void)ts__msg_wrong_shard_encode(body, sizeof(body), &w, &blen);
    srv->stats.wrong_shard++;
    tsd_reply(c, op, rid, TS_ST_WRONG_SHARD, body, blen);
}

int tsd_shard_refuse(tsd_conn *c, uint8_t op, uint32_t rid, const uint8_t *name, size_t len)
{
    /* An embedding table exists on every shard, its rows spread by id (docs/PS.md). */
    if (op == TS_OP_EMB_PULL || op == TS_OP_EMB_PUSH || op == TS_OP_EMB_CREATE)
        return 0;
    if (!tsd_shard_foreign(c->srv, name, len))
        return 0;
    reply_wrong_shard(c, op, rid, name, len);
    return 1;
}

int tsd_shard_refuse_request(tsd_conn *c, const ts__hdr *h, const ts__msg *m, const uint8_t *body,
                             size_t len)
{
    if (c->srv->cfg.shard_map == NULL)
        return 0;
    switch (m->kind) {
    case TS_MSG_MGET_REQ: {
        /* Every name must be owned: one reply answers the whole request. */
        size_t off = 0;
        const uint8_t *name;
        size_t nl;
        while (ts__msg_mget_req_next(&m->u.mget_req, &off, &name, &nl))
            if (tsd_shard_refuse(c, h->opcode, h->request_id, name, nl))
                return 1;
        return 0;
    }
    /*
     * The bodies that open with the name of the bin, stream, table, counter, barrier, parameter
     * or embedding table they act on (u8 length, then its bytes); their decoder has checked that
     * the name is in the body.
     */
    case TS_MSG_NAME_REQ:
    case TS_MSG_GET_REQ:
    case TS_MSG_WAIT_REQ:
    case TS_MSG_PUT_FD_REQ:
    case TS_MSG_TENSOR_BIN_REQ:
    case TS_MSG_READ_ROWS_REQ:
    case TS_MSG_STREAM_CREATE_REQ:
    case TS_MSG_STREAM_MARK_REQ:
    case TS_MSG_STREAM_CREDIT_REQ:
    case TS_MSG_STREAM_JOIN_REQ:
    case TS_MSG_STREAM_READ_REQ:
    case TS_MSG_STREAM_ACK_REQ:
    case TS_MSG_STREAM_LEAVE_REQ:
    case TS_MSG_STREAM_RANGE_REQ:
    case TS_MSG_ADD_REQ:
    case TS_MSG_TAKE_REQ:
    case TS_MSG_BARRIER_REQ:
    case TS_MSG_TABLE_CREATE_REQ:
    case TS_MSG_TABLE_SAMPLE_REQ:
    case TS_MSG_TABLE_UPDATE_REQ:
    case TS_MSG_TABLE_REMOVE_REQ:
    case TS_MSG_PS_CREATE_REQ:
    case TS_MSG_PS_PULL_REQ:
        if (len < 1 || (size_t)body[0] > len - 1)
            return 0; /* cannot happen after the decoder; nothing to check */
        return tsd_shard_refuse(c, h->opcode, h->request_id, body + 1, body[0]);
    default:
        /*
         * HELLO, PING, LIST, STATS, SAVE, SHARD_MAP: local, never WRONG_SHARD. EMB_CREATE
         * neither: an embedding table exists on every shard, its rows spread by id (docs/PS.md).
         */
        return 0;
    }
}

void tsd_shard_map_reply(tsd_conn *c, const ts__hdr *h)
{
    const tsd_config *cfg = &c->srv->cfg;
    size_t size = ts__msg_shard_map_size(cfg->shard_map), len = 0;
    uint8_t small[TS_MSG_SHARD_MAP_FIXED];
    uint8_t *body = size <= sizeof(small) ? small : ts__malloc(size);
    if (body == NULL) {
        c->srv->stats.out_of_memory++;
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY,
                      "tensord is out of memory: the %zu-byte SHARD_MAP reply", size);
        return;
    }
    (void)ts__msg_shard_map_encode(body, size, cfg->shard_map, cfg->shard_self, &len);
    tsd_reply(c, h->opcode, h->request_id, TS_ST_OK, body, len);
    if (body != small)
        ts__free(body);
}
