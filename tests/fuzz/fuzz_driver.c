/*
 * A plain driver for the fuzz targets, for compilers without libFuzzer: it feeds every file of
 * the corpus directories named on the command line (or the target's own corpus, built in as
 * TS_FUZZ_CORPUS) to LLVMFuzzerTestOneInput, then FZ_MUTATIONS deterministic mutations of each.
 * The mutations depend only on the file's name and contents, so a failure reproduces exactly.
 * A file argument is replayed alone (without mutations), which is how a crash file is rerun.
 */
#include "fuzz.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#ifndef FZ_MUTATIONS
#define FZ_MUTATIONS                                                                               \
    2000 /* per corpus file; a target may set fewer (tests/fuzz/CMakeLists.txt)                    \
          */
#endif
#define FZ_MAX_FILES 4096      /* files per directory; corpora here hold a few dozen */
#define FZ_MAX_INPUT (1 << 20) /* bytes; larger files are skipped */
#define FZ_GROW      256       /* bytes a mutation may add */

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *s = x;
    return x;
}

static uint64_t hash_bytes(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull; /* FNV-1a */
    return h;
}

/* Values that sit on the edges decoders care about. */
static const uint64_t interesting[] = {
    0,
    1,
    2,
    7,
    8,
    15,
    16,
    63,
    64,
    65,
    127,
    128,
    255,
    256,
    4096,
    65535,
    65536,
    0x7fffffffu,
    0x80000000u,
    0xffffffffu,
    0x7fffffffffffffffull,
    0x8000000000000000ull,
    UINT64_MAX,
    UINT64_MAX - 63,
};

/*
 * Apply one to three random edits to buf (length *len, capacity cap): bit flips, interesting
 * bytes and integers written little-endian, truncation, erasure, duplication of a chunk.
 */
static void mutate(uint8_t *buf, size_t *len, size_t cap, uint64_t *rng)
{
    int edits = 1 + (int)(rng_next(rng) % 3);
    for (int e = 0; e < edits; e++) {
        size_t n = *len;
        uint64_t r = rng_next(rng);
        size_t pos = n > 0 ? (size_t)(rng_next(rng) % n) : 0;
        switch (r % 7) {
        case 0: /* flip a bit */
            if (n > 0)
                buf[pos] ^= (uint8_t)(1u << ((r >> 8) % 8));
            break;
        case 1: /* an interesting byte */
            if (n > 0)
                buf[pos] = (uint8_t)interesting[(r >> 8) % TS__ARRAY_SIZE(interesting)];
            break;
        case 2: { /* an interesting u16, u32 or u64, little-endian */
            static const size_t widths[] = {2, 4, 8};
            size_t w = widths[(r >> 8) % 3];
            uint64_t v = interesting[(r >> 16) % TS__ARRAY_SIZE(interesting)];
            if ((r >> 24) & 1)
                v += (r >> 25) % 3 - 1; /* one off either way (unsigned wrap gives -1) */
            for (size_t i = 0; i < w && pos + i < n; i++)
                buf[pos + i] = (uint8_t)(v >> (8 * i));
            break;
        }
        case 3: /* truncate */
            *len = pos;
            break;
        case 4: { /* erase a chunk */
            size_t k = (size_t)((r >> 8) % 16) + 1;
            if (pos + k > n)
                k = n - pos;
            memmove(buf + pos, buf + pos + k, n - pos - k);
            *len = n - k;
            break;
        }
        case 5: { /* duplicate a chunk in place */
            size_t k = (size_t)((r >> 8) % 64) + 1;
            if (pos + k > n)
                k = n - pos;
            if (n + k > cap)
                break;
            memmove(buf + pos + k, buf + pos, n - pos);
            *len = n + k;
            break;
        }
        default: /* a random byte */
            if (n > 0)
                buf[pos] = (uint8_t)(r >> 32);
            break;
        }
    }
}

/* Read a whole file (at most FZ_MAX_INPUT bytes) into a new buffer; NULL when unreadable. */
static uint8_t *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    uint8_t *buf = ts__malloc(FZ_MAX_INPUT + 1);
    size_t n = buf != NULL ? fread(buf, 1, FZ_MAX_INPUT + 1, f) : 0;
    fclose(f);
    if (buf == NULL || n > FZ_MAX_INPUT) {
        ts__free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

/* Run one input from its own exact-size copy, so reads past its end are caught by ASan. */
static void run_one(const uint8_t *p, size_t n)
{
    uint8_t *copy = ts__malloc(n);
    if (copy == NULL) {
        fprintf(stderr, "fuzz_driver: out of memory\n");
        exit(2);
    }
    if (n > 0)
        memcpy(copy, p, n);
    (void)LLVMFuzzerTestOneInput(copy, n);
    ts__free(copy);
}

/* Feed one file and its mutations. Returns the number of runs. */
static unsigned long run_file(const char *path, const char *name, int mutations)
{
    size_t len;
    uint8_t *seed = read_file(path, &len);
    if (seed == NULL) {
        fprintf(stderr, "fuzz_driver: cannot read %s\n", path);
        exit(2);
    }
    run_one(seed, len);
    unsigned long runs = 1;
    size_t cap = len + FZ_GROW;
    uint8_t *buf = ts__malloc(cap);
    if (buf == NULL)
        exit(2);
    uint64_t rng = hash_bytes(hash_bytes(0xcbf29ce484222325ull, name, strlen(name)), seed, len);
    rng |= 1;
    for (int i = 0; i < mutations; i++) {
        size_t n = len;
        memcpy(buf, seed, len);
        mutate(buf, &n, cap, &rng);
        run_one(buf, n);
        runs++;
    }
    ts__free(buf);
    ts__free(seed);
    return runs;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Feed every regular file of dir, in name order. Returns the number of runs. */
static unsigned long run_dir(const char *dir, unsigned long *files)
{
    DIR *d = opendir(dir);
    if (d == NULL) {
        fprintf(stderr, "fuzz_driver: cannot open %s\n", dir);
        exit(2);
    }
    char **names = ts__calloc(FZ_MAX_FILES, sizeof(*names));
    size_t count = 0;
    struct dirent *e;
    while (names != NULL && count < FZ_MAX_FILES && (e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        names[count] = ts__strndup(e->d_name, strlen(e->d_name));
        if (names[count] != NULL)
            count++;
    }
    closedir(d);
    if (names == NULL)
        exit(2);
    qsort(names, count, sizeof(*names), by_name);
    unsigned long runs = 0;
    for (size_t i = 0; i < count; i++) {
        char path[4096];
        int w = snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        if (w > 0 && (size_t)w < sizeof(path)) {
            struct stat st;
            if (stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
                runs += run_file(path, names[i], FZ_MUTATIONS);
                (*files)++;
            }
        }
        ts__free(names[i]);
    }
    ts__free(names);
    return runs;
}

int main(int argc, char **argv)
{
#ifdef TS_FUZZ_CORPUS
    static const char *const fallback[] = {TS_FUZZ_CORPUS};
#else
    static const char *const fallback[] = {"corpus"};
#endif
    const char *const *paths = argc > 1 ? (const char *const *)argv + 1 : fallback;
    int npaths = argc > 1 ? argc - 1 : 1;
    unsigned long runs = 0, files = 0;
    for (int i = 0; i < npaths; i++) {
        struct stat st;
        if (stat(paths[i], &st) == 0 && S_ISREG(st.st_mode)) {
            runs += run_file(paths[i], paths[i], 0);
            files++;
        } else {
            runs += run_dir(paths[i], &files);
        }
    }
    printf("fuzz_driver: %lu files, %lu runs, no failures\n", files, runs);
    /* An empty corpus exercises nothing: that is a broken setup, not a pass. */
    return files > 0 ? 0 : 1;
}
