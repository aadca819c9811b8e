/*
 * slot_balance: how evenly the slot function (src/slot.c) and the default split spread bin names
 * over shards. For 3, 16 and 64 shards it maps a set of names to their owners and prints the
 * busiest shard's count over the mean (1.00 = perfectly even). Two sets of names: random ones
 * (a prefix people use and a random suffix, from a seeded generator, so every run sees the same
 * names) and sequential ones ("worker-0", "worker-1", ...). Target: at most 1.08 for the random
 * names at 100,000 names; 1.0 + about 2.5 standard deviations of a fair split is what chance
 * alone gives (64 shards: 1562 names each, sigma 39, so about 1.06).
 *
 * It also prints what the slot of a name costs (the check a sharded tensord makes per request):
 * nanoseconds per ts__slot over the random names, the best of a few passes.
 *
 * Usage: slot_balance [--names N] [--seed S]. Pure computation: no server, no network.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "slot.h"

#define DEFAULT_NAMES 100000u
#define MAX_NAMES     10000000u /* names per run: bounds the run time (about a second) */
#define TARGET        1.08      /* busiest/mean at most this for the random names */

/* xorshift64*: a small seeded generator, so the names are the same on every run. */
static uint64_t rng_state;

static uint64_t rng_next(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ull;
}

/* Prefixes of the kind bins get named with (no braces: no hash tags). */
static const char *const prefixes[] = {
    "params/",   "grads/",     "rollout-",  "experience.", "model.layer", "ckpt_",
    "worker-",   "actor/",     "batch:",    "replay-",     "env",         "policy_v",
    "stats/run", "embedding.", "optimizer", "obs-",
};

/* A random name: a prefix and 4 to 16 characters of [a-z0-9] (or a decimal id). */
static size_t random_name(char *out, size_t cap)
{
    static const char alphabet[] = "abcdefghijklmnopqrstuvwxyz0123456789";
    const char *prefix = prefixes[rng_next() % (sizeof(prefixes) / sizeof(prefixes[0]))];
    size_t n = (size_t)snprintf(out, cap, "%s", prefix);
    if (rng_next() % 4 == 0) {
        n += (size_t)snprintf(out + n, cap - n, "%" PRIu64, rng_next() % 1000000u);
        return n;
    }
    size_t len = 4 + (size_t)(rng_next() % 13);
    for (size_t i = 0; i < len && n + 1 < cap; i++)
        out[n++] = alphabet[rng_next() % (sizeof(alphabet) - 1)];
    out[n] = '\0';
    return n;
}

/* Count the names' owners under the default split of n shards; the busiest over the mean. */
static double busiest_over_mean(const uint16_t *slots, uint32_t n_names, uint32_t n, uint32_t *top)
{
    ts__shard_map *map = NULL;
    if (ts__shard_map_default(n, NULL, 1, &map) != 0) {
        fprintf(stderr, "slot_balance: cannot make a map of %u shards\n", n);
        exit(1);
    }
    uint32_t *count = calloc(n, sizeof(*count));
    if (count == NULL)
        exit(1);
    for (uint32_t i = 0; i < n_names; i++)
        count[ts__shard_map_owner(map, slots[i])]++;
    uint32_t max = 0;
    for (uint32_t i = 0; i < n; i++)
        max = count[i] > max ? count[i] : max;
    free(count);
    ts__shard_map_free(map);
    *top = max;
    return (double)max / ((double)n_names / n);
}

static double mean_len(const uint8_t *lens, uint32_t n)
{
    double sum = 0;
    for (uint32_t i = 0; i < n; i++)
        sum += lens[i];
    return sum / n;
}

int main(int argc, char **argv)
{
    uint32_t n_names = DEFAULT_NAMES;
    uint64_t seed = 42;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--names") == 0 && i + 1 < argc) {
            n_names = (uint32_t)strtoul(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
            seed = strtoull(argv[++i], NULL, 10);
        } else {
            fprintf(stderr, "usage: %s [--names N (1 to %u)] [--seed S]\n", argv[0], MAX_NAMES);
            return 2;
        }
    }
    if (n_names == 0 || n_names > MAX_NAMES) {
        fprintf(stderr, "slot_balance: --names must be 1 to %u\n", MAX_NAMES);
        return 2;
    }
    rng_state = seed != 0 ? seed : 1;
    uint16_t *random_slots = malloc((size_t)n_names * sizeof(uint16_t));
    uint16_t *seq_slots = malloc((size_t)n_names * sizeof(uint16_t));
    if (random_slots == NULL || seq_slots == NULL)
        return 1;
    char name[64];
    for (uint32_t i = 0; i < n_names; i++) {
        size_t len = random_name(name, sizeof(name));
        random_slots[i] = ts__slot(name, len);
        int k = snprintf(name, sizeof(name), "worker-%" PRIu32, i);
        seq_slots[i] = ts__slot(name, (size_t)k);
    }
    printf("slot_balance: %u names, seed %" PRIu64 ", default split; busiest shard / mean "
           "(target for random names: at most %.2f)\n",
           n_names, seed, TARGET);
    printf("%8s  %22s  %22s\n", "shards", "random names", "worker-0..N-1");
    static const uint32_t shards[] = {3, 16, 64};
    int over = 0;
    for (size_t k = 0; k < sizeof(shards) / sizeof(shards[0]); k++) {
        uint32_t top_r = 0, top_s = 0;
        double r = busiest_over_mean(random_slots, n_names, shards[k], &top_r);
        double q = busiest_over_mean(seq_slots, n_names, shards[k], &top_s);
        printf("%8u  %8u / %8.1f = %.3f  %8u / %8.1f = %.3f\n", shards[k], top_r,
               (double)n_names / shards[k], r, top_s, (double)n_names / shards[k], q);
        over |= r > TARGET;
    }
    printf("%s\n", over ? "random names: OVER the target" : "random names: within the target");
    /* The cost of a slot: the same names again (kept this time), best of 5 passes. */
    rng_state = seed != 0 ? seed : 1;
    char(*names)[32] = malloc((size_t)n_names * 32);
    uint8_t *lens = malloc(n_names);
    if (names == NULL || lens == NULL)
        return 1;
    for (uint32_t i = 0; i < n_names; i++)
        lens[i] = (uint8_t)random_name(names[i], sizeof(names[i]));
    double best = 1e30;
    unsigned sink = 0;
    for (int pass = 0; pass < 5; pass++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (uint32_t i = 0; i < n_names; i++)
            sink += ts__slot(names[i], lens[i]);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ns =
            ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / n_names;
        best = ns < best ? ns : best;
    }
    printf("slot of a name: %.1f ns (mean length %.1f bytes; checksum %u)\n", best,
           mean_len(lens, n_names), sink);
    free(names);
    free(lens);
    free(random_slots);
    free(seq_slots);
    return 0;
}
