/*
 * Sharded test clusters (cluster.h): a thin layer over the harness's daemons.
 */
#include "cluster.h"

#include <stdio.h>
#include <string.h>

#include "slot.h"

/* Start shard i of cl->n, on port (0: ephemeral) through the harness. */
static int shard_spawn(tsc_cluster *cl, int i, const char *const *extra, int restart)
{
    char shard[32];
    snprintf(shard, sizeof(shard), "%d/%d", i, cl->n);
    const char *argv[48];
    int k = 0;
    argv[k++] = "--shard";
    argv[k++] = shard;
    argv[k++] = "--log-level";
    argv[k++] = "warn";
    for (int j = 0; extra != NULL && extra[j] != NULL && k < 47; j++)
        argv[k++] = extra[j];
    argv[k] = NULL;
    return restart ? tsh_server_restart(&cl->srv[i], argv) : tsh_server_start(&cl->srv[i], argv);
}

int tsc_start(tsc_cluster *cl, int n, const char *const *extra)
{
    memset(cl, 0, sizeof(*cl));
    if (n < 1 || n > TSC_MAX_SHARDS)
        return -1;
    cl->n = n;
    for (int i = 0; i < n; i++) {
        if (shard_spawn(cl, i, extra, 0) != 0) {
            fprintf(stderr, "cluster: shard %d did not start\n", i);
            tsc_stop(cl);
            return -1;
        }
    }
    return tsc_list(cl, NULL, cl->list, sizeof(cl->list));
}

void tsc_kill(tsc_cluster *cl, int i)
{
    tsh_server_kill(&cl->srv[i]);
}

int tsc_restart(tsc_cluster *cl, int i, const char *const *extra)
{
    if (cl->srv[i].pid > 0)
        return -1;
    return shard_spawn(cl, i, extra, 1);
}

void tsc_stop(tsc_cluster *cl)
{
    for (int i = 0; i < cl->n; i++) {
        if (cl->srv[i].dir[0] == '\0')
            continue;
        if (cl->srv[i].pid > 0)
            tsh_server_stop(&cl->srv[i]);
        tsh_server_cleanup(&cl->srv[i]);
        cl->srv[i].dir[0] = '\0';
    }
}

int tsc_list(const tsc_cluster *cl, const int *order, char *out, size_t cap)
{
    size_t len = 0;
    out[0] = '\0';
    for (int k = 0; k < cl->n; k++) {
        int i = order != NULL ? order[k] : k;
        int w = snprintf(out + len, cap - len, "%s127.0.0.1:%d", k > 0 ? "," : "", cl->srv[i].port);
        if (w < 0 || (size_t)w >= cap - len)
            return -1;
        len += (size_t)w;
    }
    return 0;
}

int tsc_write_map(const tsc_cluster *cl, const char *path, uint64_t epoch, const int *order)
{
    FILE *f = fopen(path, "w");
    if (f == NULL)
        return -1;
    fprintf(f, "# a test cluster of %d shards\n", cl->n);
    if (epoch > 0)
        fprintf(f, "epoch %llu\n", (unsigned long long)epoch);
    for (int k = 0; k < cl->n; k++)
        fprintf(f, "127.0.0.1:%d\n", cl->srv[order != NULL ? order[k] : k].port);
    return fclose(f) == 0 ? 0 : -1;
}

int tsc_owner(const char *name, int n)
{
    uint16_t slot = ts__slot(name, strlen(name));
    for (int i = n - 1; i >= 0; i--) {
        if (slot >= ts__slot_split_first((uint32_t)i, (uint32_t)n))
            return i;
    }
    return 0;
}

int tsc_name_for(char *out, size_t cap, const char *prefix, int k, int shard, int n)
{
    for (int j = 0; j < 100000; j++) {
        snprintf(out, cap, "%s.%d.%d", prefix, k, j);
        if (tsc_owner(out, n) == shard)
            return 0;
    }
    return -1;
}
