/*
 * The data loading work of the stream example and of bench/stream_bench.c: a batch of synthetic
 * images made the way a real loader makes one, so that the CPU it costs is real.
 *
 *   1. "Decode": every sample (epoch, index) gets a deterministic 3x64x64 uint8 image from a
 *      seed (an xorshift fill), then IMG_DECODE_PASSES passes of a 3x3 box filter stand for the
 *      inverse transform and colour conversion of a JPEG decoder.
 *   2. Augment: a random 52x52 crop, a random horizontal flip, and normalisation to float32 with
 *      per-channel mean and standard deviation.
 *
 * The default costs about 7 ms of CPU for 32 rows (one 0.99 MiB float32 batch) on the 2-core
 * machine of docs/PERFORMANCE.md. Each row also gets a 64-bit hash of its float32 bytes, which a
 * consumer recomputes to prove that the row arrived intact, whatever batch it came in.
 *
 * Header-only (static functions) so that the example and the benchmark do exactly the same work.
 */
#ifndef TS_STREAM_IMAGES_H
#define TS_STREAM_IMAGES_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define IMG_CHANNELS 3
#define IMG_SRC      64 /* pixels; the side of a "decoded" image */
#define IMG_CROP     52 /* pixels; the side of the crop a training step sees */
/* float32 values per row of a batch's "image" tensor [rows, 3, 52, 52]. */
#define IMG_ROW_FLOATS ((size_t)IMG_CHANNELS * IMG_CROP * IMG_CROP)
/* bytes of one decoded uint8 image. */
#define IMG_SRC_BYTES ((size_t)IMG_CHANNELS * IMG_SRC * IMG_SRC)
/* Box-filter passes of the decode: about 7 ms per 32 rows on the reference machine. */
#define IMG_DECODE_PASSES 3
/* Labels are the sample index modulo this (an ImageNet-sized label space). */
#define IMG_CLASSES 1000

/* A 64-bit mix (splitmix64's finaliser): seeds and hashes. */
static inline uint64_t img_mix(uint64_t x)
{
    x += 0x9E3779B97F4A7C15u;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9u;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBu;
    return x ^ (x >> 31);
}

/* The seed of one sample in one epoch (augmentation differs per epoch, the image does not). */
static inline uint64_t img_seed(uint64_t epoch, uint64_t index)
{
    return img_mix(img_mix(index) ^ (epoch * 0xD1B54A32D192ED03u));
}

/*
 * "Decode" sample index into src (IMG_SRC_BYTES) with passes box-filter passes; tmp is scratch
 * of IMG_SRC_BYTES.
 */
static inline void img_decode(uint8_t *src, uint8_t *tmp, uint64_t index, int passes)
{
    uint64_t x = img_mix(index) | 1;
    for (size_t i = 0; i < IMG_SRC_BYTES; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(src + i, &x, 8);
    }
    for (int p = 0; p < passes; p++) {
        for (int ch = 0; ch < IMG_CHANNELS; ch++) {
            const uint8_t *in = src + (size_t)ch * IMG_SRC * IMG_SRC;
            uint8_t *out = tmp + (size_t)ch * IMG_SRC * IMG_SRC;
            for (int y = 0; y < IMG_SRC; y++) {
                int y0 = y > 0 ? y - 1 : y, y1 = y < IMG_SRC - 1 ? y + 1 : y;
                for (int xx = 0; xx < IMG_SRC; xx++) {
                    int x0 = xx > 0 ? xx - 1 : xx, x1 = xx < IMG_SRC - 1 ? xx + 1 : xx;
                    unsigned s = 0;
                    s += in[y0 * IMG_SRC + x0] + in[y0 * IMG_SRC + xx] + in[y0 * IMG_SRC + x1];
                    s += in[y * IMG_SRC + x0] + in[y * IMG_SRC + xx] + in[y * IMG_SRC + x1];
                    s += in[y1 * IMG_SRC + x0] + in[y1 * IMG_SRC + xx] + in[y1 * IMG_SRC + x1];
                    /* A sharpening term keeps the image from flattening out over the passes. */
                    int v = (int)(s / 9) * 2 - in[y * IMG_SRC + xx] + (int)(p & 7);
                    out[y * IMG_SRC + xx] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
                }
            }
        }
        memcpy(src, tmp, IMG_SRC_BYTES);
    }
}

/* Random crop, random flip, normalisation of one decoded image into dst (IMG_ROW_FLOATS). */
static inline void img_augment(const uint8_t *src, float *dst, uint64_t seed)
{
    static const float mean[IMG_CHANNELS] = {0.485f, 0.456f, 0.406f};
    static const float inv_std[IMG_CHANNELS] = {1.0f / 0.229f, 1.0f / 0.224f, 1.0f / 0.225f};
    uint64_t r = img_mix(seed);
    int oy = (int)(r % (IMG_SRC - IMG_CROP + 1));
    int ox = (int)((r >> 16) % (IMG_SRC - IMG_CROP + 1));
    int flip = (int)((r >> 32) & 1);
    for (int ch = 0; ch < IMG_CHANNELS; ch++) {
        const uint8_t *in = src + (size_t)ch * IMG_SRC * IMG_SRC;
        float *out = dst + (size_t)ch * IMG_CROP * IMG_CROP;
        for (int y = 0; y < IMG_CROP; y++) {
            const uint8_t *line = in + (size_t)(oy + y) * IMG_SRC + ox;
            for (int xx = 0; xx < IMG_CROP; xx++) {
                int sx = flip ? IMG_CROP - 1 - xx : xx;
                out[y * IMG_CROP + xx] =
                    ((float)line[sx] * (1.0f / 255.0f) - mean[ch]) * inv_std[ch];
            }
        }
    }
}

/* A 64-bit hash of n float32 values (their bytes), cheap enough to run on every row received. */
static inline uint64_t img_row_hash(const float *row, size_t n)
{
    const uint8_t *b = (const uint8_t *)row;
    uint64_t s1 = 0, s2 = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t w;
        memcpy(&w, b + i * 4, 4);
        s1 += w;
        s2 += (uint64_t)w * (uint64_t)(i + 1);
    }
    return img_mix(s1 ^ img_mix(s2 + n));
}

/*
 * Make one batch of rows samples: indices first_index.., of epoch. image: rows x IMG_ROW_FLOATS,
 * label, index, epoch_col, hash: rows each (int64, as the record's tensors hold them).
 * src and tmp: IMG_SRC_BYTES of scratch each.
 */
static inline void img_make_batch(float *image, int64_t *label, int64_t *index, int64_t *epoch_col,
                                  int64_t *hash, int rows, uint64_t epoch, uint64_t first_index,
                                  int passes, uint8_t *src, uint8_t *tmp)
{
    for (int r = 0; r < rows; r++) {
        uint64_t idx = first_index + (uint64_t)r;
        float *row = image + (size_t)r * IMG_ROW_FLOATS;
        img_decode(src, tmp, idx, passes);
        img_augment(src, row, img_seed(epoch, idx));
        label[r] = (int64_t)(idx % IMG_CLASSES);
        index[r] = (int64_t)idx;
        epoch_col[r] = (int64_t)epoch;
        hash[r] = (int64_t)img_row_hash(row, IMG_ROW_FLOATS);
    }
}

#endif /* TS_STREAM_IMAGES_H */
